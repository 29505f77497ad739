"""One process of benchmarks/scaling.py: trains the emulated model
(bench_common/scaling_model.py) with one system, times it after the warm-up and reports.

    python benchmarks/scaling_worker.py --system SYSTEM --model M --byte-scale S --stats-dir D ...

SYSTEM is what each row of the benchmark runs, each written as its users write it:
- run_config: a tf.estimator.Estimator with `config=hvd.run_config()` (MPI or TCP: the launch
  decides);
- alone: the same Estimator with a plain RunConfig and a model_dir of its own on every rank, no
  collectives (the ranks only start their timed steps together): what the machine allows;
- alone_sync: the same, but each step ends with a 4-byte allreduce, so every rank waits for the
  slowest one each step, as in any synchronous training: what the machine allows a
  synchronous system;
- sync_hook: tf.compat.v1.train.MonitoredTrainingSession with `hvd.SyncReplicasHook()`;
- dist_opt: `hvd.DistributedOptimizer` and `hvd.BroadcastGlobalVariablesHook(0)` in a
  MonitoredTrainingSession;
- horovod: the same with Horovod 0.28.1's own `horovod.tensorflow` (MPI or Gloo: the launch
  decides), in the peers venv;
- ps_async, ps_sync: tf.estimator with TF_CONFIG parameter servers (TF 2.15.1), the plain
  optimizer or SyncReplicasOptimizer, started by cluster_training.launch_parameter_servers;
- mwms: tf.distribute.MultiWorkerMirroredStrategy (TF_CONFIG, RING) in a tf.function loop.

Every trainer writes `<stats-dir>/<who>.json`: its steps, wall seconds and CPU seconds (user +
system, this process) over the timed steps, and this product's rounds and allreduces in them
(runtime_stats()) when it runs it. The chief (rank 0) also prints
`RESULT {"seconds": ..., "global_steps": ...}` (cluster_training's format) when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

LEARNING_RATE = 1e-6  # the gradients are constants: the weights barely move
RESULT = "RESULT "
SYSTEMS = ("run_config", "alone", "alone_sync", "sync_hook", "dist_opt", "horovod", "ps_async",
           "ps_sync", "mwms")


def _threads(tf):
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                    inter_op_parallelism_threads=2)


def _step_stats_hook(tf, args: argparse.Namespace, who: str, reporter: bool):
    """A SessionRunHook timing this process's steps after `args.warmup` of its own, reading
    global_step at both ends; writes the stats file (and RESULT, on the chief) at the end.

    The first session.run of a new set of fetches builds an executor for it: up to a second of
    CPU on a loaded host, which the ranks do not finish together. So the global step is read
    once already after the first warm-up step, through the same tensor StopAtStepHook reads
    (the global step's cached read): otherwise the first read after the warm-up, and
    StopAtStepHook's own check in the last step, would each build one inside the timed
    steps. The ranks would build it together, and on 8 emulated hosts sharing 2 cores, the
    last step took 280 ms more than the others (ResNet-101): 5% of ten steps."""

    from tensorflow.python.training import training_util

    class StepStats(tf.compat.v1.train.SessionRunHook):
        def begin(self) -> None:
            # StopAtStepHook's tensor (created by its begin(), or here first)
            self.global_step = training_util._get_or_create_global_step_read()
            self.local_steps = 0
            self.first = None  # (seconds, cpu seconds, global step)

        def after_run(self, run_context, run_values) -> None:
            self.local_steps += 1
            if self.local_steps == args.warmup:
                if args.system.startswith("alone"):
                    _start_together()
                self.first = self._now(run_context.session)
                self.first_step = self.local_steps
            elif self.local_steps == 1:
                self._now(run_context.session)  # builds the fetch's executor (docstring)

        def end(self, session) -> None:
            if self.first is None:
                raise RuntimeError(f"{who}: training ended after {self.local_steps} steps, "
                                   f"before the warm-up's {args.warmup}: nothing was timed")
            last = self._now(session)
            write_stats(args, who, reporter, seconds=last[0] - self.first[0],
                        cpu_s=last[1] - self.first[1], global_steps=last[2] - self.first[2],
                        local_steps=self.local_steps - self.first_step,
                        runtime={k: v - self.first[3].get(k, 0) for k, v in last[3].items()})

        def _now(self, session) -> tuple:
            step = int(session.run(self.global_step))
            return time.perf_counter(), time.process_time(), step, _runtime_counters()

    return StepStats()


def _start_together() -> None:
    """Waits for every rank of the job (an allreduce of one number): ranks that train alone
    start their timed steps together, so each is timed while all the others train."""
    import numpy as np

    from perseus_legacy.common.native import core

    core().allreduce(np.zeros(1, np.float32), "alone.start_together")


def _runtime_counters() -> dict:
    """This product's runtime counters (runtime_stats()), when this process runs it."""
    hvd = sys.modules.get("perseus_legacy")
    if hvd is None or not hvd.is_initialized():
        return {}
    stats = hvd.runtime_stats()
    carried = stats.get("carried_allreduces", 0)  # travelled with a round: no data plane
    return {"rounds": stats["cache_rounds"] + stats["coordinator_rounds"],
            "collectives": stats["collectives_executed"]["allreduce"] + carried,
            **{f"allreduce_{name}": count
               for name, count in stats.get("allreduce_algorithms", {}).items()},
            "allreduce_carried": carried}


def write_stats(args: argparse.Namespace, who: str, reporter: bool, **stats) -> None:
    Path(args.stats_dir, f"{who}.json").write_text(json.dumps({"who": who, **stats}))
    if reporter:
        print(RESULT + json.dumps(stats), flush=True)


def _loss(args: argparse.Namespace, inputs=None, make_variable=None):
    from bench_common import scaling_model

    profile = scaling_model.load_profile(args.model, step_scale=args.step_scale)
    wait = scaling_model.Wait(args.wait)
    kwargs = {"make_variable": make_variable} if make_variable else {}
    return scaling_model.build_loss(profile, args.byte_scale, wait, inputs, **kwargs)


def _total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps


# --------------------------------------------------------------------------- the systems


def run_estimator(args: argparse.Namespace) -> None:
    """run_config (perseus) or ps_async / ps_sync (TF_CONFIG) Estimators."""
    hvd = None
    alone = args.system.startswith("alone")
    if args.system == "run_config" or alone:
        import perseus_legacy as hvd  # first: on TF >= 2.16 it brings tf.estimator back
    import tensorflow as tf

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
    kwargs = {"model_dir": args.model_dir, "save_checkpoints_steps": None,
              "save_checkpoints_secs": None, "save_summary_steps": 0,
              "log_step_count_steps": None}
    replicas = args.replicas
    if alone:
        hvd.init()  # for the rank and the start together only
        kwargs["model_dir"] = os.path.join(args.model_dir, f"rank{hvd.rank()}")
        config = tf.estimator.RunConfig(session_config=_threads(tf), **kwargs)
        who, chief = f"rank{hvd.rank()}", hvd.rank() == 0
        replicas = 1  # its global step counts its own steps
    elif hvd is not None:
        config = hvd.run_config(session_config=_threads(tf), **kwargs)
        who, chief = f"rank{hvd.rank()}", hvd.rank() == 0
    else:
        session_config = tf.compat.v1.ConfigProto()
        session_config.CopyFrom(tf.estimator.RunConfig().session_config)  # device filters
        session_config.MergeFrom(_threads(tf))
        config = tf.estimator.RunConfig(session_config=session_config,
                                        experimental_max_worker_delay_secs=0, **kwargs)
        who, chief = f"{config.task_type}{config.task_id}", config.is_chief

    def model_fn(features, labels, mode, params, config):
        loss = _loss(args, features)
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
        hooks = [_step_stats_hook(tf, args, who, chief)]
        if args.system == "ps_sync":
            optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
                optimizer, replicas_to_aggregate=replicas, total_num_replicas=replicas)
            hooks.append(optimizer.make_session_run_hook(config.is_chief))
        train_op = optimizer.minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        if args.system == "alone_sync":
            with tf.control_dependencies([train_op]):  # the step ends when every rank's ends
                train_op = tf.group(hvd.allreduce(tf.zeros([1]), name="alone_sync.barrier"))
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                          training_hooks=hooks)

    def input_fn():
        return tf.data.Dataset.from_tensors(tf.ones([1])).repeat()

    # One global step is one batch of every trainer, except with asynchronous ps (one batch).
    per_global_step = 1 if args.system == "ps_async" else replicas
    max_steps = _total_steps(args) * replicas // per_global_step
    estimator = tf.estimator.Estimator(model_fn, config=config)
    if args.system.startswith("ps_"):
        from bench_common import training_model

        spec = tf.estimator.TrainSpec(input_fn, max_steps=max_steps,
                                      hooks=[training_model.StartTogether()])
        tf.estimator.train_and_evaluate(estimator, spec,
                                        tf.estimator.EvalSpec(input_fn, steps=1))
    else:
        estimator.train(input_fn, max_steps=max_steps)


def run_monitored_session(args: argparse.Namespace) -> None:
    """sync_hook, dist_opt (perseus_legacy) or horovod (horovod.tensorflow)."""
    if args.system == "horovod":
        import horovod.tensorflow as hvd
    else:
        import perseus_legacy as hvd
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    hvd.init()
    who, chief = f"rank{hvd.rank()}", hvd.rank() == 0
    global_step = tf.compat.v1.train.get_or_create_global_step()
    loss = _loss(args)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=_total_steps(args)),
             _step_stats_hook(tf, args, who, chief)]
    if args.system == "sync_hook":
        hooks.append(hvd.SyncReplicasHook())
    else:
        optimizer = hvd.DistributedOptimizer(optimizer)
        hooks.append(hvd.BroadcastGlobalVariablesHook(0))
    train_op = optimizer.minimize(loss, global_step=global_step)
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks, config=_threads(tf),
                                                     save_summaries_steps=None,
                                                     save_summaries_secs=None,
                                                     log_step_count_steps=None) as session:
        while not session.should_stop():
            session.run(train_op)


def run_mwms(args: argparse.Namespace) -> None:
    """MultiWorkerMirroredStrategy (RING): each worker one replica, gradients all-reduced by
    the strategy when the optimizer step applies them."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=ring))
    task = strategy.cluster_resolver.task_id
    who, chief = f"worker{task}", task == 0
    variables: dict = {}

    def make_variable(name: str, elements: int):
        if name not in variables:  # the first, eager build under the scope makes them
            variables[name] = tf.Variable(tf.zeros([elements]), name=name)
        return variables[name]

    with strategy.scope():
        _loss(args, make_variable=make_variable)
    weights = list(variables.values())

    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = _loss(args, make_variable=make_variable)
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.MEAN, tape.gradient(loss, weights))
            for weight, grad in zip(weights, grads):
                weight.assign_sub(LEARNING_RATE * grad)
            return loss

        return strategy.run(replica_fn)

    for _ in range(args.warmup):
        step()
    first = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    write_stats(args, who, chief, seconds=time.perf_counter() - first[0],
                cpu_s=time.process_time() - first[1], global_steps=args.steps,
                local_steps=args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--byte-scale", type=float, required=True)
    parser.add_argument("--step-scale", type=float, default=1.0)
    parser.add_argument("--wait", choices=("op", "py_function"), default="op")
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=1, help="trainers in the job")
    parser.add_argument("--stats-dir", required=True)
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    if args.system in ("run_config", "alone", "alone_sync", "ps_async", "ps_sync"):
        run_estimator(args)
    elif args.system == "mwms":
        run_mwms(args)
    else:
        run_monitored_session(args)


if __name__ == "__main__":
    main()
