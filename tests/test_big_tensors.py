"""Tensors over 2 GiB and over INT_MAX elements, on both controllers (2 ranks on one host).

One launch per controller runs tests/workers/big_tensors.py: an in-place int8 allreduce (Sum) of
2**31 + 4099 elements, an allgather whose output is over 2 GiB with a rank's block starting past
2 GiB, a broadcast over 2 GiB, and an alltoall sending over 2 GiB to one rank, each compared
with numpy element by element. MPI's counts are ints: past them its collectives run in pieces
(mpi_controller.cc); this is what tests that.
Each rank holds about two copies of the tensor at its peak; on a machine without the memory the
test skips, saying how much it needs.
"""

from __future__ import annotations

import re

import pytest
from harness import CONTROLLERS, run_ranks

COUNT = 2**31 + 4099  # int8: over 2 GiB and over INT_MAX elements
SMALL = (1 << 20) + 3  # the worker's small blocks
TENSOR_GIB = COUNT / 2**30
# Per rank: the tensor and the allgather output (or the broadcast's input and output), the
# transport's scratch in between, and the interpreter; two ranks.
NEEDED_GIB = 2 * (2 * TENSOR_GIB + 0.8)


def available_gib() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_collectives_over_2gib_and_int_max_elements_match_numpy(controller):
    if available_gib() < NEEDED_GIB:
        pytest.skip(f"needs {NEEDED_GIB:.1f} GiB of available memory for two ranks holding "
                    f"about two {TENSOR_GIB:.1f} GiB tensors each; "
                    f"MemAvailable is {available_gib():.1f} GiB")
    out = run_ranks(2, "tests/workers/big_tensors.py", COUNT, timeout=240,
                    controller=controller).stdout
    for rank in range(2):
        done = [f"allreduce of {COUNT}"] + [f"{collective} of {COUNT + SMALL}" for collective
                                            in ("allgather", "broadcast", "alltoall")]
        for what in done:
            assert f"[rank {rank}] {what} int8 elements OK" in out, out
        assert f"[rank {rank}] big tensors OK" in out, out
        peak = re.search(rf"\[rank {rank}\] peak memory ([0-9.]+) GiB", out)
        assert peak, out
        # At most three copies of the tensor: no transport stages a whole copy of its own.
        assert float(peak.group(1)) < 3 * TENSOR_GIB, out
