"""Helpers for scripts that run on every rank: checks that name the rank, seeded data."""

from __future__ import annotations

import sys

import numpy as np


def fail(rank: int, message: str) -> None:
    print(f"[rank {rank}] FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def assert_close(rank: int, what: str, got, expected, rtol: float = 1e-6, atol: float = 0.0):
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        fail(rank, f"{what}: shape {got.shape}, expected {expected.shape}")
    if got.dtype != expected.dtype:
        fail(rank, f"{what}: dtype {got.dtype}, expected {expected.dtype}")
    g = got.astype(np.float64) if got.dtype != bool else got
    e = expected.astype(np.float64) if expected.dtype != bool else expected
    if not np.allclose(g, e, rtol=rtol, atol=atol):
        bad = np.argwhere(~np.isclose(g, e, rtol=rtol, atol=atol))[:5]
        fail(rank, f"{what}: mismatch at {bad.tolist()}: got {g[tuple(bad[0])]}, "
                   f"expected {e[tuple(bad[0])]}")


def rank_data(rank: int, shape, dtype, seed: int = 0) -> np.ndarray:
    """Deterministic per-rank data any rank can regenerate (for numpy expectations)."""
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)  # small: products stay in range
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
