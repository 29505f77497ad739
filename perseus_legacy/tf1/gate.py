"""Sync points led by rank 0, at which the other ranks may wait for as long as rank 0 is busy.

Here in tf1/ because both layers pass the same points: the stop agreement after each training
step (perseus_legacy.tf1.stopping) and the distributed Estimator's (perseus_legacy.estimator).
Rank 0 alone does some work between training steps (evaluating a checkpoint, exporting a model).
The other ranks must wait for it, but not inside a pending collective: a tensor that some ranks
submitted and rank 0 did not is a stall to the runtime (a warning after
PERSEUS_STALL_WARNING_SECS, an error after PERSEUS_STALL_SHUTDOWN_SECS). So every rank passes the
same sequence of sync points, and while rank 0 works inside `busy()`, a thread of rank 0 answers
the waiting ranks every HEARTBEAT_SECS with "still busy"; no collective stays pending for longer.

A sync point is a series of rounds, each one allreduce (Sum) named `<prefix>.<k>` (k = 0, 1, ...)
of a [ranks, 3] table in which each rank fills its own row [state, value, payload bytes]: rank
0's state BUSY makes every rank go round again with k + 1, DONE ends the sync point (followed by
a broadcast `<prefix>.payload` when there are payload bytes). `sync()` gives every rank rank 0's
value; `agree()` gives every rank every rank's value (and the payload of the lowest rank with the
highest value), in the same one collective: the stop agreement after each training step is such
a sync point, so a step costs one small allreduce, of the same name every step (the runtime's
response cache knows it, and carries a table this small with its negotiation round).
A rank that joined (perseus_legacy.join()) takes part with zeros: a row of zeros reads DONE.

The wait is bounded: a rank that has heard "still busy" for PERSEUS_CHIEF_WAIT_SECS (default
7200: longer than any evaluation or export a job should have between two steps; 0: no bound)
fails with an error saying so, rather than wait forever on a rank 0 stuck in its work.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import numpy as np

import perseus_env
from perseus_legacy.common import basics

HEARTBEAT_SECS = 0.5
DEFAULT_CHIEF_WAIT_SECS = 7200.0


def chief_wait_secs(env: dict | None = None) -> float:
    """PERSEUS_CHIEF_WAIT_SECS: how long a rank waits at a sync point for a busy rank 0."""
    return perseus_env.read_seconds("PERSEUS_CHIEF_WAIT_SECS", DEFAULT_CHIEF_WAIT_SECS, env)
_DONE, _BUSY = 0, 1


class ChiefGate:
    """Sync points at which every rank takes rank 0's value; every rank must pass the same ones."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._point = 0  # the next sync point, the same on every rank
        self._answered = 0  # BUSY answers rank 0 gave for it so far
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def _round(self, state: int, value: int, nbytes: int, k: int) -> np.ndarray:
        """One round: every rank's row [state, value, payload bytes]."""
        table = np.zeros((basics.size(), 3), np.int64)
        table[basics.rank()] = (state, value, nbytes)
        return basics.core().allreduce(table, f"{self._prefix}.{k}", basics.Sum)

    def _heartbeat(self) -> None:
        try:
            while not self._stop.wait(HEARTBEAT_SECS):
                self._round(_BUSY, 0, 0, self._answered)
                self._answered += 1
        except BaseException as exc:  # re-raised by the next sync()
            self._error = exc

    def _join_heartbeat(self) -> None:
        # The thread may be inside a round: it completes as soon as the other ranks reach this
        # sync point, where they are going (they pass no other collective before it).
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"perseus_legacy: rank 0 could not answer the ranks waiting for it: "
                               f"{error}") from error

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """On rank 0: the ranks waiting at the next sync point keep being answered meanwhile.

        Elsewhere, and with a single rank, it does nothing. The other ranks must not need rank 0
        in any collective between this and the next sync point.
        """
        if basics.size() == 1 or basics.rank() != 0:
            yield
            return
        self._join_heartbeat()  # a previous busy() before the same sync point
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="perseus-chief-busy",
                                        daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()  # not joined here: the next sync() does, once the others are there

    def sync(self, value: int = 0, payload: bytes = b"") -> tuple:
        """Every rank gets `(value, payload)` of rank 0, once rank 0 reaches this point too."""
        if basics.size() == 1:
            return int(value), payload
        mine = (int(value), payload) if basics.rank() == 0 else (0, b"")
        table, payload = self._pass(*mine, source=0)
        return int(table[0, 1]), payload

    def agree(self, value: int, payload: bytes = b"") -> tuple:
        """Every rank gets every rank's `value` (>= 0; an array, in rank order) and the payload
        of the lowest rank of highest value (b"" when every value is 0), once rank 0 reaches
        this point too."""
        if basics.size() == 1:
            return np.array([int(value)], np.int64), payload if value else b""
        table, payload = self._pass(int(value), payload, source=None)
        return table[:, 1], payload

    def _pass(self, value: int, payload: bytes, source: int | None) -> tuple:
        """The rounds of one sync point, then the payload of `source` (None: the lowest rank
        of highest value) when it has one."""
        try:
            table = self._lead(value, len(payload)) if basics.rank() == 0 else \
                self._follow(value, len(payload))
            if source is None:
                source = int(np.argmax(table[:, 1]))  # the first of the highest
            nbytes = int(table[source, 2])
            if not nbytes:
                return table, b""
            mine = payload if basics.rank() == source else bytes(nbytes)
            return table, basics.core().broadcast(np.frombuffer(mine, np.uint8), source,
                                                  f"{self._prefix}.payload").tobytes()
        finally:
            self._point += 1
            self._answered = 0

    def _lead(self, value: int, nbytes: int) -> np.ndarray:
        self._join_heartbeat()
        return self._round(_DONE, value, nbytes, self._answered)

    def _follow(self, value: int, nbytes: int) -> np.ndarray:
        limit = chief_wait_secs()
        start = time.monotonic()
        k = 0
        while True:
            table = self._round(_DONE, value, nbytes, k)
            if table[0, 0] == _DONE:
                return table
            k += 1
            waited = time.monotonic() - start
            if limit and waited > limit:
                raise RuntimeError(
                    f"perseus_legacy: rank {basics.rank()} waited {waited:.0f} s at sync point "
                    f"{self._point} ({self._prefix}.{k}) while rank 0 kept answering 'still "
                    f"busy' (PERSEUS_CHIEF_WAIT_SECS={limit:g}); rank 0 may be stuck in an "
                    "evaluation or export")


# The one gate of this process: the Estimator's sync points (perseus_legacy.estimator) and the
# stop agreement after each training step (perseus_legacy.tf1.stopping) are points of the same
# sequence, so the ranks waiting at either are answered while rank 0 is busy().
GATE = ChiefGate("perseus.gate")
