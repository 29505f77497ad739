"""perseusrun: starts a job's ranks; the command line, and which backend runs the job.

    perseusrun -np 4 -H hostA:2,hostB:2 python train.py --epochs 3
    perseusrun --tcp -np 4 python train.py      (this machine, no MPI: the TCP controller)
    perseusrun --emulate-hosts 2:2 --link-rate 1gbit python train.py   (2 emulated hosts here)
    perseusrun python train.py                   (in a Slurm allocation: its nodes and slots)

Everything after the first argument that is not a perseusrun option is the program and its own
arguments. Each backend is a module (see perseusrun.job): mpi_run (mpirun, this machine or
-H/--hostfile), tcp_run (--tcp), slurm_run (inside a Slurm allocation), emulated_run
(--emulate-hosts), elastic_run (--tcp with --min-np/--max-np/--host-discovery-script);
supervise watches the job for the others. This module imports neither
TensorFlow nor the native core; only `--check-build` loads them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import secrets
import sys
from types import ModuleType

import perseus_env
from perseus_env import LEGACY_KERAS_SET_HERE
from perseus_shared import slurm
from perseusrun import elastic_run, emulated_run, mpi_run, slurm_run, tcp_run
from perseusrun.job import UsageError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perseusrun", allow_abbrev=False,
        usage="perseusrun -np N [-H host:slots,... | --hostfile FILE] [options] program [args...]",
        description="Runs `program` on N ranks with Open MPI's mpirun. PERSEUS_*, TF_*, PATH, "
                    "PYTHONPATH, LD_LIBRARY_PATH, VIRTUAL_ENV and OMP_NUM_THREADS are forwarded.")
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=int,
                   help="number of ranks (in a Slurm allocation: default all its task slots)")
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
    p.add_argument("--link-mtu", type=int, metavar="BYTES",
                   help="with --emulate-hosts: the links' MTU (default 1500; 9000 for jumbo "
                        "frames)")
    p.add_argument("--link-delay", type=float, metavar="MS",
                   help="with --emulate-hosts: hold every frame leaving a host MS milliseconds "
                        "(one way; a round trip between hosts takes 2 x MS); user-space links")
    p.add_argument("--link-jitter", type=float, metavar="MS",
                   help="with --link-delay: each frame's delay varies uniformly by +-MS "
                        "(frames keep their order)")
    p.add_argument("--link-loss", type=float, metavar="PCT",
                   help="with --emulate-hosts: drop PCT percent of the frames leaving each host "
                        "at random (fault tests); user-space links")
    p.add_argument("--link-queue", type=float, metavar="MS",
                   help="with --link-rate: each link holds MS milliseconds of traffic at its "
                        "rate before it drops frames, like a switch port's buffer (default 10)")
    p.add_argument("--restarts", type=int, default=0, metavar="K",
                   help="after a lost rank, start the job again (at most K times), without "
                        "its host when --min-np allows; it resumes from the last checkpoint")
    p.add_argument("--min-np", type=int, metavar="N",
                   help="fewest ranks the job may continue with after losing some (default "
                        "-np); elastic with --tcp")
    p.add_argument("--max-np", type=int, metavar="N",
                   help="elastic (--tcp): most ranks the job may grow to as hosts are added "
                        "(default -np, or every discovered slot with --host-discovery-script)")
    p.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="elastic (--tcp): a command printing the job's hosts, `host:slots` per "
                        "line; run every second: hosts it adds join and hosts it drops leave "
                        "at the next commit (with --emulate-hosts: names or indexes of them)")
    p.add_argument("--check-build", action="store_true",
                   help="print which native parts were built and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print the mpirun command")
    return p


def _value_options() -> set[str]:
    """The options that consume the next argument, read from the parser itself."""
    return {option for action in _parser()._actions if action.nargs != 0
            for option in action.option_strings}


def split_program(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits argv into perseusrun's options and the user's program with its arguments."""
    takes_value = _value_options()
    for i, arg in enumerate(argv):
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if not arg.startswith("-") and (i == 0 or argv[i - 1] not in takes_value):
            return argv[:i], argv[i:]
    return list(argv), []


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parses perseusrun's command line; `.program` holds the user's command."""
    options, program = split_program(argv)
    args = _parser().parse_args(options)  # SystemExit(2) with argparse's message when bad
    args.program = program
    return args


def choose_backend(args: argparse.Namespace, env: dict) -> ModuleType:
    """The backend module (see perseusrun.job) that runs this command line."""
    if args.emulate_hosts:
        return emulated_run
    for flag, value in (("--link-rate", args.link_rate), ("--link-mtu", args.link_mtu),
                        ("--link-delay", args.link_delay), ("--link-jitter", args.link_jitter),
                        ("--link-loss", args.link_loss), ("--link-queue", args.link_queue)):
        if value is not None:
            raise UsageError(f"{flag} sets emulated hosts' links: add --emulate-hosts N")
    if slurm_run.in_allocation(args, env):
        if elastic_run.is_elastic(args):
            raise UsageError("elastic training (--min-np, --max-np, --host-discovery-script) "
                             "is not run by Slurm's srun here: use perseusrun --tcp")
        return slurm_run
    if elastic_run.is_elastic(args):
        return elastic_run
    return tcp_run if args.tcp else mpi_run


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
    if args.check_build:
        return check_build()
    env = inherited_environment()
    if not perseus_env.read("PERSEUS_SECRET", env):
        env["PERSEUS_SECRET"] = secrets.token_hex(16)  # the ranks' shared job secret
    # TensorFlow's caching CPU allocator keeps large buffers mapped between steps instead of
    # faulting fresh pages in for every large tensor (a set value is kept).
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    try:
        slurm.check_secret_file(env, "perseusrun")
        run = choose_backend(args, env).prepare(args, env)
    except (UsageError, slurm.SlurmEnvironmentError) as exc:
        print(f"perseusrun: error: {exc}", file=sys.stderr)
        return 2
    return run()


if __name__ == "__main__":
    sys.exit(main())
