"""Model updates that bypass the optimizer, on 2 real ranks: KMeans, LinearSDCA and a model_fn's
own assign from this rank's data are refused before the first step; declared per-rank updates,
updates from an allreduce and batch normalization train, checked against numpy on the global
batch (tests/workers/per_rank_updates.py)."""

from __future__ import annotations

import pytest
from harness import run_ranks

CASES = ("kmeans_refused", "sdca_refused", "assign_add_refused", "assign_add_declared",
         "allreduce_value", "batch_norm")


@pytest.fixture(scope="module")
def output() -> str:
    """One launch for every case (start-up dominates)."""
    return run_ranks(2, "tests/workers/per_rank_updates.py", *CASES, timeout=300).stdout


@pytest.mark.parametrize("case", CASES)
def test_update_outside_the_optimizer_is_refused_or_matches_one_process(output, case):
    assert output.count(f"] {case}: OK") == 2, (case, output)
