"""The runtime observed: counters (perseus_legacy.runtime_stats) prove that fusion and the
response cache happen, and the timeline (PERSEUS_TIMELINE) records every tensor's phases in
Chrome trace-event files that stay valid JSON even when a rank is killed.

Expectations are computed here from what the workers submit, not read back from the runtime.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from harness import CONTROLLERS, ROOT, launch_env, run_ranks

FUSION_TENSORS = 20  # tests/workers/observe_counters.py
LARGE_TENSORS, LARGE_BYTES = 4, 320_000
CACHED_NAMES, CACHED_STEPS, CACHE_CAPACITY = 3, 10, 3
CARRIED_SMALL, CARRIED_STEPS = 6, 4  # observe_counters.py: small allreduces, one big, a step
TIMELINE_NAMES = ["tl.a", "tl.b", "tl.c", "tl.gather", "tl.bcast"]  # observe_timeline.py


def deltas(out: str, rank: int, phase: str) -> dict:
    found = re.search(rf"^\[rank {rank}\] {phase} (\{{.*\}})$", out, re.M)
    assert found, out
    return json.loads(found.group(1))


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_small_allreduces_submitted_together_run_as_fewer_collectives(controller):
    out = run_ranks(2, "tests/workers/observe_counters.py", "fusion", timeout=120,
                    controller=controller).stdout
    for rank in range(2):
        d = deltas(out, rank, "fusion")
        assert d["tensors_submitted.allreduce"] == FUSION_TENSORS, d
        assert d["bytes_submitted.allreduce"] == FUSION_TENSORS * 4 * 8, d
        assert d["collectives_executed.allreduce"] < FUSION_TENSORS, d
        assert d["fused_groups"] >= 1, d
        assert d["tensors_fused"] > d["fused_groups"], d


def test_fusion_threshold_zero_runs_one_collective_per_tensor():
    out = run_ranks(2, "tests/workers/observe_counters.py", "fusion", timeout=120,
                    env={"PERSEUS_FUSION_THRESHOLD": "0"}).stdout
    for rank in range(2):
        d = deltas(out, rank, "fusion")
        assert d["collectives_executed.allreduce"] == FUSION_TENSORS, d
        assert d["fused_groups"] == 0 and d["tensors_fused"] == 0, d


# 2 ranks: one step of 2 ms copies 2.7 MB in and out at the runtime's 2.7 GB/s, more than the
# 4 tensors; 50 us (the default) copies less than one of them, and each runs alone.
@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("hop_us, collectives", [("50", LARGE_TENSORS), ("2000", 1)])
def test_large_tensors_run_alone_unless_a_collective_starts_slower_than_they_copy(
        controller, hop_us, collectives):
    out = run_ranks(2, "tests/workers/observe_counters.py", "large", timeout=120,
                    env={"PERSEUS_ALLREDUCE_HOP_LATENCY_US": hop_us},
                    controller=controller).stdout
    for rank in range(2):
        d = deltas(out, rank, "large")
        assert d["bytes_submitted.allreduce"] == LARGE_TENSORS * LARGE_BYTES, d
        assert d["collectives_executed.allreduce"] == collectives, d
        assert d["tensors_fused"] == (LARGE_TENSORS if collectives == 1 else 0), d


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_repeated_steps_hit_the_response_cache_and_eviction_and_mismatch_are_counted(
        controller):
    out = run_ranks(2, "tests/workers/observe_counters.py", "cache", timeout=120,
                    env={"PERSEUS_CACHE_CAPACITY": str(CACHE_CAPACITY)},
                    controller=controller).stdout
    for rank in range(2):
        warmup = deltas(out, rank, "warmup")
        assert warmup["cache_misses"] == CACHED_NAMES and warmup["cache_hits"] == 0, warmup
        assert warmup["coordinator_rounds"] >= 1, warmup
        repeated = deltas(out, rank, "repeated")
        assert repeated["cache_hits"] == CACHED_NAMES * CACHED_STEPS, repeated
        assert repeated["cache_misses"] == 0, repeated
        assert repeated["coordinator_rounds"] == 0, repeated
        assert repeated["cache_rounds"] >= CACHED_STEPS, repeated
        # Two names more than the 3 slots hold: the two least recently run are evicted.
        new_names = deltas(out, rank, "new_names")
        assert new_names["cache_evictions"] == 2, new_names
        # The changed shape drops the entry on every rank; the coordinator reports the mismatch.
        mismatch = deltas(out, rank, "mismatch")
        assert mismatch["cache_invalidations"] == 1, mismatch
        assert mismatch["coordinator_rounds"] >= 1, mismatch
        assert mismatch["cache_hits"] == 0, mismatch
        assert f"[rank {rank}] observe cache OK" in out, out


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_small_cached_allreduces_travel_with_the_cache_round_and_match_numpy(controller):
    # Three ranks: rank 0 reduces what the others sent, in rank order, and answers everyone.
    out = run_ranks(3, "tests/workers/observe_counters.py", "carried", timeout=120,
                    controller=controller).stdout
    for rank in range(3):
        d = deltas(out, rank, "carried")
        assert d["carried_allreduces"] == CARRIED_SMALL * CARRIED_STEPS, d
        assert d["collectives_executed.allreduce"] == CARRIED_STEPS, d  # the big one only
        assert d["cache_hits"] == (CARRIED_SMALL + 1) * CARRIED_STEPS, d
        assert f"[rank {rank}] observe carried OK" in out, out


def test_no_carried_allreduces_when_their_budget_is_zero():
    out = run_ranks(3, "tests/workers/observe_counters.py", "carried", timeout=120,
                    env={"PERSEUS_CARRIED_ALLREDUCE_BYTES": "0"}).stdout
    for rank in range(3):
        d = deltas(out, rank, "carried")
        assert d["carried_allreduces"] == 0, d
        assert d["collectives_executed.allreduce"] == (CARRIED_SMALL + 1) * CARRIED_STEPS, d
        assert f"[rank {rank}] observe carried OK" in out, out


def load_events(path) -> list:
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list) and events, path
    return events


def phases_by_tensor(events: list) -> dict:
    """{(pid, tensor): [event, ...] in time order} from the rows' names."""
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "thread_name"}
    out: dict = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault((e["pid"], rows[e["pid"], e["tid"]]), []).append(e)
    for row in out.values():
        row.sort(key=lambda e: (e["ts"], e["ts"] + e["dur"]))
    return out


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_timeline_files_of_every_rank_parse_and_merge_with_phases_in_order(tmp_path, controller):
    trace = tmp_path / "trace.json"
    # Its small allreduces fused on the data plane, not carried by the cache rounds.
    run_ranks(2, "tests/workers/observe_timeline.py", "run", timeout=120,
              env={"PERSEUS_TIMELINE": str(trace), "PERSEUS_CARRIED_ALLREDUCE_BYTES": "0"},
              controller=controller)
    files = [tmp_path / f"trace.rank{r}.json" for r in range(2)]
    for f in files:
        load_events(f)
    merged = tmp_path / "merged.json"
    subprocess.run([sys.executable, "-m", "perseus_legacy.timeline", "merge", str(merged),
                    *map(str, files)], cwd=ROOT, env=launch_env(), check=True, timeout=120)
    events = load_events(merged)
    assert {e["pid"] for e in events} == {0, 1}
    rows = phases_by_tensor(events)
    transport = controller.upper()
    collective = {"tl.gather": "ALLGATHER", "tl.bcast": "BROADCAST"}
    for rank in range(2):
        for name in TIMELINE_NAMES:
            row = rows.get((rank, name))
            assert row, f"rank {rank} has no events for {name}"
            wire = f"{transport}_{collective.get(name, 'ALLREDUCE')}"
            seq = [e["name"] for e in row]
            # Each submission: NEGOTIATE, then the collective, then CALLBACK.
            negotiate = [i for i, n in enumerate(seq) if n == "NEGOTIATE"]
            assert negotiate, seq
            for i in negotiate:
                after = seq[i:]
                assert wire in after and "CALLBACK" in after, seq
                assert after.index(wire) < after.index("CALLBACK"), seq
                assert row[i]["args"]["cache_hit"] in (True, False), row[i]
            if name.startswith("tl.") and name not in collective:
                assert seq.count(wire) == 3, seq  # three steps
                fused = [e for e in row if e["name"] == wire]
                assert all(e["args"]["group_size"] == 3 for e in fused), fused
                assert "MEMCPY_IN_FUSION_BUFFER" in seq and "MEMCPY_OUT_FUSION_BUFFER" in seq
        # Repeated steps are cache hits after the first.
        hits = [e["args"]["cache_hit"] for e in rows[rank, "tl.a"] if e["name"] == "NEGOTIATE"]
        assert hits[0] is False and hits[-1] is True, hits


def test_timeline_of_a_rank_killed_mid_run_still_parses(tmp_path):
    trace = tmp_path / "trace.json"
    run_ranks(2, "tests/workers/observe_timeline.py", "kill", timeout=120,
              env={"PERSEUS_TIMELINE": str(trace)}, expect_failure=True)
    events = load_events(tmp_path / "trace.rank1.json")
    assert any(e["name"] == "MPI_BROADCAST" for e in events), events
    load_events(tmp_path / "trace.rank0.json")
