"""The elastic backend: `perseusrun --tcp` with --min-np, --max-np or --host-discovery-script.

Runs one worker process per slot of the job's hosts (this machine's, or emulated hosts with
--emulate-hosts) and the driver (perseusrun.elastic_driver) that forms their rounds. Workers
that are lost (their process ended, or frozen / cut off while the others regroup) are ended and
their host is not used again; the discovery script, run every DISCOVERY_SECONDS, adds hosts
(workers start on their free slots, up to --max-np, and join at the next commit) and removes
them (their workers leave at the next commit). The job ends when its ranks have ended: 0 when
training finished, 1 with the driver's reason when fewer than --min-np ranks remained.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import perseus_env
from perseus_env import ELASTIC_DRIVER_VARIABLE, ELASTIC_WORKER_VARIABLE, SECRET_VARIABLE
from perseusrun import supervise
from perseusrun.elastic_driver import Driver, Worker
from perseusrun.job import UsageError, check_job_args, is_local_host, job_hosts, rank_environment

DISCOVERY_SECONDS = 1.0
DISCOVERY_TIMEOUT = 10.0
# Emulated hosts: slot s of a host listens on this port + s in round 1; each round moves to a
# new block of ports, so that a round never waits on the sockets of the last one.
PORT_BLOCK = 64
PORT_BLOCKS = 32


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the command line asks for elastic training: --max-np, --host-discovery-script,
    or --min-np without --restarts (which restarts the whole job instead)."""
    if getattr(args, "max_np", None) is not None or getattr(args, "host_discovery_script", None):
        return True
    return getattr(args, "min_np", None) is not None and not getattr(args, "restarts", 0)


def check_elastic_args(args: argparse.Namespace) -> None:
    """The rules of an elastic job (UsageError)."""
    if not args.tcp:
        raise UsageError("elastic training (--min-np, --max-np, --host-discovery-script) needs "
                         "--tcp: MPI cannot re-form its world after a rank is lost (a lost rank "
                         "ends an MPI job); run the job with perseusrun --tcp")
    if args.np is None and not args.host_discovery_script:
        raise UsageError("-np N is required: how many ranks to start")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise UsageError("give either -H/--hostfile or --host-discovery-script, not both")
    for name in ("min_np", "max_np"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.mpi_args:
        raise UsageError("--mpi-args has no meaning with --tcp (no mpirun is started)")


def parse_discovery(text: str) -> list[tuple[str, int]]:
    """The discovery script's output, `host:slots` per line (`host` alone: 1 slot)."""
    hosts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, slots = line.partition(":")
        if slots and (not slots.strip().isdigit() or int(slots) < 1):
            raise ValueError(f"bad line {line!r}: expected host:slots")
        hosts[name.strip()] = int(slots or 1)
    return list(hosts.items())


def discover(script: str) -> list[tuple[str, int]]:
    """Runs the discovery script; its hosts and slots (ValueError saying what went wrong)."""
    try:
        proc = subprocess.run(script, shell=True, capture_output=True, text=True,
                              timeout=DISCOVERY_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{script!r} ran longer than {DISCOVERY_TIMEOUT:g} s") from None
    if proc.returncode != 0:
        raise ValueError(f"{script!r} exited with {proc.returncode}: {proc.stderr.strip()}")
    return parse_discovery(proc.stdout)


class Place:
    """Where workers can run: host name -> (address, wrap(argv) -> argv run on that host)."""

    def __init__(self, resolve: Callable[[str], tuple[str, str, Callable] | None],
                 driver_address: str) -> None:
        self.resolve = resolve  # name -> (canonical name, address, wrap) or None
        self.driver_address = driver_address


def local_place() -> Place:
    """This machine (localhost's names): ranks listen on 127.0.0.1."""
    def resolve(name: str):
        return (name, "127.0.0.1", None) if is_local_host(name) else None
    return Place(resolve, "127.0.0.1")


def emulated_place(hosts) -> Place:
    """Emulated hosts (perseusrun.emulate), named by hostname or index."""
    by_name = {h.name: h for h in hosts}
    by_name.update({str(h.index): h for h in hosts})

    def resolve(name: str):
        host = by_name.get(name)
        return (host.name, host.address, host.command) if host else None
    return Place(resolve, hosts.launch_address)


class ElasticJob:
    """The worker processes, their output, the discovery loop and the driver."""

    def __init__(self, args: argparse.Namespace, env: dict, place: Place,
                 ports: Callable[[int, list[Worker]], list[int]]) -> None:
        self.args = args
        self.place = place
        self.base = rank_environment(args, env)
        self.base["PERSEUS_CONTROLLER"] = "tcp"
        self.procs: dict[str, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self.blacklist: set[str] = set()
        self.hosts: dict[str, int] = {}  # discovered host -> slots
        self.unknown: set[str] = set()  # discovered names that are no host of this job
        self.started = 0
        self.codes: dict[str, int] = {}
        # The workers' secret, -x PERSEUS_SECRET=... included: the driver must prove the same.
        self.driver = Driver(perseus_env.read(SECRET_VARIABLE, self.base) or "",
                             place.driver_address,
                             min_np=args.min_np, max_np=args.max_np, ports=ports,
                             on_lost=self._lost)

    def _lost(self, worker: Worker, why: str) -> None:
        # Called with the driver's lock held: only signals here.
        self.blacklist.add(worker.host)
        proc = self.procs.get(worker.name)
        if proc is not None and proc.poll() is None:
            _kill(proc)

    def _start(self, host: str, slot: int) -> None:
        resolved = self.place.resolve(host)
        if resolved is None:
            raise UsageError(f"host {host!r} is not one this job can start workers on")
        name, address, wrap = resolved
        worker_name = f"{name}/{slot}"
        if worker_name in self.procs:  # the host was dropped and listed again: a new worker
            worker_name += f".{self.started}"
        worker = Worker(name=worker_name, host=name, slot=slot, address=address,
                        order=self.started)
        self.started += 1
        env = {**self.base, ELASTIC_DRIVER_VARIABLE: self.driver.address,
               ELASTIC_WORKER_VARIABLE: worker.name}
        argv = wrap(self.args.program) if wrap else list(self.args.program)
        self.driver.add_worker(worker)
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        self.procs[worker.name] = proc
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            prefix = f"[{worker.name}]" if self.args.tag_output else ""
            thread = threading.Thread(target=_forward, args=(stream, prefix, out), daemon=True)
            thread.start()
            self.threads.append(thread)

    def update_hosts(self, hosts: list[tuple[str, int]], limit: int) -> None:
        """Starts workers on new hosts' free slots (up to `limit` running), removes gone hosts."""
        canonical = []
        for name, slots in hosts:
            resolved = self.place.resolve(name)
            if resolved is None:
                if name not in self.unknown:
                    self.unknown.add(name)
                    print(f"perseusrun: elastic: ignoring discovered host {name!r}: not a host "
                          "of this job", file=sys.stderr, flush=True)
                continue
            canonical.append((resolved[0], slots))
        for gone in set(self.hosts) - {name for name, _ in canonical}:
            self.driver.remove_host(gone)
            del self.hosts[gone]
        for name, slots in canonical:
            self.hosts[name] = slots
            if name in self.blacklist:
                continue
            used = {int(w.slot) for w in self.driver.workers.values()
                    if w.host == name and w.alive}
            for slot in range(slots):
                running = sum(1 for p in self.procs.values() if p.poll() is None)
                if running >= limit:
                    return
                if slot not in used:
                    self._start(name, slot)

    def run(self, initial: list[tuple[str, int]], discovery: str | None) -> int:
        stopped: list[int] = []
        previous = {s: signal.signal(s, lambda signum, _f: stopped.append(signum))
                    for s in supervise.STOP_SIGNALS}
        deadline = time.monotonic() + self.args.timeout if self.args.timeout else None
        next_discovery = time.monotonic() + DISCOVERY_SECONDS
        try:
            self.update_hosts(initial, self.args.np)
            while any(p.poll() is None for p in self.procs.values()):
                time.sleep(supervise.POLL_SECONDS)
                for name, proc in list(self.procs.items()):
                    if name not in self.codes and proc.poll() is not None:
                        code = proc.returncode
                        self.codes[name] = 128 - code if code < 0 else code  # killed: 128 + N
                        self.driver.worker_exited(name, self.codes[name])
                now = time.monotonic()
                if stopped or (deadline is not None and now >= deadline):
                    if not stopped:
                        print(f"perseusrun: timeout: the job ran longer than --timeout "
                              f"{self.args.timeout:g} s; terminating all ranks",
                              file=sys.stderr, flush=True)
                    self._end_all()
                    return 128 + stopped[0] if stopped else supervise.TIMEOUT_EXIT_CODE
                if discovery and now >= next_discovery and not self.driver.finished \
                        and not self.driver.failure:
                    next_discovery = now + DISCOVERY_SECONDS
                    try:
                        self.update_hosts(discover(discovery), self.args.max_np)
                    except ValueError as exc:
                        print(f"perseusrun: elastic: host discovery failed: {exc}",
                              file=sys.stderr, flush=True)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._end_all()
            self.driver.stop()
            for thread in self.threads:
                thread.join(timeout=5)
        if self.driver.failure:
            print(f"perseusrun: error: elastic job failed: {self.driver.failure}",
                  file=sys.stderr, flush=True)
            return 1
        if self.driver.finished:
            return 0
        codes = [code for code in self.codes.values() if code != 0]
        return codes[0] if codes else 0

    def _end_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM)
        until = time.monotonic() + supervise.KILL_GRACE_SECONDS
        while time.monotonic() < until and any(p.poll() is None for p in self.procs.values()):
            time.sleep(supervise.POLL_SECONDS)
        for proc in self.procs.values():
            if proc.poll() is None:
                _kill(proc)
            proc.wait()


def _signal(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except OSError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    _signal(proc, signal.SIGKILL)


def _forward(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def _defaults(args: argparse.Namespace, initial: list[tuple[str, int]]) -> None:
    slots = sum(count for _, count in initial)
    if args.np is None:
        args.np = slots
    check_job_args(args)
    if args.min_np is None:
        args.min_np = args.np
    if args.max_np is None:
        args.max_np = max(args.np, slots) if args.host_discovery_script else args.np
    if args.min_np > args.np or args.np > args.max_np:
        raise UsageError(f"elastic sizes must satisfy --min-np {args.min_np} <= -np {args.np} "
                         f"<= --max-np {args.max_np}")


def initial_hosts(args: argparse.Namespace, fallback: list[tuple[str, int]]) -> list:
    """The hosts of the first round: the discovery script's, -H/--hostfile's or `fallback`."""
    if args.host_discovery_script:
        try:
            hosts = discover(args.host_discovery_script)
        except ValueError as exc:
            raise UsageError(f"--host-discovery-script: {exc}") from None
        if not hosts:
            raise UsageError(f"--host-discovery-script {args.host_discovery_script!r} listed "
                             "no hosts")
        return hosts
    return job_hosts(args) or fallback


def run_local(args: argparse.Namespace, env: dict, initial: list[tuple[str, int]]) -> int:
    """An elastic job on this machine (ranks on 127.0.0.1)."""
    from perseusrun.tcp_run import free_local_ports

    job = ElasticJob(args, env, local_place(), lambda _round, workers:
                     free_local_ports(len(workers)))
    return job.run(initial, args.host_discovery_script)


def run_emulated(args: argparse.Namespace, env: dict, hosts, slots: int, base_port: int) -> int:
    """An elastic job on emulated hosts (perseusrun.emulate), `slots` per host by default."""
    initial = initial_hosts(args, [(h.name, slots) for h in hosts])
    _defaults(args, initial)

    def ports(round_number: int, workers: list[Worker]) -> list[int]:
        block = (round_number - 1) % PORT_BLOCKS * PORT_BLOCK
        return [base_port + block + w.slot for w in workers]

    job = ElasticJob(args, env, emulated_place(hosts), ports)
    if args.verbose:
        print(f"perseusrun: elastic driver at {job.driver.address}", file=sys.stderr, flush=True)
    return job.run(initial, args.host_discovery_script)


def prepare(args: argparse.Namespace, env: dict) -> Callable[[], int]:
    """Backend interface (see perseusrun.job): an elastic job on this machine."""
    check_elastic_args(args)
    remote = [name for name, _ in job_hosts(args) if not is_local_host(name)]
    if remote:
        raise UsageError(f"--tcp starts ranks on this machine only, not on {', '.join(remote)}")
    initial = initial_hosts(args, [("localhost", args.np or 1)])
    _defaults(args, initial)
    return lambda: run_local(args, env, initial)
