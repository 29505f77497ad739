"""What every perseusrun backend shares: the backend interface, the job's checks, host lists.

A backend (a module of BACKENDS) has one function, `prepare(args, env)`: it checks the parsed
command line against its own rules (UsageError, which perseusrun prints before anything starts)
and returns the call that runs the job and returns its exit code. launch.main() picks the
backend; supervise.supervise() watches what it starts.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import Protocol

LOCAL_HOST_NAMES = {"localhost", "127.0.0.1", "::1"}
# Variables of an MPI launcher; ranks that perseusrun starts without MPI do not inherit them.
MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_")


# Every backend, a module perseusrun/<name>.py (tests/test_launcher.py checks the list against the
# *_run.py files and their prepare()); launch.choose_backend() picks one.
BACKENDS = ("mpi_run", "tcp_run", "slurm_run", "emulated_run", "elastic_run")


class UsageError(Exception):
    """A command line perseusrun cannot run; main() prints it and exits 2."""


class Backend(Protocol):
    """How one kind of job is started (a module of perseusrun)."""

    def prepare(self, args: argparse.Namespace, env: dict) -> Callable[[], int]:
        """Checks `args` (UsageError) and returns the job's run: it returns the exit code."""
        ...


def check_job_args(args: argparse.Namespace) -> None:
    """The rules of every backend: a rank count, a program, a positive timeout."""
    if args.np is None:
        raise UsageError("-np N is required: how many ranks to start")
    if args.np < 1:
        raise UsageError(f"-np must be at least 1, got {args.np}")
    if not args.program:
        raise UsageError("no program given: perseusrun -np N program [args...]")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """`a:2,b,a` -> [("a", 3), ("b", 1)]: slots per host, in first-seen order."""
    slots: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        slots[name] = slots.get(name, 0) + slot_count(count or "1", item)
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
        entries.append(f"{name}:{slot_count(count or '1', f'{path}:{number}')}")
    if not entries:
        raise UsageError(f"hostfile {path!r} lists no hosts")
    return parse_hosts(",".join(entries))


def slot_count(text: str, where: str) -> int:
    """A positive slot count, or UsageError quoting `where` it was read."""
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"bad slot count {text!r} in {where!r}: expected a positive integer")
    return int(text)


def job_hosts(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (host, slots) of -H or --hostfile; empty when neither is given."""
    if args.hosts and args.hostfile:
        raise UsageError("give either -H or --hostfile, not both")
    if args.hosts:
        return parse_hosts(args.hosts)
    return read_hostfile(args.hostfile) if args.hostfile else []


def is_local_host(name: str) -> bool:
    """Whether `name` is this machine (ranks there need no remote daemon)."""
    here = socket.gethostname()
    return name in LOCAL_HOST_NAMES or name in (here, here.split(".")[0])


def rank_environment(args: argparse.Namespace, env: dict) -> dict:
    """`env` for ranks started without MPI: no MPI launcher's variables, then -x VAR=VALUE."""
    base = {name: value for name, value in env.items() if not name.startswith(MPI_PREFIXES)}
    for item in args.env:
        name, has_value, value = item.partition("=")
        if not name:
            raise UsageError(f"-x {item!r}: expected VAR or VAR=value")
        if has_value:
            base[name] = value
    return base
