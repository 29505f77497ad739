"""perseusrun: starts a job's ranks with the Open MPI `mpirun` of this Python environment.

    perseusrun -np 4 -H hostA:2,hostB:2 python train.py --epochs 3
    perseusrun --tcp -np 4 python train.py      (this machine, no MPI: the TCP controller)
    perseusrun --emulate-hosts 2:2 --link-rate 1gbit python train.py   (2 emulated hosts here)

Everything after the first argument that is not a perseusrun option is the program and its own
arguments. This module imports neither TensorFlow nor the native core; only `--check-build`
loads them.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import perseus_env
from perseus_env import ADDRESSES_VARIABLE, LEGACY_KERAS_SET_HERE, RANK_VARIABLE
from perseusrun import emulate

# Forwarded to every rank (with `-x NAME`) whenever they are set.
FORWARDED_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("PERSEUS_", "TF_")
LOCAL_HOST_NAMES = {"localhost", "127.0.0.1", "::1"}
# Variables of an MPI launcher; `--tcp` ranks do not inherit them.
MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_")
# SIGTERM first, then SIGKILL for the whole process tree when the job is still there.
KILL_GRACE_SECONDS = 10.0
# The signals that stop a job: forwarded to its ranks (or, while emulated hosts are built, they
# unwind the launcher so that the hosts are removed).
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
                     if s)
TIMEOUT_EXIT_CODE = 124
# What a rank prints (mpi_controller.cc) before MPI_Abort when another rank stopped answering.
ABORT_LINE = "]: aborting the MPI job: "
# After that line mpirun ends the job, unless it waits for the daemon of a host it can no longer
# reach (a cut link), which can last for as long as TCP retransmits: then the launcher ends it.
ABORT_GRACE_SECONDS = 15.0
# The exit code of a job a rank aborted (MPI_Abort's error code in mpi_controller.cc).
ABORT_EXIT_CODE = 1
# `--tcp --emulate-hosts`: local rank i of every emulated host listens on this port + i (the
# hosts' network namespaces are new: nothing else listens there).
EMULATED_TCP_PORT = 29500
# Options that consume the next argument; the first argument that is neither one of these nor
# an option starts the user's program.
_VALUE_OPTIONS = {"-np", "-n", "--num-proc", "-H", "--host", "--hosts", "--hostfile", "-x",
                  "--timeout", "--bind-to", "--mpi-args", "--yield-when-idle",
                  "--emulate-hosts", "--link-rate"}


class UsageError(Exception):
    """A command line perseusrun cannot run; main() prints it and exits 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perseusrun", allow_abbrev=False,
        usage="perseusrun -np N [-H host:slots,... | --hostfile FILE] [options] program [args...]",
        description="Runs `program` on N ranks with Open MPI's mpirun. PERSEUS_*, TF_*, PATH, "
                    "PYTHONPATH, LD_LIBRARY_PATH, VIRTUAL_ENV and OMP_NUM_THREADS are forwarded.")
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=int, help="number of ranks")
    p.add_argument("-H", "--host", "--hosts", dest="hosts",
                   help="comma-separated host[:slots] list (a host without :slots has 1 slot)")
    p.add_argument("--hostfile", help="file of `host slots=N` or `host:N` lines")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="VAR[=VALUE]",
                   help="also forward VAR (or set it to VALUE) on every rank; repeatable")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than host slots (always on for localhost-only jobs)")
    p.add_argument("--bind-to", choices=("none", "core"), default="none",
                   help="pin each rank to a core (default none: ranks share the cores)")
    p.add_argument("--yield-when-idle", choices=("auto", "on", "off"), default="auto",
                   help="MPI waits yield the CPU (auto: on when a host's ranks fill its cores); "
                        "env PERSEUS_MPI_YIELD_WHEN_IDLE=on|off sets the default")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="terminate the whole job when it runs longer than this")
    p.add_argument("--mpi-args", default="", metavar='"ARGS"',
                   help="raw extra mpirun arguments, e.g. --mpi-args \"--mca btl self,tcp\"")
    p.add_argument("--tag-output", action="store_true",
                   help="prefix each output line with its rank")
    p.add_argument("--tcp", action="store_true",
                   help="start the ranks on this machine without MPI; they use the TCP "
                        "controller (PERSEUS_TCP_RANK / PERSEUS_TCP_ADDRESSES, no TF_CONFIG)")
    p.add_argument("--emulate-hosts", metavar="N[:SLOTS]",
                   help="run the job on N emulated hosts of this machine (network namespaces, "
                        "root only) with SLOTS ranks each (default 1); -np defaults to N*SLOTS")
    p.add_argument("--link-rate", metavar="RATE",
                   help="with --emulate-hosts: limit each host's link to RATE in each direction "
                        "(tc syntax: 1gbit, 10gbit, 100mbit)")
    p.add_argument("--check-build", action="store_true",
                   help="print which native parts were built and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print the mpirun command")
    return p


def split_program(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits argv into perseusrun's options and the user's program with its arguments."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if not arg.startswith("-") and (i == 0 or argv[i - 1] not in _VALUE_OPTIONS):
            return argv[:i], argv[i:]
    return list(argv), []


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parses perseusrun's command line; `.program` holds the user's command."""
    options, program = split_program(argv)
    args = _parser().parse_args(options)  # SystemExit(2) with argparse's message when bad
    args.program = program
    return args


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """`a:2,b,a` -> [("a", 3), ("b", 1)]: slots per host, in first-seen order."""
    slots: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        slots[name] = slots.get(name, 0) + _slot_count(count or "1", item)
    if not slots:
        raise UsageError(f"no hosts in {spec!r}")
    return list(slots.items())


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """Hosts of a file with lines `host`, `host:N` or `host slots=N` (# starts a comment)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read hostfile {path!r}: {exc.strerror}") from None
    entries = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        extra = [w for w in words[1:] if not w.startswith("max_slots=")]
        if len(extra) > 1 or (extra and not extra[0].startswith("slots=")):
            raise UsageError(f"{path}:{number}: expected `host slots=N` or `host:N`, got {line!r}")
        count = extra[0][len("slots="):] if extra else None
        name = words[0]
        if count is None:
            name, _, count = name.partition(":")
        entries.append(f"{name}:{_slot_count(count or '1', f'{path}:{number}')}")
    if not entries:
        raise UsageError(f"hostfile {path!r} lists no hosts")
    return parse_hosts(",".join(entries))


def _slot_count(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"bad slot count {text!r} in {where!r}: expected a positive integer")
    return int(text)


def is_local_host(name: str) -> bool:
    """Whether `name` is this machine (ranks there need no remote daemon)."""
    here = socket.gethostname()
    return name in LOCAL_HOST_NAMES or name in (here, here.split(".")[0])


def find_mpirun(env: dict) -> str:
    """The mpirun next to sys.executable (the venv's), else the first one on PATH."""
    try:
        return perseus_env.find_mpirun(env)
    except perseus_env.MpirunNotFoundError as exc:
        raise UsageError(str(exc)) from None


def _yield_when_idle(args: argparse.Namespace, env: dict, hosts: list[tuple[str, int]]) -> bool:
    """Whether ranks' MPI waits should yield the CPU (see --yield-when-idle)."""
    choice = args.yield_when_idle
    if choice == "auto":
        try:
            choice = perseus_env.read_choice("PERSEUS_MPI_YIELD_WHEN_IDLE", ("on", "off", "auto"),
                                             "auto", env, aliases=perseus_env.SWITCH_ALIASES)
        except perseus_env.SettingError as exc:
            raise UsageError(str(exc)) from None
    if choice in ("1", "on", "true", "yes"):
        return True
    if choice in ("0", "off", "false", "no"):
        return False
    if choice != "auto":
        raise UsageError(f"PERSEUS_MPI_YIELD_WHEN_IDLE={choice!r}: expected on, off or auto")
    # Ranks that fill every core leave TensorFlow's threads no spare core: an MPI wait that
    # busy-polls then takes CPU from compute (benchmarks/yield_when_idle.py measures it).
    ranks_per_host = min(args.np, max((slots for _, slots in hosts), default=args.np))
    return ranks_per_host >= (os.cpu_count() or 1)


def _hosts(args: argparse.Namespace) -> list[tuple[str, int]]:
    if args.hosts and args.hostfile:
        raise UsageError("give either -H or --hostfile, not both")
    if args.hosts:
        return parse_hosts(args.hosts)
    return read_hostfile(args.hostfile) if args.hostfile else []


def _check_job_args(args: argparse.Namespace) -> None:
    if args.np is None:
        raise UsageError("-np N is required: how many ranks to start")
    if args.np < 1:
        raise UsageError(f"-np must be at least 1, got {args.np}")
    if not args.program:
        raise UsageError("no program given: perseusrun -np N program [args...]")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")


def build_mpirun_command(args: argparse.Namespace, env: dict,
                         launcher_args: list[str] | None = None) -> list[str]:
    """The mpirun command line for parsed perseusrun `args` launched from environment `env`;
    `launcher_args` go before the user's --mpi-args."""
    _check_job_args(args)
    hosts = _hosts(args)
    local_only = all(is_local_host(name) for name, _ in hosts)
    slots = sum(count for _, count in hosts)
    if hosts and not local_only and args.np > slots and not args.oversubscribe:
        listed = ",".join(f"{name}:{count}" for name, count in hosts)
        raise UsageError(f"-np {args.np} needs {args.np} slots but the hosts give {slots} "
                         f"({listed}); add slots or pass --oversubscribe")

    mpirun = find_mpirun(env)
    cmd = [mpirun, "-np", str(args.np)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hosts:
        cmd += ["--host", ",".join(f"{name}:{count}" for name, count in hosts)]
    if not local_only:  # remote daemons find Open MPI where it lives here
        cmd += ["--prefix", os.path.dirname(os.path.dirname(os.path.realpath(mpirun)))]
    if local_only or args.oversubscribe:
        cmd.append("--oversubscribe")
    cmd += ["--bind-to", args.bind_to]
    if args.tag_output:
        cmd.append("--tag-output")
    if "OMPI_MCA_mpi_yield_when_idle" not in env and _yield_when_idle(args, env, hosts):
        cmd += ["--mca", "mpi_yield_when_idle", "1"]

    forwarded = {name: name for name in sorted(env)
                 if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)}
    for item in args.env:
        name = item.partition("=")[0]
        if not name:
            raise UsageError(f"-x {item!r}: expected VAR or VAR=value")
        forwarded[name] = item
    for item in forwarded.values():
        cmd += ["-x", item]
    return cmd + list(launcher_args or []) + shlex.split(args.mpi_args) + args.program


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    # mpirun puts each rank in its own process group, so kill by pid, ranks first.
    for pid in _descendants(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _forward_mpirun(stream, out, aborted: threading.Event) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        if ABORT_LINE in text:
            aborted.set()
        out.write(text)
        out.flush()


def run_job(cmd: list[str], env: dict, timeout: float | None = None,
            grace: float = KILL_GRACE_SECONDS) -> int:
    """Runs mpirun; forwards SIGINT/SIGTERM/SIGHUP; SIGKILLs the job `grace` s after a stop, and
    ABORT_GRACE_SECONDS after a rank has aborted it (see ABORT_LINE)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    aborted = threading.Event()
    forwarders = [threading.Thread(target=_forward_mpirun, args=(stream, out, aborted),
                                   daemon=True)
                  for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for t in forwarders:
        t.start()
    job_deadline = time.monotonic() + timeout if timeout else None
    kill_deadline: list[float | None] = [None]
    abort_deadline = None
    stopped_by: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)  # a second Ctrl-C makes mpirun abort at once
        if kill_deadline[0] is None:
            kill_deadline[0] = time.monotonic() + grace

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        while True:
            if abort_deadline is None and aborted.is_set():
                abort_deadline = time.monotonic() + ABORT_GRACE_SECONDS
            deadlines = [d for d in (job_deadline, kill_deadline[0], abort_deadline)
                         if d is not None]
            wait = min(deadlines) - time.monotonic() if deadlines else 0.5
            try:
                code = proc.wait(timeout=max(0.0, min(wait, 0.5)))
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if kill_deadline[0] is not None and now >= kill_deadline[0]:
                print(f"perseusrun: the job did not stop within {grace:g} s; killing it",
                      file=sys.stderr, flush=True)
                _kill_tree(proc)
                code = proc.wait()
                break
            if abort_deadline is not None and now >= abort_deadline:
                print(f"perseusrun: a rank aborted the job and mpirun has not ended "
                      f"{ABORT_GRACE_SECONDS:g} s later (it may wait for a host it cannot "
                      "reach); killing it", file=sys.stderr, flush=True)
                _kill_tree(proc)
                proc.wait()
                code = ABORT_EXIT_CODE
                break
            if job_deadline is not None and now >= job_deadline:
                print(f"perseusrun: timeout: the job ran longer than --timeout {timeout:g} s; "
                      "terminating all ranks", file=sys.stderr, flush=True)
                job_deadline = None
                stopped_by.append(-1)
                proc.send_signal(signal.SIGTERM)
                kill_deadline[0] = now + grace
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for t in forwarders:
        t.join(timeout=5)
    if -1 in stopped_by:
        return TIMEOUT_EXIT_CODE
    if stopped_by:
        return 128 + stopped_by[0]
    return code


def free_local_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tcp_rank_envs(args: argparse.Namespace, env: dict,
                  addresses: list[str] | None = None) -> list[dict]:
    """Each rank's environment for `perseusrun --tcp` (validates the command line); the ranks
    listen on `addresses` (default: free ports of 127.0.0.1)."""
    _check_job_args(args)
    if args.mpi_args:
        raise UsageError("--mpi-args has no meaning with --tcp (no mpirun is started)")
    hosts = _hosts(args)
    remote = [name for name, _ in hosts if not is_local_host(name)]
    if remote:
        raise UsageError(f"--tcp starts ranks on this machine only, not on {', '.join(remote)}; "
                         "on several machines start one process per task with TF_CONFIG")
    # A launch from inside an MPI job must not make the ranks look MPI-launched.
    base = {name: value for name, value in env.items() if not name.startswith(MPI_PREFIXES)}
    for item in args.env:
        name, has_value, value = item.partition("=")
        if not name:
            raise UsageError(f"-x {item!r}: expected VAR or VAR=value")
        if has_value:
            base[name] = value
    base["PERSEUS_CONTROLLER"] = "tcp"
    base[ADDRESSES_VARIABLE] = ",".join(
        addresses or (f"127.0.0.1:{port}" for port in free_local_ports(args.np)))
    return [{**base, RANK_VARIABLE: str(rank)} for rank in range(args.np)]


def _forward_lines(stream, prefix: str, out) -> None:
    # Whole lines only: ranks writing to one shared stdout would interleave within a line (an
    # unbuffered print() writes its newline separately).
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)  # each rank leads its own process group
            except OSError:
                pass


def run_local_ranks(program: list[str], envs: list[dict], timeout: float | None = None,
                    grace: float = KILL_GRACE_SECONDS, tag_output: bool = False,
                    hosts: list[emulate.EmulatedHost] | None = None) -> int:
    """Runs one `program` per environment (rank i on `hosts[i]` when given); ends every rank
    when one fails or time runs out."""
    procs, forwarders = [], []
    for rank, env in enumerate(envs):
        argv = hosts[rank].command(program) if hosts else program
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        procs.append(proc)
        for stream, tag, out in ((proc.stdout, "stdout", sys.stdout),
                                 (proc.stderr, "stderr", sys.stderr)):
            prefix = f"[1,{rank}]<{tag}>:" if tag_output else ""
            t = threading.Thread(target=_forward_lines, args=(stream, prefix, out), daemon=True)
            t.start()
            forwarders.append(t)
    job_deadline = time.monotonic() + timeout if timeout else None
    kill_deadline: list[float | None] = [None]
    stopped_by: list[int] = []
    failure: list[int] = []

    def stop(signum: int) -> None:
        _signal_all(procs, signum)
        if kill_deadline[0] is None:
            kill_deadline[0] = time.monotonic() + grace

    def forward(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        stop(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        while any(proc.poll() is None for proc in procs):
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                code = proc.poll()
                if code not in (None, 0) and not failure and not stopped_by:
                    failure.append(128 - code if code < 0 else code)
                    print(f"perseusrun: rank {rank} exited with code {code}; terminating the "
                          "other ranks", file=sys.stderr, flush=True)
                    stop(signal.SIGTERM)
            if job_deadline is not None and now >= job_deadline:
                print(f"perseusrun: timeout: the job ran longer than --timeout {timeout:g} s; "
                      "terminating all ranks", file=sys.stderr, flush=True)
                job_deadline = None
                stopped_by.append(-1)
                stop(signal.SIGTERM)
            if kill_deadline[0] is not None and now >= kill_deadline[0]:
                print(f"perseusrun: the job did not stop within {grace:g} s; killing it",
                      file=sys.stderr, flush=True)
                _signal_all(procs, signal.SIGKILL)
                kill_deadline[0] = float("inf")
            time.sleep(0.05)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for t in forwarders:
        t.join(timeout=5)
    if not failure:  # every rank ended within one poll interval: none was seen failing above
        failure = [128 - c if c < 0 else c for c in (p.returncode for p in procs) if c != 0][:1]
    if -1 in stopped_by:
        return TIMEOUT_EXIT_CODE
    if stopped_by:
        return 128 + stopped_by[0]
    return failure[0] if failure else 0


def parse_emulated_hosts(spec: str) -> tuple[int, int]:
    """`--emulate-hosts N[:SLOTS]` -> (N, SLOTS)."""
    count, _, slots = spec.partition(":")
    return (_slot_count(count, f"--emulate-hosts {spec}"),
            _slot_count(slots or "1", f"--emulate-hosts {spec}"))


def check_emulation_args(args: argparse.Namespace) -> tuple[int, int] | None:
    """(hosts, slots) of --emulate-hosts, None without it; sets -np's default to all slots."""
    if not args.emulate_hosts:
        if args.link_rate:
            raise UsageError("--link-rate limits emulated hosts' links: add --emulate-hosts N")
        return None
    if args.hosts or args.hostfile:
        raise UsageError("--emulate-hosts makes its own hosts: drop -H/--hostfile")
    count, slots = parse_emulated_hosts(args.emulate_hosts)
    if args.np is None:
        args.np = count * slots
    if args.tcp and args.np > count * slots:
        raise UsageError(f"-np {args.np} needs {args.np} slots but --emulate-hosts "
                         f"{args.emulate_hosts} gives {count * slots}")
    try:
        emulate.check_requirements(args.link_rate)
        if args.link_rate:
            emulate.rate_bytes_per_second(args.link_rate)
    except emulate.EmulationError as exc:
        raise UsageError(str(exc)) from None
    return count, slots


class _Stopped(BaseException):
    """A stop signal while emulated hosts are built: unwinds so that they are removed."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def run_emulated(args: argparse.Namespace, env: dict, count: int, slots: int) -> int:
    """Builds the emulated hosts, runs the job across them, removes them whatever happens."""
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        with emulate.emulated_hosts(count, args.link_rate) as hosts:
            if args.verbose:
                listed = ", ".join(f"{h.name}={h.address}" for h in hosts)
                print(f"perseusrun: {count} emulated hosts with {slots} slots on {hosts.subnet}:"
                      f" {listed}", file=sys.stderr, flush=True)
            if args.tcp:
                placed = [hosts[rank // slots] for rank in range(args.np)]
                addresses = [f"{host.address}:{EMULATED_TCP_PORT + rank % slots}"
                             for rank, host in enumerate(placed)]
                envs = tcp_rank_envs(args, env, addresses)
                return run_local_ranks(args.program, envs, timeout=args.timeout,
                                       tag_output=args.tag_output, hosts=placed)
            args.hosts = ",".join(f"{host.address}:{slots}" for host in hosts)
            cmd = build_mpirun_command(args, env, hosts.mpirun_args())
            if args.verbose:
                print("perseusrun:", shlex.join(cmd), file=sys.stderr, flush=True)
            return run_job(cmd, env, timeout=args.timeout)
    except _Stopped as stop:
        return 128 + stop.args[0]
    except (emulate.EmulationError, UsageError) as exc:
        print(f"perseusrun: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_build() -> int:
    """Prints perseus_legacy's diagnostics report; non-zero when a native part is missing."""
    try:
        diagnostics = importlib.import_module("perseus_legacy.diagnostics")
    except Exception as exc:  # the report says why, whatever it is
        print(f"perseus_legacy: MISSING: cannot import it: {type(exc).__name__}: {exc}",
              flush=True)
        return 1
    return diagnostics.main()


def inherited_environment() -> dict:
    """os.environ without the TF_USE_LEGACY_KERAS that importing perseus_legacy set in this
    process or its parent: each rank's own import decides, on its TensorFlow."""
    env = dict(os.environ)
    if env.pop(LEGACY_KERAS_SET_HERE, None):
        env.pop("TF_USE_LEGACY_KERAS", None)
    return env


def main(argv: list[str] | None = None) -> int:
    """perseusrun's entry point; returns the job's exit code (2 for a bad command line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help, or argparse already printed what is wrong
        return int(exc.code or 0)
    try:
        if args.check_build:
            return check_build()
        env = inherited_environment()
        if not perseus_env.read("PERSEUS_SECRET", env):
            env["PERSEUS_SECRET"] = secrets.token_hex(16)  # the ranks' shared job secret
        # TensorFlow's caching CPU allocator keeps large buffers mapped between steps instead of
        # faulting fresh pages in for every large tensor (a set value is kept).
        env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
        emulation = check_emulation_args(args)
        if emulation:
            _check_job_args(args)
            if args.tcp and args.mpi_args:
                raise UsageError("--mpi-args has no meaning with --tcp (no mpirun is started)")
        elif args.tcp:
            envs = tcp_rank_envs(args, env)
        else:
            cmd = build_mpirun_command(args, env)
    except UsageError as exc:
        print(f"perseusrun: error: {exc}", file=sys.stderr)
        return 2
    if emulation:
        return run_emulated(args, env, *emulation)
    if args.tcp:
        if args.verbose:
            print(f"perseusrun: {args.np} local ranks over TCP at "
                  f"{envs[0][ADDRESSES_VARIABLE]}: {shlex.join(args.program)}",
                  file=sys.stderr, flush=True)
        return run_local_ranks(args.program, envs, timeout=args.timeout,
                               tag_output=args.tag_output)
    if args.verbose:
        print("perseusrun:", shlex.join(cmd), file=sys.stderr, flush=True)
    return run_job(cmd, env, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
