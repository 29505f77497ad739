"""Slurm: a job step's tasks (`srun` without MPI) as the ranks of the TCP controller.

Every task of a step computes the same rank -> host:port table from the step's variables, as
`perseusrun --tcp` would have passed it: rank r listens on its node at the step's base port +
its local id. Nothing here is read unless SLURM_STEP_ID and SLURM_STEP_NODELIST are set (a
batch script is no step) and no MPI launcher (srun --mpi=..., mpirun) started the process.
The launcher's Slurm backend (perseusrun/slurm_run.py) reads the job's host list with it too.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import socket
import stat
import zlib
from collections.abc import Mapping

from perseus_env import (
    ADDRESSES_VARIABLE,
    RANK_VARIABLE,
    SECRET_FILE_VARIABLE,
    SECRET_VARIABLE,
    SLURM_PORT_VARIABLE,
    read,
)
from perseus_shared.mpi import MPI_LAUNCHER_VARIABLES

# A step's ports when neither srun --resv-ports nor PERSEUS_SLURM_PORT chooses them: a range
# that a hash of the job and step id places between these, below Linux's ephemeral ports
# (32768-60999), so that no connection's local port takes one. Each task reserves its port on
# its node (reserve_ports): two steps whose ranges overlap on a node fail with an error instead
# of failing to bind, or crossing, at init().
SLURM_PORT_FIRST = 20000
SLURM_PORT_END = 32768
SLURM_PORT_MOST_LOCAL = 64  # the most tasks of one step on one node with a derived port
# SLURM_STEP_RESV_PORTS: the ports Slurm reserved for the step on every node of it
# (srun --resv-ports, MpiParams=ports=... in slurm.conf); no other step gets them there.
RESERVED_PORTS_VARIABLE = "SLURM_STEP_RESV_PORTS"
# Host lists and tasks per node name at most this many nodes (Slurm's own limit is lower).
MOST_NODES = 1 << 16
# How long a task waits for every node name of the step to resolve.
RESOLVE_SECONDS = 30.0
_HOSTLIST_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_PER_NODE_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class SlurmEnvironmentError(ValueError):
    """The Slurm step's variables cannot describe this task's rank; the text names them."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as `scontrol show hostnames` expands it.

    `node[01-03,7],login` -> node01 node02 node03 node7 login; several brackets in one name
    expand as a product (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2).
    """
    names: list[str] = []
    for item in _split_outside_brackets(text.strip(), ","):
        if item:
            if _count_names(item, text) + len(names) > MOST_NODES:
                raise SlurmEnvironmentError(f"host list {text[:80]!r}: more than {MOST_NODES} "
                                            "names")
            names += _expand_name(item, text)
    return names


def _count_names(item: str, whole: str) -> int:
    """How many names `item` expands to, without expanding it."""
    count = 1
    for ranges in re.findall(r"\[([^\]]*)\]", item):
        numbers = 0
        for part in ranges.split(","):
            match = _HOSTLIST_RANGE.match(part.strip())
            if match:
                numbers += max(0, int(match.group(2) or match.group(1)) - int(match.group(1)) + 1)
        count *= max(numbers, 1)
    return count


def _split_outside_brackets(text: str, separator: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _expand_name(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise SlurmEnvironmentError(f"host list {whole!r}: unbalanced ']' in {item!r}")
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise SlurmEnvironmentError(f"host list {whole!r}: unbalanced '[' in {item!r}")
    prefix, ranges, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    numbers: list[str] = []
    for part in ranges.split(","):
        match = _HOSTLIST_RANGE.match(part.strip())
        if not match:
            raise SlurmEnvironmentError(f"host list {whole!r}: {part!r} in [{ranges}] is not N "
                                        "or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise SlurmEnvironmentError(f"host list {whole!r}: range {part!r} runs backwards")
        width = len(first) if first.startswith("0") else 0  # node[01-10]: zero-padded
        numbers += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    tails = _expand_name(rest, whole) if rest else [""]
    return [prefix + number + tail for number in numbers for tail in tails]


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's `2(x3),1` -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE)."""
    counts: list[int] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        match = _TASKS_PER_NODE_ITEM.match(item)
        if not match:
            raise SlurmEnvironmentError(f"tasks per node {text!r}: {item!r} is not N or N(xM)")
        if len(counts) + int(match.group(2) or 1) > MOST_NODES:
            raise SlurmEnvironmentError(f"tasks per node {text[:80]!r}: more than {MOST_NODES} "
                                        "nodes")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_placement(counts: list[int], distribution: str = "block") -> list[tuple[int, int]]:
    """(node index, local id) of each task in rank order, for `counts` tasks per node.

    Slurm's node-level distribution (the part of SLURM_DISTRIBUTION before ':'): `block` fills
    each node in turn, `cyclic` deals tasks out one per node in turn.
    """
    kind = (distribution or "block").split(":")[0].split(",")[0].strip().lower()
    if kind in ("block", "pack", "nopack", "*", ""):
        return [(node, local) for node, count in enumerate(counts) for local in range(count)]
    if kind == "cyclic":
        placed, used = [], [0] * len(counts)
        while len(placed) < sum(counts):
            for node, count in enumerate(counts):
                if used[node] < count:
                    placed.append((node, used[node]))
                    used[node] += 1
        return placed
    raise SlurmEnvironmentError(f"SLURM_DISTRIBUTION={distribution!r}: only block and cyclic "
                                "task distributions can be placed without MPI; use "
                                "srun --distribution=block (the default) or srun --mpi=pmix")


def is_slurm_step_without_mpi(env: Mapping[str, str]) -> bool:
    """Whether `env` is a task of an `srun` step that no MPI launcher started, and nothing else
    (TF_CONFIG, perseusrun --tcp, PERSEUS_CONTROLLER=mpi) already says who is which rank."""
    if not (env.get("SLURM_STEP_ID") and env.get("SLURM_STEP_NODELIST")):
        return False
    if any(name in env for name in MPI_LAUNCHER_VARIABLES):
        return False
    if (read("PERSEUS_CONTROLLER", env) or "").strip().lower() == "mpi":
        return False
    return not (read(ADDRESSES_VARIABLE, env) or env.get("TF_CONFIG", "").strip())


def _int_variable(env: Mapping[str, str], name: str, where: str) -> int:
    text = env.get(name, "")
    if not text.strip().isdigit():
        raise SlurmEnvironmentError(f"{where}: {name}={text!r} is not a non-negative integer")
    return int(text)


def slurm_base_port(env: Mapping[str, str], most_local: int, where: str = "Slurm task") -> int:
    """The first port of the step's ranks on every node (local task i: it + i): Slurm's
    reservation for the step (SLURM_STEP_RESV_PORTS), else PERSEUS_SLURM_PORT, else one a hash
    of the job and step id places in [SLURM_PORT_FIRST, SLURM_PORT_END). Every task computes
    the same."""
    reserved = (env.get(RESERVED_PORTS_VARIABLE) or "").strip()
    if reserved:
        first, _, last = reserved.split(",")[0].partition("-")
        if not first.isdigit() or not (last or first).isdigit():
            raise SlurmEnvironmentError(f"{where}: {RESERVED_PORTS_VARIABLE}={reserved!r}: "
                                        "expected FIRST-LAST")
        if int(last or first) - int(first) + 1 < most_local:
            raise SlurmEnvironmentError(
                f"{where}: {RESERVED_PORTS_VARIABLE}={reserved!r} reserves fewer ports than the "
                f"{most_local} tasks of a node: srun --resv-ports={most_local}")
        return int(first)
    text = (read(SLURM_PORT_VARIABLE, env) or "").strip()
    if text:
        if not text.isdigit() or not 0 < int(text) <= 65535 - most_local:
            raise SlurmEnvironmentError(f"{where}: {SLURM_PORT_VARIABLE}={text!r}: expected a "
                                        f"port such that it + {most_local - 1} is at most 65535")
        return int(text)
    if most_local > SLURM_PORT_MOST_LOCAL:
        raise SlurmEnvironmentError(
            f"{where}: {most_local} tasks on one node exceed the {SLURM_PORT_MOST_LOCAL} ports a "
            f"step gets by default; run srun --resv-ports, or set {SLURM_PORT_VARIABLE} to a "
            "free port range's first port")
    job = _int_variable(env, "SLURM_JOB_ID", where)
    step = _int_variable(env, "SLURM_STEP_ID", where)
    choices = SLURM_PORT_END - SLURM_PORT_FIRST - most_local + 1
    return SLURM_PORT_FIRST + zlib.crc32(f"{job}.{step}".encode()) % choices


# The reservations of this process's ports (reserve_ports), held until it exits.
_RESERVED: dict[int, socket.socket] = {}


def reserve_ports(ports: list[int], where: str, what: str) -> None:
    """Reserves `ports` on this node for this process's lifetime: an abstract Unix socket per
    port, which the kernel frees when the process ends (no file to clean up) and which every
    process of the node's network namespace sees. SlurmEnvironmentError when another process
    (another step's task) holds one."""
    for port in ports:
        if port in _RESERVED:
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0perseus_legacy-port-{port}")
        except OSError as exc:
            sock.close()
            raise SlurmEnvironmentError(
                f"{where}: port {port} ({what}) is already taken on this node by another "
                f"perseus_legacy step ({exc.strerror}): run srun --resv-ports (Slurm reserves "
                f"each step's ports), or give the steps other {SLURM_PORT_VARIABLE}s") from None
        _RESERVED[port] = sock


def read_secret_file(path: str, where: str) -> str:
    """The job secret in `path` (PERSEUS_SECRET_FILE); SlurmEnvironmentError naming the file
    when it cannot be read or other users could read or change it."""
    try:
        with open(path) as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            if mode & 0o077:
                raise SlurmEnvironmentError(
                    f"{where}: {SECRET_FILE_VARIABLE}={path!r} has mode {mode:04o}: the job "
                    "secret must be readable by its owner only (whoever reads it can join the "
                    f"job as a rank and send it data to unpickle); chmod 600 {path}")
            return f.read().strip()
    except OSError as exc:
        directory = os.path.dirname(os.path.abspath(path))
        shared = "" if os.path.isdir(directory) else (
            f"; its directory {directory} does not exist on this node: the secret's directory "
            "must be shared by every node of the job")
        raise SlurmEnvironmentError(f"{where}: cannot read {SECRET_FILE_VARIABLE}={path!r}: "
                                    f"{exc.strerror}{shared}") from None


def check_secret_file(env: Mapping[str, str], where: str) -> None:
    """SlurmEnvironmentError when PERSEUS_SECRET_FILE is set in `env` and read_secret_file()
    refuses it (the launcher checks it before it starts anything)."""
    path = (read(SECRET_FILE_VARIABLE, env) or "").strip()
    if path:
        read_secret_file(path, where)


def _slurm_secret(env: Mapping[str, str], where: str) -> str:
    if read(SECRET_VARIABLE, env):
        return env[SECRET_VARIABLE]
    path = (read(SECRET_FILE_VARIABLE, env) or "").strip()
    if not path:
        raise SlurmEnvironmentError(
            f"{where}: a Slurm step without MPI needs the job secret that every task shares: "
            f"export {SECRET_VARIABLE} before srun (srun forwards it), or set "
            f"{SECRET_FILE_VARIABLE} to a file in a directory all nodes share")
    return read_secret_file(path, where)


def _check_resolves(names: list[str], where: str) -> None:
    """Every distinct name resolves, looked up a few at a time, all within RESOLVE_SECONDS."""
    distinct = list(dict.fromkeys(names))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(distinct)))
    try:
        lookups = {pool.submit(socket.getaddrinfo, name, None, type=socket.SOCK_STREAM): name
                   for name in distinct}
        done, late = concurrent.futures.wait(lookups, timeout=RESOLVE_SECONDS)
        for lookup in sorted(done, key=lambda f: distinct.index(lookups[f])):
            if lookup.exception() is not None:
                raise SlurmEnvironmentError(
                    f"{where}: node {lookups[lookup]!r} of SLURM_STEP_NODELIST does not resolve "
                    f"({lookup.exception()}): the ranks reach each other by node name")
        if late:
            slow = sorted(lookups[f] for f in late)
            raise SlurmEnvironmentError(
                f"{where}: {len(slow)} node name(s) of SLURM_STEP_NODELIST did not resolve "
                f"within {RESOLVE_SECONDS:g} s (first: {slow[0]!r})")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def slurm_tcp_settings(env: Mapping[str, str], reserve: bool = True) -> dict[str, str]:
    """The PERSEUS_* settings of `perseusrun --tcp` that a Slurm step's variables imply for this
    task (PERSEUS_CONTROLLER, PERSEUS_TCP_RANK, PERSEUS_TCP_ADDRESSES, PERSEUS_SECRET); empty
    unless is_slurm_step_without_mpi(env). SlurmEnvironmentError names a bad allocation, or a
    port of this task that another step holds on this node (`reserve`: this process then holds
    its port until it exits)."""
    if not is_slurm_step_without_mpi(env):
        return {}
    settings = dict(_slurm_tcp_settings(*(env.get(name, "") for name in _SLURM_INPUTS)))
    if reserve:
        rank = int(settings[RANK_VARIABLE])
        port = int(settings[ADDRESSES_VARIABLE].split(",")[rank].rsplit(":", 1)[1])
        reserve_ports([port], f"Slurm task {rank} (job {env.get('SLURM_JOB_ID', '?')})",
                      f"rank {rank} of step {env.get('SLURM_STEP_ID')}")
    return settings


_SLURM_INPUTS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
                 "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_DISTRIBUTION", "SLURM_JOB_ID", "SLURM_STEP_ID", SLURM_PORT_VARIABLE,
                 SECRET_VARIABLE, SECRET_FILE_VARIABLE, RESERVED_PORTS_VARIABLE)


@functools.lru_cache(maxsize=8)
def _slurm_tcp_settings(*values: str) -> tuple[tuple[str, str], ...]:
    env = {name: value for name, value in zip(_SLURM_INPUTS, values) if value}
    rank = _int_variable(env, "SLURM_PROCID", "Slurm task")
    where = f"Slurm task {rank} (job {env.get('SLURM_JOB_ID', '?')})"
    size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    size = _int_variable(env, size_name, where)
    nodes = expand_hostlist(env["SLURM_STEP_NODELIST"])
    counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    if len(counts) != len(nodes) or sum(counts) != size:
        raise SlurmEnvironmentError(
            f"{where}: the step's allocation does not add up: SLURM_STEP_TASKS_PER_NODE="
            f"{env.get('SLURM_STEP_TASKS_PER_NODE', '')!r} places {sum(counts)} task(s) on "
            f"{len(counts)} node(s), but {size_name}={size} and SLURM_STEP_NODELIST="
            f"{env['SLURM_STEP_NODELIST']!r} names {len(nodes)} node(s)")
    if rank >= size:
        raise SlurmEnvironmentError(f"{where}: SLURM_PROCID={rank} is not below "
                                    f"{size_name}={size}")
    placement = slurm_placement(counts, env.get("SLURM_DISTRIBUTION", "block"))
    node, local = placement[rank]
    seen = (env.get("SLURM_NODEID"), env.get("SLURM_LOCALID"))
    if None not in seen and (_int_variable(env, "SLURM_NODEID", where),
                             _int_variable(env, "SLURM_LOCALID", where)) != (node, local):
        raise SlurmEnvironmentError(
            f"{where}: SLURM_NODEID={seen[0]} SLURM_LOCALID={seen[1]}, but the "
            f"{env.get('SLURM_DISTRIBUTION', 'block')} distribution of "
            f"SLURM_STEP_TASKS_PER_NODE={env.get('SLURM_STEP_TASKS_PER_NODE')!r} puts this rank "
            f"on node {node} as local task {local}; launch with --distribution=block")
    _check_resolves(nodes, where)
    port = slurm_base_port(env, max(counts), where)
    addresses = ",".join(f"{nodes[n]}:{port + i}" for n, i in placement)
    return (("PERSEUS_CONTROLLER", "tcp"), (RANK_VARIABLE, str(rank)),
            (ADDRESSES_VARIABLE, addresses), (SECRET_VARIABLE, _slurm_secret(env, where)))
