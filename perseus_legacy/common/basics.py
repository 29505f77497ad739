"""Process-group basics: init/shutdown and rank queries, over the native runtime (`_core`)."""

from __future__ import annotations

import atexit
import importlib
from typing import Any

import numpy as np

from perseus_legacy.common import elastic_client, failure, tf_config
from perseus_legacy.common.native import (  # noqa: F401 (part of basics' API)
    NotInitializedError,
    core,
    is_initialized,
    require_initialized,
)
from perseus_legacy.common.process_sets import register_at_init

Average, Sum, Min, Max, Product = 0, 1, 2, 3, 4
# Adasum is no op of the native runtime: perseus_legacy.tensorflow.adasum combines allgathered
# tensors.
Adasum = 5
REDUCE_OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product",
                   Adasum: "Adasum"}


def _comm_handle(comm: Any) -> int:
    if comm is None:
        return 0
    from mpi4py import MPI

    if isinstance(comm, (list, tuple)):
        raise ValueError("init(comm=...) takes an mpi4py communicator, not a list of ranks")
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"init(comm=...) expects an mpi4py MPI.Comm, got {type(comm).__name__}")
    if comm == MPI.COMM_WORLD:
        return 0  # the same group as init() without comm: a second init() is then a no-op
    return int(MPI._handleof(comm))


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins the process group: MPI_COMM_WORLD, the mpi4py `comm` given, or TF_CONFIG's tasks.

    Without `comm`, tf_config.controller_from_env() picks the transport: MPI under an MPI
    launcher, TCP (MPI never initialized) for TF_CONFIG or `perseusrun --tcp`.
    `process_sets`: ProcessSet objects (or rank lists) registered right after, in order; every
    rank must pass the same list. Horovod's "dynamic" is accepted: sets may always be added later.
    """
    _join_group(comm)
    failure.install()  # an uncaught exception now fails every rank with its cause
    if process_sets is None or isinstance(process_sets, str):
        if process_sets not in (None, "dynamic"):
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet "
                             "objects or \"dynamic\"")
        return
    register_at_init(process_sets)


# Elastic rounds after the first: their ranks have all asked the driver already, so they meet at
# once; a rank lost while they do fails the round quickly and the survivors ask for another.
ELASTIC_ROUND_START_SECONDS = 15.0


def _join_group(comm: Any) -> None:
    if comm is None and elastic_client.enabled():
        _join_elastic_group()
        return
    # An mpi4py communicator is an MPI group; without one, the environment names the transport.
    JOINS["mpi" if comm is not None else tf_config.controller_from_env()](comm)


def _join_mpi(comm: Any) -> None:
    core().init_mpi(_comm_handle(comm), tf_config.start_timeout())


def _join_tcp(comm: Any) -> None:
    cluster = tf_config.current_cluster()
    if cluster is None:
        raise tf_config.TFConfigError(
            "PERSEUS_CONTROLLER=tcp needs a TF_CONFIG with a \"cluster\" or perseusrun --tcp's "
            f"{tf_config.ADDRESSES_VARIABLE}: they say where the ranks meet")
    if cluster.rank is None:
        raise tf_config.TFConfigError(
            f"this process is the TF_CONFIG {cluster.task_type!r} task, which is not a rank: "
            "it must not call init() or run collectives (check "
            "perseus_legacy.common.tf_config.current_cluster().is_rank first)")
    core().init_tcp(cluster.rank, list(cluster.addresses), cluster.local_rank,
                    cluster.local_size, cluster.cross_rank, cluster.cross_size,
                    tf_config.job_secret(), tf_config.start_timeout(),
                    debug_resolve_secs=tf_config.debug_resolve_secs())


# How init() joins over each transport the native core registers, each through the core function
# its registration names (_core.transports()'s "binding"); tests/test_tcp.py compares the two.
JOINS = {"mpi": _join_mpi, "tcp": _join_tcp}


def _join_elastic_group() -> None:
    """Joins the elastic driver's next round (perseus_legacy.common.elastic_client); when a rank
    of it is lost before the group is formed, asks for the round after it."""
    secret = tf_config.job_secret()
    while True:
        place = elastic_client.join(secret)
        timeout = tf_config.start_timeout()
        if place.round > 1:
            timeout = min(timeout, ELASTIC_ROUND_START_SECONDS)
        hosts = [address.rsplit(":", 1)[0] for address in place.addresses]
        try:
            core().init_tcp(place.rank, list(place.addresses), place.local_rank,
                            place.local_size, place.cross_rank, place.cross_size, secret, timeout,
                            debug_resolve_secs=tf_config.debug_resolve_secs())
            return
        except RuntimeError as exc:
            print(f"perseus_legacy elastic: {elastic_client.describe()} could not form the group "
                  f"of {place.size} ranks on {sorted(set(hosts))}: {exc}; asking for the next "
                  "round", flush=True)


def shutdown() -> None:
    """Leaves the process group; later collectives fail. Safe to call twice."""
    try:
        mod = importlib.import_module("perseus_legacy._core")
    except ImportError:
        return
    mod.shutdown()
    _homogeneous.clear()  # the next init() may form another group


atexit.register(shutdown)


def check_root(root_rank: int, what: str, process_set_id: int = 0) -> int:
    """`root_rank` as an int; ValueError naming `what` unless it is a rank of the group (and of
    the process set `process_set_id`)."""
    require_initialized(f"{what}()")
    group_size = size()
    if not 0 <= int(root_rank) < group_size:
        raise ValueError(f"{what} root_rank {root_rank} is not a rank (size() is {group_size})")
    if process_set_id:
        ranks = list(core().process_sets().get(process_set_id, []))
        if int(root_rank) not in ranks:
            raise ValueError(f"{what} root_rank {root_rank} is not in process set "
                             f"{process_set_id} (ranks {ranks}); root_rank is a global rank")
    return int(root_rank)


def _query(name: str) -> int:
    require_initialized(f"{name}()")
    return int(getattr(core(), name)())


def rank() -> int:
    """This process's rank in the group, 0 .. size()-1."""
    return _query("rank")


def size() -> int:
    """Number of ranks in the group."""
    return _query("size")


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _query("local_rank")


def local_size() -> int:
    """Number of ranks on this host."""
    return _query("local_size")


def cross_rank() -> int:
    """Index of this host among hosts (ranks with the same local_rank)."""
    return _query("cross_rank")


def cross_size() -> int:
    """Number of hosts (ranks sharing this local_rank)."""
    return _query("cross_size")


# Whether the current group is homogeneous, once asked (cleared by shutdown()).
_homogeneous: dict = {}


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks (Horovod's definition).

    The first call after init() is a collective: every rank must make it (later calls return
    the answer remembered then).
    """
    require_initialized("is_homogeneous()")
    if "answer" not in _homogeneous:
        local_sizes = core().allgather(np.array([local_size()], np.int32),
                                       "perseus.is_homogeneous")
        _homogeneous["answer"] = bool(np.all(local_sizes == local_sizes[0]))
    return _homogeneous["answer"]


def join() -> int:
    """Blocks until every rank has called join(); returns, on every rank, the rank that joined last.

    Call it when this rank has run out of data: until the others join too, their collectives
    still complete, with this rank contributing nothing (an Average is over the ranks with data).
    """
    require_initialized("join()")
    return int(core().join())


def runtime_stats() -> dict:
    """This process's runtime counters since it started (they survive shutdown() and init()).

    Per collective type ("allreduce", "allgather", "broadcast", "alltoall"): "tensors_submitted",
    "bytes_submitted", "collectives_executed" (calls on the transport: fused tensors share one).
    Totals: "fused_groups" and "tensors_fused" (tensors per fused group is their ratio),
    "cache_hits" / "cache_misses" (tensors negotiated through the response cache / sent on to
    the coordinator), "cache_evictions", "cache_invalidations", "coordinator_rounds",
    "cache_rounds", "carried_allreduces" (small cached allreduces that travelled with a cache
    round instead of running on the data plane: docs/design.md), "stall_warnings" (rank 0's),
    "timeline_events_dropped",
    "hierarchical_allreduces" (allreduce collectives that ran hierarchically: docs/settings.md),
    "pipelined_hierarchical_allreduces" (those of them whose phases overlapped on slices of a
    large tensor: docs/design.md),
    "single_rank_shortcuts" (allreduces and broadcasts of a one-rank job, which complete on the
    submitting thread with no negotiation, unless a timeline runs),
    "allreduce_algorithms" (flat allreduce collectives, and the part across hosts of the
    hierarchical ones, by the algorithm that ran: "ring", "halving_doubling",
    "recursive_doubling", "torus", "transport" for MPI's own; docs/design.md),
    "autotune" (not counters: "fusion_threshold_bytes", "cycle_time_us" and "hop_latency_ns" in
    force, "changes" PERSEUS_AUTOTUNE made to them, "fixed": 1 once its search has ended;
    docs/settings.md).
    """
    return dict(core().runtime_stats())


def start_timeline(file_path: str) -> None:
    """Starts writing this rank's timeline (Chrome trace-event JSON) to its own file.

    Every rank writes `file_path` with its rank inserted before the extension (trace.json ->
    trace.rank0.json); merge them with `python -m perseus_legacy.timeline merge OUT IN...`.
    PERSEUS_TIMELINE=path at init() does the same.
    """
    require_initialized("start_timeline()")
    core().start_timeline(str(file_path))


def stop_timeline() -> None:
    """Writes out and closes this rank's timeline; a no-op when none is being written."""
    core().stop_timeline()


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (other threads may call MPI too)."""
    require_initialized("mpi_threads_supported()")
    return bool(core().mpi_threads_supported())


# What this build and this process group use, under Horovod's names. Horovod's Gloo, NCCL, DDL,
# oneCCL, CUDA and ROCm back ends do not exist here: their *_built() are False.

def _build_info() -> dict:
    return dict(core().build_info())


def mpi_built() -> bool:
    """Whether this build can run the process group over MPI."""
    return bool(_build_info().get("mpi"))


def mpi_enabled() -> bool:
    """Whether the process group runs over MPI (before init(): whether init() would use MPI).

    False under the TCP controller (TF_CONFIG, `perseusrun --tcp`).
    """
    if is_initialized():
        return _build_info().get("controller") == "mpi"
    return mpi_built() and tf_config.controller_from_env() == "mpi"


def nccl_built() -> bool:
    """Whether NCCL is built in: never (every collective runs on the CPU)."""
    return bool(_build_info().get("nccl"))


def gloo_built() -> bool:
    """Whether Gloo is built in: never (the non-MPI transport is perseus_legacy's TCP ring)."""
    return False


def gloo_enabled() -> bool:
    """Whether Gloo is in use: never."""
    return False


def ddl_built() -> bool:
    """Whether IBM DDL is built in: never."""
    return False


def ccl_built() -> bool:
    """Whether oneCCL is built in: never."""
    return False


def cuda_built() -> bool:
    """Whether CUDA kernels are built in: never."""
    return False


def gpu_available(ext_base_name: str = "tensorflow", verbose: bool = False) -> bool:
    """Whether the collectives of `ext_base_name` run on a GPU: never (host memory)."""
    del ext_base_name, verbose
    return False


def rocm_built() -> bool:
    """Whether ROCm kernels are built in: never."""
    return False
