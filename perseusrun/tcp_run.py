"""The `--tcp` backend: one process per rank on this machine, no MPI; the ranks form the TCP
controller from PERSEUS_TCP_RANK and PERSEUS_TCP_ADDRESSES (emulated_run places them on
emulated hosts instead).
"""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
from collections.abc import Callable

from perseus_env import ADDRESSES_VARIABLE, RANK_VARIABLE
from perseusrun import restarts, supervise
from perseusrun.job import UsageError, check_job_args, is_local_host, job_hosts, rank_environment


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


def check_tcp_args(args: argparse.Namespace) -> None:
    """The rules of a job without mpirun."""
    check_job_args(args)
    restarts.check_restart_args(args)
    if args.mpi_args:
        raise UsageError("--mpi-args has no meaning with --tcp (no mpirun is started)")


def tcp_rank_envs(args: argparse.Namespace, env: dict,
                  addresses: list[str] | None = None) -> list[dict]:
    """Each rank's environment for `perseusrun --tcp` (validates the command line); the ranks
    listen on `addresses` (default: free ports of 127.0.0.1)."""
    check_tcp_args(args)
    remote = [name for name, _ in job_hosts(args) if not is_local_host(name)]
    if remote:
        raise UsageError(f"--tcp starts ranks on this machine only, not on {', '.join(remote)}; "
                         "on several machines start one process per task with TF_CONFIG")
    # A launch from inside an MPI job must not make the ranks look MPI-launched.
    base = rank_environment(args, env)
    base["PERSEUS_CONTROLLER"] = "tcp"
    base[ADDRESSES_VARIABLE] = ",".join(
        addresses or (f"127.0.0.1:{port}" for port in free_local_ports(args.np)))
    return [{**base, RANK_VARIABLE: str(rank)} for rank in range(args.np)]


def run_ranks(program: list[str], envs: list[dict], args: argparse.Namespace,
              wrap: Callable[[int, list[str]], list[str]] | None = None,
              lost: set | None = None) -> int:
    """Runs `program` once per environment (`wrap(rank, program)` says where, if given);
    `lost` collects the ranks the output says were lost (see supervise)."""
    commands = [((wrap(rank, program) if wrap else program), env) for rank, env in enumerate(envs)]
    return supervise.supervise(commands, timeout=args.timeout, per_rank=True,
                               tag_output=args.tag_output, lost=lost)


def prepare(args: argparse.Namespace, env: dict) -> Callable[[], int]:
    """Backend interface (see perseusrun.job): local ranks over TCP."""
    envs = tcp_rank_envs(args, env)

    def run_once(np: int, lost: set | None, timeout: float | None) -> int:
        args.np = np
        envs_now = envs if np == len(envs) and lost is None else tcp_rank_envs(args, env)
        if lost is not None:
            args.timeout = timeout
        if args.verbose:
            print(f"perseusrun: {args.np} local ranks over TCP at "
                  f"{envs_now[0][ADDRESSES_VARIABLE]}: {shlex.join(args.program)}",
                  file=sys.stderr, flush=True)
        return run_ranks(args.program, envs_now, args, lost=lost)

    if not args.restarts:
        return lambda: run_once(args.np, None, args.timeout)
    placement = restarts.placement_of(job_hosts(args), args.np)  # this machine only
    return lambda: restarts.run_with_restarts(
        args, placement, lambda placed, lost, left: run_once(len(placed), lost, left))
