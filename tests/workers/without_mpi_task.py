"""One rank of a build without MPI, for tests/test_without_mpi.py. Imports only the native core
of that build (its perseus_legacy package holds nothing else) and numpy.

    without_mpi_task.py info                       prints transports(), build_info() and what
                                                   init() over MPI raises, as JSON
    without_mpi_task.py allreduce RANK ADDRESSES   joins the ranks at ADDRESSES (comma
                                                   separated host:port) over TCP, allreduces
                                                   against numpy, checks no MPI library is loaded
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from worker_util import assert_close, fail, rank_data

from perseus_legacy import _core

SUM, AVERAGE = 1, 0


def info() -> None:
    try:
        _core.init_mpi()
        mpi_init = "init() over MPI succeeded"
    except RuntimeError as exc:
        mpi_init = str(exc)
    print(json.dumps({"core": _core.__file__, "transports": _core.transports(),
                      "build_info": _core.build_info(), "mpi_init": mpi_init}), flush=True)


def loaded_mpi_libraries() -> list:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libmpi" in line})


def allreduce(rank: int, addresses: list) -> None:
    size = len(addresses)
    _core.init_tcp(rank, addresses, rank, size, 0, 1, os.environ["PERSEUS_SECRET"],
                   start_timeout=60.0)
    if (_core.rank(), _core.size(), _core.build_info()["controller"]) != (rank, size, "tcp"):
        fail(rank, f"rank {_core.rank()} of {_core.size()} over "
                   f"{_core.build_info()['controller']}, expected {rank} of {size} over tcp")
    small = [rank_data(r, (1000, 3), "float32", seed=1) for r in range(size)]
    got = _core.allreduce(small[rank], "without_mpi.small", op=SUM)
    assert_close(rank, "without_mpi.small", got, np.sum(small, axis=0), rtol=1e-6)
    # Several ring chunks per rank: the pipelined path.
    big = [rank_data(r, (1 << 20,), "float64", seed=2) for r in range(size)]
    got = _core.allreduce(big[rank], "without_mpi.big", op=AVERAGE)
    assert_close(rank, "without_mpi.big", got, np.mean(big, axis=0), rtol=1e-12)
    if loaded_mpi_libraries():
        fail(rank, f"an MPI library is loaded: {loaded_mpi_libraries()}")
    _core.shutdown()
    print(f"[rank {rank}] allreduce over tcp OK from {_core.__file__}", flush=True)


def main() -> None:
    if sys.argv[1] == "info":
        info()
    elif sys.argv[1] == "allreduce":
        allreduce(int(sys.argv[2]), sys.argv[3].split(","))
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
