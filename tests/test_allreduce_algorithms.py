"""The flat allreduce algorithms (ring, halving-doubling, recursive doubling, torus:
docs/design.md "Transports") on real ranks against numpy and bit for bit alike on every rank
(tests/workers/allreduce_algorithms.py): over TCP every group size from 2 to 16 (the cost model's
choice) and from 2 to 12 for the torus, over MPI every group size from 2 to 6 for
halving-doubling and the torus and 2 to 4 for recursive doubling (each algorithm named by
PERSEUS_ALLREDUCE_ALGORITHM, since under auto Open MPI's own allreduce runs small tensors; these
cover powers of two, groups folding one and two extra ranks, tori of one column (primes) and of
2 x 2 to 3 x 4, and keep the launches cheap: 16 MPI ranks on 2 cores take minutes). The
schedules are the same code on both transports (allreduce_algorithms.cc); the torus's rings are
each transport's own, over the same segments. Which algorithm ran is read from runtime_stats()
and checked against the cost model as docs/design.md states it."""

from __future__ import annotations

import math
import re

import pytest
from harness import needs_emulation, run_emulated, run_ranks

HOP_LATENCY_US = 5.0  # moves the cut-overs down to the worker's small tensors
LINK_GBIT = 1.0
REDUCE_SECS_PER_BYTE = 0.5e-9
HALVING_DOUBLING_BYTE_COST = 1.3  # its bytes move at 1 / 1.3 of the ring's rate
TORUS_BYTE_COST = 1.1
TORUS_WIDE_BYTE_COST = 1.5  # from a step latency of 1 ms (a wide network)
RING_REDUCE_CHUNK_BYTES = 256 << 10  # a ring's pieces: combined, then forwarded
RING_FORWARD_BYTES = 64 << 10  # forwarded as they arrive (the allgather)

LAUNCHES = {  # name: controller, PERSEUS_ALLREDUCE_ALGORITHM, ranks
    "tcp-auto": ("tcp", "auto", 16),
    "mpi-halving_doubling": ("mpi", "halving_doubling", 6),
    "mpi-recursive_doubling": ("mpi", "recursive_doubling", 4),
    "tcp-torus": ("tcp", "torus", 12),
    "mpi-torus": ("mpi", "torus", 6),
}


def torus_shape(ranks: int) -> tuple:
    """(x, y): rows of x positions, x the largest divisor with x * x <= ranks."""
    x = max(d for d in range(1, int(math.isqrt(ranks)) + 1) if ranks % d == 0)
    return x, ranks // x


def modelled_costs(ranks: int, nbytes: int, hop_us: float = HOP_LATENCY_US,
                   gbit: float = LINK_GBIT) -> dict:
    """Seconds of each algorithm by the alpha-beta model of docs/design.md."""
    alpha, beta, gamma = hop_us * 1e-6, 8 / (gbit * 1e9), REDUCE_SECS_PER_BYTE
    p = 2 ** int(math.log2(ranks))
    steps = int(math.log2(p))
    fold = 0.0 if p == ranks else 2 * alpha + 2 * nbytes * beta + nbytes * gamma
    n = ranks
    torus_cost = TORUS_WIDE_BYTE_COST if hop_us >= 1000 else TORUS_BYTE_COST
    segment = nbytes / n

    def ring_step(piece):
        """A streamed step: it starts once the previous step's first piece has arrived, and
        its link is busy with its segment's bytes."""
        return max(segment * beta, alpha + min(segment, piece) * beta)

    costs = {
        "ring": (n - 1) * ring_step(RING_REDUCE_CHUNK_BYTES)
        + (n - 2) * ring_step(RING_FORWARD_BYTES) + alpha + segment * beta
        + (n - 1) / n * nbytes * gamma,
        "halving_doubling": fold + 2 * steps * alpha
        + (p - 1) / p * nbytes * (2 * beta * HALVING_DOUBLING_BYTE_COST + gamma),
        "recursive_doubling": fold + steps * (alpha + nbytes * (beta + gamma)),
        "torus": 2 * (sum(torus_shape(n)) - 2) * alpha
        + (n - 1) / n * nbytes * (2 * beta * torus_cost + gamma),
    }
    return costs


def modelled_choice(ranks: int, nbytes: int, hop_us: float = HOP_LATENCY_US,
                    gbit: float = LINK_GBIT) -> str:
    """The cheapest algorithm by that model (ties: the ring first)."""
    costs = modelled_costs(ranks, nbytes, hop_us, gbit)
    best = "ring"
    for name in ("halving_doubling", "recursive_doubling", "torus"):
        if costs[name] < costs[best]:
            best = name
    return best


@pytest.fixture(scope="module", params=list(LAUNCHES))
def launch(request):
    controller, algorithm, ranks = LAUNCHES[request.param]
    env = {"PERSEUS_ALLREDUCE_ALGORITHM": algorithm,
           "PERSEUS_ALLREDUCE_HOP_LATENCY_US": str(HOP_LATENCY_US),
           "PERSEUS_ALLREDUCE_LINK_GBIT": str(LINK_GBIT)}
    out = run_ranks(ranks, "tests/workers/allreduce_algorithms.py", timeout=300, env=env,
                    controller=controller).stdout
    ran = [(int(n), int(nbytes), name)
           for n, nbytes, name in re.findall(r"^RAN (\d+) (\d+) (\w+)$", out, re.M)]
    return algorithm, ranks, out, ran


def test_every_group_size_matches_numpy_bit_for_bit_on_every_rank(launch):
    _, ranks, out, ran = launch
    for rank in range(ranks):
        assert f"[rank {rank}] allreduce algorithms OK" in out, out
    assert {n for n, _, _ in ran} == set(range(2, ranks + 1)), out


def test_the_algorithm_that_ran_is_the_setting_or_the_cost_models_choice(launch):
    algorithm, _, out, ran = launch
    for n, nbytes, name in ran:
        expected = modelled_choice(n, nbytes) if algorithm == "auto" else algorithm
        assert name == expected, f"{n} ranks, {nbytes} bytes: ran {name}, expected {expected}"
    if algorithm == "auto":  # the worker's sizes cross every cut-over of the model
        assert {name for _, _, name in ran} == {"ring", "halving_doubling",
                                                "recursive_doubling", "torus"}, out


def test_the_core_exposes_the_cost_model_the_runtime_picks_by():
    # benchmarks/scaling_projection.py reads the runtime's choice through this function.
    from perseus_legacy import _core

    for ranks in (2, 3, 5, 8, 16, 512):
        for nbytes in (64, 4 << 10, 64 << 10, 1 << 20, 64 << 20):
            for hop_us, gbit in ((5.0, 1.0), (50.0, 25.0), (2000.0, 1.0), (9700.0, 0.25)):
                name, secs = _core.allreduce_cost(ranks, nbytes, hop_us, gbit)
                assert name == modelled_choice(ranks, nbytes, hop_us, gbit), (ranks, nbytes)
                assert secs == pytest.approx(modelled_costs(ranks, nbytes, hop_us, gbit)[name])
                _, ring = _core.allreduce_cost(ranks, nbytes, hop_us, gbit, "ring")
                assert ring == pytest.approx(modelled_costs(ranks, nbytes, hop_us, gbit)["ring"])
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        _core.allreduce_cost(4, 1024, 50.0, 1.0, "tree")
    with pytest.raises(ValueError, match="at least 2"):
        _core.allreduce_cost(1, 1024, 50.0, 1.0)


LOCAL_HOP_SECS = 50e-6  # between two ranks of a host
LOCAL_BYTES_PER_SEC = 2.7e9
OWN_COLLECTIVE_MIN_BYTES = 256 << 10


def own_collective_bytes(ranks: int, hop_us: float, gbit: float, algorithm: str) -> int:
    """A tensor of a fused response runs alone from where copying it in and out of the fusion
    buffer at LOCAL_BYTES_PER_SEC costs more than the start-up of one more allreduce (the
    model's allreduce of no bytes), and from 256 KiB at least."""
    costs = modelled_costs(ranks, 0, hop_us, gbit)
    chosen = modelled_choice(ranks, 0, hop_us, gbit) if algorithm == "auto" else algorithm
    return max(OWN_COLLECTIVE_MIN_BYTES, int(costs[chosen] * LOCAL_BYTES_PER_SEC / 2))


def test_the_size_from_which_a_fused_responses_tensor_runs_alone_follows_the_start_up():
    from perseus_legacy import _core

    for ranks in (2, 3, 6, 8, 16, 512):
        for hop_us in (5.0, 50.0, 1000.0, 9700.0):
            for algorithm in ("auto", "ring", "halving_doubling", "torus"):
                got = _core.own_collective_bytes(ranks, hop_us, 1.0, algorithm)
                want = own_collective_bytes(ranks, hop_us, 1.0, algorithm)
                assert got == pytest.approx(want, abs=1), (ranks, hop_us, algorithm)
    # A fast network keeps large tensors alone; a wide one fuses tens of MiB.
    assert _core.own_collective_bytes(2, 50.0, 1.0) == OWN_COLLECTIVE_MIN_BYTES
    assert _core.own_collective_bytes(16, 9700.0, 0.25) > 32 << 20
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        _core.own_collective_bytes(4, 50.0, 1.0, "tree")


PIPELINE_MIN_BYTES = 4 << 20


def pipeline_slices(nbytes: int) -> int:
    return min(16, max(2, nbytes // (2 << 20)))


def modelled_hierarchical(local: int, hosts: int, nbytes: float, slices: int, across: str,
                          hop_us: float, gbit: float) -> float:
    """Seconds of a hierarchical allreduce by docs/design.md's model: the host's phases one
    after another with the part across hosts (slices 0), or as the stages of the pipeline."""
    def host_half(b):
        return (local - 1) * LOCAL_HOP_SECS + (local - 1) / local * b / LOCAL_BYTES_PER_SEC

    shared = gbit / local  # the host's link, its local ranks' parts across hosts at once
    if slices == 0:
        return 2 * host_half(nbytes) + modelled_costs(hosts, nbytes / local, hop_us,
                                                      shared)[across]
    x, y = torus_shape(hosts) if across == "torus" else (1, hosts)
    depth = 4 if x > 1 else 2
    byte_cost = TORUS_WIDE_BYTE_COST if x > 1 and hop_us >= 1000 else 1.0
    alpha, beta = hop_us * 1e-6, byte_cost * 8 / (shared * 1e9)
    segment = nbytes / slices / local
    total = 0.0
    for stage in range(slices + depth):
        host = sum(host_half(nbytes / slices) for k in (stage, stage - depth) if 0 <= k < slices)
        steps = sent = combined = 0.0  # across hosts: the longest lane's steps, all bytes
        if x > 1:
            row = (x - 1) / x * segment
            row_steps = 0
            if 0 <= stage - 1 < slices:  # the row's reduce-scatter
                row_steps, sent, combined = x - 1, row, row
            if 0 <= stage - 3 < slices:  # and allgather, in the same lane
                row_steps, sent = row_steps + x - 1, sent + row
            steps = row_steps
            if 0 <= stage - 2 < slices:  # the column's allreduce of its part
                column = (y - 1) / y * segment / x
                steps, sent, combined = max(steps, 2 * (y - 1)), sent + 2 * column, \
                    combined + column
        elif 0 <= stage - 1 < slices:
            ring = (hosts - 1) / hosts * segment
            steps, sent, combined = 2 * (hosts - 1), 2 * ring, ring
        cross = steps * alpha + sent * beta + combined * REDUCE_SECS_PER_BYTE
        total += max(host, cross)
    return total


def modelled_plan(local: int, hosts: int, nbytes: int, hop_us: float, gbit: float) -> tuple:
    """(slices, algorithm across hosts) of the TCP transport's hierarchical allreduce."""
    in_turn = (0, modelled_choice(hosts, nbytes // local, hop_us, gbit))
    if nbytes < PIPELINE_MIN_BYTES:
        return in_turn
    slices = pipeline_slices(nbytes)
    sliced = modelled_choice(hosts, nbytes // slices // local, hop_us, gbit)
    if sliced in ("ring", "torus"):
        return slices, sliced
    plans = [in_turn] + [(s, "torus") for s in (2, 4, 8, 16)]
    return min(plans, key=lambda plan: modelled_hierarchical(local, hosts, nbytes, *plan,
                                                             hop_us, gbit))


def test_the_core_exposes_the_hierarchical_plan_the_tcp_runtime_picks():
    # The phases overlap where a slice's segment takes the ring or the torus; where it takes
    # halving-doubling or recursive doubling they overlap on the torus, on fewer slices, if the
    # model says that pays (at 128 hosts x 4 on 25 Gbit/s for tens of MiB).
    from perseus_legacy import _core

    seen = set()
    for local, hosts in ((2, 2), (2, 4), (4, 4), (2, 8), (4, 128), (4, 512)):
        for nbytes in (1 << 20, 4 << 20, 9 << 20, 32 << 20, 64 << 20):
            for hop_us, gbit in ((50.0, 1.0), (50.0, 25.0), (1000.0, 10.0), (200.0, 100.0)):
                slices, across, secs = _core.hierarchical_cost(local, hosts, nbytes, hop_us, gbit)
                plan = modelled_plan(local, hosts, nbytes, hop_us, gbit)
                assert (slices, across) == plan, (local, hosts, nbytes, hop_us, gbit)
                assert secs == pytest.approx(modelled_hierarchical(
                    local, hosts, nbytes, *plan, hop_us, gbit)), (local, hosts, nbytes)
                seen.add((slices > 0, across, slices == pipeline_slices(nbytes)))
    # every kind of plan came up: in turn, overlapped on the default slices, on fewer
    assert {(False, "halving_doubling", False), (True, "ring", True),
            (True, "torus", True), (True, "torus", False)} <= seen, seen
    assert _core.hierarchical_cost(4, 128, 32 << 20, 50.0, 25.0)[:2] == (4, "torus")
    with pytest.raises(ValueError, match="needs its algorithm"):
        _core.hierarchical_cost(2, 4, 1 << 22, 50.0, 1.0, "auto", 4)


@needs_emulation
@pytest.mark.parametrize("controller", ["tcp", "mpi"])
def test_an_auto_step_latency_is_measured_at_init_and_moves_the_choice(controller):
    # 8 emulated hosts, 10 ms added to every frame: a step between two hosts costs at least
    # 10 ms, and not much more (a barrier's time over its messages one after another: over MPI 3
    # rounds, over TCP 2 messages; counting MPI's as 2 would give 15 ms; the margin is for the
    # wake-ups of 8 ranks on a loaded machine). At the default 50 us the ring is the model's
    # choice for 256 KiB; at 10 ms recursive doubling (3 steps of the whole tensor instead of 14
    # of eighths) is. Over MPI a tensor below 1 MiB runs Open MPI's own allreduce unless the step
    # latency is 1 ms or more, as here.
    delay_ms, nbytes, hosts = 10.0, 256 << 10, 8
    out = run_emulated(["--emulate-hosts", str(hosts), "--link-delay", str(delay_ms),
                        *(["--tcp"] if controller == "tcp" else [])],
                       "tests/workers/hop_latency.py", timeout=180,
                       env={"PERSEUS_ALLREDUCE_HOP_LATENCY_US": "auto"})
    found = re.findall(r"^\[rank (\d+)\] HOP (\d+) RAN (\w+)$", out, re.M)
    hops = {int(rank): int(ns) for rank, ns, _ in found}
    assert sorted(hops) == list(range(hosts)), out
    assert len(set(hops.values())) == 1, hops  # rank 0's measurement, on every rank
    hop_us = hops[0] / 1e3
    assert delay_ms * 1e3 <= hop_us < 1.3 * delay_ms * 1e3, hops
    assert modelled_choice(hosts, nbytes, 50.0) == "ring"
    assert modelled_choice(hosts, nbytes, hop_us) == "recursive_doubling", hop_us
    assert {name for _, _, name in found} == {"recursive_doubling"}, out
