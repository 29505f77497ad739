"""A model of one training step on H hosts x G ranks, fitted on the zero-delay rows of
benchmarks/scaling.py, checked against every other measured row (more hosts, added link delay,
the MPI transport, several ranks a host, the flat ring), then projected to 16-512 hosts on
25 Gbit/s links.

    python benchmarks/scaling_projection.py [--measured a.jsonl,b.jsonl] [--json projection.jsonl]

The step (bench_common/scaling_model.py's profile of the model):
- forward, then backward layer by layer; each gradient exists when its layer's backward ends;
- the runtime's background thread runs rounds one after another: a round starts once the
  previous collective has ended and a gradient is ready, and takes every gradient ready by then
  (fused: the whole step fits the 64 MiB threshold; the runtime's tensors that run alone, from
  256 KiB on a fast network, are left out, and on a wide one there are none of them);
- a round negotiates (a gather to rank 0 and its answer: two messages between hosts, `hop_ms`
  each, plus `tensor_us` per tensor: benchmarks/allreduce.py's 100 x 16 KiB row against one
  fused tensor), then allreduces the fused bytes:
  - one rank a host: across the H hosts with the algorithm the runtime picks (its own cost
    model, `_core.allreduce_cost`, with the run's PERSEUS_ALLREDUCE_* settings; below 1 MiB
    the MPI transport runs Open MPI's allreduce, counted as recursive doubling, unless that step
    latency is 1 ms or more), costed by the
    same alpha-beta formula with the fitted hop as alpha and the fitted share of the link rate;
  - G ranks a host: the hierarchical allreduce, a reduce-scatter and an allgather among the
    host's ranks and between them each local rank's allreduce of its 1/G segment across the
    hosts at once, the G of them sharing the host's link; costed by the runtime's own model of
    it (`_core.hierarchical_cost`: the host's phases at its step latency and rate, the part
    across hosts as above), on the TCP transport by the plan its runtime picks (the phases
    overlapped on slices, each stage as long as its slowest lane, where the model says that
    pays), on MPI one phase after another;
- a round's tensors of at most PERSEUS_CARRIED_ALLREDUCE_BYTES, taken in order while their
  bytes fit in it, travel with the negotiation (docs/design.md, carried allreduces) and cost
  nothing more; a round with nothing else in it has no allreduce;
- every message between hosts also waits the run's added link delay (`link_delay_ms`, one way);
- the step ends when backward and the last collective have ended, then every rank agrees on
  whether a hook stopped or raised (perseus_legacy.tf1.stopping: one more round, an allreduce
  of 24 bytes a rank, carried when it fits), plus what the same system's one-host step
  measured beyond the profile's compute (the waits' own cost, the optimizer).

Two constants are fitted, to the `run_config_tcp` rows with one rank a host, no added delay
and at most half of the machine's cores busy (the transport whose CPU stays lowest, and only
where it does, so that the rows measure the links and the runtime rather than the machine;
the model has no CPU in it): the share of the link rate a transfer reaches
and the latency of one message between hosts. Every other row is a prediction: the delayed
rows add the delay to the hop and nothing else. The projection keeps the constants, takes the
real bytes on 25 Gbit/s links, H servers x G ranks with the runtime's default policy told the
real link (PERSEUS_ALLREDUCE_LINK_GBIT=25), optionally fp16 gradients on the wire, and gives the
efficiency beside Horovod's published 90% (Inception V3, ResNet-101) and 68% (VGG-16) on 128
servers x 4 GPUs.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from bench_common import scaling_model  # benchmarks/: this script's directory

HERE = Path(__file__).resolve().parent

REFERENCE = HERE / "scaling_reference.jsonl"
CALIBRATION_SYSTEM = "run_config_tcp"
# Rows whose ranks kept more of the machine's cores busy measure the machine as much as the
# links and the runtime (the model has no CPU in it): they are checked, not fitted.
MAX_CALIBRATION_CPU = 0.5
# The rows the model is about: this product's runtime (other systems run other allreduces).
PRODUCT_SYSTEMS = {"run_config_mpi", "run_config_tcp", "run_config_tcp_ring", "sync_hook_mpi",
                   "dist_opt_mpi"}
TENSOR_US = 2.0  # per tensor and round: allreduce.py, 100 x 16 KiB as ops against one tensor
# A negotiation's message between two ranks of one host (the runtime's kLocalHopSecs).
LOCAL_HOP_MS = 0.05
# Below these, MPI runs Open MPI's own allreduce (mpi_controller.h): flat, and a hierarchical
# allreduce's slice across hosts.
MPI_RING_MIN_BYTES = 1 << 20
MPI_CROSS_RING_MIN_BYTES = 64 << 10
# ... unless the cost model's step latency is this or more (mpi_controller.h, kWideHopSecs).
MPI_WIDE_HOP_US = 1000.0
PROJECTED_HOSTS = (16, 32, 64, 128, 256, 512)
REAL_LINK = "25gbit"
# The stop agreement after each step (perseus_legacy.tf1.gate): a [ranks, 3] int64 table.
AGREEMENT_BYTES_PER_RANK = 24
HOROVOD_PUBLISHED = {"inception3": 0.90, "resnet101": 0.90, "vgg16": 0.68}  # 128 x 4 GPUs
# The runtime's defaults (docs/settings.md): PERSEUS_ALLREDUCE_HOP_LATENCY_US and _LINK_GBIT.
DEFAULT_POLICY_HOP_US = 50.0
DEFAULT_POLICY_GBIT = 1.0
# PERSEUS_CARRIED_ALLREDUCE_BYTES's default; rows measured before it existed carried nothing.
DEFAULT_CARRIED_BYTES = 1024


@dataclass(frozen=True)
class Constants:
    efficiency: float  # share of the link rate a transfer reaches
    hop_ms: float  # latency of one message between two hosts, with no added delay
    tensor_us: float = TENSOR_US
    coordinator_us: float = 0.0  # rank 0's cost per other rank and round (not fitted)


@dataclass(frozen=True)
class Cluster:
    """What one run (or a projected cluster) is: its layout, links and runtime settings."""

    hosts: int
    ranks_per_host: int
    link_bytes_s: float
    byte_scale: float = 1.0  # the emulation's gradient bytes per real byte
    delay_ms: float = 0.0  # added to every message between hosts, one way
    transport: str = "tcp"  # tcp or mpi
    algorithm: str = "auto"  # PERSEUS_ALLREDUCE_ALGORITHM
    policy_hop_us: float = DEFAULT_POLICY_HOP_US  # the runtime's cost model: what it picks by
    policy_gbit: float = DEFAULT_POLICY_GBIT
    wire_bytes: float = 1.0  # bytes on the wire per gradient byte: 0.5 with fp16 compression
    stop_agreement: bool = True  # the round after each step (runs before 28 November had none)
    carried_bytes: int = DEFAULT_CARRIED_BYTES  # PERSEUS_CARRIED_ALLREDUCE_BYTES


def _core():
    from perseus_legacy import _core as core  # no init(): the cost model is a pure function

    return core


def chosen_algorithm(cluster: Cluster, ranks: int, nbytes: float) -> str:
    """The algorithm the runtime picks for an allreduce of `nbytes` across `ranks` hosts."""
    ring_min = MPI_CROSS_RING_MIN_BYTES if cluster.ranks_per_host > 1 else MPI_RING_MIN_BYTES
    if cluster.transport == "mpi" and cluster.algorithm == "auto" and nbytes < ring_min \
            and cluster.policy_hop_us < MPI_WIDE_HOP_US:
        return "recursive_doubling"  # Open MPI's own allreduce for small messages
    return _core().allreduce_cost(ranks, nbytes, cluster.policy_hop_us, cluster.policy_gbit,
                                  cluster.algorithm)[0]


def fitted_gbit(cluster: Cluster, constants: Constants) -> float:
    """The rate a transfer between hosts reaches: the fitted share of the link."""
    return 8e-9 * constants.efficiency * cluster.link_bytes_s


def allreduce_ms(cluster: Cluster, constants: Constants, nbytes: float) -> tuple[str, float]:
    """(what ran, ms) of one allreduce of `nbytes` on `cluster`. One rank a host: across the
    hosts by the algorithm the runtime picks. Several: the hierarchical allreduce (the host's
    phases at the runtime's model of them), the TCP transport's plan for it (its phases
    overlapped on slices where its model says so), the MPI transport's phases one after
    another."""
    core = _core()
    hosts, local = cluster.hosts, cluster.ranks_per_host
    hop_us = 1e3 * (constants.hop_ms + cluster.delay_ms)
    if local == 1:
        chosen = chosen_algorithm(cluster, hosts, nbytes)
        _, secs = core.allreduce_cost(hosts, nbytes, hop_us, fitted_gbit(cluster, constants),
                                      chosen)
        return chosen, 1e3 * secs
    if cluster.transport == "tcp" or hosts == 1:
        slices, across, _ = core.hierarchical_cost(local, hosts, nbytes, cluster.policy_hop_us,
                                                   cluster.policy_gbit, cluster.algorithm)
    else:
        slices, across = 0, chosen_algorithm(cluster, hosts, nbytes / local)
    _, _, secs = core.hierarchical_cost(local, hosts, nbytes, hop_us,
                                        fitted_gbit(cluster, constants), across, slices)
    if hosts == 1:
        return "local", 1e3 * secs
    return (f"{across} on {slices} slices" if slices else across), 1e3 * secs


def carried_split(cluster: Cluster, sizes: list) -> float:
    """The bytes of a round's tensors (`sizes`, in order) left to its allreduce once those
    that fit the carried budget travel with its negotiation."""
    budget, rest = cluster.carried_bytes, 0.0
    for size in sizes:
        if size <= budget:
            budget -= size
        else:
            rest += size
    return rest


def round_ms(cluster: Cluster, constants: Constants, fused_bytes: float, tensors: int) -> float:
    """One round: its negotiation and the allreduce of the tensors it fused (none: every
    tensor of the round was carried)."""
    nbytes = fused_bytes * cluster.wire_bytes
    hosts, local = cluster.hosts, cluster.ranks_per_host
    hop = constants.hop_ms + cluster.delay_ms if hosts > 1 else LOCAL_HOP_MS
    negotiation = 2 * hop + (tensors * constants.tensor_us
                             + (hosts * local - 1) * constants.coordinator_us) / 1e3
    if nbytes <= 0:
        return negotiation
    return negotiation + allreduce_ms(cluster, constants, nbytes)[1]


def step_ms(profile: scaling_model.Profile, cluster: Cluster, constants: Constants,
            one_host_extra_ms: float = 0.0) -> float:
    """The modelled step (module docstring)."""
    compute = profile.forward_ms + profile.backward_ms
    if cluster.hosts * cluster.ranks_per_host == 1:
        return compute + one_host_extra_ms
    ready = profile.backward_ready_ms(cluster.byte_scale)
    free, index = 0.0, 0
    while index < len(ready):
        start = max(free, ready[index][0])
        group = index
        while group < len(ready) and ready[group][0] <= start:
            group += 1
        fused = carried_split(cluster, [size for _, size in ready[index:group]])
        free = start + round_ms(cluster, constants, fused, group - index)
        index = group
    return profile.forward_ms + max(profile.backward_ms, free) + agreement_ms(cluster, constants) \
        + one_host_extra_ms


def agreement_ms(cluster: Cluster, constants: Constants) -> float:
    """The stop agreement after a step: one round of one small table, not compressed."""
    if not cluster.stop_agreement:
        return 0.0
    ranks = cluster.hosts * cluster.ranks_per_host
    table = AGREEMENT_BYTES_PER_RANK * ranks
    return round_ms(replace(cluster, wire_bytes=1.0), constants,
                    carried_split(cluster, [table]), 1)


@functools.cache
def profile_of(model: str, step_scale: float = 1.0) -> scaling_model.Profile:
    return scaling_model.load_profile(model, step_scale=step_scale)


def row_profile(row: dict) -> scaling_model.Profile:
    """The profile a measured row ran (its compute scaled as the run scaled it: --dilate)."""
    return profile_of(row["model"], row.get("step_scale", 1.0))


def load_rows(*paths: Path) -> list:
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines()
            if line.strip()]


def measured_step_ms(row: dict, profile) -> float:
    return 1e3 * row["hosts"] * row["ranks_per_host"] * profile.batch / row["examples_per_s"]


def policy_hop_us(row: dict) -> float:
    """The cost model's step latency the row ran with: its PERSEUS_ALLREDUCE_HOP_LATENCY_US, or,
    measured (`auto`), the added delay over the default."""
    setting = row.get("allreduce_hop_latency_us") or DEFAULT_POLICY_HOP_US
    if setting == "auto":
        return DEFAULT_POLICY_HOP_US + 1e3 * (row.get("link_delay_ms") or 0.0)
    return float(setting)


def cluster_of(row: dict, link_bytes_s: float, byte_scale: float) -> Cluster:
    """The cluster a measured row ran on (its own link and settings where it records them)."""
    from perseusrun import emulate

    if row.get("link_rate"):
        link_bytes_s = emulate.rate_bytes_per_second(row["link_rate"])
    return Cluster(row["hosts"], row["ranks_per_host"], link_bytes_s,
                   byte_scale=row.get("byte_scale", byte_scale),
                   delay_ms=row.get("link_delay_ms") or 0.0,
                   transport="tcp" if row["system"].endswith(("_tcp", "_ring")) else "mpi",
                   algorithm=row.get("allreduce_algorithm") or "auto",
                   stop_agreement=row.get("stop_agreement", True),
                   carried_bytes=row.get("carried_allreduce_bytes", 0),
                   policy_hop_us=policy_hop_us(row),
                   policy_gbit=row.get("allreduce_link_gbit", DEFAULT_POLICY_GBIT))


def one_host_extra(rows: list, row: dict, profile) -> float | None:
    """What the same system's one-host step of the same run measured beyond the compute (the
    one-host row with the same delay setting, else any of the system's one-host rows; always
    one whose compute was scaled as this row's was: --dilate)."""
    ones = [r for r in rows if (r["model"], r["system"], r["hosts"], r["ranks_per_host"],
                                r.get("step_scale", 1.0))
            == (row["model"], row["system"], 1, 1, row.get("step_scale", 1.0))]
    same = [r for r in ones if r.get("link_delay_ms") == row.get("link_delay_ms")]
    for one in same or ones:
        return measured_step_ms(one, profile) - profile.forward_ms - profile.backward_ms
    return None


def is_calibration(row: dict, max_hosts: int | None = None) -> bool:
    return (row["system"] == CALIBRATION_SYSTEM and row["ranks_per_host"] == 1
            and not row.get("link_delay_ms")
            and (row.get("cpu_busy") or 0.0) <= MAX_CALIBRATION_CPU
            and (max_hosts is None or row["hosts"] <= max_hosts))


def predictions(rows: list, constants: Constants, byte_scale: float, link_bytes_s: float,
                systems: set | None = None, calibration_only: bool = False) -> list:
    """(row, predicted step ms, measured step ms) of every measured row of this product's
    with 2 ranks or more."""
    out = []
    for row in rows:
        if row["hosts"] * row["ranks_per_host"] < 2 or row.get("efficiency") is None \
                or row["system"] not in PRODUCT_SYSTEMS:
            continue
        if systems is not None and row["system"] not in systems:
            continue
        if calibration_only and not is_calibration(row):
            continue
        profile = row_profile(row)
        extra = one_host_extra(rows, row, profile)
        if extra is None:
            continue
        predicted = step_ms(profile, cluster_of(row, link_bytes_s, byte_scale), constants, extra)
        out.append((row, predicted, measured_step_ms(row, profile)))
    return out


def fit(rows: list, byte_scale: float, link_bytes_s: float,
        max_hosts: int | None = None) -> Constants:
    """The constants whose largest relative error over the calibration rows is least: a coarse
    grid (link share 0.70-1.00 by 0.05, hop 0-2 ms by 0.05 ms), then a fine one (0.01) around
    the best point of the coarse one."""
    calibration = [r for r in rows if is_calibration(r, max_hosts) or r["hosts"] == 1]

    def worst_error(constants: Constants) -> float:
        checks = predictions(calibration, constants, byte_scale, link_bytes_s,
                             calibration_only=True)
        if not checks:
            raise ValueError(f"no {CALIBRATION_SYSTEM} rows without added delay on 1 and 2+ "
                             f"hosts, at most {MAX_CALIBRATION_CPU:.0%} of the cores busy, to "
                             "calibrate with")
        return max(abs(p - m) / m for _, p, m in checks)

    def best_of(efficiencies, hops) -> Constants:
        grid = [Constants(round(e, 4), round(h, 4)) for e in efficiencies for h in hops
                if 0 < e <= 1 and h >= 0]
        return min(grid, key=worst_error)

    coarse = best_of([0.70 + 0.05 * i for i in range(7)], [0.05 * i for i in range(41)])
    return best_of([coarse.efficiency + 0.01 * i for i in range(-5, 6)],
                   [coarse.hop_ms + 0.01 * i for i in range(-5, 6)])


def project(constants: Constants, models: list, real_link_bytes_s: float,
            hop_ms: float | None = None, ranks_per_host: int = 1,
            hosts_list: tuple = PROJECTED_HOSTS, wire_bytes: float = 1.0) -> list:
    """Efficiency of each model on `hosts_list` servers x `ranks_per_host` at the real link rate
    and real bytes, the runtime's cost model told that link and that message latency (as
    PERSEUS_ALLREDUCE_LINK_GBIT and PERSEUS_ALLREDUCE_HOP_LATENCY_US, or `auto`, would on such a
    network); the one-rank step is the profile's compute (the emulation's own overhead left
    out)."""
    constants = replace(constants, hop_ms=constants.hop_ms if hop_ms is None else hop_ms)
    gbit = 8e-9 * real_link_bytes_s
    out = []
    for model in models:
        profile = profile_of(model)
        one = step_ms(profile, Cluster(1, 1, real_link_bytes_s), constants)
        for hosts in hosts_list:
            cluster = Cluster(hosts, ranks_per_host, real_link_bytes_s, policy_gbit=gbit,
                              policy_hop_us=1e3 * constants.hop_ms, wire_bytes=wire_bytes)
            step = step_ms(profile, cluster, constants)
            out.append({"model": model, "hosts": hosts, "ranks_per_host": ranks_per_host,
                        "ranks": hosts * ranks_per_host, "step_ms": step,
                        "efficiency": one / step, "hop_ms": constants.hop_ms,
                        "wire_bytes": wire_bytes,
                        "horovod_published": HOROVOD_PUBLISHED.get(model)})
    return out


def print_checks(rows: list, constants: Constants, byte_scale: float, link: float,
                 max_hosts: int | None = None) -> None:
    print("| model | system | hosts x ranks | delay (ms) | algorithm for a step's bytes | "
          "measured ms/step | model "
          "ms/step | error | measured efficiency | model efficiency | cores busy |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    checks = predictions(rows, constants, byte_scale, link)
    key = {id(r): i for i, r in enumerate(rows)}
    checks.sort(key=lambda c: (c[0]["model"], c[0].get("link_delay_ms") or 0,
                               c[0]["hosts"] * c[0]["ranks_per_host"], key[id(c[0])]))
    for row, predicted, measured in checks:
        profile = row_profile(row)
        one = measured_step_ms(row, profile) * row["efficiency"]  # the one-rank step
        busy = f"{row['cpu_busy']:.0%}" if row.get("cpu_busy") is not None else ""
        cluster = cluster_of(row, link, byte_scale)
        fused = 4 * sum(profile.tensor_elements(cluster.byte_scale))
        chosen = allreduce_ms(cluster, constants, fused)[0]
        marker = " (fit)" if is_calibration(row, max_hosts) else ""
        print(f"| {row['model']} | {row['system']}{marker} | {row['hosts']}x"
              f"{row['ranks_per_host']} | {row.get('link_delay_ms') or 0:g} | {chosen} | "
              f"{measured:.0f} | {predicted:.0f} | {(predicted - measured) / measured:+.1%} | "
              f"{row['efficiency']:.0%} | {one / predicted:.0%} | {busy} |")


def main() -> None:
    from perseusrun import emulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default=str(REFERENCE),
                        help="comma-separated scaling.py --json files, fitted and checked as "
                        "one set (default: the quiet run of docs/scaling.md)")
    parser.add_argument("--link-rate", default="1gbit", help="of the measured runs")
    parser.add_argument("--real-link-rate", default=REAL_LINK)
    parser.add_argument("--real-hop-ms", type=float, default=0.05,
                        help="a message's latency between two hosts of the real cluster")
    parser.add_argument("--coordinator-us", type=float, default=0.0,
                        help="rank 0's cost per other rank in each negotiation round (the "
                        "gather and the answer go through it), for the projection only")
    parser.add_argument("--fit-max-hosts", type=int,
                        help="fit on the calibration rows of at most this many hosts only (the "
                        "others are checked)")
    parser.add_argument("--json", help="write the projection's rows here, one JSON object each")
    args = parser.parse_args()
    link = emulate.rate_bytes_per_second(args.link_rate)
    real = emulate.rate_bytes_per_second(args.real_link_rate)
    paths = [Path(p) for p in args.measured.split(",")]
    rows = [r for r in load_rows(*paths) if "failed" not in r]
    constants = fit(rows, link / real, link, args.fit_max_hosts)
    print(f"\nFitted on the {CALIBRATION_SYSTEM} rows without added delay, at most "
          f"{MAX_CALIBRATION_CPU:.0%} of the cores busy, of "
          f"{', '.join(p.name for p in paths)}: transfers reach {constants.efficiency:.0%} of "
          f"{args.link_rate}, {constants.hop_ms:.2f} ms a message between hosts, "
          f"{constants.tensor_us:g} us a tensor\n")
    print_checks(rows, constants, link / real, link, args.fit_max_hosts)
    constants = replace(constants, coordinator_us=args.coordinator_us)
    models = list(scaling_model.MODELS)
    projected = []
    for hop_ms in (constants.hop_ms, args.real_hop_ms):
        print(f"\nProjected efficiency, {args.real_link_rate} links, real gradient bytes, "
              f"{hop_ms:g} ms a message between hosts, {args.coordinator_us:g} us a rank at "
              "the coordinator\n")
        print("| model | ranks a host | wire | " + " | ".join(f"{h} hosts" for h in
                                                          PROJECTED_HOSTS)
              + " | Horovod published (128 x 4) |")
        print("|---|---:|---|" + "---:|" * (len(PROJECTED_HOSTS) + 1))
        for ranks_per_host, wire in ((1, 1.0), (4, 1.0), (4, 0.5)):
            rows_out = project(constants, models, real, hop_ms, ranks_per_host,
                               wire_bytes=wire)
            for model in models:
                cells = [f"{p['efficiency']:.0%}" for p in rows_out if p["model"] == model]
                published = HOROVOD_PUBLISHED.get(model)
                print(f"| {model} | {ranks_per_host} | {'fp16' if wire < 1 else 'fp32'} | "
                      + " | ".join(cells) + " | " + (f"{published:.0%}" if published else "")
                      + " |")
            projected += rows_out
    if args.json:
        with open(args.json, "w") as out:
            for row in projected:
                out.write(json.dumps({**row, "link_rate": args.real_link_rate,
                                      "link_efficiency": constants.efficiency}) + "\n")


if __name__ == "__main__":
    main()
