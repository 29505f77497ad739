"""Elastic state: State, ObjectState, run() and Horovod's exceptions.

Under `perseusrun --tcp` in elastic mode (--min-np / --max-np / --host-discovery-script), run()
regroups as elastic Horovod does: a lost rank fails every survivor's collectives, which run()
turns into HorovodInternalError; the state returns to its last commit(), the runtime shuts down,
init() joins the driver's next round (new ranks, same secret), the reset callbacks run, sync()
gives every rank rank 0's state, and the function runs again. Hosts the driver adds or removes
make commit() / check_host_updates() raise HostsUpdatedInterrupt on every rank at the same
step, and the group re-forms the same way without a restore. Launched any other way (MPI, a
fixed --tcp world, TF_CONFIG) the ranks never change: a lost rank ends the job.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Callable

from perseus_legacy.common import basics, elastic_client, objects, tf_config

# What every failed collective's message holds once the runtime lost a rank (runtime.cc).
COMMUNICATION_FAILED = "communication failed on rank"


class HorovodInternalError(RuntimeError):
    """A collective failed (a rank was lost). In elastic mode run() restores the last commit and
    re-forms the group; otherwise the job ends."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
    """Hosts were added or removed: raised by commit() / check_host_updates() on every rank at
    the same step, in elastic mode only."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


class State:
    """What a training function keeps across (elastic Horovod's) resets: saved by commit(),
    brought back by restore(), made rank 0's on every rank by sync().

    `bcast_object` and `get_rank` default to perseus_legacy's broadcast_object and rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        # One fixed name: a rank that joins later counts its broadcasts from zero.
        self._bcast_object = bcast_object or functools.partial(
            objects.broadcast_object, name="perseus.elastic.state")
        self._get_rank = get_rank or basics.rank
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks: list) -> None:
        """Keeps functions that run() calls after the group re-formed (new ranks and size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """reset(), then every reset callback."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Horovod's notification of changed hosts; here the driver is asked at each commit."""

    def commit(self) -> None:
        """Saves the state in this rank's memory (restore() returns to it)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank when the elastic driver has hosts to add
        or remove (collective in elastic mode: rank 0 asks, every rank gets its answer)."""
        if not elastic_client.enabled() or not basics.is_initialized():
            return
        updated = False
        if basics.rank() == 0:
            try:
                updated = elastic_client.hosts_updated(tf_config.job_secret())
            except OSError:  # the driver is out of reach: the hosts are as they were
                updated = False
        try:
            updated = objects.broadcast_object(updated, root_rank=0,
                                               name="perseus.elastic.hosts_updated")
        except Exception as exc:
            raise as_internal_error(exc) from exc
        if updated:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Saves the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Returns to the last saved state, dropping what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Gives every rank rank 0's state (collective)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called before the reset callbacks."""


class ObjectState(State):
    """Picklable Python values, one attribute per keyword argument (`state.epoch`, ...).

    commit() keeps a copy of their current values; sync() gives every rank rank 0's last
    committed values (the initial ones before any commit).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        """Copies the attributes' current values."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        """Sets the attributes back to their committed values."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes rank 0's committed values (collective)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because the group lost a rank."""
    return isinstance(exc, HorovodInternalError) or COMMUNICATION_FAILED in str(exc)


def as_internal_error(exc: BaseException) -> BaseException:
    """HorovodInternalError for a failed collective (any exception type the op raised); other
    exceptions as they are."""
    if isinstance(exc, HorovodInternalError) or not is_collective_failure(exc):
        return exc
    # TensorFlow puts its own lines first ("Graph execution error:"): keep the runtime's.
    lines = [line.strip() for line in str(exc).splitlines() if COMMUNICATION_FAILED in line]
    return HorovodInternalError(lines[0] if lines else str(exc))


def reset(state: State) -> None:
    """Leaves the broken group and joins the driver's next round, then runs the state's reset
    callbacks (sizes, learning rates and data shards follow the new group there)."""
    basics.shutdown()
    basics.init()
    print(f"perseus_legacy elastic: rank {basics.rank()} of {basics.size()} in round "
          f"{elastic_client.current_round()}", file=sys.stderr, flush=True)
    state.on_reset()


def run(func: Callable) -> Callable:
    """Decorates `func(state, ...)`: syncs `state` from rank 0, then runs `func`.

    Every rank must call the decorated function. In elastic mode, a rank lost during `func`
    (a failed collective, HorovodInternalError) restores the last commit, re-forms the group
    without it and runs `func` again on the survivors; HostsUpdatedInterrupt re-forms it with
    the driver's new hosts, keeping the state. Otherwise a failed collective raises
    HorovodInternalError and ends the job: a fixed world has no group to re-form.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                if not elastic_client.enabled():
                    raise
                skip_sync = exc.skip_sync
            except Exception as exc:
                error = as_internal_error(exc)
                if error is exc and not isinstance(exc, HorovodInternalError):
                    raise
                if not elastic_client.enabled():
                    raise error from exc
                print(f"perseus_legacy elastic: {elastic_client.describe()} lost a rank: "
                      f"{error}; restoring the last commit", file=sys.stderr, flush=True)
                state.restore()
                skip_sync = False
            reset(state)

    return wrapper
