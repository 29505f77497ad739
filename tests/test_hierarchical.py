"""The hierarchical allreduce (reduce-scatter within a host, an allreduce across hosts per local
rank by the cost model's algorithm, allgather within the host) on emulated hosts of 2 and 4 ranks,
over MPI and TCP: results against numpy, and the algorithms that ran, from runtime_stats and the
timeline. PERSEUS_HIERARCHICAL_ALLREDUCE=0 and one
rank per host run flat; ranks that disagree on the setting fail init() saying so.

The emulated launches need root and iproute2 (see tests/harness.py); without them they
are skipped with the reason.
"""

from __future__ import annotations

import pytest
from harness import needs_emulation, run_emulated, run_ranks

WORKER = "tests/workers/hierarchical.py"


def assert_every_rank(out: str, ranks: int, hierarchical: bool) -> None:
    for rank in range(ranks):
        assert f"[rank {rank}] hierarchical OK" in out, out
    ran_hierarchical = "hierarchical OK: 0 of" not in out
    assert ran_hierarchical == hierarchical, out


NOT_APPLICABLE = "PERSEUS_HIERARCHICAL_ALLREDUCE=1, but every allreduce runs flat"


@needs_emulation
@pytest.mark.parametrize("controller,layout,setting",
                         [("mpi", "2:2", ""), ("tcp", "2:2", "1"), ("mpi", "2:4", ""),
                          ("tcp", "2:4", "")],
                         ids=["mpi-2x2-auto", "tcp-2x2-setting-1", "mpi-2x4", "tcp-2x4"])
def test_hosts_of_several_ranks_reduce_hierarchically_and_match_numpy(controller, layout, setting,
                                                                      tmp_path):
    """Every op and dtype, 1 to ~1 MiB + 7 elements, scaling, fused groups: equal to numpy; each
    global-set allreduce counted hierarchical and named so on the timeline, its part across
    hosts counted by the cost model's algorithm for its segment; a process set's allreduce (one
    rank per host) ran flat. With 4 ranks a host (8 ranks on this machine's cores), fewer dtypes
    and large tensors."""
    options = ["--emulate-hosts", layout] + (["--tcp"] if controller == "tcp" else [])
    expect = "hierarchical-quick" if layout == "2:4" else "hierarchical"
    out = run_emulated(options, WORKER, expect, tmp_path / "trace", timeout=150,
                       env={"PERSEUS_HIERARCHICAL_ALLREDUCE": setting})
    per_host = int(layout.split(":")[1])
    assert_every_rank(out, 2 * per_host, hierarchical=True)
    # The layout the launcher gave: each rank's host and its place on it.
    assert out.count(f"local_size={per_host} cross_size=2") == 2 * per_host, out
    assert NOT_APPLICABLE not in out, out


@needs_emulation
@pytest.mark.parametrize("controller", ["tcp", "mpi"])
def test_a_torus_across_four_hosts_of_two_ranks_matches_numpy(controller, tmp_path):
    """PERSEUS_ALLREDUCE_ALGORITHM=torus: across 4 hosts, rows of 2 and columns of 2. Odd sizes
    (the phases one after another) and tensors from 4 MiB (over TCP pipelined: the torus's
    three phases across hosts are stages of their own beside the host's) equal to numpy and
    alike on every rank; every part across hosts counted as the torus."""
    options = ["--emulate-hosts", "4:2"] + (["--tcp"] if controller == "tcp" else [])
    out = run_emulated(options, WORKER, "torus", timeout=240,
                       env={"PERSEUS_ALLREDUCE_ALGORITHM": "torus"})
    assert_every_rank(out, 8, hierarchical=True)
    assert out.count("local_size=2 cross_size=4") == 8, out


@needs_emulation
def test_phases_overlap_on_the_torus_where_a_slice_alone_takes_another_algorithm(tmp_path):
    """Over TCP, 4 hosts of 2 ranks, a step latency of 0.4 ms and 80 Gbit/s links: a default
    slice's segment would take recursive doubling across the hosts, which the pipeline cannot
    run; the cost model overlaps the phases on the torus instead, on 2 slices where the default
    cuts 2, 4 and 6 (docs/design.md): less than the phases in turn with a streamed ring across
    the hosts. Tensors of 4-12 MiB equal to numpy and alike on every rank, each counted
    pipelined and its part across hosts the torus."""
    out = run_emulated(["--emulate-hosts", "4:2", "--tcp"], WORKER, "planned", timeout=240,
                       env={"PERSEUS_ALLREDUCE_HOP_LATENCY_US": "400",
                            "PERSEUS_ALLREDUCE_LINK_GBIT": "80"})
    assert_every_rank(out, 8, hierarchical=True)
    assert out.count("planned: 3 overlapped on the torus") == 8, out


@needs_emulation
@pytest.mark.parametrize("controller,layout,setting", [("mpi", "2:2", "0"), ("tcp", "2:1", "1")],
                         ids=["mpi-setting-0", "tcp-1-rank-per-host"])
def test_flat_when_turned_off_or_one_rank_per_host(controller, layout, setting, tmp_path):
    """Counted flat and named so on the timeline; asked for (1) where it cannot run, rank 0
    says why."""
    options = ["--emulate-hosts", layout] + (["--tcp"] if controller == "tcp" else [])
    out = run_emulated(options, WORKER, "flat", tmp_path / "trace", timeout=150,
                       env={"PERSEUS_HIERARCHICAL_ALLREDUCE": setting})
    assert_every_rank(out, 4 if layout == "2:2" else 2, hierarchical=False)
    assert (f"[rank 0]: {NOT_APPLICABLE}" in out) == (setting == "1"), out


def test_ranks_disagreeing_on_the_setting_fail_init_naming_them():
    """Over TCP, where a rank that left early would fail the others with a lost peer instead."""
    out = run_ranks(3, WORKER, "mismatch", controller="tcp", timeout=120).stdout
    for rank in range(3):
        assert f"[rank {rank}] init refused" in out, out
    assert "rank 0 has 1, rank 1 has 0" in out, out


def test_a_value_other_than_auto_0_1_fails_init_quoting_it():
    out = run_ranks(1, WORKER, "bad-value", timeout=60).stdout
    assert "[rank 0] init refused" in out, out
