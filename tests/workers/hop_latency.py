"""Runs on every rank of a launch on emulated hosts whose links add a delay, with
PERSEUS_ALLREDUCE_HOP_LATENCY_US=auto: prints the step latency the runtime measured at init
(runtime_stats()["autotune"]["hop_latency_ns"]), then allreduces 64 Ki float32 against numpy
and prints the algorithm that ran: "[rank R] HOP NS RAN ALGORITHM"."""

from __future__ import annotations

from worker_util import SUM, assert_close, expected_reduce, fail, rank_data

from perseus_legacy import _core
from perseus_legacy.common import basics

ELEMENTS = 64 << 10


def main() -> None:
    basics.init()
    rank, size = _core.rank(), _core.size()
    hop_ns = _core.runtime_stats()["autotune"]["hop_latency_ns"]
    data = [rank_data(r, (ELEMENTS,), "float32", seed=41) for r in range(size)]
    before = dict(_core.runtime_stats()["allreduce_algorithms"])
    got = _core.allreduce(data[rank], "hop.probe", op=SUM)
    after = dict(_core.runtime_stats()["allreduce_algorithms"])
    assert_close(rank, f"{ELEMENTS} float32 over {size} ranks", got,
                 expected_reduce(data, SUM, "float32"), rtol=1e-5)
    ran = [name for name in after if after[name] != before.get(name)]
    if len(ran) != 1:
        fail(rank, f"algorithm counters moved: {ran}")
    print(f"[rank {rank}] HOP {hop_ns} RAN {ran[0]}", flush=True)
    _core.shutdown()


if __name__ == "__main__":
    main()
