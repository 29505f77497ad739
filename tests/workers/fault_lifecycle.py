"""init() and shutdown() misuse fails clearly (MPI, 2 ranks, mpi4py owning MPI):

- init() again with another communicator while initialized is an error naming both groups (it
  used to do nothing); init() again with the same one is a no-op;
- shutdown() then init() on that other communicator forms the new group;
- a process forked after init(): its collectives fail at once saying so (they used to hang), and
  its shutdown() returns at once, leaving the parent's background thread and connections alone;
- Ctrl-C while waiting in a collective or in join() raises KeyboardInterrupt at once and shuts
  this rank's runtime down; the other rank's collectives fail naming it.

Each rank prints `[rank R] lifecycle OK` at the end.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
from mpi4py import MPI  # first: MPI outlives shutdown(), so init() can follow it
from worker_util import assert_close, fail

from perseus_legacy import _core
from perseus_legacy.common import basics

CHILD_DEADLINE_SECS = 30


def check_init_with_another_communicator(rank: int) -> None:
    comm = MPI.COMM_WORLD.Dup()
    basics.init()
    basics.init()  # the same group again: nothing happens
    basics.init(comm=MPI.COMM_WORLD)  # the same group, named
    try:
        _core.init_mpi(MPI._handleof(comm))
    except RuntimeError as exc:
        if "init() was already called for MPI_COMM_WORLD" not in str(exc) or \
                "call shutdown() first" not in str(exc):
            fail(rank, f"init() with another communicator: unexpected error: {exc}")
    else:
        fail(rank, "init() with another communicator while initialized did nothing")
    _core.shutdown()
    _core.init_mpi(MPI._handleof(comm))
    got = _core.allreduce(np.full(3, rank + 1.0), "lifecycle.sum", op=1)
    assert_close(rank, "lifecycle.sum", got, np.full(3, 3.0))
    _core.shutdown()
    comm.Free()


def check_fork_after_init(rank: int) -> None:
    basics.init()
    pid = os.fork()
    if pid == 0:
        try:
            _core.allreduce(np.ones(2), "lifecycle.in_child", op=1)
        except RuntimeError as exc:
            ok = "in a process forked after init()" in str(exc)
            print(f"[rank {rank}] child: {exc}", flush=True)
            basics.shutdown()  # must return at once, leaving the parent's thread alone
            # Not sys.exit: mpi4py's MPI_Finalize at exit cannot work in a forked child.
            os._exit(0 if ok else 3)
        os._exit(4)
    deadline = time.monotonic() + CHILD_DEADLINE_SECS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        fail(rank, "the forked child hung")
    if os.waitstatus_to_exitcode(status) != 0:
        fail(rank, f"the forked child exited with {os.waitstatus_to_exitcode(status)}")
    got = _core.allreduce(np.ones(2), "lifecycle.parent", op=1)  # the parent is unaffected
    assert_close(rank, "lifecycle.parent", got, np.full(2, 2.0))
    _core.shutdown()


def submitted() -> int:
    return _core.runtime_stats()["tensors_submitted"].get("allreduce", 0)


def interrupt_once_submitted(before: int) -> None:
    """Ctrl-C for this process once its allreduce is in the runtime (the main thread waits)."""
    deadline = time.monotonic() + CHILD_DEADLINE_SECS
    while submitted() == before and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)


def check_ctrl_c_interrupts_a_wait(rank: int) -> None:
    """Rank 0 waits on an allreduce rank 1 never submits, and gets Ctrl-C: KeyboardInterrupt
    at once; its runtime shuts down, so rank 1's pending allreduce fails naming rank 0."""
    basics.init()
    if rank == 0:
        threading.Thread(target=interrupt_once_submitted, args=(submitted(),)).start()
        start = time.monotonic()
        try:
            _core.allreduce(np.ones(2), "interrupt.lonely", op=1)
        except KeyboardInterrupt:
            print(f"[rank 0] interrupted after {time.monotonic() - start:.1f} s", flush=True)
        else:
            fail(rank, "the allreduce completed without rank 1")
    else:
        try:
            _core.allreduce(np.ones(2), "interrupt.other", op=1)
        except RuntimeError as exc:
            print(f"[rank 1] after rank 0's Ctrl-C: {exc}", flush=True)
        else:
            fail(rank, "the allreduce completed without rank 0")
    _core.shutdown()


def check_ctrl_c_interrupts_join(rank: int) -> None:
    """Rank 0 waits in join(); rank 1 sees it joined (its allreduce ran without rank 0's data)
    and sends rank 0 Ctrl-C: KeyboardInterrupt at once, rank 0 shuts down, and rank 1's next
    collective fails naming it."""
    pids = MPI.COMM_WORLD.allgather(os.getpid())
    basics.init()
    if rank == 0:
        start = time.monotonic()
        try:
            _core.join()
        except KeyboardInterrupt:
            print(f"[rank 0] join interrupted after {time.monotonic() - start:.1f} s", flush=True)
        else:
            fail(rank, "join() completed without rank 1")
    else:
        deadline = time.monotonic() + CHILD_DEADLINE_SECS
        while not _core.take_peer_joined():
            _core.allreduce(np.ones(2), f"join.probe.{time.monotonic()}", op=1)
            if time.monotonic() > deadline:
                fail(rank, "rank 0 never joined")
        os.kill(pids[0], signal.SIGINT)
        # Rank 0 is joined: the probes run without its data until its shutdown ends them.
        try:
            while time.monotonic() < deadline:
                _core.allreduce(np.ones(2), f"join.probe.{time.monotonic()}", op=1)
            fail(rank, "rank 0 never shut down after its Ctrl-C")
        except RuntimeError as exc:
            print(f"[rank 1] after rank 0's Ctrl-C in join(): {exc}", flush=True)
    _core.shutdown()


def main() -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    check_init_with_another_communicator(rank)
    check_fork_after_init(rank)
    MPI.COMM_WORLD.Barrier()  # both ranks' runtimes are down before the next group forms
    check_ctrl_c_interrupts_a_wait(rank)
    MPI.COMM_WORLD.Barrier()
    check_ctrl_c_interrupts_join(rank)
    print(f"[rank {rank}] lifecycle OK", flush=True)


if __name__ == "__main__":
    main()
