"""Elastic state on a fixed set of ranks: State, ObjectState, run() and Horovod's exceptions.

The ranks of a job never change here, so what elastic Horovod does when hosts come or go never
happens: check_host_updates() never interrupts, reset callbacks are never called, and a rank
that is lost fails the collectives of every rank, which ends the job (nothing is restored and
re-run).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

from perseus_legacy.common import basics, objects


class HorovodInternalError(RuntimeError):
    """A collective failed. Elastic Horovod restores the last commit and re-forms the group on
    it; here nothing catches it: the job ends."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
    """Hosts were added or removed. Elastic Horovod raises it from commit(); hosts never change
    here, so it is never raised."""

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
        self._bcast_object = bcast_object or objects.broadcast_object
        self._get_rank = get_rank or basics.rank
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks: list) -> None:
        """Keeps functions that elastic Horovod calls after the ranks change (never, here)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """reset(), then every reset callback."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """A notification of changed hosts: none ever comes on a fixed set of ranks."""

    def commit(self) -> None:
        """Saves the state in this rank's memory (restore() returns to it)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Would raise HostsUpdatedInterrupt after a change of hosts; the hosts never change."""

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


def run(func: Callable) -> Callable:
    """Decorates `func(state, ...)`: each call first syncs `state` from rank 0, then runs it.

    Every rank must call the decorated function. A failed collective (a lost rank) propagates
    and ends the job: on a fixed set of ranks there is no group to re-form it on.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper
