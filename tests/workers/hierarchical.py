"""The hierarchical allreduce on emulated hosts: allreduces of every op and dtype, odd sizes,
scaling, large tensors (pipelined over TCP), fused groups and a process set checked against
numpy, and which algorithm ran, as the runtime counts it (runtime_stats) and the timeline
records it, the cost model's choice for the part across hosts included.

Usage: hierarchical.py EXPECT [TIMELINE]
  EXPECT: "hierarchical" (every allreduce of the global set runs hierarchically),
  "hierarchical-quick" (the same with fewer dtypes and large tensors, for launches of many
  ranks), "torus" (hierarchically, with PERSEUS_ALLREDUCE_ALGORITHM=torus across 4 or more
  hosts: every part across hosts counted as the torus), "planned" (hierarchically, the
  tensors from 4 MiB only, each by the plan _core.hierarchical_cost gives for the run's
  PERSEUS_ALLREDUCE_HOP_LATENCY_US and _LINK_GBIT, which must overlap the phases on the torus
  where a default slice's segment alone would take another algorithm), or
  "flat" (none does: fewer checks);
  TIMELINE: a path prefix for this run's timeline files.
"mismatch" instead of EXPECT: rank 1 sets PERSEUS_HIERARCHICAL_ALLREDUCE=0, the others 1, and
every rank must fail init() saying so; "bad-value": the setting is "yes", which init() refuses.
"""

from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np
from worker_util import (
    AVERAGE,
    MAX,
    MIN,
    NUMERIC,
    OPS,
    PRODUCT,
    SUM,
    assert_close,
    expected_reduce,
    fail,
    init_core,
    load_core,
    rank_data,
    tolerance,
)

_core = load_core()
CONTROLLER = "tcp" if "PERSEUS_TCP_RANK" in os.environ else "mpi"  # what init_core picks

# Smaller than the 4 ranks, not divisible by 2 (ranks per host) or 4, and one of ~1 MiB + 7
# elements, whose segments MPI moves in its ring's chunks.
ODD_COUNTS = [1, 3, 7, 1001]
LARGE = (1 << 18) + 7


def counters() -> tuple:
    stats = _core.runtime_stats()
    return (stats["collectives_executed"]["allreduce"], stats["hierarchical_allreduces"],
            stats["pipelined_hierarchical_allreduces"])


def algorithms_since(before: dict) -> dict:
    """{algorithm: allreduces counted} since runtime_stats()["allreduce_algorithms"] was
    `before`."""
    now = _core.runtime_stats()["allreduce_algorithms"]
    return {name: count - before[name] for name, count in now.items() if count != before[name]}


def check_every_op_and_dtype(rank: int, size: int, quick: bool) -> None:
    for dtype in (["float32", "int32"] if quick else NUMERIC):
        for op_name, op in OPS.items():
            for count in ODD_COUNTS:
                name = f"h.{np.dtype(dtype).name}.{op_name}.{count}"
                data = [rank_data(r, (count,), dtype, seed=op * 10 + count % 7)
                        for r in range(size)]
                got = _core.allreduce(data[rank], name, op=op)
                assert_close(rank, name, got, expected_reduce(data, op, dtype),
                             **tolerance(dtype))


def check_large_and_scaled(rank: int, size: int, quick: bool) -> None:
    cases = [("float32", AVERAGE, 2.0, 1.0), ("float16", SUM, 0.25, 2.0),
             (ml_dtypes.bfloat16, MIN, 1.0, 1.0), ("int32", PRODUCT, 1.0, 1.0),
             ("int64", AVERAGE, 3.0, 0.5), ("float64", MAX, 1.0, 4.0)]
    for i, (dtype, op, pre, post) in enumerate(cases[:2] if quick else cases):
        name = f"h.large.{i}"
        data = [rank_data(r, (LARGE,), dtype, seed=60 + i) for r in range(size)]
        got = _core.allreduce(data[rank], name, op=op, prescale_factor=pre,
                              postscale_factor=post)
        assert_close(rank, name, got, expected_reduce(data, op, dtype, pre, post),
                     **tolerance(dtype))
        if not np.array_equal(data[rank], rank_data(rank, (LARGE,), dtype, seed=60 + i)):
            fail(rank, f"{name}: the allreduce modified its input")
    # In place, and every rank with the same bits (each element is reduced on one rank only).
    data = [rank_data(r, (LARGE,), "float32", seed=70) for r in range(size)]
    mine = data[rank].copy()
    _core.allreduce(mine, "h.inplace", op=SUM, out=mine)
    assert_close(rank, "h.inplace", mine, expected_reduce(data, SUM, "float32"), rtol=1e-5)
    everyone = _core.allgather(mine[None, :], "h.inplace.bits")
    if not all(np.array_equal(row.view(np.uint32), mine.view(np.uint32)) for row in everyone):
        fail(rank, "h.inplace: ranks ended with different bits")


# dtype, op, prescale, postscale, count, in place: from 4 MiB, odd counts (uneven slices and
# segments).
PIPELINED_CASES = [("float64", MAX, 1.0, 1.0, (1 << 19) + 5, True),
                   ("float32", AVERAGE, 0.5, 3.0, (9 << 18) + 13, False),
                   ("int32", SUM, 1.0, 1.0, (3 << 20) + 1, False)]


def check_pipelined(rank: int, size: int, quick: bool) -> int:
    """Tensors from 4 MiB, whose phases overlap on slices over TCP: odd counts, so that slices
    and segments are uneven. Returns how many ran."""
    cases = PIPELINED_CASES[:1] if quick else PIPELINED_CASES
    for i, (dtype, op, pre, post, count, in_place) in enumerate(cases):
        name = f"h.pipelined.{i}"
        data = [rank_data(r, (count,), dtype, seed=100 + i) for r in range(size)]
        mine = data[rank].copy()
        place = {"out": mine} if in_place else {}
        got = _core.allreduce(mine, name, op=op, prescale_factor=pre, postscale_factor=post,
                              **place)
        assert_close(rank, name, got, expected_reduce(data, op, dtype, pre, post),
                     **tolerance(dtype))
        everyone = _core.allgather(got[None, :], f"{name}.bits")
        if not all(np.array_equal(row, got) for row in everyone):
            fail(rank, f"{name}: ranks ended with different values")
    return len(cases)


def check_planned(rank: int, size: int, algorithms_before: dict) -> None:
    """The pipelined cases, each overlapped on the torus across hosts (on as many slices as the
    default of 2 MiB ones or fewer) where a default slice's segment alone would take another
    algorithm: the plan of the cost model (_core.hierarchical_cost) for the run's policy."""
    hop_us = float(os.environ["PERSEUS_ALLREDUCE_HOP_LATENCY_US"])
    gbit = float(os.environ["PERSEUS_ALLREDUCE_LINK_GBIT"])
    local, hosts = _core.local_size(), _core.cross_size()
    for dtype, _, _, _, count, _ in PIPELINED_CASES:
        nbytes = count * np.dtype(dtype).itemsize
        slices, across, _ = _core.hierarchical_cost(local, hosts, nbytes, hop_us, gbit)
        default = min(16, max(2, nbytes // (2 << 20)))
        alone, _ = _core.allreduce_cost(hosts, nbytes // default // local, hop_us, gbit)
        if not (0 < slices <= default and across == "torus"
                and alone not in ("ring", "torus")):
            fail(rank, f"{nbytes} bytes: the plan is {slices} slices, {across} across hosts "
                       f"({alone} for a default slice's segment); the test wants the torus on "
                       f"at most {default} slices where a default slice alone takes another")
    check_pipelined(rank, size, quick=False)
    ran_as = algorithms_since(algorithms_before)
    if ran_as != {"torus": len(PIPELINED_CASES)}:
        fail(rank, f"the parts across hosts ran {ran_as}, expected the torus for each tensor")
    print(f"[rank {rank}] planned: {len(PIPELINED_CASES)} overlapped on the torus", flush=True)


# Bytes of each rank's segment (its 1 / local_size of the tensor) that the part across hosts
# reduces, and what the runtime counts for it on 2 hosts under the default cost model
# (docs/design.md, "Transports": recursive doubling below about 195 KB on 2 ranks, the ring
# above; over MPI, Open MPI's own below 64 KiB).
CROSS_SEGMENTS = {4096: {"tcp": "recursive_doubling", "mpi": "transport"},
                  96 << 10: {"tcp": "recursive_doubling", "mpi": "recursive_doubling"},
                  512 << 10: {"tcp": "ring", "mpi": "ring"}}


def check_cross_algorithms(rank: int, size: int) -> None:
    """The part across hosts runs the cost model's choice for its segment, counted in
    runtime_stats()["allreduce_algorithms"] (one count per hierarchical allreduce)."""
    if _core.cross_size() != 2:
        fail(rank, f"the expectations are for 2 hosts, not {_core.cross_size()}")
    for segment_bytes, expected in CROSS_SEGMENTS.items():
        count = segment_bytes // 4 * _core.local_size()  # every segment of the same size
        name = f"h.cross.{segment_bytes}"
        data = [rank_data(r, (count,), "float32", seed=segment_bytes % 97) for r in range(size)]
        before = dict(_core.runtime_stats()["allreduce_algorithms"])
        got = _core.allreduce(data[rank], name, op=SUM)
        after = dict(_core.runtime_stats()["allreduce_algorithms"])
        assert_close(rank, name, got, expected_reduce(data, SUM, "float32"), rtol=1e-5)
        ran = {algorithm: after[algorithm] - before[algorithm] for algorithm in after
               if after[algorithm] != before[algorithm]}
        if ran != {expected[CONTROLLER]: 1}:
            fail(rank, f"{name}: a {segment_bytes}-byte segment across hosts counted {ran}, "
                       f"expected {{{expected[CONTROLLER]!r}: 1}}")


def check_fused(rank: int, size: int) -> None:
    """Tensors of one grouped_allreduce reduced together in the fusion buffer."""
    fused_before = _core.runtime_stats()["fused_groups"]
    for dtype, op, pre, post in [("float32", SUM, 1.0, 1.0), ("int16", AVERAGE, 1.0, 1.0),
                                 ("float64", MAX, 0.5, 3.0)]:
        shapes = [(3,), (5, 1), (1,), (2, 7)]
        data = [[rank_data(r, shape, dtype, seed=80 + i) for i, shape in enumerate(shapes)]
                for r in range(size)]
        names = [f"h.fused.{np.dtype(dtype).name}.{i}" for i in range(len(shapes))]
        got = _core.grouped_allreduce(data[rank], names, op=op, prescale_factor=pre,
                                      postscale_factor=post)
        for i, name in enumerate(names):
            expected = expected_reduce([d[i] for d in data], op, dtype, pre, post)
            assert_close(rank, name, got[i], expected, **tolerance(dtype))
    if _core.runtime_stats()["fused_groups"] < fused_before + 3:
        fail(rank, "grouped_allreduce was not fused")


def check_process_set(rank: int, size: int) -> int:
    """A set with one rank of each host: its allreduces run flat. Returns how many ran."""
    if size < 3:
        return 0  # its only such set is the global one
    members = [0, size - 1]
    set_id = _core.add_process_set(members)
    ran = 0
    if rank in members:
        data = [rank_data(r, (LARGE,), "float32", seed=90) for r in members]
        got = _core.allreduce(data[members.index(rank)], "h.set", op=SUM, process_set_id=set_id)
        assert_close(rank, "h.set", got, expected_reduce(data, SUM, "float32"), rtol=1e-5)
        ran = 1
    _core.remove_process_set(set_id)
    return ran


def check_timeline(rank: int, size: int, prefix: str, expect: str) -> None:
    """The timeline's allreduce events name the algorithm."""
    path = f"{prefix}.json"
    _core.start_timeline(path)
    data = [rank_data(r, (LARGE,), "float32", seed=95) for r in range(size)]
    _core.allreduce(data[rank], "h.timeline", op=SUM)
    _core.stop_timeline()
    with open(f"{prefix}.rank{rank}.json") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    algorithms = [e.get("args", {}).get("algorithm") for e in events
                  if e.get("name", "").endswith("_ALLREDUCE")]
    # A flat allreduce is named by its algorithm (docs/settings.md, PERSEUS_ALLREDUCE_ALGORITHM).
    flat = {"ring", "halving_doubling", "recursive_doubling", "torus", "transport"}
    if not (algorithms == [expect] or (expect == "flat" and len(algorithms) == 1
                                       and algorithms[0] in flat)):
        fail(rank, f"timeline allreduce events name algorithms {algorithms}, expected "
                   f"[{expect!r}]")


def mismatch() -> None:
    rank = int(os.environ.get("PERSEUS_TCP_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["PERSEUS_HIERARCHICAL_ALLREDUCE"] = "0" if rank == 1 else "1"
    try:
        init_core(_core)
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
        init_core(_core)
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
    init_core(_core)
    rank, size = _core.rank(), _core.size()
    print(f"[rank {rank}] {CONTROLLER} local_size={_core.local_size()} "
          f"cross_size={_core.cross_size()}", flush=True)
    before = counters()
    algorithms_before = dict(_core.runtime_stats()["allreduce_algorithms"])
    pipelined_cases = 0
    if expect.startswith("hierarchical"):  # the flat algorithms have tests of their own
        quick = expect == "hierarchical-quick"
        check_every_op_and_dtype(rank, size, quick)
        check_large_and_scaled(rank, size, quick)
        pipelined_cases = check_pipelined(rank, size, quick)
        check_cross_algorithms(rank, size)
    elif expect == "torus":
        check_every_op_and_dtype(rank, size, quick=True)
        pipelined_cases = check_pipelined(rank, size, quick=False)
    elif expect == "planned":
        check_planned(rank, size, algorithms_before)
        pipelined_cases = len(PIPELINED_CASES)
    check_fused(rank, size)
    in_set = check_process_set(rank, size)
    after = counters()
    ran, hierarchical, pipelined = (a - b for a, b in zip(after, before))
    global_set = ran - in_set
    if expect == "torus":
        ran_as = algorithms_since(algorithms_before)
        if set(ran_as) != {"torus"}:
            fail(rank, f"the parts across hosts and the set's flat allreduce ran {ran_as}, "
                       "expected only the torus")
    wanted = global_set if expect != "flat" else 0
    if hierarchical != wanted:
        fail(rank, f"{hierarchical} of {ran} allreduces ran hierarchically ({in_set} on a "
                   f"process set), expected {wanted}")
    # Only the TCP transport overlaps the phases; MPI runs them one after another.
    wanted = pipelined_cases if CONTROLLER == "tcp" else 0
    if pipelined != wanted:
        fail(rank, f"{pipelined} allreduces ran pipelined, expected {wanted}")
    if len(sys.argv) > 2:
        check_timeline(rank, size, sys.argv[2], "flat" if expect == "flat" else "hierarchical")
    print(f"[rank {rank}] hierarchical OK: {hierarchical} of {ran} allreduces hierarchical",
          flush=True)
    _core.shutdown()


if __name__ == "__main__":
    main()
