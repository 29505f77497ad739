"""SETTINGS, the one table of every PERSEUS_* variable, and the typed readers every Python read
goes through; imports nothing of the project.

A module of its own, outside both packages: `perseusrun` must start ranks without importing
TensorFlow (which `import perseus_legacy` does), and the library must not depend on the launcher.
docs/settings.md is checked against the table by tests/test_settings.py. What else the launcher
and the ranks share (Slurm's variables, the elastic driver's wire, the lost-rank line) is in the
package `perseus_shared`.
"""

from __future__ import annotations

import os
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
# The job secret every TCP rank (and the elastic driver) shares.
SECRET_VARIABLE = "PERSEUS_SECRET"
# A file that holds the job secret, in a directory every node shares (read when no
# PERSEUS_SECRET is set): `srun` forwards the environment, but a secret in a file stays out of
# the job's recorded environment.
SECRET_FILE_VARIABLE = "PERSEUS_SECRET_FILE"
# Slurm without MPI: the first port of a step's ranks on every node.
SLURM_PORT_VARIABLE = "PERSEUS_SLURM_PORT"

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
    Setting("PERSEUS_CARRIED_ALLREDUCE_BYTES", "1024", "bytes >= 0 (0: none)",
            "input bytes of small cached allreduces a rank sends with each cache round",
            (RUNTIME,)),
    Setting("PERSEUS_STALL_WARNING_SECS", "60", "seconds >= 3",
            "rank 0 warns about a tensor some ranks submitted and others did not", (RUNTIME,)),
    Setting("PERSEUS_STALL_SHUTDOWN_SECS", "300", "seconds >= 3, or 0: never",
            "such a stall (or a silent rank on MPI) becomes an error on every rank", (RUNTIME,)),
    Setting("PERSEUS_CHIEF_WAIT_SECS", "7200", "seconds >= 0 (0: no limit)",
            "Estimator: how long the other ranks wait for rank 0 at a sync point", (LIBRARY,)),
    Setting("PERSEUS_HIERARCHICAL_ALLREDUCE", "auto", "auto, 1 or 0",
            "hierarchical allreduce across hosts", (RUNTIME,)),
    Setting("PERSEUS_ALLREDUCE_ALGORITHM", "auto",
            "auto, ring, halving_doubling, recursive_doubling or torus",
            "the flat allreduce's algorithm (auto: the cost model's choice)", (RUNTIME,)),
    Setting("PERSEUS_ALLREDUCE_HOP_LATENCY_US", "50", "microseconds >= 0",
            "the cost model's latency of one step (alpha)", (RUNTIME,)),
    Setting("PERSEUS_ALLREDUCE_LINK_GBIT", "1", "Gbit/s > 0",
            "the cost model's link rate (1 / beta)", (RUNTIME,)),
    Setting("PERSEUS_AUTOTUNE", "0", "0 or 1",
            "rank 0 searches the fusion threshold, cycle time and step latency in the first "
            "cycles, then fixes the best", (RUNTIME,)),
    Setting("PERSEUS_AUTOTUNE_LOG", "unset", "a file path",
            "rank 0 writes each configuration the search tried and its score (CSV)", (RUNTIME,)),
    Setting("PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE", "10", "count >= 1",
            "rounds that ran allreduces measured for each configuration the search tries",
            (RUNTIME,)),
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
    Setting("PERSEUS_DEBUG_RESOLVE_SECS", "0", "seconds >= 0",
            "tests of a slow resolver only: every TCP name lookup at init() answers that late",
            (LIBRARY,)),
    Setting(RANK_VARIABLE, "set by perseusrun --tcp", "a rank of PERSEUS_TCP_ADDRESSES",
            "TCP: this process's rank", (LIBRARY,)),
    Setting(ADDRESSES_VARIABLE, "set by perseusrun --tcp", "host:port,host:port,...",
            "TCP: every rank's address, in rank order", (LIBRARY,)),
    Setting("PERSEUS_SECRET_FILE", "unset", "a file path, readable by its owner only (0600)",
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
