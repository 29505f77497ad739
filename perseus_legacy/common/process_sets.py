"""Process sets: subsets of the ranks that run collectives among themselves (Horovod's API).

    even = perseus_legacy.add_process_set([0, 2])      # every rank calls it, in the same order
    if even.included():
        perseus_legacy.allreduce(x, process_set=even)  # only ranks 0 and 2 call it

A set's collectives are negotiated by the same coordinator as the global set's, in one order on
every rank, so collectives of overlapping sets and of the global set may be in flight together.
Within a collective on a set, "rank" means the set's order (allgather's rows, alltoall's splits,
an Average's divisor), except `root_rank` of a broadcast, which is a global rank of the set, as
in Horovod. Adding and removing sets is collective over every rank and needs no switch
(Horovod's HOROVOD_DYNAMIC_PROCESS_SETS is not needed): the change is negotiated like a
collective, so every rank registers the same id for the same ranks at the same point.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Sequence

from perseus_legacy.common import native


class ProcessSet:
    """A set of ranks, registered by init(process_sets=...) or add_process_set().

    `ranks` is sorted; `process_set_id` is None until the set is registered (and again after
    remove_process_set()).
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self.process_set_id: int | None = None
        self.ranks: list | None = None
        # Any iterable of ints, as in Horovod (range, reversed(range), numpy arrays); an MPI
        # communicator (which has Get_rank) is Horovod's other form, not supported here.
        if isinstance(ranks, (str, bytes, dict)) or hasattr(ranks, "Get_rank") or not hasattr(
                ranks, "__iter__"):
            raise TypeError("ProcessSet takes an iterable of ranks (an MPI communicator is not "
                            f"supported), got {type(ranks).__name__}")
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in ranks):
            raise TypeError(f"ProcessSet ranks must be ints, got {ranks!r}")
        self.ranks = sorted(int(r) for r in ranks)

    def _registered_id(self, what: str) -> int:
        if self.process_set_id is None:
            raise ValueError(f"ProcessSet.{what}(): {self} is not registered: pass it to "
                             "perseus_legacy.init(process_sets=...) or add_process_set()")
        return self.process_set_id

    def _current_ranks(self) -> list:
        set_id = self._registered_id("ranks")
        ranks = registered().get(set_id)
        if ranks is None:
            raise ValueError(f"{self} is no longer registered (removed, or shutdown() ran)")
        return ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        self._registered_id("size")
        return len(self._current_ranks())

    def rank(self) -> int:
        """This process's rank within the set (its position in `ranks`).

        ValueError when this rank is not in the set, as in Horovod.
        """
        self._registered_id("rank")
        ranks = self._current_ranks()
        me = native.core().rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not in {self}")
        return ranks.index(me)

    def included(self) -> bool:
        """Whether this process is one of the set's ranks."""
        self._registered_id("included")
        return native.core().rank() in self._current_ranks()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank (id 0); its ranks are known once init() has run."""

    def __init__(self) -> None:
        self.ranks = None
        self.process_set_id = 0

    def _current_ranks(self) -> list:
        native.require_initialized("global_process_set")
        ranks = list(range(native.core().size()))
        self.ranks = ranks
        return ranks


global_process_set: ProcessSet = _GlobalProcessSet()


def registered() -> dict:
    """{id: ranks} of every registered process set (empty before init())."""
    if not native.is_initialized():
        return {}
    return {int(k): list(v) for k, v in native.core().process_sets().items()}


def as_process_set(process_set: Any) -> ProcessSet:
    if isinstance(process_set, ProcessSet):
        return process_set
    return ProcessSet(process_set)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set; collective: every rank calls it, with the same ranks, in the
    same order. Returns the ProcessSet (made from the ranks when a list is given).

    ValueError on every rank when the ranks' calls disagree (naming the ranks of each call),
    when the set already exists, or when a rank has joined.
    """
    native.require_initialized("add_process_set()")
    process_set = as_process_set(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered")
    process_set.process_set_id = int(native.core().add_process_set(process_set.ranks))
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set; collective like add_process_set(). Returns False for the
    global set and for a set that is not registered (nothing to remove), True otherwise.

    Collectives of the set still pending on its ranks fail.
    """
    native.require_initialized("remove_process_set()")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    native.core().remove_process_set(set_id)
    process_set.process_set_id = None
    return True


def process_set_id(process_set: ProcessSet | None, what: str) -> int:
    """The id of `process_set` (None: the global set), after checking this rank is in it.

    A rank outside the set gets a ValueError naming it, the set and `what`.
    """
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a perseus_legacy.ProcessSet, got "
                        f"{type(process_set).__name__}")
    set_id = process_set._registered_id("id")
    if set_id == 0:
        return 0
    ranks = registered().get(set_id)
    if ranks is None:
        raise ValueError(f"{what}: {process_set} is not registered on this rank")
    me = native.core().rank()
    if me not in ranks:
        raise ValueError(f"{what}: rank {me} is not in process set {set_id} (ranks {ranks}); "
                         "only its ranks may run its collectives")
    return set_id


def set_size_and_rank(set_id: int) -> tuple:
    """(size, this rank's position) of the registered process set `set_id`."""
    if set_id == 0:
        return native.core().size(), native.core().rank()
    ranks = registered()[set_id]
    return len(ranks), ranks.index(native.core().rank())


def register_at_init(process_sets: Iterable) -> None:
    """init(process_sets=...): registers every set, in order, after checking the whole list
    (a refused list leaves nothing behind for the next init()); sets registered by an earlier
    init() are kept."""
    sets = [as_process_set(p) for p in process_sets]
    seen: dict = {}
    for process_set in sets:
        key = tuple(process_set.ranks)
        if key in seen and seen[key] is not process_set:
            raise ValueError(f"init(process_sets=...) names the ranks {list(key)} twice: each "
                             "process set must have ranks of its own")
        seen[key] = process_set
    for process_set in sets:
        if process_set.process_set_id is not None and \
                registered().get(process_set.process_set_id) == process_set.ranks:
            continue  # init() again: already registered
        add_process_set(process_set)
