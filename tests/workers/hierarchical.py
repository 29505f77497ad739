"""The hierarchical allreduce on emulated hosts: allreduces of every op and dtype, odd sizes,
scaling, large tensors (pipelined over TCP), fused groups and a process set checked against
numpy, and which algorithm ran, as the runtime counts it (runtime_stats) and the timeline
records it.

Usage: hierarchical.py EXPECT [TIMELINE]
  EXPECT: "hierarchical" (every allreduce of the global set runs hierarchically), or "flat"
  (none does: fewer checks); TIMELINE: a path prefix for this run's timeline files.
"mismatch" instead of EXPECT: rank 1 sets PERSEUS_HIERARCHICAL_ALLREDUCE=0, the others 1, and
every rank must fail init() saying so; "bad-value": the setting is "yes", which init() refuses.
"""

from __future__ import annotations

import json
import os
import sys

import core_collectives as cc
import ml_dtypes
import numpy as np
from worker_util import assert_close, fail, rank_data

from perseus_legacy import _core
from perseus_legacy.common import basics, process_sets, tf_config

# Smaller than the 4 ranks, not divisible by 2 (ranks per host) or 4, and one of ~1 MiB + 7
# elements, whose segments MPI moves in its ring's chunks.
ODD_COUNTS = [1, 3, 7, 1001]
LARGE = (1 << 18) + 7


def counters() -> tuple:
    stats = _core.runtime_stats()
    return (stats["collectives_executed"]["allreduce"], stats["hierarchical_allreduces"],
            stats["pipelined_hierarchical_allreduces"])


def check_every_op_and_dtype(rank: int, size: int) -> None:
    for dtype in cc.NUMERIC:
        for op_name, op in cc.OPS.items():
            for count in ODD_COUNTS:
                name = f"h.{np.dtype(dtype).name}.{op_name}.{count}"
                data = [rank_data(r, (count,), dtype, seed=op * 10 + count % 7)
                        for r in range(size)]
                got = _core.allreduce(data[rank], name, op=op)
                assert_close(rank, name, got, cc.expected_reduce(data, op, dtype),
                             **cc.tolerance(dtype))


def check_large_and_scaled(rank: int, size: int) -> None:
    cases = [("float32", cc.AVERAGE, 2.0, 1.0), ("float16", cc.SUM, 0.25, 2.0),
             (ml_dtypes.bfloat16, cc.MIN, 1.0, 1.0), ("int32", cc.PRODUCT, 1.0, 1.0),
             ("int64", cc.AVERAGE, 3.0, 0.5), ("float64", cc.MAX, 1.0, 4.0)]
    for i, (dtype, op, pre, post) in enumerate(cases):
        name = f"h.large.{i}"
        data = [rank_data(r, (LARGE,), dtype, seed=60 + i) for r in range(size)]
        got = _core.allreduce(data[rank], name, op=op, prescale_factor=pre,
                              postscale_factor=post)
        assert_close(rank, name, got, cc.expected_reduce(data, op, dtype, pre, post),
                     **cc.tolerance(dtype))
        if not np.array_equal(data[rank], rank_data(rank, (LARGE,), dtype, seed=60 + i)):
            fail(rank, f"{name}: the allreduce modified its input")
    # In place, and every rank with the same bits (each element is reduced on one rank only).
    data = [rank_data(r, (LARGE,), "float32", seed=70) for r in range(size)]
    mine = data[rank].copy()
    _core.allreduce(mine, "h.inplace", op=cc.SUM, out=mine)
    assert_close(rank, "h.inplace", mine, cc.expected_reduce(data, cc.SUM, "float32"), rtol=1e-5)
    everyone = _core.allgather(mine[None, :], "h.inplace.bits")
    if not all(np.array_equal(row.view(np.uint32), mine.view(np.uint32)) for row in everyone):
        fail(rank, "h.inplace: ranks ended with different bits")


def check_pipelined(rank: int, size: int) -> int:
    """Tensors from 4 MiB, whose phases overlap on slices over TCP: odd counts, so that slices
    and segments are uneven. Returns how many ran."""
    cases = [("float32", cc.AVERAGE, 0.5, 3.0, (9 << 18) + 13, False),
             ("float64", cc.MAX, 1.0, 1.0, (1 << 19) + 5, True),
             ("int32", cc.SUM, 1.0, 1.0, (3 << 20) + 1, False)]
    for i, (dtype, op, pre, post, count, in_place) in enumerate(cases):
        name = f"h.pipelined.{i}"
        data = [rank_data(r, (count,), dtype, seed=100 + i) for r in range(size)]
        mine = data[rank].copy()
        place = {"out": mine} if in_place else {}
        got = _core.allreduce(mine, name, op=op, prescale_factor=pre, postscale_factor=post,
                              **place)
        assert_close(rank, name, got, cc.expected_reduce(data, op, dtype, pre, post),
                     **cc.tolerance(dtype))
        everyone = _core.allgather(got[None, :], f"{name}.bits")
        if not all(np.array_equal(row, got) for row in everyone):
            fail(rank, f"{name}: ranks ended with different values")
    return len(cases)


def check_fused(rank: int, size: int) -> None:
    """Tensors of one grouped_allreduce reduced together in the fusion buffer."""
    fused_before = _core.runtime_stats()["fused_groups"]
    for dtype, op, pre, post in [("float32", cc.SUM, 1.0, 1.0), ("int16", cc.AVERAGE, 1.0, 1.0),
                                 ("float64", cc.MAX, 0.5, 3.0)]:
        shapes = [(3,), (5, 1), (1,), (2, 7)]
        data = [[rank_data(r, shape, dtype, seed=80 + i) for i, shape in enumerate(shapes)]
                for r in range(size)]
        names = [f"h.fused.{np.dtype(dtype).name}.{i}" for i in range(len(shapes))]
        got = _core.grouped_allreduce(data[rank], names, op=op, prescale_factor=pre,
                                      postscale_factor=post)
        for i, name in enumerate(names):
            expected = cc.expected_reduce([d[i] for d in data], op, dtype, pre, post)
            assert_close(rank, name, got[i], expected, **cc.tolerance(dtype))
    if _core.runtime_stats()["fused_groups"] < fused_before + 3:
        fail(rank, "grouped_allreduce was not fused")


def check_process_set(rank: int, size: int) -> int:
    """A set with one rank of each host: its allreduces run flat. Returns how many ran."""
    if size < 3:
        return 0  # its only such set is the global one
    members = [0, size - 1]
    the_set = process_sets.add_process_set(members)
    set_id = the_set.process_set_id
    ran = 0
    if rank in members:
        data = [rank_data(r, (LARGE,), "float32", seed=90) for r in members]
        got = _core.allreduce(data[members.index(rank)], "h.set", op=cc.SUM, process_set_id=set_id)
        assert_close(rank, "h.set", got, cc.expected_reduce(data, cc.SUM, "float32"), rtol=1e-5)
        ran = 1
    process_sets.remove_process_set(the_set)
    return ran


def check_timeline(rank: int, size: int, prefix: str, expect: str) -> None:
    """The timeline's allreduce events name the algorithm."""
    path = f"{prefix}.json"
    _core.start_timeline(path)
    data = [rank_data(r, (LARGE,), "float32", seed=95) for r in range(size)]
    _core.allreduce(data[rank], "h.timeline", op=cc.SUM)
    _core.stop_timeline()
    with open(f"{prefix}.rank{rank}.json") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    algorithms = [e.get("args", {}).get("algorithm") for e in events
                  if e.get("name", "").endswith("_ALLREDUCE")]
    # A flat allreduce is named by its algorithm (docs/settings.md, PERSEUS_ALLREDUCE_ALGORITHM).
    flat = {"ring", "halving_doubling", "recursive_doubling", "transport"}
    if not (algorithms == [expect] or (expect == "flat" and len(algorithms) == 1
                                       and algorithms[0] in flat)):
        fail(rank, f"timeline allreduce events name algorithms {algorithms}, expected "
                   f"[{expect!r}]")


def mismatch() -> None:
    rank = int(os.environ.get("PERSEUS_TCP_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["PERSEUS_HIERARCHICAL_ALLREDUCE"] = "0" if rank == 1 else "1"
    try:
        basics.init()
    except Exception as exc:  # noqa: BLE001 (whatever the error type, its text is checked)
        text = str(exc)
        if "PERSEUS_HIERARCHICAL_ALLREDUCE differs between ranks" in text and \
                "rank 1 has 0" in text:
            print(f"[rank {rank}] init refused: {text}", flush=True)
            return
        fail(rank, f"init failed for another reason: {text}")
    fail(rank, "init succeeded with PERSEUS_HIERARCHICAL_ALLREDUCE differing between ranks")


def bad_value() -> None:
    os.environ["PERSEUS_HIERARCHICAL_ALLREDUCE"] = "yes"
    try:
        basics.init()
    except Exception as exc:  # noqa: BLE001 (whatever the error type, its text is checked)
        if 'PERSEUS_HIERARCHICAL_ALLREDUCE="yes" is not one of auto, 0, 1' not in str(exc):
            fail(0, f"init failed for another reason: {exc}")
        print(f"[rank 0] init refused: {exc}", flush=True)
        return
    fail(0, "init accepted PERSEUS_HIERARCHICAL_ALLREDUCE=yes")


def main() -> None:
    if sys.argv[1] in ("mismatch", "bad-value"):
        (mismatch if sys.argv[1] == "mismatch" else bad_value)()
        return
    expect = sys.argv[1]
    basics.init()
    rank, size = _core.rank(), _core.size()
    print(f"[rank {rank}] {tf_config.controller_from_env()} local_size={_core.local_size()} "
          f"cross_size={_core.cross_size()}", flush=True)
    before = counters()
    pipelined_cases = 0
    if expect == "hierarchical":  # the flat algorithms have tests of their own
        check_every_op_and_dtype(rank, size)
        check_large_and_scaled(rank, size)
        pipelined_cases = check_pipelined(rank, size)
    check_fused(rank, size)
    in_set = check_process_set(rank, size)
    after = counters()
    ran, hierarchical, pipelined = (a - b for a, b in zip(after, before))
    global_set = ran - in_set
    wanted = global_set if expect == "hierarchical" else 0
    if hierarchical != wanted:
        fail(rank, f"{hierarchical} of {ran} allreduces ran hierarchically ({in_set} on a "
                   f"process set), expected {wanted}")
    # Only the TCP transport overlaps the phases; MPI runs them one after another.
    wanted = pipelined_cases if tf_config.controller_from_env() == "tcp" else 0
    if pipelined != wanted:
        fail(rank, f"{pipelined} allreduces ran pipelined, expected {wanted}")
    if len(sys.argv) > 2:
        check_timeline(rank, size, sys.argv[2], expect)
    print(f"[rank {rank}] hierarchical OK: {hierarchical} of {ran} allreduces hierarchical",
          flush=True)
    basics.shutdown()


if __name__ == "__main__":
    main()
