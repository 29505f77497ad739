"""tf.estimator.train_and_evaluate under TF_CONFIG: chief, worker and evaluator on localhost.

    python examples/train_and_evaluate.py [--steps 300] [--model-dir DIR] [--timeout 300]
        [--smoke]

Without TF_CONFIG, this script is the launcher: it picks free localhost ports, starts itself
three times with each task's TF_CONFIG (what TFJob does on a cluster) and a shared
PERSEUS_SECRET, waits for all three with a timeout (ending the others when one fails) and prints
what the chief left in model_dir. With TF_CONFIG, it is one task: the chief and the worker train
synchronously (one allreduce group, no parameter servers), the evaluator evaluates each new
checkpoint of the chief, exports it (LatestExporter) and prints the final metrics; the chief and
the worker print their final weights (`python examples/estimator.py --steps 30
--reference-ranks 2` is what they must reach with --smoke).
"""

import perseus_legacy as pl  # perseus_legacy (first: brings back tf.estimator)  # noqa: I001

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

import tensorflow as tf

import digits
from estimator import classifier, input_fns, session_config
from perseusrun.tcp_run import free_local_ports

TASKS = (("chief", 0), ("worker", 0), ("evaluator", 0))


def task(args: argparse.Namespace, steps: int) -> None:
    """One TF_CONFIG task: train_and_evaluate, as in single-process code."""
    tf.get_logger().setLevel("ERROR")  # tf.estimator's deprecation notices
    config = pl.run_config(model_dir=args.model_dir, tf_random_seed=1,  # perseus_legacy
                           session_config=session_config(), save_checkpoints_steps=steps // 3)
    train_input_fn, eval_input_fn, columns, classes = input_fns(None)
    est = classifier(config, columns, classes)
    serving = tf.estimator.export.build_parsing_serving_input_receiver_fn(
        tf.feature_column.make_parse_example_spec(columns))
    tf.estimator.train_and_evaluate(
        est, tf.estimator.TrainSpec(train_input_fn, max_steps=steps,
                                    hooks=[digits.PrintWeights()]),  # chief and worker
        tf.estimator.EvalSpec(eval_input_fn, exporters=[tf.estimator.LatestExporter(
            "digits", serving)], start_delay_secs=0, throttle_secs=1))
    if config.task_type == "evaluator":
        metrics = est.evaluate(eval_input_fn, name="final")
        print(f"[evaluator] global step {int(metrics['global_step'])}: loss "
              f"{metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f}", flush=True)


def launch(args: argparse.Namespace) -> int:
    """Starts every task of TASKS with its TF_CONFIG; waits for all of them, `args.timeout` s."""
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="train_and_evaluate_")
    ports = iter(free_local_ports(len(TASKS)))
    cluster: dict = {}
    for task_type, _ in TASKS:
        cluster.setdefault(task_type, []).append(f"127.0.0.1:{next(ports)}")
    env = dict(os.environ, PERSEUS_SECRET=secrets.token_hex(16), TF_CPP_MIN_LOG_LEVEL="2",
               TF_NUM_INTRAOP_THREADS="1", OMP_NUM_THREADS="1")
    # The tasks share this stdout: buffered output writes each flushed line at once, while an
    # unbuffered print() writes its newline separately and two tasks' lines could interleave.
    env.pop("PYTHONUNBUFFERED", None)
    procs = []
    for task_type, index in TASKS:
        env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                       "task": {"type": task_type, "index": index}})
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--model-dir", model_dir, "--steps", str(args.steps),
             *(["--smoke"] if args.smoke else [])], env=env))
    deadline = time.monotonic() + args.timeout
    while True:
        running = [p for p in procs if p.poll() is None]
        failed = any(p.returncode for p in procs if p.returncode is not None)
        if failed or not running:
            break
        if time.monotonic() > deadline:
            print(f"timed out after {args.timeout} s", file=sys.stderr)
            failed = True
            break
        try:
            running[0].wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    for (task_type, index), proc in zip(TASKS, procs):
        print(f"{task_type} {index}: exit {proc.returncode}")
    if failed:
        return 1
    print(f"model_dir {model_dir}: checkpoint {tf.train.latest_checkpoint(model_dir)}, "
          f"exports {sorted(os.listdir(os.path.join(model_dir, 'export', 'digits')))}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model-dir", default=None, help="shared by every task (default: temp)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the whole job")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: 30 steps")
    args = parser.parse_args()
    steps = 30 if args.smoke else args.steps
    if os.environ.get("TF_CONFIG"):
        task(args, steps)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
