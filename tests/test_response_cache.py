"""The response cache: tensors seen before are negotiated with a bit vector, results unchanged."""

from __future__ import annotations

from harness import run_ranks


def test_cached_negotiation_matches_numpy_through_eviction_changed_metadata_and_late_ranks():
    """A 4-slot cache: hits in shuffled orders, eviction, changed metadata, a mismatch, a late rank.
    (With the default capacity, every other multi-rank test runs through the cache as well.)"""
    out = run_ranks(3, "tests/workers/response_cache.py", timeout=180,
                    env={"PERSEUS_CACHE_CAPACITY": "4"}).stdout
    for rank in range(3):
        assert f"[rank {rank}] response cache OK" in out, out
