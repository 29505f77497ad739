"""What a lost host costs: seconds from the loss to the next completed step, steps trained twice,
and examples/s before, during and after, for `perseusrun --restarts`, for today's rerun from the
last checkpoint, and for TF 2.15.1's asynchronous parameter servers, measured in one run.

    python benchmarks/faults.py [--hosts 4] [--steps 40] [--fault-step 17] [--every 10]
                                [--rows restarts,rerun,ps_async] [--link-rate 10gbit]  (as root)

Every row trains the same Estimator model_fn (an MLP on synthetic data, a batch of --batch
per process, gradient descent) on --hosts emulated hosts (perseusrun/emulate.py), one process
per host, and loses the last host's process (SIGKILL, as a crash or an evicted pod) once global
step --fault-step is done; rank 0 / the chief checkpoints every --every steps.

- restarts: `perseusrun --tcp --emulate-hosts N --restarts 1 --min-np N-1` with run_config():
  the lowest survivor saves the last completed step, the launcher starts the job again on the
  N-1 other hosts, and it resumes from that step.
- rerun: the same job as before survivors saved (the worker turns the save off): it fails, and
  is started again at once on N-1 hosts (what a script or an operator does), resuming from
  rank 0's last periodic checkpoint.
- elastic: a slot for hvd.elastic.run regrouping on TCP (benchmarks/faults_elastic.py measures
  it).
- ps_async: TF_CONFIG tasks on TF 2.15.1 (.venv-tf215), a chief and N-1 workers and one ps task
  beside the chief, plain tf.estimator with train_and_evaluate. The killed worker is started
  again at once (a pod restarted by its controller) and rejoins; the others never stop.

Columns: seconds from the kill to the next step completed anywhere (and to the next step past
the loss: for a rerun that means the steps it trains twice), steps redone, and examples/s from
the chief's global step and clock before the kill, from the kill until the job trains on
the hosts it will finish with, and after that. A synchronous global step holds a batch of every
rank; an asynchronous one holds one worker's batch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TF215_PYTHON = ROOT / ".venv-tf215" / "bin" / "python"
WORKER_PORT, PS_PORT = 2222, 2223
FEATURES, HIDDEN = 512, 2048
LEARNING_RATE = 1e-4  # stable with stale asynchronous gradients too
STEP, START, KILLED = "FAULTS_STEP", "FAULTS_START", "FAULTS_KILLED"  # worker -> launcher lines
THREADS = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
           "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
CLEARED = ("TF_CONFIG", "TF_USE_LEGACY_KERAS", "PERSEUS_CONTROLLER", "PERSEUS_TCP_RANK",
           "PERSEUS_TCP_ADDRESSES")


@dataclass(frozen=True)
class System:
    title: str
    measure: str | None  # the function of this module that measures it; None: another mode's


SYSTEMS = {
    "restarts": System("perseusrun --restarts 1 (survivor saves, relaunch on N-1)",
                       "measure_perseusrun"),
    "rerun": System("rerun from rank 0's last checkpoint (before --restarts)",
                    "measure_perseusrun"),
    "elastic": System("hvd.elastic.run on TCP (regroups on N-1)", None),
    "ps_async": System("parameter servers, async (TF 2.15.1), worker restarted",
                       "measure_parameter_servers"),
}
DEFAULT_ROWS = "restarts,rerun,ps_async"


# --------------------------------------------------------------------------- one process

def _say(kind: str, step: int) -> None:
    print(f"{kind} {step} {time.time():.6f}", flush=True)


def model_fn(features, labels, mode, params):
    import tensorflow as tf

    hidden = tf.compat.v1.layers.dense(features, HIDDEN, activation=tf.nn.relu)
    output = tf.compat.v1.layers.dense(hidden, 1)
    loss = tf.compat.v1.losses.mean_squared_error(labels, output)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def input_fn(batch: int, seed: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(seed)
    x = rng.normal(size=(batch * 8, FEATURES)).astype(np.float32)
    y = x[:, :1] * 0.5
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)


def progress_hook(log: bool, kill_at: int | None, marker: Path):
    """A hook printing START and each completed global STEP (when `log`), and killing this
    process once it has run `kill_at` steps itself (once: `marker` remembers it)."""
    import tensorflow as tf

    class Progress(tf.compat.v1.train.SessionRunHook):
        def begin(self) -> None:
            self._step = tf.compat.v1.train.get_global_step()
            self._ran = 0

        def after_create_session(self, session, coord) -> None:
            _say(START, int(session.run(self._step)))

        def after_run(self, run_context, run_values) -> None:
            step = int(run_context.session.run(self._step))
            self._ran += 1
            if log:
                _say(STEP, step)
            if kill_at is not None and self._ran >= kill_at and not marker.exists():
                marker.touch()
                _say(KILLED, step)
                os.kill(os.getpid(), signal.SIGKILL)

    return Progress()


def run_worker(args: argparse.Namespace) -> None:
    """One process: a perseusrun rank (`rank`, `rank_nosave`) or a TF_CONFIG task (`ps`)."""
    marker = Path(args.model_dir).parent / "killed"
    if args.worker.startswith("rank"):
        import perseus_legacy as pl  # noqa: I001 (first: on TF >= 2.16 it brings tf.estimator back)
        import tensorflow as tf

        tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
        config = pl.run_config(
            model_dir=args.model_dir, save_checkpoints_steps=args.every, save_summary_steps=0,
            log_step_count_steps=None,
            session_config=tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                    inter_op_parallelism_threads=2))
        if args.worker == "rank_nosave":
            from perseus_legacy.tf1 import survivor

            survivor.set_job_checkpoint_dir(None)  # the behaviour before survivors saved
        kill_at = args.fault_step if pl.rank() == pl.size() - 1 and pl.size() > 1 else None
        hook = progress_hook(pl.rank() == 0, kill_at, marker)
        estimator = tf.estimator.Estimator(model_fn, config=config)
        estimator.train(lambda: input_fn(args.batch, pl.rank()), max_steps=args.steps,
                        hooks=[hook])
        return
    import tensorflow as tf  # TF 2.15.1: its own tf.estimator, no perseus_legacy

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
    session_config = tf.compat.v1.ConfigProto()
    session_config.CopyFrom(tf.estimator.RunConfig().session_config)  # its device filters
    session_config.MergeFrom(tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                      inter_op_parallelism_threads=2))
    config = tf.estimator.RunConfig(
        model_dir=args.model_dir, save_checkpoints_steps=args.every, save_summary_steps=0,
        log_step_count_steps=None, session_config=session_config,
        experimental_max_worker_delay_secs=0)
    last_worker = config.task_type == "worker" and config.task_id == args.hosts - 2
    hook = progress_hook(config.is_chief, args.fault_step if last_worker else None, marker)
    estimator = tf.estimator.Estimator(model_fn, config=config)
    train = lambda: input_fn(args.batch, config.global_id_in_cluster)  # noqa: E731
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(train, max_steps=args.ps_steps, hooks=[hook]),
        tf.estimator.EvalSpec(train, steps=1))  # a ps task serves until it is ended


# --------------------------------------------------------------------------- the launcher

_EVENT = re.compile(rf"({STEP}|{START}|{KILLED}) (\d+) ([\d.]+)")


def events(text: str) -> list[tuple[str, int, float]]:
    """(kind, global step, time) of every worker line, in time order."""
    found = [(m.group(1), int(m.group(2)), float(m.group(3))) for m in _EVENT.finditer(text)]
    return sorted(found, key=lambda e: e[2])


def rate(steps: list[tuple[int, float]], start: float, end: float) -> float | None:
    """Global steps per second between the first and last STEP inside [start, end]."""
    inside = [(s, t) for s, t in steps if start <= t <= end]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def summarize(text: str, batch_before: int, batch_after: int, warmup: int,
              rejoined: float | None = None, steady_from: float = 0.0) -> dict:
    """The row's numbers from the STEP, START and KILLED lines of rank 0 / the chief (and the
    killed process's KILLED line). Recovery ends at the first step past the loss, or at
    `rejoined` (a restarted parameter-server worker's session start) when given; examples/s
    before counts from `steady_from` (when every worker trains) and past the warm-up."""
    found = events(text)
    killed = [(s, t) for kind, s, t in found if kind == KILLED]
    if not killed:
        raise RuntimeError(f"no {KILLED} line in the output:\n{text[-4000:]}")
    lost_step, lost_at = killed[0]
    steps = [(s, t) for kind, s, t in found if kind == STEP]
    starts = [(s, t) for kind, s, t in found if kind == START and t > lost_at]
    resumed_from, resumed_at = starts[0] if starts else (lost_step, lost_at)
    following = [(s, t) for s, t in steps if t > resumed_at]
    new = [t for s, t in following if s > lost_step]
    if not following or not new:
        raise RuntimeError(f"no step completed after the loss:\n{text[-4000:]}")
    recovered = rejoined if rejoined is not None else new[0]
    progress = max([s for s, t in steps if t <= recovered] + [lost_step]) - lost_step
    before = [(s, t) for s, t in steps if steady_from <= t < lost_at and s > warmup]
    return {"next_step_s": following[0][1] - lost_at, "new_step_s": new[0] - lost_at,
            "redone": max(0, lost_step - resumed_from),
            "before": _examples(rate(before, 0, lost_at), batch_before),
            "during": progress * batch_after / (recovered - lost_at),
            "after": _examples(rate(steps, recovered, float("inf")), batch_after),
            "recovery_s": recovered - lost_at}


def _examples(steps_per_second: float | None, batch: int) -> float | None:
    return None if steps_per_second is None else steps_per_second * batch


def process_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(THREADS)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])
    env.update(extra or {})
    return env


def worker_argv(mode: str, model_dir: Path, args: argparse.Namespace) -> list:
    return [str(Path(__file__).resolve()), "--worker", mode, "--model-dir", str(model_dir),
            "--hosts", str(args.hosts), "--steps", str(args.steps), "--fault-step",
            str(args.fault_step), "--every", str(args.every), "--batch", str(args.batch),
            "--ps-steps", str(args.ps_steps)]


def perseusrun(hosts: int, options: list, mode: str, model_dir: Path,
               args: argparse.Namespace) -> str:
    cmd = [str(Path(sys.executable).parent / "perseusrun"), "--tcp", "--emulate-hosts",
           str(hosts), "--link-rate", args.link_rate, *options, "--timeout", str(args.timeout),
           sys.executable, *worker_argv(mode, model_dir, args)]
    proc = subprocess.run(cmd, env=process_env(), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=args.timeout + 120)
    if args.verbose:
        print(proc.stdout[-6000:], file=sys.stderr)
    return proc.stdout


def measure_perseusrun(name: str, work: Path, args: argparse.Namespace) -> dict:
    model_dir = work / "model"
    hosts = args.hosts
    if name == "restarts":
        out = perseusrun(hosts, ["--restarts", "1", "--min-np", str(hosts - 1)], "rank",
                         model_dir, args)
    else:  # the job fails; the rerun starts at once on the hosts that are left
        out = perseusrun(hosts, [], "rank_nosave", model_dir, args)
        out += perseusrun(hosts - 1, [], "rank_nosave", model_dir, args)
    return summarize(out, hosts * args.batch, (hosts - 1) * args.batch, args.warmup)


def wait_line(log: Path, marker: str, deadline: float, proc: subprocess.Popen) -> str:
    """The first line of `log` holding `marker`, once it is there (polled: a benchmark)."""
    while time.monotonic() < deadline:
        ended = proc.poll() is not None
        for line in log.read_text(errors="replace").splitlines():
            if marker in line:
                return line
        if ended:
            break
        time.sleep(0.05)
    raise RuntimeError(f"no {marker!r} in {log} (exit {proc.poll()}):\n"
                       f"{log.read_text()[-4000:]}")


def measure_parameter_servers(name: str, work: Path, args: argparse.Namespace) -> dict:
    from perseusrun import emulate

    model_dir, python = work / "model", str(args.tf215_python)
    deadline = time.monotonic() + args.timeout
    procs: dict[str, subprocess.Popen] = {}
    with emulate.emulated_hosts(args.hosts, link_rate=args.link_rate) as machines:
        cluster = {"chief": [f"{machines[0].address}:{WORKER_PORT}"],
                   "ps": [f"{machines[0].address}:{PS_PORT}"],
                   "worker": [f"{m.address}:{WORKER_PORT}" for m in machines[1:]]}

        def start(who: str, task_type: str, index: int, machine) -> Path:
            tf_config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
            log = work / f"{who}.log"
            with open(log, "w") as out:
                procs[who] = machine.popen(
                    [python, *worker_argv("ps", model_dir, args)], cwd=ROOT, stdout=out,
                    stderr=subprocess.STDOUT,
                    env=process_env({"TF_CONFIG": json.dumps(tf_config)}))
            return log

        try:
            start("ps0", "ps", 0, machines[0])
            chief = start("chief", "chief", 0, machines[0])
            # Workers that find the chief's variables uninitialized wait 30 s (SessionManager)
            # before they look again: they start once the chief has trained a step.
            wait_line(chief, STEP, deadline, procs["chief"])
            for index, machine in enumerate(machines[1:]):
                start(f"worker{index}", "worker", index, machine)
            victim = f"worker{args.hosts - 2}"
            steady_from = max(float(wait_line(work / f"worker{index}.log", START, deadline,
                                              procs[f"worker{index}"]).split()[2])
                              for index in range(args.hosts - 1))
            killed = wait_line(work / f"{victim}.log", KILLED, deadline, procs[victim])
            procs[victim].wait(timeout=60)
            again = start(f"{victim}.restarted", "worker", args.hosts - 2, machines[-1])
            rejoined = float(wait_line(again, START, deadline,
                                       procs[f"{victim}.restarted"]).split()[2])
            procs["chief"].wait(timeout=max(1.0, deadline - time.monotonic()))
            text = chief.read_text(errors="replace") + "\n" + killed
        finally:
            if args.keep:
                shutil.copytree(work, args.keep, dirs_exist_ok=True)
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    if args.verbose:
        print(text[-6000:], file=sys.stderr)
    return summarize(text, args.batch, args.batch, args.warmup, rejoined=rejoined,
                     steady_from=steady_from)


def cell(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(results: dict, args: argparse.Namespace) -> None:
    print(f"\nA lost host: {args.hosts} emulated hosts (links {args.link_rate}), one process "
          f"each, batch {args.batch}, the last host's process killed after {args.fault_step} "
          f"steps of its own, checkpoints every {args.every} steps; {args.steps} global steps "
          f"(synchronous), {args.ps_steps} (parameter servers).\n")
    print("| system | s to next step | s to a new step | steps redone | examples/s before "
          "| during | after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, system in SYSTEMS.items():
        row = results.get(name)
        if row is None:
            why = "benchmarks/faults_elastic.py" if system.measure is None else "not run"
            print(f"| {system.title} | {why} | | | | | |")
            continue
        print(f"| {system.title} | {cell(row['next_step_s'])} | {cell(row['new_step_s'])} | "
              f"{row['redone']} | {cell(row['before'], 0)} | {cell(row['during'], 0)} | "
              f"{cell(row['after'], 0)} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="global steps to train")
    p.add_argument("--ps-steps", type=int, default=5000,
                   help="global steps of ps_async (each is one worker's batch)")
    p.add_argument("--fault-step", type=int, default=17,
                   help="the killed process dies after this many steps of its own")
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of examples/s before")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--link-rate", default="10gbit")
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--tf215-python", default=str(TF215_PYTHON))
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="copy the parameter servers' logs there")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in SYSTEMS or SYSTEMS[r].measure is None]
    if unknown:
        sys.exit(f"--rows: cannot measure {unknown} here; choose from "
                 f"{[n for n, s in SYSTEMS.items() if s.measure]}")
    results = {}
    for name in rows:
        with tempfile.TemporaryDirectory(prefix=f"faults_{name}_",
                                         ignore_cleanup_errors=True) as work:
            started = time.monotonic()
            results[name] = globals()[SYSTEMS[name].measure](name, Path(work), args)
            print(f"{name}: {results[name]} ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
