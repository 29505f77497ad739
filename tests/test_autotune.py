"""PERSEUS_AUTOTUNE on real ranks (tests/workers/autotune.py): 2 ranks over MPI and 3 over TCP
run steps of allreduces of mixed sizes while rank 0's search switches the fusion threshold, the
cycle time and the cost model's step latency, every result against numpy, until the search ends;
then every rank holds the same chosen values, and rank 0's log lists each configuration tried,
scored, and the choice (docs/settings.md, PERSEUS_AUTOTUNE)."""

from __future__ import annotations

import csv
import re

import pytest
from harness import run_ranks

MIB = 1 << 20
THRESHOLDS = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]  # the search's candidates (docs)
CYCLES_MS = [0.5, 1.0, 2.5, 5.0]
LATENCIES_US = [10.0, 50.0, 250.0]
# The defaults of PERSEUS_CYCLE_TIME and PERSEUS_ALLREDUCE_HOP_LATENCY_US: the thresholds are
# tried at them.
START_CYCLE_MS, START_LATENCY_US = 1.0, 50.0

LAUNCHES = {"mpi-2-ranks": ("mpi", 2), "tcp-3-ranks": ("tcp", 3)}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def launch(request, tmp_path_factory):
    controller, ranks = LAUNCHES[request.param]
    log = tmp_path_factory.mktemp(request.param) / "autotune.csv"
    env = {"PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_LOG": str(log),
           "PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE": "3"}
    out = run_ranks(ranks, "tests/workers/autotune.py", timeout=240, env=env,
                    controller=controller).stdout
    chosen = {int(r): tuple(map(int, values)) for r, *values in
              re.findall(r"^\[rank (\d+)\] CHOSEN (\d+) (\d+) (\d+) (\d+) after", out, re.M)}
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    return ranks, out, chosen, rows


def test_every_result_equals_numpy_while_the_values_switch_and_after(launch):
    ranks, out, _, _ = launch
    for rank in range(ranks):
        assert f"[rank {rank}] autotune OK" in out, out


def test_every_rank_ends_with_the_same_chosen_values(launch):
    ranks, out, chosen, _ = launch
    assert sorted(chosen) == list(range(ranks)), out
    assert len(set(chosen.values())) == 1, chosen
    assert "autotune chose PERSEUS_FUSION_THRESHOLD=" in out, out


def test_the_log_lists_each_configuration_tried_with_its_score_and_the_choice(launch):
    _, out, chosen, rows = launch
    kinds = [row["kind"] for row in rows]
    assert kinds == ["warmup"] + ["tried"] * 9 + ["chosen"], rows
    tried = [(int(row["fusion_threshold_bytes"]), float(row["cycle_time_ms"]),
              float(row["hop_latency_us"])) for row in rows if row["kind"] == "tried"]
    # The coordinate search: every threshold at the starting values, then the other cycle times
    # at one threshold, then the other step latencies at one threshold and cycle time.
    assert tried[:4] == [(t, START_CYCLE_MS, START_LATENCY_US) for t in THRESHOLDS], rows
    assert len({t for t, _, _ in tried[4:]}) == 1 and tried[4][0] in THRESHOLDS, rows
    assert [(c, lat) for _, c, lat in tried[4:7]] == [
        (c, START_LATENCY_US) for c in CYCLES_MS if c != START_CYCLE_MS], rows
    assert len({c for _, c, _ in tried[7:]}) == 1 and tried[7][1] in CYCLES_MS, rows
    assert [lat for _, _, lat in tried[7:]] == [
        x for x in LATENCIES_US if x != START_LATENCY_US], rows
    for row in rows:
        assert float(row["seconds"]) > 0 and int(row["bytes"]) > 0, row
        assert float(row["bytes_per_second"]) == pytest.approx(
            int(row["bytes"]) / float(row["seconds"]), rel=1e-3, abs=1), row
    best = max((row for row in rows if row["kind"] == "tried"),
               key=lambda row: float(row["bytes_per_second"]))
    final = rows[-1]
    columns = ("fusion_threshold_bytes", "cycle_time_ms", "hop_latency_us")
    assert [final[c] for c in columns] == [best[c] for c in columns], rows
    threshold, cycle_us, latency_ns, changes = chosen[0]
    assert (threshold, cycle_us, latency_ns) == (
        int(final["fusion_threshold_bytes"]), round(float(final["cycle_time_ms"]) * 1000),
        round(float(final["hop_latency_us"]) * 1000)), (chosen, rows)
    assert changes == len(tried) + 1, chosen  # a change before each sample tried, and the last
