"""A calibrated model of one training step on emulated hosts, checked against what
benchmarks/scaling.py measured on 2-8 hosts and projected to 16-512 hosts on 25 Gbit/s links.

    python benchmarks/scaling_projection.py [--measured scaling.jsonl] [--json projection.jsonl]

The step, on H hosts with one rank each (bench_common/scaling_model.py's profile of the model):
- forward, then backward layer by layer; each gradient exists when its layer's backward ends;
- the runtime's background thread runs rounds one after another: a round starts once the
  previous collective has ended and a gradient is ready, takes every gradient ready by then
  (fused: the whole step fits the 64 MiB threshold), negotiates them (a round trip through rank
  0 over the links, `hop_ms` each way, plus `tensor_us` per tensor: the per-tensor cost of
  benchmarks/allreduce.py's 100 x 16 KiB row against one fused tensor), then allreduces them
  in a ring: 2(H-1) steps of `hop_ms` latency each and 2(H-1)/H of the bytes over the link at
  `efficiency` x the link rate;
- the step ends when backward and the last collective have ended, plus what the same system's
  one-host step measured beyond the profile's compute (the waits' own cost, the optimizer).

`efficiency` and `hop_ms` are fitted to the measured TCP rows on 2-8 hosts (every model in
the file): the transport whose CPU stays well below the machine's 2 cores at every host count,
so that its rows measure the links and the runtime rather than the machine. The table gives
every measured row of 2-8 hosts beside the model's prediction (the MPI rows' ranks poll while
they wait and fill the cores at 8 hosts, which the model leaves out: their error says how much
that costs). The projection keeps the fitted constants, takes the real bytes (no scale) on
25 Gbit/s links, and gives the efficiency of 16-512 hosts for the four models, beside
Horovod's published 90% (Inception V3, ResNet-101) and 68% (VGG-16) on 128 servers x 4 GPUs.
By default it reads benchmarks/scaling_reference.jsonl: the quiet-machine run of
docs/scaling.md.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from bench_common import scaling_model  # benchmarks/: this script's directory

HERE = Path(__file__).resolve().parent

REFERENCE = HERE / "scaling_reference.jsonl"
CALIBRATION_SYSTEM = "run_config_tcp"
TENSOR_US = 2.0  # per tensor and round: allreduce.py, 100 x 16 KiB as ops against one tensor
PROJECTED_HOSTS = (16, 32, 64, 128, 256, 512)
REAL_LINK = "25gbit"
HOROVOD_PUBLISHED = {"inception3": 0.90, "resnet101": 0.90, "vgg16": 0.68}  # 512 GPUs


@dataclass(frozen=True)
class Constants:
    efficiency: float  # share of the link rate a ring's transfers reach
    hop_ms: float  # latency of one message between two hosts (a ring step, half a round)
    tensor_us: float = TENSOR_US


def step_ms(profile: scaling_model.Profile, hosts: int, byte_scale: float, link_bytes_s: float,
            constants: Constants, one_host_extra_ms: float = 0.0) -> float:
    """The modelled step on `hosts` hosts (module docstring)."""
    compute = profile.forward_ms + profile.backward_ms
    if hosts == 1:
        return compute + one_host_extra_ms
    ready = profile.backward_ready_ms(byte_scale)
    share = scaling_model.allreduce_link_share(hosts)
    bytes_ms = 1e3 * share / (constants.efficiency * link_bytes_s)
    ring_latency = 2 * (hosts - 1) * constants.hop_ms
    free, index = 0.0, 0
    while index < len(ready):
        start = max(free, ready[index][0])
        group = index
        while group < len(ready) and ready[group][0] <= start:
            group += 1
        tensors = group - index
        fused_bytes = sum(size for _, size in ready[index:group])
        free = (start + 2 * constants.hop_ms + tensors * constants.tensor_us / 1e3
                + ring_latency + fused_bytes * bytes_ms)
        index = group
    return profile.forward_ms + max(profile.backward_ms, free) + one_host_extra_ms


@functools.cache
def profile_of(model: str) -> scaling_model.Profile:
    return scaling_model.load_profile(model)


def load_rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_host_extra(rows: list, model: str, system: str, profile) -> float | None:
    for row in rows:
        if (row["model"], row["system"], row["hosts"], row["ranks_per_host"]) == \
                (model, system, 1, 1):
            return measured_step_ms(row, profile) - profile.forward_ms - profile.backward_ms
    return None


def measured_step_ms(row: dict, profile) -> float:
    return 1e3 * row["hosts"] * row["ranks_per_host"] * profile.batch / row["examples_per_s"]


def predictions(rows: list, constants: Constants, byte_scale: float, link_bytes_s: float,
                systems: set | None = None) -> list:
    """(row, predicted step ms, measured step ms) of every measured row of 2 hosts or more
    with one rank per host."""
    out = []
    for row in rows:
        if row["hosts"] < 2 or row["ranks_per_host"] != 1:
            continue
        if systems is not None and row["system"] not in systems:
            continue
        profile = profile_of(row["model"])
        extra = one_host_extra(rows, row["model"], row["system"], profile)
        if extra is None:
            continue
        predicted = step_ms(profile, row["hosts"], byte_scale, link_bytes_s, constants, extra)
        out.append((row, predicted, measured_step_ms(row, profile)))
    return out


def fit(rows: list, byte_scale: float, link_bytes_s: float) -> Constants:
    """The constants whose largest relative error over the calibration rows is least: a coarse
    grid (link share 0.70-1.00 by 0.05, hop 0-2 ms by 0.05 ms), then a fine one (0.01) around
    the best point of the coarse one."""

    def worst_error(constants: Constants) -> float:
        checks = predictions(rows, constants, byte_scale, link_bytes_s, {CALIBRATION_SYSTEM})
        if not checks:
            raise ValueError(f"no {CALIBRATION_SYSTEM} rows on 1 and 2+ hosts to calibrate with")
        return max(abs(p - m) / m for _, p, m in checks)

    def best_of(efficiencies, hops) -> Constants:
        grid = [Constants(round(e, 4), round(h, 4)) for e in efficiencies for h in hops
                if 0 < e <= 1 and h >= 0]
        return min(grid, key=worst_error)

    coarse = best_of([0.70 + 0.05 * i for i in range(7)], [0.05 * i for i in range(41)])
    return best_of([coarse.efficiency + 0.01 * i for i in range(-5, 6)],
                   [coarse.hop_ms + 0.01 * i for i in range(-5, 6)])


def project(constants: Constants, models: list, real_link_bytes_s: float) -> list:
    """Efficiency on PROJECTED_HOSTS of each model at the real link rate and real bytes; the
    one-host step is the profile's compute (the emulation's own overhead left out)."""
    out = []
    for model in models:
        profile = profile_of(model)
        one = step_ms(profile, 1, 1.0, real_link_bytes_s, constants)
        for hosts in PROJECTED_HOSTS:
            step = step_ms(profile, hosts, 1.0, real_link_bytes_s, constants)
            out.append({"model": model, "hosts": hosts, "step_ms": step, "efficiency": one / step,
                        "horovod_published": HOROVOD_PUBLISHED.get(model)})
    return out


def main() -> None:
    from perseusrun import emulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default=str(REFERENCE),
                        help="scaling.py --json rows (default: the quiet run of docs/scaling.md)")
    parser.add_argument("--link-rate", default="1gbit", help="of the measured run")
    parser.add_argument("--real-link-rate", default=REAL_LINK)
    parser.add_argument("--real-hop-ms", type=float, default=0.05,
                        help="a message's latency between two hosts of the real cluster")
    parser.add_argument("--json", help="write the projection's rows here, one JSON object each")
    args = parser.parse_args()
    link = emulate.rate_bytes_per_second(args.link_rate)
    real = emulate.rate_bytes_per_second(args.real_link_rate)
    rows = [r for r in load_rows(Path(args.measured)) if "failed" not in r]
    constants = fit(rows, link / real, link)
    print(f"\nFitted on the {CALIBRATION_SYSTEM} rows of {args.measured}: links reach "
          f"{constants.efficiency:.0%} of {args.link_rate}, {constants.hop_ms:.2f} ms a hop, "
          f"{constants.tensor_us:g} us a tensor\n")
    print("| model | system | hosts | measured ms/step | model ms/step | error | measured "
          "efficiency | model efficiency | cores busy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row, predicted, measured in predictions(rows, constants, link / real, link):
        profile = profile_of(row["model"])
        one = measured_step_ms(row, profile) * row["efficiency"] if row.get("efficiency") \
            else None  # the one-host step
        model_eff = f"{one / predicted:.0%}" if one else ""
        busy = f"{row['cpu_busy']:.0%}" if row.get("cpu_busy") is not None else ""
        print(f"| {row['model']} | {row['system']} | {row['hosts']} | {measured:.0f} | "
              f"{predicted:.0f} | {(predicted - measured) / measured:+.1%} | "
              f"{row['efficiency']:.0%} | {model_eff} | {busy} |")
    print(f"\nProjected scaling efficiency: {args.real_link_rate} links, one rank per host, "
          "real gradient bytes; hop: the fitted one (this emulated network: a veth pair and "
          f"tc's queue), and {args.real_hop_ms:g} ms (--real-hop-ms: a data-centre network)\n")
    print("| model | hop (ms) | " + " | ".join(f"{h} hosts" for h in PROJECTED_HOSTS)
          + " | Horovod published (512 GPUs) |")
    print("|---|---:|" + "---:|" * (len(PROJECTED_HOSTS) + 1))
    projected = []
    for hop_ms in (constants.hop_ms, args.real_hop_ms):
        rows_out = project(Constants(constants.efficiency, hop_ms), list(scaling_model.MODELS),
                           real)
        for model in scaling_model.MODELS:
            cells = [f"{p['efficiency']:.0%}" for p in rows_out if p["model"] == model]
            published = HOROVOD_PUBLISHED.get(model)
            print(f"| {model} | {hop_ms:g} | " + " | ".join(cells) + " | "
                  + (f"{published:.0%}" if published else "") + " |")
        projected += [{**row, "hop_ms": hop_ms} for row in rows_out]
    if args.json:
        with open(args.json, "w") as out:
            for row in projected:
                out.write(json.dumps({**row, "link_rate": args.real_link_rate,
                                      "link_efficiency": constants.efficiency}) + "\n")


if __name__ == "__main__":
    main()
