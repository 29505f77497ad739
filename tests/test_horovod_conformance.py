"""Horovod idioms found by running Horovod's own examples and tests against perseus_legacy, on
real ranks, checked against numpy (tests/workers/hvd_conformance.py)."""

from __future__ import annotations

import pytest
from harness import run_ranks

# (case, ranks): three ranks give the even ranks' set two members.
CASES = (("broadcast_variables_in_tf_function", 2), ("each_rank_its_own_process_set", 3))


@pytest.mark.parametrize("case, np_", CASES)
def test_horovod_idiom_matches_numpy(case, np_):
    out = run_ranks(np_, "tests/workers/hvd_conformance.py", case, timeout=300).stdout
    assert out.count(f"] {case}: OK") == np_, out
