"""Slurm: a job step's tasks (`srun` without MPI) as the ranks of the TCP controller.

Every task of a step computes the same rank -> host:port table from the step's variables, as
`perseusrun --tcp` would have passed it: rank r listens on its node at the step's base port +
its local id. Nothing here is read unless SLURM_STEP_ID and SLURM_STEP_NODELIST are set (a
batch script is no step) and no MPI launcher (srun --mpi=..., mpirun) started the process.
The launcher's Slurm backend (perseusrun/slurm_run.py) reads the job's host list with it too.
"""

from __future__ import annotations

import functools
import os
import re
import socket
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

SLURM_PORT_FIRST = 20000
SLURM_PORT_BLOCKS = 640  # blocks of SLURM_PORT_BLOCK ports above SLURM_PORT_FIRST
SLURM_PORT_BLOCK = 64  # the most tasks of one step on one node with a derived port
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
            names += _expand_name(item, text)
    return names


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
    """The first port of the step's ranks: PERSEUS_SLURM_PORT, else one the job and step ids
    choose (every task computes the same; concurrent steps of a job get different ports)."""
    text = (read(SLURM_PORT_VARIABLE, env) or "").strip()
    if text:
        if not text.isdigit() or not 0 < int(text) <= 65535 - most_local:
            raise SlurmEnvironmentError(f"{where}: {SLURM_PORT_VARIABLE}={text!r}: expected a "
                                        f"port such that it + {most_local - 1} is at most 65535")
        return int(text)
    if most_local > SLURM_PORT_BLOCK:
        raise SlurmEnvironmentError(
            f"{where}: {most_local} tasks on one node exceed the {SLURM_PORT_BLOCK} ports a step "
            f"gets by default; set {SLURM_PORT_VARIABLE} to a free port range's first port")
    job = _int_variable(env, "SLURM_JOB_ID", where)
    step = _int_variable(env, "SLURM_STEP_ID", where)
    return SLURM_PORT_FIRST + ((job * 8 + step) % SLURM_PORT_BLOCKS) * SLURM_PORT_BLOCK


def _slurm_secret(env: Mapping[str, str], where: str) -> str:
    if read(SECRET_VARIABLE, env):
        return env[SECRET_VARIABLE]
    path = (read(SECRET_FILE_VARIABLE, env) or "").strip()
    if not path:
        raise SlurmEnvironmentError(
            f"{where}: a Slurm step without MPI needs the job secret that every task shares: "
            f"export {SECRET_VARIABLE} before srun (srun forwards it), or set "
            f"{SECRET_FILE_VARIABLE} to a file in a directory all nodes share")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        directory = os.path.dirname(os.path.abspath(path))
        shared = "" if os.path.isdir(directory) else (
            f"; its directory {directory} does not exist on this node: the secret's directory "
            "must be shared by every node of the job")
        raise SlurmEnvironmentError(f"{where}: cannot read {SECRET_FILE_VARIABLE}={path!r}: "
                                    f"{exc.strerror}{shared}") from None


def _check_resolves(names: list[str], where: str) -> None:
    for name in names:
        try:
            socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise SlurmEnvironmentError(
                f"{where}: node {name!r} of SLURM_STEP_NODELIST does not resolve ({exc}): the "
                "ranks reach each other by node name") from None


def slurm_tcp_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The PERSEUS_* settings of `perseusrun --tcp` that a Slurm step's variables imply for this
    task (PERSEUS_CONTROLLER, PERSEUS_TCP_RANK, PERSEUS_TCP_ADDRESSES, PERSEUS_SECRET); empty
    unless is_slurm_step_without_mpi(env). SlurmEnvironmentError names a bad allocation."""
    if not is_slurm_step_without_mpi(env):
        return {}
    return dict(_slurm_tcp_settings(*(env.get(name, "") for name in _SLURM_INPUTS)))


_SLURM_INPUTS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
                 "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_DISTRIBUTION", "SLURM_JOB_ID", "SLURM_STEP_ID", SLURM_PORT_VARIABLE,
                 SECRET_VARIABLE, SECRET_FILE_VARIABLE)


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
    if None not in seen and (int(seen[0]), int(seen[1])) != (node, local):
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
