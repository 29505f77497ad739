"""A failure of one rank's own (not a lost peer) must reach every rank at once, with its cause.

    fault_abort.py DIR collective  PERSEUS_DEBUG_FAULT (set by the test: KIND@RANK) makes one
                                   rank fail at the allreduce "debug_fault.0", after a few healthy
                                   ones. Every rank prints `[rank R] FAULT_SEEN after S s: <error>`
                                   (S: seconds since it submitted "debug_fault.0").
    fault_abort.py DIR python      rank 1 catches an exception of its own (nothing is reported:
                                   the next allreduce succeeds everywhere), then raises one it
                                   does not catch, ValueError(UNCAUGHT); rank 0 prints
                                   `[rank 0] FAULT_SEEN after S s: <error>` of its next allreduce
                                   (S: seconds since it submitted it).
    fault_abort.py DIR caught      the first part of `python` only: every rank ends normally.
    fault_abort.py DIR init        init() only: PERSEUS_DEBUG_FAULT=stop-at-agreement@1 or a
                                   disagreeing setting; every rank that returns from init()
                                   prints `[rank R] INIT_FAILED after S s: <error>`.
    fault_abort.py DIR never-init  rank 1 waits for a signal instead of calling init(); rank 0's
                                   init() must fail within PERSEUS_START_TIMEOUT.
    fault_abort.py DIR mismatch    rank 1 sets PERSEUS_CACHE_CAPACITY=0 and
                                   PERSEUS_FUSION_THRESHOLD=4096 before init(), then as `init`.

Before exiting each rank leaves DIR/seen.R and waits (polling, with a deadline) until every
rank's file is there: on MPI the first rank to exit ends the job (MPI_Abort), which must not
come before the others have reported.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from worker_util import wait_until

from perseus_legacy import _core
from perseus_legacy.common import basics

REPORT_WAIT_SECS = 30
UNCAUGHT = "raised on purpose and not caught"


def launcher_rank() -> int:
    return int(os.environ.get("PERSEUS_TCP_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])


def await_files(paths: list[Path]) -> None:
    """Returns once every file in `paths` exists, or after REPORT_WAIT_SECS."""
    wait_until(lambda: all(path.exists() for path in paths), REPORT_WAIT_SECS)


def leave(out_dir: Path, rank: int, size: int) -> None:
    """Marks this rank as reported and waits for the others' marks (bounded)."""
    (out_dir / f"seen.{rank}").write_text("")
    await_files([out_dir / f"seen.{r}" for r in range(size)])


def expect_failure(out_dir: Path, rank: int, size: int, tag: str, call, what: str) -> None:
    """Runs `call`, which must fail: prints `[rank R] TAG after S s: <error>` and exits 1 once
    every rank has reported."""
    start = time.monotonic()
    try:
        call()
    except RuntimeError as exc:
        print(f"[rank {rank}] {tag} after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        leave(out_dir, rank, size)
        sys.exit(1)
    print(f"[rank {rank}] UNEXPECTED: {what} succeeded", flush=True)


def warmed_up() -> tuple[int, int, np.ndarray]:
    """init() and a few healthy allreduces: (rank, size, the data)."""
    basics.init()
    rank, size = _core.rank(), _core.size()
    data = np.ones(1024, np.float32)
    for step in range(3):
        out = _core.allreduce(data, f"warm.{step}", op=1)
        assert out[0] == size, out[:4]
    return rank, size, data


def collective(out_dir: Path) -> None:
    rank, size, data = warmed_up()
    expect_failure(out_dir, rank, size, "FAULT_SEEN",
                   lambda: _core.allreduce(data, "debug_fault.0", op=1), "debug_fault.0")


def python_error(out_dir: Path, uncaught: bool) -> None:
    if launcher_rank() == 1:
        # Installed before init(): perseus_legacy's hook reports first, then calls this one,
        # which waits for rank 0's report (on MPI this rank's exit ends the job).
        def hook(*exc_info) -> None:
            sys.__excepthook__(*exc_info)
            leave(out_dir, 1, 2)

        sys.excepthook = hook
    rank, size, data = warmed_up()
    if rank == 1:
        try:
            raise ValueError("raised on purpose and caught")
        except ValueError as exc:
            print(f"[rank 1] caught {exc!r}", flush=True)
    out = _core.allreduce(data, "after_caught", op=1)
    assert out[0] == size, out[:4]
    if not uncaught:
        print(f"[rank {rank}] ENDED normally", flush=True)
        return
    if rank == 0:
        (out_dir / "after_caught.0").write_text("")
    else:
        # Not before rank 0 has its result: the notice could overtake the allreduce's last data.
        await_files([out_dir / "after_caught.0"])
        raise ValueError(UNCAUGHT)
    expect_failure(out_dir, rank, size, "FAULT_SEEN",
                   lambda: _core.allreduce(data, "after_uncaught", op=1), "after_uncaught")


def init_only(out_dir: Path, size: int) -> None:
    expect_failure(out_dir, launcher_rank(), size, "INIT_FAILED", basics.init, "init()")


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "collective":
        collective(out_dir)
        return
    if mode in ("python", "caught"):
        python_error(out_dir, uncaught=mode == "python")
        return
    if mode == "never-init" and launcher_rank() == 1:
        print("[rank 1] waiting for a signal instead of calling init()", flush=True)
        signal.pause()  # the launcher's SIGTERM ends it
    if mode == "mismatch" and launcher_rank() == 1:
        os.environ["PERSEUS_CACHE_CAPACITY"] = "0"
        os.environ["PERSEUS_FUSION_THRESHOLD"] = "4096"
    init_only(out_dir, 1 if mode == "never-init" else 2)


if __name__ == "__main__":
    main()
