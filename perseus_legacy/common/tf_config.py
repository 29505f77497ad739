"""Who is which rank in a job launched without MPI: TF_CONFIG, or `perseusrun --tcp`'s variables.

The one place that reads TF_CONFIG: `current_cluster()` parses it once into the Cluster that
init(), run_config() and the Estimator's evaluator all read. `TF_CONFIG` (TFJob, hand-started
tasks) gives ranks to the chief (rank 0; `worker` 0 when there is no chief) and then the
workers in index order; the evaluator is no rank. `perseusrun --tcp` passes
`PERSEUS_TCP_RANK` and `PERSEUS_TCP_ADDRESSES` instead (TF_CONFIG would change what
tf.estimator does). `controller_from_env()` decides between MPI and TCP.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import perseus_env
from perseus_env import ADDRESSES_VARIABLE, RANK_VARIABLE
from perseus_legacy.common import native
from perseus_shared.mpi import MPI_LAUNCHER_VARIABLES
from perseus_shared.slurm import slurm_tcp_settings

DEFAULT_START_TIMEOUT = 120.0
# Task types that become ranks, in rank order; `master` is TF1's name for the chief.
CHIEF_TYPES = ("chief", "master")
KNOWN_TYPES = (*CHIEF_TYPES, "worker", "evaluator", "ps")


class TFConfigError(ValueError):
    """TF_CONFIG (or PERSEUS_TCP_*) cannot describe an allreduce job; the text says why."""


@dataclass(frozen=True)
class Cluster:
    """This process's place in the job; `rank` is None for a task that is not a rank.

    The one description of a process: what TF_CONFIG or `perseusrun --tcp` says, and, for the
    distributed Estimator under MPI, the process group's rank and size (no addresses).
    """

    rank: int | None
    addresses: tuple[str, ...]  # host:port of every rank, in rank order (empty under MPI)
    task_type: str | None = None
    task_index: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    cross_rank: int | None = None
    cross_size: int | None = None
    has_evaluator: bool = False  # TF_CONFIG names an evaluator task: rank 0 does not evaluate
    size: int = field(default=-1)  # number of ranks; -1: len(addresses)

    def __post_init__(self) -> None:
        if self.size < 0:
            object.__setattr__(self, "size", len(self.addresses))

    @property
    def is_rank(self) -> bool:
        """Whether this process takes part in the collectives (the evaluator does not)."""
        return self.rank is not None

    @property
    def is_chief(self) -> bool:
        """Rank 0: writes checkpoints and summaries, evaluates (without an evaluator), logs."""
        return self.rank == 0


def _environ() -> Mapping[str, str]:
    """os.environ with the PERSEUS_* settings that a Slurm step (srun without MPI) implies."""
    return {**os.environ, **slurm_tcp_settings(os.environ)}


def _excerpt(value: object, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _check_address(address: object, where: str) -> str:
    if not isinstance(address, str) or ":" not in address:
        raise TFConfigError(f"TF_CONFIG: {where} is {_excerpt(address)!r}, expected 'host:port'")
    port = address.rsplit(":", 1)[1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise TFConfigError(f"TF_CONFIG: {where} is {address!r}: the port must be 1-65535")
    return address


def make_cluster(rank: int | None, addresses: list[str], task_type: str | None = None,
                 task_index: int | None = None, has_evaluator: bool = False) -> Cluster:
    """A Cluster for `rank` of `addresses`, with local/cross ranks from the shared hosts."""
    seen: dict[str, list[str]] = {}
    for i, address in enumerate(addresses):
        seen.setdefault(address, []).append(str(i))
    duplicates = {a: ranks for a, ranks in seen.items() if len(ranks) > 1}
    if duplicates:
        address, ranks = next(iter(duplicates.items()))
        raise TFConfigError(f"duplicate address {address!r}: ranks {', '.join(ranks)} would "
                            "all listen on it; every task needs its own host:port")
    if rank is None:
        return Cluster(None, tuple(addresses), task_type, task_index, has_evaluator=has_evaluator)
    hosts = [_host(a) for a in addresses]
    local_ranks = [hosts[:r].count(hosts[r]) for r in range(len(hosts))]
    mine = local_ranks[rank]
    # Horovod's convention: cross ranks count the ranks that share this local rank.
    return Cluster(rank, tuple(addresses), task_type, task_index,
                   local_rank=mine, local_size=hosts.count(hosts[rank]),
                   cross_rank=local_ranks[:rank].count(mine),
                   cross_size=local_ranks.count(mine), has_evaluator=has_evaluator)


def parse_tf_config(text: str) -> Cluster:
    """The Cluster that a TF_CONFIG JSON string describes; TFConfigError quoting what is wrong."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TFConfigError(f"TF_CONFIG is not valid JSON ({exc}): {_excerpt(text)!r}") from None
    if not isinstance(config, dict):
        raise TFConfigError(f"TF_CONFIG must be a JSON object, got {_excerpt(text)!r}")
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise TFConfigError(f"TF_CONFIG has no \"cluster\" object: {_excerpt(config)}")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise TFConfigError("TF_CONFIG has no \"task\": {\"type\": ..., \"index\": ...}: "
                            f"{_excerpt(config.get('task'))}")
    for job, tasks in cluster.items():
        if job not in KNOWN_TYPES:
            raise TFConfigError(f"TF_CONFIG: unknown job {job!r} in cluster (known: "
                                f"{', '.join(KNOWN_TYPES)})")
        if not isinstance(tasks, list):
            raise TFConfigError(f"TF_CONFIG: cluster[{job!r}] must be a list of 'host:port' "
                                f"addresses, got {_excerpt(tasks)}")
    task_type, index = task["type"], task["index"]
    if cluster.get("ps") or task_type == "ps":
        raise TFConfigError(
            f"TF_CONFIG has parameter servers (cluster 'ps': {_excerpt(cluster.get('ps', []))}, "
            f"task {_excerpt(task)}): allreduce training needs no parameter servers; remove the "
            "'ps' job and start only chief/worker tasks (and an optional evaluator)")
    if task_type not in KNOWN_TYPES:
        raise TFConfigError(f"TF_CONFIG: unknown task type {_excerpt(task_type)!r} in "
                            f"{_excerpt(task)}")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise TFConfigError(f"TF_CONFIG: task index {_excerpt(index)!r} is not a non-negative "
                            f"integer in {_excerpt(task)}")
    chiefs = [job for job in CHIEF_TYPES if cluster.get(job)]
    if len(chiefs) > 1 or (chiefs and len(cluster[chiefs[0]]) != 1):
        raise TFConfigError("TF_CONFIG: a cluster has at most one chief, got "
                            f"{_excerpt({job: cluster[job] for job in chiefs})}")
    ranked_jobs = chiefs + ["worker"]
    addresses, owners = [], []
    for job in ranked_jobs:
        for i, address in enumerate(cluster.get(job, [])):
            addresses.append(_check_address(address, f"cluster[{job!r}][{i}]"))
            owners.append((job, i))
    if not addresses:
        raise TFConfigError(f"TF_CONFIG: the cluster has no chief or worker tasks: "
                            f"{_excerpt(cluster)}")
    if task_type == "evaluator":
        if index >= max(1, len(cluster.get("evaluator", []))):
            raise TFConfigError(f"TF_CONFIG: task {_excerpt(task)} is out of range: there is one "
                                "evaluator (index 0)")
        return make_cluster(None, addresses, task_type, index, has_evaluator=True)
    jobs = len(cluster.get(task_type, []))
    if index >= jobs:
        raise TFConfigError(f"TF_CONFIG: task {_excerpt(task)} is out of range: cluster "
                            f"[{task_type!r}] has {jobs} task(s)")
    return make_cluster(owners.index((task_type, index)), addresses, task_type, index,
                        has_evaluator=bool(cluster.get("evaluator")))


def parse_perseus_variables(rank_text: str, addresses_text: str) -> Cluster:
    """The Cluster of `perseusrun --tcp`'s PERSEUS_TCP_RANK and PERSEUS_TCP_ADDRESSES."""
    addresses = [a.strip() for a in addresses_text.split(",") if a.strip()]
    if not addresses:
        raise TFConfigError(f"{ADDRESSES_VARIABLE}={addresses_text!r} lists no host:port")
    for i, address in enumerate(addresses):
        _check_address(address, f"{ADDRESSES_VARIABLE} entry {i}")
    if not rank_text.strip().isdigit() or int(rank_text) >= len(addresses):
        raise TFConfigError(f"{RANK_VARIABLE}={rank_text!r} is not a rank of the "
                            f"{len(addresses)} addresses in {ADDRESSES_VARIABLE}")
    return make_cluster(int(rank_text), addresses)


def _names_no_cluster(text: str) -> bool:
    # A TF_CONFIG object without a "cluster" (e.g. only an "environment") describes no job.
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False  # parse_tf_config says what is wrong
    return isinstance(value, dict) and not value.get("cluster")


def cluster_from_env(env: Mapping[str, str] | None = None) -> Cluster | None:
    """The Cluster of PERSEUS_TCP_* (first) or TF_CONFIG in `env`; None when neither names one.

    `cluster_from_env().rank is None` answers "am I a rank?" for the evaluator.
    """
    env = _environ() if env is None else env
    addresses = perseus_env.read(ADDRESSES_VARIABLE, env)
    if addresses:
        return parse_perseus_variables(perseus_env.read(RANK_VARIABLE, env) or "", addresses)
    text = env.get("TF_CONFIG", "").strip()
    if not text or _names_no_cluster(text):
        return None
    return parse_tf_config(text)


@functools.lru_cache(maxsize=8)
def _parsed(rank_text: str | None, addresses_text: str | None,
            tf_config_text: str | None) -> Cluster | None:
    env = {ADDRESSES_VARIABLE: addresses_text, RANK_VARIABLE: rank_text,
           "TF_CONFIG": tf_config_text}
    return cluster_from_env({k: v for k, v in env.items() if v is not None})


def current_cluster() -> Cluster | None:
    """This process's Cluster (cluster_from_env() of os.environ), parsed once."""
    env = _environ()
    return _parsed(perseus_env.read(RANK_VARIABLE, env), perseus_env.read(ADDRESSES_VARIABLE, env),
                   env.get("TF_CONFIG"))


def controller_from_env(env: Mapping[str, str] | None = None) -> str:
    """"mpi" or "tcp": PERSEUS_CONTROLLER if set; MPI under an MPI launcher; TCP with a cluster."""
    env = _environ() if env is None else env
    transports = tuple(t["name"] for t in native.core().transports())  # as registered natively
    choice = perseus_env.read_choice("PERSEUS_CONTROLLER", transports, "", env)
    if choice:
        return choice
    if any(name in env for name in MPI_LAUNCHER_VARIABLES):
        return "mpi"
    if perseus_env.read(ADDRESSES_VARIABLE, env) or env.get("TF_CONFIG", "").strip():
        return "tcp"
    return "mpi"


def start_timeout(env: Mapping[str, str] | None = None) -> float:
    """PERSEUS_START_TIMEOUT: seconds the ranks (TCP or MPI) wait for each other at init()."""
    return perseus_env.read_seconds("PERSEUS_START_TIMEOUT", DEFAULT_START_TIMEOUT, env,
                                    zero_allowed=False)


MIN_SECRET_BYTES = 16


def job_secret(env: Mapping[str, str] | None = None) -> str:
    """PERSEUS_SECRET, which every TCP rank must share; a clear error when missing or short."""
    env = _environ() if env is None else env
    secret = perseus_env.read("PERSEUS_SECRET", env) or ""
    how = ("e.g. set it to the output of `python -c 'import secrets; print(secrets.token_hex(16))'`"
           " for every task (perseusrun --tcp creates one itself)")
    if not secret:
        raise TFConfigError(
            "a TCP (TF_CONFIG) launch needs PERSEUS_SECRET, the same value on every task, so "
            f"that only this job's tasks can join it; {how}")
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise TFConfigError(
            f"PERSEUS_SECRET has {len(secret.encode())} bytes, fewer than {MIN_SECRET_BYTES}: a "
            f"short secret can be guessed by anyone who reaches the ranks' ports; {how}")
    return secret
