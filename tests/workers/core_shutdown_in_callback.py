"""shutdown() from within a collective's done callback (on the runtime's background thread), on 2
ranks: rank 0's callback of "cb.last" shuts its runtime down. Rank 0's later collectives must be
refused, rank 1's pending one must fail naming rank 0, and init() again on both ranks must form
a working group (an allreduce checked against numpy). Nothing may hang: the launch has a timeout.
"""

from __future__ import annotations

import os

from worker_util import assert_close, expect_error, fail, init_core, load_core, rank_data

if "PERSEUS_TCP_RANK" not in os.environ:
    from mpi4py import MPI  # noqa: F401 (MPI outlives shutdown(), so that init() may come again)

_core = load_core()
SUM = 1


def main() -> None:
    rank = init_core(_core)
    data = [rank_data(r, (5, 3), "int32", seed=3) for r in range(2)]
    if rank == 0:
        got = _core._allreduce_then_shutdown_in_callback(data[0], "cb.last")
    else:
        got = _core.allreduce(data[1], "cb.last", op=SUM)
    assert_close(rank, "cb.last", got, data[0] + data[1])
    if rank == 0:
        # Refused at once: asked to stop, or (once the stop was negotiated) stopped.
        text = expect_error(rank, "after the callback's shutdown",
                            lambda: _core.allreduce(data[0], "cb.after", op=SUM), RuntimeError,
                            'cannot run allreduce "cb.after"')
        if not any(why in text for why in ("shutdown() was called on this rank",
                                           "rank 0 shut down")):
            fail(rank, f"cb.after: the error does not say this rank shut down: {text}")
    else:
        # Pending when rank 0 stopped, or refused once its goodbye was read: both name rank 0.
        text = expect_error(rank, "pending on the other rank",
                            lambda: _core.allreduce(data[1], "cb.pending", op=SUM), RuntimeError,
                            "cb.pending")
        if not any(f"rank 0{how}" in text for how in (" shut down", " (127.0.0.1:")):
            fail(rank, f"cb.pending: the error does not name rank 0: {text}")
        _core.shutdown()
    if init_core(_core) != rank or _core.size() != 2:
        fail(rank, f"init() again: rank {_core.rank()} of {_core.size()}")
    got = _core.allreduce(data[rank] * (rank + 2), "cb.again", op=SUM)
    assert_close(rank, "cb.again", got, data[0] * 2 + data[1] * 3)
    _core.shutdown()
    if _core.is_initialized():
        fail(rank, "still initialized after shutdown()")
    print(f"[rank {rank}] shutdown in a done callback OK", flush=True)


if __name__ == "__main__":
    main()
