"""Horovod idioms found by running Horovod's own examples and tests against perseus_legacy, on
real ranks, checked against numpy (tests/workers/hvd_conformance.py)."""

from __future__ import annotations

from harness import run_ranks

CASES = ("broadcast_variables_in_tf_function", "each_rank_its_own_process_set",
         "init_with_a_repeated_set_registers_none")


def test_horovod_idioms_match_numpy_on_3_ranks():
    """One launch for every case (start-up dominates); three ranks give the even ranks' set two
    members."""
    out = run_ranks(3, "tests/workers/hvd_conformance.py", *CASES, timeout=300).stdout
    for case in CASES:
        assert out.count(f"] {case}: OK") == 3, (case, out)
