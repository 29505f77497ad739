"""Launching a benchmark's processes on emulated hosts (perseusrun/emulate.py) and reading their
results: the configurations' environments, TF_CONFIG parameter-server clusters, perseusrun
--emulate-hosts launches, the emulated links' options, and the processes' output as it comes.
Used by benchmarks/cluster_training.py and benchmarks/scaling.py; imports no TensorFlow.

A launched program prints one `RESULT {json}` line (its chief or rank 0); parameter-server
tasks hold at the handshake of training_model.StartTogether until every task is up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
ROOT = HERE.parent
TF215_PYTHON = ROOT / ".venv-tf215" / "bin" / "python"
MPI_BIN = ROOT / ".venv" / "bin"  # mpirun comes with the main environment's Open MPI wheel
WORKER_PORT, PS_PORT = 2222, 2223  # a worker host holds its chief/worker task and a ps task
GRACE_SECONDS = 20.0  # for the workers to end once the chief has reported
# The launcher's handshake with each chief or worker (training_model.StartTogether).
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
    env: tuple = ()  # (name, value) pairs every process of the launch gets

    @property
    def synchronous(self) -> bool:
        """Whether one global step holds a batch of every process."""
        return self.run in ("ps_sync", "rank")


class LaunchError(RuntimeError):
    """A configuration failed to run; the text holds what its processes printed."""


def python_for(config: Config, args: argparse.Namespace) -> str:
    return args.tf215_python if config.tensorflow == "2.15" else args.tf221_python


def process_env(config: Config, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(THREADS)
    env["PATH"] = f"{MPI_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])
    if config.tensorflow == "2.15":
        env["TF_USE_LEGACY_KERAS"] = "0"  # TF 2.15's tf.keras is Keras 2 already
    env.update(dict(config.env))
    env.update(extra or {})
    return env


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


def launch_parameter_servers(config: Config, hosts: int, args: argparse.Namespace,
                             program: list) -> dict:
    """A chief and hosts-1 workers, one per host, and `hosts` ps tasks: one beside each of
    them, or (--ps-layout dedicated) each on a host of its own. Every task runs `program` (a
    script and its arguments) with the configuration's Python."""
    from perseusrun import emulate

    python = python_for(config, args)
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
    parser.add_argument("--link-queue", type=float, metavar="MS",
                        help="milliseconds of traffic at the link rate a link holds before it "
                             "drops frames (perseusrun's default: 10)")


def emulated_links(args: argparse.Namespace) -> dict:
    """emulate.emulated_hosts' keywords for the links that add_link_options describes."""
    return {"link_rate": args.link_rate, "mtu": args.link_mtu, "delay_ms": args.link_delay,
            "jitter_ms": args.link_jitter, "loss": args.link_loss, "queue_ms": args.link_queue}


def link_flags(args: argparse.Namespace) -> list:
    """perseusrun's flags for the same links."""
    values = {"--link-rate": args.link_rate, "--link-mtu": args.link_mtu,
              "--link-delay": args.link_delay, "--link-jitter": args.link_jitter,
              "--link-loss": args.link_loss, "--link-queue": args.link_queue}
    return [text for flag, value in values.items() if value is not None
            for text in (flag, str(value))]


def launch_perseusrun(config: Config, hosts: int, args: argparse.Namespace, program: list,
                      slots: int = 1) -> dict:
    """perseusrun --emulate-hosts HOSTS:SLOTS (run by the configuration's Python), rank 0
    reports. Each rank runs `program` (a whole argv: its Python, the script, the arguments)."""
    python = python_for(config, args)
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
