"""The `--emulate-hosts N[:SLOTS]` backend: the job on N emulated hosts of this machine (see
perseusrun.emulate), over mpirun or, with --tcp, one process per rank in its host's namespace
(elastic: perseusrun.elastic_run starts and ends them, on the hosts its discovery script names).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable

from perseusrun import elastic_run, emulate, mpi_run, restarts, tcp_run
from perseusrun.job import UsageError, check_job_args, slot_count
from perseusrun.supervise import STOP_SIGNALS

# `--tcp --emulate-hosts`: local rank i of every emulated host listens on this port + i (the
# hosts' network namespaces are new: nothing else listens there).
EMULATED_TCP_PORT = 29500


def parse_emulated_hosts(spec: str) -> tuple[int, int]:
    """`--emulate-hosts N[:SLOTS]` -> (N, SLOTS)."""
    count, _, slots = spec.partition(":")
    return (slot_count(count, f"--emulate-hosts {spec}"),
            slot_count(slots or "1", f"--emulate-hosts {spec}"))


def _links(args: argparse.Namespace) -> tuple:
    """emulate.emulated_hosts' link parameters after its host count, from the command line."""
    return (args.link_rate, args.link_mtu, args.link_delay, args.link_jitter, args.link_loss,
            args.link_queue)


def check_emulation_args(args: argparse.Namespace) -> tuple[int, int]:
    """(hosts, slots) of --emulate-hosts; sets -np's default to all slots."""
    if args.hosts or args.hostfile:
        raise UsageError("--emulate-hosts makes its own hosts: drop -H/--hostfile")
    count, slots = parse_emulated_hosts(args.emulate_hosts)
    elastic = elastic_run.is_elastic(args)
    if elastic:
        elastic_run.check_elastic_args(args)
    if args.np is None and not (elastic and args.host_discovery_script):
        args.np = count * slots
    if args.tcp and args.np > count * slots:
        raise UsageError(f"-np {args.np} needs {args.np} slots but --emulate-hosts "
                         f"{args.emulate_hosts} gives {count * slots}")
    try:
        emulate.check_requirements(*_links(args))
    except emulate.EmulationError as exc:
        raise UsageError(str(exc)) from None
    if elastic:  # -np may come from the discovery script: checked when it has run
        return count, slots
    check_job_args(args)
    restarts.check_restart_args(args)
    if args.tcp:
        tcp_run.check_tcp_args(args)
    return count, slots


class _Stopped(BaseException):
    """A stop signal while emulated hosts are built: unwinds so that they are removed."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _run_placed(hosts: emulate.EmulatedHosts, placement: list, args: argparse.Namespace,
                env: dict, lost: set | None = None, timeout: float | None = None) -> int:
    """The job with rank i on host placement[i] (a host's ranks next to each other)."""
    args.np, args.timeout = len(placement), timeout if lost is not None else args.timeout
    if args.tcp:
        addresses = [f"{host.address}:{EMULATED_TCP_PORT + placement[:rank].count(host)}"
                     for rank, host in enumerate(placement)]
        envs = tcp_run.tcp_rank_envs(args, env, addresses)
        return tcp_run.run_ranks(args.program, envs, args,
                                 wrap=lambda rank, program: placement[rank].command(program),
                                 lost=lost)
    args.hosts = ",".join(f"{host.address}:{n}" for host, n in restarts.hosts_of(placement))
    cmd = mpi_run.build_mpirun_command(args, env, hosts.mpirun_args())
    return mpi_run.run_mpirun(cmd, env, args, lost)


def _run_on(hosts: emulate.EmulatedHosts, slots: int, args: argparse.Namespace,
            env: dict) -> int:
    if elastic_run.is_elastic(args):
        return elastic_run.run_emulated(args, env, hosts, slots, EMULATED_TCP_PORT)
    placement = [hosts[(rank // slots) % len(hosts)] for rank in range(args.np)]
    if not args.restarts:
        return _run_placed(hosts, placement, args, env)
    return restarts.run_with_restarts(
        args, placement, lambda placed, lost, left: _run_placed(hosts, placed, args, env, lost,
                                                                left),
        local=lambda host: False)


def run_emulated(args: argparse.Namespace, env: dict, count: int, slots: int) -> int:
    """Builds the emulated hosts, runs the job across them, removes them whatever happens."""
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        with emulate.emulated_hosts(count, *_links(args)) as hosts:
            if args.verbose:
                listed = ", ".join(f"{h.name}={h.address}" for h in hosts)
                print(f"perseusrun: {count} emulated hosts with {slots} slots on {hosts.subnet}:"
                      f" {listed}", file=sys.stderr, flush=True)
            return _run_on(hosts, slots, args, env)
    except _Stopped as stop:
        return 128 + stop.args[0]
    except (emulate.EmulationError, UsageError) as exc:
        print(f"perseusrun: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def prepare(args: argparse.Namespace, env: dict) -> Callable[[], int]:
    """Backend interface (see perseusrun.job): the job across emulated hosts."""
    count, slots = check_emulation_args(args)
    return lambda: run_emulated(args, env, count, slots)



