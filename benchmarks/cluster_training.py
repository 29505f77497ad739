"""Estimator training across emulated hosts on rate-limited links: parameter servers (the real
tf.estimator of TF 2.15.1, asynchronous and with SyncReplicasOptimizer) against
perseus_legacy.run_config(), one model_fn for all.

    python benchmarks/cluster_training.py [--configs ...] [--hosts 1,2,4] [--steps 40]  (as root)

Every configuration trains benchmarks/bench_common/training_model.py (24 MiB of dense weights, a
batch of 32 per process, plain gradient descent) on N emulated hosts (perseusrun/emulate.py)
whose links are capped at --link-rate each way, launched fresh with its own model_dir under a
temporary directory:

- plain: one process, a plain tf.estimator.RunConfig, no cluster (the baseline);
- ps_async, ps_sync: TF_CONFIG tasks started on the hosts with their namespace addresses, as
  `train_and_evaluate` users run parameter-server training today: a chief on host 0 and a
  worker on each other host, and N ps tasks over which the model_fn partitions its weights,
  one beside each chief/worker (--ps-layout dedicated: each on a host of its own). ps_async
  uses the plain optimizer; ps_sync wraps it in
  tf.compat.v1.train.SyncReplicasOptimizer(replicas_to_aggregate=N) with its hook;
- run_config, run_config_tcp: the ps_async model_fn unchanged, with `config=pl.run_config()`,
  launched by `perseusrun --emulate-hosts N --link-rate RATE`, one rank per host, over MPI
  or (--tcp) the TCP controller. The _tf221 configurations run on TF 2.21.

Throughput is measured on the chief (rank 0) from global_step and the clock, from the end of
the first step that leaves global_step at the warm-up's end to the end of training. Examples
are those of every process: a global step is one process's batch in ps_async (each worker's
update advances it) and N batches in ps_sync and run_config (N gradients per update). ms/step
is the time one process spends on one step of its own batch, N x batch / (examples/s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common.emulated import (
    MPI_BIN,
    RESULT,
    TF215_PYTHON,
    Config,
    LaunchError,
    Processes,
    add_link_options,
    emulated_links,
    launch_parameter_servers,
    launch_perseusrun,
    parse_result,
    process_env,
    python_for,
    stop_signals_raise,
)

# Launches whose traffic crosses no link take ~10 ms steps: they train this many times --steps,
# so that their timing spans seconds rather than a blip of the machine's other load.
NO_LINK_STEPS_FACTOR = 10


CONFIGS = {
    "plain": Config("plain RunConfig, one process (baseline)", "2.15", "plain"),
    "ps_async": Config("parameter servers, async", "2.15", "ps_async"),
    "ps_sync": Config("parameter servers, SyncReplicasOptimizer", "2.15", "ps_sync"),
    "run_config": Config("pl.run_config(), MPI allreduce", "2.15", "rank"),
    "run_config_tcp": Config("pl.run_config(), TCP allreduce", "2.15", "rank", tcp=True),
    "plain_tf221": Config("plain RunConfig, one process", "2.21", "plain"),
    "run_config_tf221": Config("pl.run_config(), MPI allreduce", "2.21", "rank"),
}
DEFAULT_CONFIGS = ",".join(CONFIGS)



# --------------------------------------------------------------------------- one process


def run_process(args: argparse.Namespace) -> None:
    """One process of a configuration; the chief (rank 0) prints the RESULT line."""
    pl = None
    if args.run == "rank" or args.perseus:
        import perseus_legacy as pl  # first: on TF >= 2.16 it brings tf.estimator back
    from bench_common import training_model as model  # noqa: I001 (TensorFlow, after perseus)
    import tensorflow as tf

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
    kwargs = {"model_dir": args.model_dir, "tf_random_seed": 1,
              "save_checkpoints_steps": None, "save_checkpoints_secs": None,
              "save_summary_steps": 0, "log_step_count_steps": None}
    threads = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                       inter_op_parallelism_threads=2)
    per_global_step = 1 if args.run in ("ps_async", "plain") else args.replicas
    rounds = args.warmup + args.steps  # every process trains about this many steps
    max_steps = rounds * args.replicas // per_global_step
    params = {"sync_replicas": args.replicas if args.run == "ps_sync" else 0}
    if args.run == "rank":
        config, seed = pl.run_config(session_config=threads, **kwargs), pl.rank()
    elif args.run == "plain":
        config, seed = tf.estimator.RunConfig(session_config=threads, **kwargs), 0
    else:
        # TF_CONFIG names this task; keep the Estimator's own distributed session config
        # (device filters: a worker talks to the ps tasks only), with the thread counts above.
        session_config = tf.compat.v1.ConfigProto()
        session_config.CopyFrom(tf.estimator.RunConfig().session_config)
        session_config.MergeFrom(threads)
        config = tf.estimator.RunConfig(session_config=session_config,
                                        experimental_max_worker_delay_secs=0, **kwargs)
        seed = config.global_id_in_cluster
    # The chief (rank 0) reports as soon as training ends: a SyncReplicasOptimizer chief then
    # waits up to 120 s for its queue runner, which waits for gradients that will never come.
    reporter = pl.rank() == 0 if args.run == "rank" else config.is_chief
    timer = model.GlobalStepTimer(args.warmup * args.replicas // per_global_step,
                                  report=RESULT if reporter else None)
    estimator = tf.estimator.Estimator(model.model_fn, config=config, params=params)
    train_input = lambda: model.input_fn(args.batch, seed)  # noqa: E731
    if args.run in ("ps_async", "ps_sync"):
        hooks = [timer, model.StartTogether()]
        tf.estimator.train_and_evaluate(
            estimator, tf.estimator.TrainSpec(train_input, max_steps=max_steps, hooks=hooks),
            tf.estimator.EvalSpec(train_input, steps=1))  # a ps task serves until ended
    else:
        estimator.train(train_input, max_steps=max_steps, hooks=[timer])


# --------------------------------------------------------------------------- the launcher


def process_args(config: Config, model_dir: Path, replicas: int,
                 args: argparse.Namespace) -> list:
    steps = args.steps * (1 if crosses_links(config, replicas, args.ps_layout)
                          else NO_LINK_STEPS_FACTOR)
    # TensorFlow 2.15 still has tf.estimator: there the plain and ps processes run without
    # perseus_legacy, as they do today.
    perseus = ["--perseus"] if config.tensorflow != "2.15" else []
    return [str(Path(__file__).resolve()), "--run", config.run, *perseus, "--model-dir",
            str(model_dir), "--replicas", str(replicas), "--batch", str(args.batch),
            "--warmup", str(args.warmup), "--steps", str(steps)]


def launch_plain(config: Config, model_dir: Path, args: argparse.Namespace) -> dict:
    procs = Processes(time.monotonic() + args.timeout)
    try:
        procs.start("plain", [python_for(config, args),
                              *process_args(config, model_dir, 1, args)], process_env(config))
        return parse_result(procs.wait_for(RESULT, {"plain"})["plain"])
    finally:
        procs.close()


def launch(name: str, hosts: int, args: argparse.Namespace) -> dict:
    """Trains configuration `name` on `hosts` hosts; examples/s and ms/step of its chief."""
    config = CONFIGS[name]
    model_dir = Path(tempfile.mkdtemp(prefix=f"cluster_training_{name}_{hosts}_"))
    started = time.monotonic()
    try:
        if config.run == "plain":
            result = launch_plain(config, model_dir, args)
        elif config.run == "rank":
            python = python_for(config, args)
            result = launch_perseusrun(config, hosts, args,
                                       [python, *process_args(config, model_dir, hosts, args)])
        else:
            result = launch_parameter_servers(config, hosts, args,
                                              process_args(config, model_dir, hosts, args))
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    per_global_step = args.batch * (hosts if config.synchronous else 1)
    examples_per_s = result["global_steps"] * per_global_step / result["seconds"]
    row = {"examples_per_s": examples_per_s,
           "step_ms": 1e3 * hosts * args.batch / examples_per_s,
           "global_steps": result["global_steps"], "launch_s": time.monotonic() - started,
           "parameter_bytes": result["parameter_bytes"]}
    print(f"{name} on {hosts} host(s): {examples_per_s:.0f} examples/s, "
          f"{row['step_ms']:.0f} ms/step ({result['global_steps']} global steps timed, "
          f"launch {row['launch_s']:.0f} s)", file=sys.stderr, flush=True)
    return row


def host_counts(name: str, hosts: list[int]) -> list[int]:
    return [1] if CONFIGS[name].run == "plain" else hosts


def tasks_text(name: str, hosts: int, ps_layout: str) -> str:
    run = CONFIGS[name].run
    if run == "plain":
        return "1 process"
    if run == "rank":
        return f"{hosts} rank{'s' if hosts > 1 else ''}"
    workers = f" + {hosts - 1} worker{'s' if hosts > 2 else ''}" if hosts > 1 else ""
    where = f" on {hosts} more host{'s' if hosts > 1 else ''}" if ps_layout == "dedicated" else ""
    return f"chief{workers} + {hosts} ps{where}"


def crosses_links(config: Config, hosts: int, ps_layout: str) -> bool:
    """Whether the launch's traffic crosses an emulated host's link."""
    return config.run != "plain" and (hosts > 1 or (config.run != "rank"
                                                    and ps_layout == "dedicated"))


def link_floor_ms(name: str, hosts: int, ps_layout: str, parameter_bytes: int,
                  link_bytes_s: float) -> float:
    """Least time per step of one process that the links allow. Per step, each host link
    carries 2(n-1)/n of the parameters each way in a ring allreduce and with a ps beside every
    trainer (its own pushes and pulls for the other n-1 shards, and the other trainers' for its
    shard); with dedicated ps hosts, every trainer's link carries all of them each way."""
    if not crosses_links(CONFIGS[name], hosts, ps_layout):
        return 0.0
    if CONFIGS[name].run != "rank" and ps_layout == "dedicated":
        share = 1.0
    else:
        share = 2 * (hosts - 1) / hosts
    return 1e3 * share * parameter_bytes / link_bytes_s


def ratio(row: dict | None, base: dict | None) -> str:
    """row's examples/s over base's, e.g. `1.52x`; empty when either is missing."""
    return f"{row['examples_per_s'] / base['examples_per_s']:.2f}x" if row and base else ""


def print_table(results: dict, args: argparse.Namespace, parameter_bytes: int,
                link_bytes_s: float) -> None:
    plain = {CONFIGS[name].tensorflow: row for (name, _), row in results.items()
             if CONFIGS[name].run == "plain"}
    print(f"\nEstimator MLP, {parameter_bytes / 2**20:.1f} MiB of float32 weights, batch "
          f"{args.batch} per process, {args.steps} timed steps per process "
          f"({NO_LINK_STEPS_FACTOR * args.steps} where no link is crossed) after {args.warmup} "
          f"of warm-up, links {args.link_rate} each way, median of {args.repeats} run(s)\n")
    print("| config | TF | hosts | processes | global examples/s | ms/step | link floor ms/step | "
          "vs 1 host | vs plain RunConfig |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for (name, hosts), row in results.items():
        config = CONFIGS[name]
        cells = ["failed", "", ""]
        if row is not None:
            floor = link_floor_ms(name, hosts, args.ps_layout, parameter_bytes, link_bytes_s)
            cells = [f"{row['examples_per_s']:.0f}", f"{row['step_ms']:.0f}", f"{floor:.0f}"]
        cells += [ratio(row, results.get((name, 1))), ratio(row, plain.get(config.tensorflow))]
        print(f"| {config.title} | {config.tensorflow} | {hosts} | "
              f"{tasks_text(name, hosts, args.ps_layout)} | "
              + " | ".join(cells) + " |")
    versus = [(name, hosts, row) for (name, hosts), row in results.items()
              if CONFIGS[name].run == "rank" and CONFIGS[name].tensorflow == "2.15"
              and any((ps, hosts) in results for ps in ("ps_async", "ps_sync"))]
    if versus:
        print("\npl.run_config() against parameter servers on as many hosts, TF 2.15 "
              "(examples/s over theirs)\n")
        print("| config | hosts | vs parameter servers, async | vs SyncReplicasOptimizer |")
        print("|---|---:|---:|---:|")
        for name, hosts, row in versus:
            print(f"| {CONFIGS[name].title} | {hosts} | "
                  f"{ratio(row, results.get(('ps_async', hosts)))} | "
                  f"{ratio(row, results.get(('ps_sync', hosts)))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--hosts", default="1,2,4", help="comma-separated host counts")
    parser.add_argument("--link-rate", default="1gbit", help="each host's link, tc syntax")
    add_link_options(parser)
    parser.add_argument("--ps-layout", choices=("colocated", "dedicated"), default="colocated",
                        help="a ps task beside each chief/worker, or each on a host of its own")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per process first")
    parser.add_argument("--batch", type=int, default=32, help="examples per process and step")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every launch, taking turns; the median is reported")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print when each launch's stages end")
    parser.add_argument("--tf215-python", default=str(TF215_PYTHON))
    parser.add_argument("--tf221-python", default=str(MPI_BIN / "python"))
    parser.add_argument("--run", choices=("plain", "ps_async", "ps_sync", "rank"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--perseus", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_process(args)
        return
    names = args.configs.split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    try:
        hosts = [int(n) for n in args.hosts.split(",")]
    except ValueError:
        parser.error(f"--hosts {args.hosts!r}: expected comma-separated host counts")
    if min(hosts) < 1 or args.steps < 1 or args.warmup < 1 or args.batch < 1:
        parser.error("--hosts, --steps, --warmup and --batch must be at least 1")
    for name in names:
        python = python_for(CONFIGS[name], args)
        if not os.access(python, os.X_OK):
            parser.error(f"{name} runs TF {CONFIGS[name].tensorflow} with {python}, which is "
                         "missing (`make compat-venvs tf215-ops` builds .venv-tf215)")
    from perseusrun import emulate

    try:
        link_bytes_s = emulate.rate_bytes_per_second(args.link_rate)
        if any(CONFIGS[name].run != "plain" for name in names):
            emulate.check_requirements(**emulated_links(args))
    except emulate.EmulationError as exc:
        parser.error(str(exc))
    launches = [(name, n) for name in names for n in host_counts(name, hosts)]
    runs: dict = {key: [] for key in launches}
    failed = False
    try:
        with stop_signals_raise():
            for _ in range(args.repeats):
                for name, n in launches:
                    try:
                        runs[name, n].append(launch(name, n, args))
                    except LaunchError as exc:
                        failed = True
                        print(f"{name} on {n} host(s) failed: {exc}", file=sys.stderr,
                              flush=True)
    except KeyboardInterrupt as stop:  # every launch has ended its processes and hosts
        signum = stop.args[0] if stop.args else signal.SIGINT
        print(f"stopped by signal {signum}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    results = {key: ({k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows
                     else None) for key, rows in runs.items()}
    parameter_bytes = next((r["parameter_bytes"] for rows in runs.values() for r in rows), None)
    if parameter_bytes is None:
        sys.exit("every launch failed")
    print_table(results, args, parameter_bytes, link_bytes_s)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
