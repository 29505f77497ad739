"""The mpirun backend: the job's ranks started by the Open MPI `mpirun` of this environment, on
this machine or on the hosts of -H/--hostfile (or, through slurm_run and emulated_run, on those
of a Slurm allocation or of emulated hosts).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable

import perseus_env
from perseus_shared import mpi
from perseusrun import restarts, supervise
from perseusrun.job import UsageError, check_job_args, is_local_host, job_hosts

# Forwarded to every rank (with `-x NAME`) whenever they are set.
FORWARDED_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("PERSEUS_", "TF_")


def find_mpirun(env: dict) -> str:
    """The mpirun next to sys.executable (the venv's), else the first one on PATH."""
    try:
        return mpi.find_mpirun(env)
    except mpi.MpirunNotFoundError as exc:
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


def build_mpirun_command(args: argparse.Namespace, env: dict,
                         launcher_args: list[str] | None = None) -> list[str]:
    """The mpirun command line for parsed perseusrun `args` launched from environment `env`;
    `launcher_args` go before the user's --mpi-args."""
    check_job_args(args)
    restarts.check_restart_args(args)
    hosts = job_hosts(args)
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


def run_mpirun(cmd: list[str], env: dict, args: argparse.Namespace,
               lost: set | None = None) -> int:
    """Runs an mpirun command line under supervise() (printed first with -v); `lost` collects
    the ranks mpirun says died."""
    if args.verbose:
        print("perseusrun:", shlex.join(cmd), file=sys.stderr, flush=True)
    return supervise.supervise([(cmd, env)], timeout=args.timeout, lost=lost)


def prepare(args: argparse.Namespace, env: dict) -> Callable[[], int]:
    """Backend interface (see perseusrun.job): mpirun on this machine or -H/--hostfile's hosts."""
    cmd = build_mpirun_command(args, env)
    if not args.restarts:
        return lambda: run_mpirun(cmd, env, args)

    def run_once(placement: list, lost: set, timeout: float | None) -> int:
        args.np, args.timeout, args.hostfile = len(placement), timeout, None
        args.hosts = ",".join(f"{host}:{n}" for host, n in restarts.hosts_of(placement))
        return run_mpirun(build_mpirun_command(args, env), env, args, lost)

    placement = restarts.placement_of(job_hosts(args), args.np)
    return lambda: restarts.run_with_restarts(args, placement, run_once)
