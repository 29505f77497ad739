"""Disagreeing ranks get an error naming the tensor, the ranks and their values, on every rank;
the runtime stays usable afterwards. Also: duplicate pending names, the stall warning, and
init() again after shutdown() with PERSEUS_STALL_SHUTDOWN_SECS: on an MPI sub-communicator, or,
over TCP, the whole group again (its ports are listened on anew).

Run on 3 ranks with PERSEUS_STALL_WARNING_SECS=1. Under MPI, mpi4py is imported first, so MPI
belongs to it and outlives our shutdown(), which is what makes a second init() possible.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from worker_util import assert_close, expect_error, fail

from perseus_legacy import _core
from perseus_legacy.common import basics, tf_config

CONTROLLER = tf_config.controller_from_env()
if CONTROLLER == "mpi":
    from mpi4py import MPI

SUM, MAX = 1, 3


def check_mismatches(rank: int) -> None:
    dtype = np.float64 if rank == 1 else np.float32
    expect_error(rank, "dtype", lambda: _core.allreduce(np.ones(4, dtype), "mm.dtype"),
                 RuntimeError,
                 'allreduce "mm.dtype": dtype mismatch: ranks [0, 2] float32, ranks [1] float64')
    shape = (3,) if rank == 2 else (2,)
    expect_error(rank, "shape", lambda: _core.allreduce(np.ones(shape, np.float32), "mm.shape"),
                 RuntimeError,
                 'allreduce "mm.shape": shape mismatch: ranks [0, 1] [2], ranks [2] [3]')
    op = MAX if rank == 0 else SUM
    expect_error(rank, "op", lambda: _core.allreduce(np.ones(2, np.int32), "mm.op", op=op),
                 RuntimeError,
                 'allreduce "mm.op": reduce op mismatch: ranks [0] Max, ranks [1, 2] Sum')
    expect_error(rank, "root",
                 lambda: _core.broadcast(np.ones(2, np.int32), rank % 2, "mm.root"), RuntimeError,
                 'broadcast "mm.root": root_rank mismatch: ranks [0, 2] 0, ranks [1] 1')
    expect_error(rank, "root range",
                 lambda: _core.broadcast(np.ones(2, np.int32), 7, "mm.range"), RuntimeError,
                 'broadcast "mm.range": root_rank 7 is out of range for 3 ranks')
    if rank == 1:
        call = lambda: _core.allgather(np.ones((2, 2), np.float32), "mm.type")  # noqa: E731
    else:
        call = lambda: _core.allreduce(np.ones((2, 2), np.float32), "mm.type")  # noqa: E731
    expect_error(rank, "collective", call, RuntimeError,
                 '"mm.type": collective mismatch: ranks [0, 2] allreduce, ranks [1] allgather')
    cols = 4 if rank == 0 else 3
    expect_error(rank, "trailing dims",
                 lambda: _core.allgather(np.ones((rank + 1, cols), np.int8), "mm.gather"),
                 RuntimeError,
                 'allgather "mm.gather": shape beyond the first dimension mismatch: '
                 "ranks [0] [4], ranks [1, 2] [3]")
    splits = [1, 1, 1] if rank != 1 else [2, 2, 2]
    expect_error(rank, "splits",
                 lambda: _core.alltoall(np.ones((3, 2), np.float32), "mm.splits", splits),
                 RuntimeError,
                 'alltoall "mm.splits": splits [2, 2, 2] on rank 1 sum to 6 but the first '
                 "dimension is 3")
    # The runtime keeps working after errors.
    got = _core.allreduce(np.full(3, rank, np.int64), "after.errors", op=SUM)
    assert_close(rank, "after.errors", got, np.full(3, 3, np.int64))


def check_duplicate_name(rank: int) -> None:
    # The second submission of a name still pending on this rank is refused at once; the first
    # one completes normally.
    expect_error(rank, "duplicate",
                 lambda: _core.grouped_allreduce([np.ones(2), np.ones(2)], ["dup", "dup"], op=SUM),
                 RuntimeError,
                 'allreduce "dup": a collective named "dup" is already pending on rank')
    got = _core.allreduce(np.ones(2), "dup", op=SUM)
    assert_close(rank, "dup reused", got, np.full(2, 3.0))


def check_stall_warning(rank: int) -> None:
    """Rank 1 submits "stall.x" late; rank 0 must warn that rank 1 is missing."""
    if rank == 1:
        # The stall itself is the behaviour under test, so this wait is deliberate: it must
        # outlast PERSEUS_STALL_WARNING_SECS=1 plus a heartbeat (1 s) to be reported.
        time.sleep(3.5)
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(out=_core.allreduce(np.ones(2), "stall.x", op=SUM)))
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():
        fail(rank, "stall.x never completed once rank 1 submitted it")
    assert_close(rank, "stall.x", result["out"], np.full(2, 3.0))
    print(f"[rank {rank}] stall warnings counted: "
          f"{_core.runtime_stats()['stall_warnings']}", flush=True)


def check_reinit_on_subcommunicator(rank: int) -> None:
    """Ranks {0, 2} and {1} become separate groups; a tensor only rank 0 submits gives up."""
    sub = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
    _core.init_mpi(MPI._handleof(sub))
    expected_size = 2 if rank % 2 == 0 else 1
    if _core.size() != expected_size or _core.rank() != rank // 2:
        fail(rank, f"sub-communicator: rank {_core.rank()} size {_core.size()}")
    got = _core.allreduce(np.full(2, rank, np.int32), "sub.sum", op=SUM)
    assert_close(rank, "sub.sum", got, np.full(2, 2 if rank % 2 == 0 else 1, np.int32))
    print(f"[rank {rank}] init again: rank {_core.rank()} of {_core.size()}, sum "
          f"{got.tolist()}", flush=True)
    if rank == 0:
        expect_error(rank, "stall shutdown", lambda: _core.allreduce(np.ones(2), "stall.only0"),
                     RuntimeError,
                     'allreduce "stall.only0" was submitted by ranks [0] but not by ranks [1]',
                     "PERSEUS_STALL_SHUTDOWN_SECS")
    # Rank 2 must not start waiting before rank 0's stalled tensor is given up on, or it
    # would stall (and be given up on) too.
    sub.Barrier()
    got = _core.allreduce(np.ones(2), "sub.after", op=SUM)  # still usable
    assert_close(rank, "sub.after", got, np.full(2, float(expected_size)))
    _core.shutdown()
    sub.Free()


def check_reinit_over_tcp(rank: int) -> None:
    """The group meets again; tensors that only some ranks submit are given up on all of them."""
    basics.init()
    if _core.size() != 3 or _core.rank() != rank:
        fail(rank, f"after init() again: rank {_core.rank()} size {_core.size()}")
    got = _core.allreduce(np.full(2, rank, np.int32), "again.sum", op=SUM)
    assert_close(rank, "again.sum", got, np.full(2, 3, np.int32))
    print(f"[rank {rank}] init again: rank {_core.rank()} of {_core.size()}, sum "
          f"{got.tolist()}", flush=True)
    # Both sides stall at once, so nobody runs ahead into the next collective while the other
    # side is still waiting for its stalled tensor to be given up.
    if rank == 0:
        expect_error(rank, "stall shutdown", lambda: _core.allreduce(np.ones(2), "stall.only0"),
                     RuntimeError,
                     'allreduce "stall.only0" was submitted by ranks [0] but not by ranks [1, 2]',
                     "PERSEUS_STALL_SHUTDOWN_SECS")
    else:
        expect_error(rank, "stall shutdown", lambda: _core.allreduce(np.ones(2), "stall.only12"),
                     RuntimeError,
                     'allreduce "stall.only12" was submitted by ranks [1, 2] but not by ranks [0]')
    got = _core.allreduce(np.ones(2), "again.after", op=SUM)  # still usable
    assert_close(rank, "again.after", got, np.full(2, 3.0))
    _core.shutdown()


def main() -> None:
    basics.init()
    rank, size = _core.rank(), _core.size()
    if size != 3:
        fail(rank, f"run this on 3 ranks, not {size}")
    check_mismatches(rank)
    check_duplicate_name(rank)
    check_stall_warning(rank)
    _core.shutdown()
    os.environ["PERSEUS_STALL_SHUTDOWN_SECS"] = "1"  # read again by the second init()
    if CONTROLLER == "mpi":
        check_reinit_on_subcommunicator(rank)
    else:
        check_reinit_over_tcp(rank)
    print(f"[rank {rank}] core errors OK", flush=True)


if __name__ == "__main__":
    main()
