"""Estimator training across emulated hosts on rate-limited links: parameter servers (the real
tf.estimator of TF 2.15.1, asynchronous and with SyncReplicasOptimizer) against
perseus_legacy.run_config(), one model_fn for all.

    python benchmarks/cluster_training.py [--configs ...] [--hosts 1,2,4] [--steps 40]  (as root)

Every configuration trains benchmarks/cluster_training_model.py (24 MiB of dense weights, a
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
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TF215_PYTHON = ROOT / ".venv-tf215" / "bin" / "python"
MPI_BIN = ROOT / ".venv" / "bin"  # mpirun comes with the main environment's Open MPI wheel
WORKER_PORT, PS_PORT = 2222, 2223  # a worker host holds its chief/worker task and a ps task
GRACE_SECONDS = 20.0  # for the workers to end once the chief has reported
# Launches whose traffic crosses no link take ~10 ms steps: they train this many times --steps,
# so that their timing spans seconds rather than a blip of the machine's other load.
NO_LINK_STEPS_FACTOR = 10
# The launcher's handshake with each chief or worker (cluster_training_model.StartTogether).
BUILT, CONNECT, READY, GO = "BUILT", "connect", "READY", "go"
RESULT = "RESULT "
SERVING = "Started server with target"  # TensorFlow's log line once a task's server listens
# One intra-op thread per process (several processes share the 2 cores of a development host).
THREADS = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
           "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONUNBUFFERED": "1"}
# Set per launch below, never inherited from the shell that runs the benchmark.
CLEARED = ("TF_CONFIG", "TF_USE_LEGACY_KERAS", "PERSEUS_CONTROLLER", "PERSEUS_TCP_RANK",
           "PERSEUS_TCP_ADDRESSES")


@dataclass(frozen=True)
class Config:
    title: str
    tensorflow: str  # "2.15" (.venv-tf215) or "2.21" (the main environment)
    run: str  # what each process runs: plain, ps_async, ps_sync or rank
    tcp: bool = False  # rank: perseusrun --tcp (the TCP controller) instead of MPI

    @property
    def synchronous(self) -> bool:
        """Whether one global step holds a batch of every process."""
        return self.run in ("ps_sync", "rank")


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


class LaunchError(RuntimeError):
    """A configuration failed to run; the text holds what its processes printed."""


# --------------------------------------------------------------------------- one process


def run_process(args: argparse.Namespace) -> None:
    """One process of a configuration; the chief (rank 0) prints the RESULT line."""
    pl = None
    if args.run == "rank" or args.perseus:
        import perseus_legacy as pl  # first: on TF >= 2.16 it brings tf.estimator back
    import cluster_training_model as model  # noqa: I001 (imports TensorFlow, after perseus)
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


def python_for(config: Config, args: argparse.Namespace) -> str:
    return args.tf215_python if config.tensorflow == "2.15" else args.tf221_python


def process_env(config: Config, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(THREADS)
    env["PATH"] = f"{MPI_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])
    if config.tensorflow == "2.15":
        env["TF_USE_LEGACY_KERAS"] = "0"  # TF 2.15's tf.keras is Keras 2 already
    env.update(extra or {})
    return env


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


def parse_result(line: str) -> dict:
    return json.loads(line[line.index(RESULT) + len(RESULT):])


class Processes:
    """Started processes, their output lines and exit codes as they come; close() ends those
    still running."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.changed = threading.Condition()
        self.procs: dict[str, subprocess.Popen] = {}
        self.output: dict[str, list[str]] = {}
        self.codes: dict[str, int] = {}

    def start(self, who: str, argv: list, env: dict, host=None) -> None:
        """Starts `argv` (on the emulated `host` if given), stdin a pipe for send()."""
        options = {"env": env, "cwd": ROOT, "stdin": subprocess.PIPE, "text": True,
                   "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        proc = host.popen(argv, **options) if host else subprocess.Popen(argv, **options)
        with self.changed:
            self.procs[who] = proc
            self.output[who] = []
        threading.Thread(target=self._read, args=(who, proc), daemon=True).start()

    def _read(self, who: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self.changed:
                self.output[who].append(line)
                self.changed.notify_all()
        code = proc.wait()
        with self.changed:
            self.codes[who] = code
            self.changed.notify_all()

    def wait_for(self, marker: str, wanted: set[str],
                 may_end: set[str] = frozenset()) -> dict[str, str]:
        """The first line holding `marker` of each process in `wanted`, printed now or later.
        Fails at the deadline, and when a process ends with an error, or before it printed
        what is awaited, or at all (except those in `may_end`, with exit code 0)."""
        with self.changed:
            while True:
                found = {who: next(line for line in self.output[who] if marker in line)
                         for who in wanted if any(marker in line for line in self.output[who])}
                for who, code in self.codes.items():
                    if code != 0 or (who in wanted and who not in found) or (
                            who not in wanted and who not in may_end):
                        raise LaunchError(f"{who} exited {code} while the launcher waited for "
                                          f"{marker.strip()!r}:\n{self.report()}")
                if len(found) == len(wanted):
                    return found
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    missing = ", ".join(sorted(wanted - set(found)))
                    raise LaunchError(f"timed out waiting for {marker.strip()!r} from "
                                      f"{missing}:\n{self.report()}")
                self.changed.wait(remaining)

    def wait_ended(self, names: set[str], deadline: float) -> list[str]:
        """Waits until the processes `names` end or `deadline` passes; those still running."""
        for who in sorted(names):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[who].wait(timeout=max(0.0, deadline - time.monotonic()))
        return [who for who in sorted(names) if self.procs[who].poll() is None]

    def send(self, who: str, text: str) -> None:
        try:
            self.procs[who].stdin.write(text + "\n")
            self.procs[who].stdin.flush()
        except BrokenPipeError:
            raise LaunchError(f"{who} ended before the launcher could send it {text!r}:\n"
                              f"{self.report()}") from None

    def report(self, tail: int = 40) -> str:
        return "".join(f"--- {who} (exit {self.procs[who].poll()}):\n" + "".join(lines[-tail:])
                       for who, lines in self.output.items())

    def close(self) -> None:
        """Ends the processes still running: SIGTERM, then SIGKILL."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def log(args: argparse.Namespace, text: str) -> None:
    if args.verbose:
        print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def launch_plain(config: Config, model_dir: Path, args: argparse.Namespace) -> dict:
    procs = Processes(time.monotonic() + args.timeout)
    try:
        procs.start("plain", [python_for(config, args),
                              *process_args(config, model_dir, 1, args)], process_env(config))
        return parse_result(procs.wait_for(RESULT, {"plain"})["plain"])
    finally:
        procs.close()


def launch_parameter_servers(config: Config, hosts: int, model_dir: Path,
                             args: argparse.Namespace, program: list | None = None) -> dict:
    """A chief and hosts-1 workers, one per host, and `hosts` ps tasks: one beside each of
    them, or (--ps-layout dedicated) each on a host of its own. Every task runs `program`
    (this script's process by default) with the configuration's Python."""
    from perseusrun import emulate

    python = python_for(config, args)
    program = program or process_args(config, model_dir, hosts, args)
    procs = Processes(time.monotonic() + args.timeout)
    dedicated = args.ps_layout == "dedicated"
    with emulate.emulated_hosts(2 * hosts if dedicated else hosts,
                                **emulated_links(args)) as machines:
        try:
            trainer_hosts, ps_hosts = machines[:hosts], machines[hosts if dedicated else 0:]
            cluster = {"chief": [f"{trainer_hosts[0].address}:{WORKER_PORT}"],
                       "ps": [f"{m.address}:{PS_PORT}" for m in ps_hosts]}
            if hosts > 1:
                cluster["worker"] = [f"{m.address}:{WORKER_PORT}" for m in trainer_hosts[1:]]

            def start(task_type: str, index: int, machine, extra: dict | None = None) -> str:
                who = f"{task_type}{index}"
                tf_config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
                procs.start(who, [python, *program],
                            process_env(config, {"TF_CONFIG": json.dumps(tf_config),
                                                 **(extra or {})}), machine)
                return who

            # Every task starts at once; each connects once those it needs are up: gRPC waits
            # ever longer between attempts to reach a server that is not up yet, and a worker
            # that finds the variables uninitialized waits 30 s (SessionManager's recovery
            # wait) before it looks again. A ps task logs when its server listens.
            servers = {start("ps", index, machine, {"TF_CPP_MIN_LOG_LEVEL": "0"})
                       for index, machine in enumerate(ps_hosts)}
            chief = start("chief", 0, trainer_hosts[0])
            workers = {start("worker", index, machine)
                       for index, machine in enumerate(trainer_hosts[1:])}
            procs.wait_for(SERVING, servers)
            log(args, "ps tasks serving")
            procs.wait_for(BUILT, {chief})
            procs.send(chief, CONNECT)
            procs.wait_for(READY, {chief})
            log(args, "chief ready")
            procs.wait_for(BUILT, workers)
            for who in sorted(workers):
                procs.send(who, CONNECT)
            procs.wait_for(READY, workers)
            log(args, "workers ready")
            for who in (chief, *sorted(workers)):  # all begin their first step together
                procs.send(who, GO)
            line = procs.wait_for(RESULT, {chief}, may_end=workers)[chief]
            log(args, "chief done")
            # Each worker stops at the step that finds global_step at max_steps.
            running = procs.wait_ended(workers, time.monotonic() + GRACE_SECONDS)
            if running:
                print(f"{config.title}, {hosts} hosts: {', '.join(running)} still ran "
                      f"{GRACE_SECONDS:g} s after the chief reported", file=sys.stderr,
                      flush=True)
            log(args, "workers done")
            return parse_result(line)
        finally:
            procs.close()
            if args.verbose:
                print(procs.report(), file=sys.stderr, flush=True)


def add_link_options(parser: argparse.ArgumentParser) -> None:
    """The emulated links' options beyond their rate (each benchmark names its own default)."""
    parser.add_argument("--link-mtu", type=int, help="the links' MTU (default 1500)")
    parser.add_argument("--link-delay", type=float, metavar="MS",
                        help="one-way delay of each link (user-space links, see "
                             "docs/multi-host.md)")
    parser.add_argument("--link-jitter", type=float, metavar="MS", help="+- on each delay")
    parser.add_argument("--link-loss", type=float, metavar="PCT",
                        help="percent of the frames leaving a host lost")


def emulated_links(args: argparse.Namespace) -> dict:
    """emulate.emulated_hosts' keywords for the links that add_link_options describes."""
    return {"link_rate": args.link_rate, "mtu": args.link_mtu, "delay_ms": args.link_delay,
            "jitter_ms": args.link_jitter, "loss": args.link_loss}


def link_flags(args: argparse.Namespace) -> list:
    """perseusrun's flags for the same links."""
    values = {"--link-rate": args.link_rate, "--link-mtu": args.link_mtu,
              "--link-delay": args.link_delay, "--link-jitter": args.link_jitter,
              "--link-loss": args.link_loss}
    return [text for flag, value in values.items() if value is not None
            for text in (flag, str(value))]


def launch_perseusrun(config: Config, hosts: int, model_dir: Path,
                      args: argparse.Namespace, program: list | None = None,
                      slots: int = 1) -> dict:
    """perseusrun --emulate-hosts HOSTS:SLOTS, rank 0 reports. Each rank runs `program` (argv,
    this script's process with the configuration's Python by default)."""
    python = python_for(config, args)
    program = program or [python, *process_args(config, model_dir, hosts, args)]
    # A waiting rank yields its core: on separate machines its wait would cost no other host
    # anything, and here 4 hosts share 2 cores.
    cmd = [python, "-m", "perseusrun", "--emulate-hosts", f"{hosts}:{slots}",
           *link_flags(args), "--yield-when-idle", "on", *(["--tcp"] if config.tcp else []),
           "--timeout", str(int(args.timeout)), *program]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=process_env(config), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = None
    try:
        out, _ = proc.communicate(timeout=args.timeout + 60)  # perseusrun ends it at --timeout
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # perseusrun stops its ranks and removes its hosts on SIGTERM
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    if out is None:
        raise LaunchError(f"{' '.join(cmd)} outlived its timeout and was ended")
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise LaunchError(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-8000:]}")
    return parse_result(lines[-1])


def launch(name: str, hosts: int, args: argparse.Namespace) -> dict:
    """Trains configuration `name` on `hosts` hosts; examples/s and ms/step of its chief."""
    config = CONFIGS[name]
    model_dir = Path(tempfile.mkdtemp(prefix=f"cluster_training_{name}_{hosts}_"))
    started = time.monotonic()
    try:
        if config.run == "plain":
            result = launch_plain(config, model_dir, args)
        elif config.run == "rank":
            result = launch_perseusrun(config, hosts, model_dir, args)
        else:
            result = launch_parameter_servers(config, hosts, model_dir, args)
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


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP unwind, so that every launch ends its processes and hosts."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
