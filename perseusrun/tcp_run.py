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
from perseusrun import supervise
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
              wrap: Callable[[int, list[str]], list[str]] | None = None) -> int:
    """Runs `program` once per environment (`wrap(rank, program)` says where, if given)."""
    commands = [((wrap(rank, program) if wrap else program), env) for rank, env in enumerate(envs)]
    return supervise.supervise(commands, timeout=args.timeout, per_rank=True,
                               tag_output=args.tag_output)


def prepare(args: argparse.Namespace, env: dict) -> Callable[[], int]:
    """Backend interface (see perseusrun.job): local ranks over TCP."""
    envs = tcp_rank_envs(args, env)

    def run() -> int:
        if args.verbose:
            print(f"perseusrun: {args.np} local ranks over TCP at {envs[0][ADDRESSES_VARIABLE]}:"
                  f" {shlex.join(args.program)}", file=sys.stderr, flush=True)
        return run_ranks(args.program, envs, args)

    return run
