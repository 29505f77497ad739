"""Collectives of tensors over 2 GiB and over INT_MAX elements, checked against numpy (2 ranks).

argv[1]: the element count of the allreduce (2**31 + 4099 in the test: over 2 GiB and over
INT_MAX elements of int8). Every rank's data is a seeded int8 tile of prime period plus a
constant per 16 Mi-element block, so numpy regenerates any block of any rank's data, and the
expected result, without holding a second copy; the whole of every result is compared.
Peak memory: the tensor, the allgather output (one more copy) or the broadcast output, and the
transport's scratch; each rank prints its ru_maxrss.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
from worker_util import fail, init_core, load_core

_core = load_core()  # without TensorFlow: less memory, a faster start

SUM = 1
BLOCK = 1 << 24  # elements per generated / compared block
PERIOD = 8191  # prime: a block shifted by anything but a multiple of it reads other values
SMALL = (1 << 20) + 3  # rank 1's part of the allgather, placed past 2 GiB in the output


class Pattern:
    """Rank r's data: tile_r[i % PERIOD] + offset_r(i // BLOCK), in [-50, 50]."""

    def __init__(self, rank: int) -> None:
        tile = np.random.default_rng(rank).integers(-30, 31, PERIOD, dtype=np.int8)
        self.tile = np.resize(tile, PERIOD + BLOCK)  # any BLOCK-long window of the period
        self.rank = rank

    def offset(self, block: int) -> int:
        return (block * 7 + 13 * self.rank) % 41 - 20

    def window(self, start: int, length: int) -> np.ndarray:
        return self.tile[start % PERIOD:start % PERIOD + length]


class Sum(Pattern):
    """The elementwise sum of two patterns (in [-100, 100]: no int8 overflow)."""

    def __init__(self, a: Pattern, b: Pattern) -> None:
        self.tile = a.tile + b.tile
        self.parts = (a, b)

    def offset(self, block: int) -> int:
        return sum(p.offset(block) for p in self.parts)


def fill(pattern: Pattern, out: np.ndarray) -> None:
    for start in range(0, out.size, BLOCK):
        length = min(BLOCK, out.size - start)
        np.add(pattern.window(start, length), pattern.offset(start // BLOCK),
               out=out[start:start + length], dtype=np.int8)


def check(rank: int, what: str, got: np.ndarray, pattern: Pattern, first: int = 0) -> None:
    """Fails unless got[i] == pattern(first + i) for every i (piece by piece, each within one
    of the pattern's blocks, without a full copy)."""
    at = 0
    while at < got.size:
        index = first + at
        length = min(got.size - at, (index // BLOCK + 1) * BLOCK - index)
        expected = pattern.window(index, length) + np.int8(pattern.offset(index // BLOCK))
        piece = got[at:at + length]
        if not np.array_equal(piece, expected):
            bad = int(np.flatnonzero(piece != expected)[0])
            fail(rank, f"{what}: element {at + bad} is {piece[bad]}, expected {expected[bad]}")
        at += length


def maxrss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def main() -> None:
    count = int(sys.argv[1])
    rank, size = init_core(_core), _core.size()
    if size != 2:
        fail(rank, f"runs on 2 ranks, not {size}")
    mine = Pattern(rank)
    total = Sum(Pattern(0), Pattern(1))

    # Allreduce in place: the tensor and the transport's scratch only.
    data = np.empty(count, np.int8)
    fill(mine, data)
    start = time.monotonic()
    _core.allreduce(data, "big.allreduce", op=SUM, out=data)
    took = time.monotonic() - start
    check(rank, "allreduce", data, total)
    print(f"[rank {rank}] allreduce of {count} int8 elements OK ({took:.1f} s)", flush=True)

    # Allgather: rank 0's part is the reduced tensor (over 2 GiB), rank 1's a small one that
    # lands past 2 GiB in the output.
    if rank == 1:
        data = np.empty(SMALL, np.int8)
        fill(mine, data)
    start = time.monotonic()
    gathered = _core.allgather(data, "big.allgather")
    took = time.monotonic() - start
    del data
    if gathered.shape != (count + SMALL,):
        fail(rank, f"allgather: shape {gathered.shape}, expected {(count + SMALL,)}")
    check(rank, "allgather (rank 0's part)", gathered[:count], total)
    check(rank, "allgather (rank 1's part)", gathered[count:], Pattern(1))
    print(f"[rank {rank}] allgather of {count + SMALL} int8 elements OK ({took:.1f} s)", flush=True)

    # Broadcast from rank 1 of a tensor over 2 GiB (rank 0's output starts as fresh pages).
    start = time.monotonic()
    received = _core.broadcast(gathered, 1, "big.broadcast")
    took = time.monotonic() - start
    check(rank, "broadcast", received[:count], total)
    check(rank, "broadcast (tail)", received[count:], Pattern(1))
    print(f"[rank {rank}] broadcast of {count + SMALL} int8 elements OK ({took:.1f} s)", flush=True)

    # Alltoall: rank 0 sends all but its first SMALL rows (over 2 GiB) to rank 1.
    del gathered
    if rank == 0:
        data, splits = received, [SMALL, count]
    else:
        del received
        data, splits = np.empty(2 * SMALL, np.int8), [SMALL, SMALL]
        fill(mine, data)
    start = time.monotonic()
    exchanged, received_splits = _core.alltoall(data, "big.alltoall", splits=splits)
    took = time.monotonic() - start
    del data
    if rank == 0:
        expected_splits = [SMALL, SMALL]
        check(rank, "alltoall (from rank 0)", exchanged[:SMALL], total)
        check(rank, "alltoall (from rank 1)", exchanged[SMALL:], Pattern(1))
    else:
        expected_splits = [count, SMALL]
        check(rank, "alltoall (from rank 0)", exchanged[:count - SMALL], total, first=SMALL)
        check(rank, "alltoall (rank 0's tail and rank 1's)", exchanged[count - SMALL:],
              Pattern(1))
    if received_splits.tolist() != expected_splits:
        fail(rank, f"alltoall: received splits {received_splits.tolist()}, expected "
                   f"{expected_splits}")
    print(f"[rank {rank}] alltoall of {count + SMALL} int8 elements OK ({took:.1f} s)",
          flush=True)

    _core.shutdown()
    print(f"[rank {rank}] peak memory {maxrss_gib():.2f} GiB", flush=True)
    print(f"[rank {rank}] big tensors OK", flush=True)


if __name__ == "__main__":
    main()
