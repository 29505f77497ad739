"""Scaling on emulated GPU hosts: examples/s against hosts, per model, for this product,
Horovod 0.28.1 and parameter servers, in one run, with the efficiency chart.

    python benchmarks/scaling.py [--models resnet101,vgg16] [--hosts 1,2,4,8,4x2]
        [--systems run_config_mpi,...] [--json results.jsonl] [--chart scaling.png]   (as root)

Each launch trains the emulated model of benchmarks/bench_common/scaling_model.py (an
accelerator's time in waits that use no CPU, real gradient tensors of each layer scaled by link
rate / real link rate) on emulated hosts (perseusrun/emulate.py) whose links are capped at
--link-rate, one worker process per emulated GPU, with one system (the rows;
benchmarks/scaling_worker.py runs each). A layout is HOSTS or HOSTSxRANKS_PER_HOST.
docs/scaling.md says what the emulation keeps and leaves out, where the step times come from,
and a measured table.

Columns: examples/s (all ranks), the scaling efficiency (examples/s over ranks x the same
system's examples/s on one host with one rank), the model's bounds in examples/s (compute
alone, and compute plus the communication that cannot hide under backward at the link rate,
for an allreduce), the share of the link time hidden under compute (1 - (step - the system's
one-host step) / link time), and the CPU the trainers used: CPU ms of all ranks per step, and
the share of the machine's cores they kept busy (the rest is idle: a benchmark whose own CPU
grows with the hosts would measure the machine, not the system).

Systems (rows): run_config_mpi, run_config_tcp, sync_hook_mpi, dist_opt_mpi (this product,
TF 2.15.1 by default, --product-tf), alone (every rank trains by itself with a plain RunConfig,
no collectives: the efficiency this machine allows that many ranks sharing its cores),
horovod_mpi, horovod_gloo (Horovod 0.28.1 on TF 2.15.1, `make peers`), ps_async, ps_sync
(tf.estimator parameter servers on TF 2.15.1), mwms (MultiWorkerMirroredStrategy, TF 2.21).
A system whose environment is missing is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_common import emulated, scaling_model  # benchmarks/: this script's directory

HERE = Path(__file__).resolve().parent

WORKER = HERE / "scaling_worker.py"
PEERS_PYTHON = HERE.parent / ".venv-peers" / "bin" / "python"
REAL_LINK = "25gbit"  # the link of Horovod's published 128 x 4 Pascal GPU runs (RoCE)
DEFAULT_MODELS = "resnet101"
DEFAULT_LAYOUTS = "1,2,4,8,4x2"
# sync_hook_mpi and dist_opt_mpi run the runtime of run_config_mpi through other APIs (the same
# graph rewrite or the same allreduces): not by default, to keep a default run under 20 minutes.
DEFAULT_SYSTEMS = "run_config_mpi,run_config_tcp,horovod_mpi,ps_sync"
GLOO_PORT = 24200


@dataclass(frozen=True)
class System:
    title: str
    worker: str  # scaling_worker.py --system
    launch: str  # perseusrun, parameter_servers, gloo or mwms
    python: str  # product (--product-tf), main (TF 2.21), tf215 or peers
    tcp: bool = False
    env: tuple = ()  # (name, value) pairs every rank gets

    @property
    def slots_supported(self) -> bool:
        """Whether the system runs several ranks per host here."""
        return self.launch != "parameter_servers"


SYSTEMS = {
    "run_config_mpi": System("Estimator + hvd.run_config(), MPI", "run_config", "perseusrun",
                             "product"),
    "run_config_tcp": System("Estimator + hvd.run_config(), TCP", "run_config", "perseusrun",
                             "product", tcp=True),
    "run_config_tcp_ring": System("Estimator + hvd.run_config(), TCP, the flat ring only "
                                  "(PERSEUS_ALLREDUCE_ALGORITHM=ring)", "run_config",
                                  "perseusrun", "product", tcp=True,
                                  env=(("PERSEUS_ALLREDUCE_ALGORITHM", "ring"),)),
    "alone": System("each rank alone: plain RunConfig, no collectives (the machine's ceiling)",
                    "alone", "perseusrun", "product", tcp=True),
    "alone_sync": System("each rank alone, but every step ends together (one 4-byte allreduce, "
                         "TCP): the ceiling of any synchronous system here", "alone_sync",
                         "perseusrun", "product", tcp=True),
    "sync_hook_mpi": System("MonitoredTrainingSession + hvd.SyncReplicasHook, MPI",
                            "sync_hook", "perseusrun", "product"),
    "dist_opt_mpi": System("hvd.DistributedOptimizer (tf.compat.v1), MPI", "dist_opt",
                           "perseusrun", "product"),
    "horovod_mpi": System("Horovod 0.28.1 DistributedOptimizer, MPI", "horovod", "perseusrun",
                          "peers"),
    "horovod_gloo": System("Horovod 0.28.1 DistributedOptimizer, Gloo", "horovod", "gloo",
                           "peers"),
    "ps_async": System("parameter servers, async (TF 2.15.1)", "ps_async",
                       "parameter_servers", "tf215"),
    "ps_sync": System("parameter servers, SyncReplicasOptimizer (TF 2.15.1)", "ps_sync",
                      "parameter_servers", "tf215"),
    "mwms": System("MultiWorkerMirroredStrategy, RING (TF 2.21)", "mwms", "mwms", "main"),
}


class Skip(Exception):
    """A row that cannot run here; the text says why."""


def pythons(args: argparse.Namespace) -> dict:
    product = args.tf215_python if args.product_tf == "2.15" else args.tf221_python
    return {"product": product, "main": args.tf221_python, "tf215": args.tf215_python,
            "peers": args.peers_python}


def tensorflow_of(system: System, args: argparse.Namespace) -> str:
    if system.python == "product":
        return args.product_tf
    return "2.21" if system.python == "main" else "2.15"


def parse_layout(text: str) -> tuple[int, int]:
    hosts, _, slots = text.partition("x")
    return int(hosts), int(slots or 1)


def layout_name(hosts: int, slots: int) -> str:
    return f"{hosts}x{slots}" if slots > 1 else str(hosts)


# --------------------------------------------------------------------------- one launch


def worker_argv(name: str, model: str, ranks: int, stats_dir: Path, model_dir: Path,
                args: argparse.Namespace) -> list:
    return [str(WORKER), "--system", SYSTEMS[name].worker, "--model", model,
            "--byte-scale", repr(args.byte_scale), "--step-scale", repr(args.step_scale),
            "--wait", args.wait, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--replicas", str(ranks), "--stats-dir", str(stats_dir), "--model-dir",
            str(model_dir)]


def launch(name: str, model: str, hosts: int, slots: int, args: argparse.Namespace) -> dict:
    """Trains `model` with system `name` on hosts x slots ranks; the chief's RESULT and the
    summed stats of every trainer."""
    system = SYSTEMS[name]
    python = pythons(args)[system.python]
    if slots > 1 and not system.slots_supported:
        raise Skip(f"{name} runs one trainer per host here")
    work = Path(tempfile.mkdtemp(prefix=f"scaling_{name}_{model}_{hosts}x{slots}_"))
    stats_dir, model_dir = work / "stats", work / "model"
    stats_dir.mkdir()
    ranks = hosts * slots
    program = worker_argv(name, model, ranks, stats_dir, model_dir, args)
    tensorflow = tensorflow_of(system, args)
    config = emulated.Config(system.title, tensorflow,
                                     "rank" if system.launch != "parameter_servers"
                                     else system.worker, tcp=system.tcp)
    try:
        if system.launch == "perseusrun":
            # perseusrun itself runs in the main environment; the ranks run `python`.
            launcher = emulated.Config(system.title, "2.21", "rank", tcp=system.tcp,
                                       env=system.env)
            result = emulated.launch_perseusrun(launcher, hosts, args, [python, *program],
                                                slots=slots)
        elif system.launch == "parameter_servers":
            result = emulated.launch_parameter_servers(config, hosts, args, program)
        elif system.launch == "gloo":
            result = launch_gloo(hosts, slots, python, program, args)
        else:
            result = launch_mwms(hosts, slots, python, program, args)
        stats = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("*.json"))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counted = [s for s in stats if s.get("runtime")]  # this product's runtime counters

    def mean(key: str) -> float | None:
        return sum(s["runtime"][key] for s in counted) / len(counted) if counted else None

    return {**result, "trainers": len(stats), "cpu_s": sum(s["cpu_s"] for s in stats),
            "local_steps": max((s["local_steps"] for s in stats), default=0),
            "rounds": mean("rounds"), "collectives": mean("collectives"),
            "algorithms": {key[len("allreduce_"):]: count  # the first trainer's, timed steps
                           for key, count in (counted[0]["runtime"] if counted else {}).items()
                           if key.startswith("allreduce_") and count}}


def _run_hosts(hosts: int, slots: int, env_for, python: str, program: list,
               args: argparse.Namespace, before=None) -> dict:
    """Starts one process per slot on emulated hosts with env_for(cluster, index); the result
    of process 0 (its RESULT line). `before(cluster)` may start a helper (a context manager)."""
    import contextlib

    from perseusrun import emulate

    procs = emulated.Processes(time.monotonic() + args.timeout)
    with emulate.emulated_hosts(hosts, **emulated.emulated_links(args)) as cluster, \
            (before(cluster) if before else contextlib.nullcontext()):
        try:
            for index in range(hosts * slots):
                procs.start(f"p{index}", [python, *program], env_for(cluster, index),
                            cluster[index // slots])
            line = procs.wait_for(emulated.RESULT, {"p0"},
                                  may_end={f"p{i}" for i in range(1, hosts * slots)})["p0"]
            procs.wait_ended(set(procs.procs), time.monotonic() + 60)
            return emulated.parse_result(line)
        finally:
            procs.close()


def launch_mwms(hosts: int, slots: int, python: str, program: list,
                args: argparse.Namespace) -> dict:
    from bench_common import mwms

    base = emulated.Config("mwms", "2.21", "rank")

    def env_for(cluster, index: int) -> dict:
        addresses = [f"{host.address}:{mwms.BASE_PORT + slot}" for host in cluster
                     for slot in range(slots)]
        env = emulated.process_env(base)
        env.update(mwms.worker_env(addresses, index))
        env.update(emulated.THREADS)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE)])
        return env

    return _run_hosts(hosts, slots, env_for, python, program, args)


def launch_gloo(hosts: int, slots: int, python: str, program: list,
                args: argparse.Namespace) -> dict:
    """Horovod over Gloo without horovodrun (which needs ssh): Horovod's own rendezvous server
    runs on the launch side of the emulated network, and each rank gets the HOROVOD_*
    variables horovodrun would give it."""
    import contextlib

    base = emulated.Config("horovod_gloo", "2.15", "rank")

    @contextlib.contextmanager
    def rendezvous(cluster):
        plan = ",".join(f"{host.address}:{slots}" for host in cluster)
        code = ("import sys, time\n"
                "from horovod.runner.common.util import hosts\n"
                "from horovod.runner.http.http_server import RendezvousServer\n"
                "server = RendezvousServer(verbose=0)\n"
                f"port = server.start()\n"
                f"server.init(hosts.get_host_assignments(hosts.parse_hosts({plan!r}), "
                f"{hosts * slots}))\n"
                "print(port, flush=True)\n"
                "sys.stdin.read()\n")
        server = subprocess.Popen([python, "-c", code], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            if not port.isdigit():
                raise emulated.LaunchError("Horovod's rendezvous server did not start")
            rendezvous.port = int(port)
            yield
        finally:
            server.kill()
            server.wait()

    def env_for(cluster, index: int) -> dict:
        host = index // slots
        env = emulated.process_env(base)
        env.update({
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.launch_address,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous.port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "eth0", "HOROVOD_HOSTNAME": cluster[host].address,
            "HOROVOD_RANK": str(index), "HOROVOD_SIZE": str(hosts * slots),
            "HOROVOD_LOCAL_RANK": str(index % slots), "HOROVOD_LOCAL_SIZE": str(slots),
            "HOROVOD_CROSS_RANK": str(host), "HOROVOD_CROSS_SIZE": str(hosts)})
        return env

    return _run_hosts(hosts, slots, env_for, python, program, args, before=rendezvous)


# --------------------------------------------------------------------------- rows


def make_row(name: str, model: str, hosts: int, slots: int, result: dict,
             args: argparse.Namespace) -> dict:
    from perseusrun import emulate

    profile = scaling_model.load_profile(model, step_scale=args.step_scale)
    ranks = hosts * slots
    synchronous = SYSTEMS[name].worker != "ps_async"
    examples = result["global_steps"] * profile.batch * (ranks if synchronous else 1)
    examples_per_s = examples / result["seconds"]
    step_ms = 1e3 * ranks * profile.batch / examples_per_s  # one rank's step
    bounds = scaling_model.step_bounds_ms(profile, hosts, args.byte_scale, args.link_bytes_s)
    per_step = result["local_steps"] or result["global_steps"]
    return {"model": model, "system": name, "hosts": hosts, "ranks_per_host": slots,
            "examples_per_s": examples_per_s, "step_ms": step_ms,
            "compute_bound_examples_per_s": 1e3 * ranks * profile.batch / bounds["compute_ms"],
            "comm_bound_examples_per_s":
                1e3 * ranks * profile.batch / bounds["compute_comm_ms"],
            "link_ms": bounds["comm_ms"],
            "cpu_ms_per_step": 1e3 * result["cpu_s"] / per_step if per_step else None,
            "cpu_busy": result["cpu_s"] / (result["seconds"] * (os.cpu_count() or 1)),
            "rounds_per_step": result["rounds"] / per_step
            if per_step and result.get("rounds") is not None else None,
            "collectives_per_step": result["collectives"] / per_step
            if per_step and result.get("collectives") is not None else None,
            "trainers": result["trainers"], "link_rate": args.link_rate,
            "link_mtu": args.link_mtu or 1500, "link_delay_ms": args.link_delay or 0,
            "link_jitter_ms": args.link_jitter or 0, "link_loss_pct": args.link_loss or 0,
            "link_queue_ms": args.link_queue or emulate.DEFAULT_QUEUE_MS,
            "byte_scale": args.byte_scale, "step_scale": args.step_scale,
            "dilation": args.dilate, "steps": args.steps,
            "carried_allreduce_bytes": int(os.environ.get("PERSEUS_CARRIED_ALLREDUCE_BYTES",
                                                          "1024")),
            "allreduce_hop_latency_us": os.environ.get("PERSEUS_ALLREDUCE_HOP_LATENCY_US", "50"),
            "allreduce_link_gbit": float(os.environ.get("PERSEUS_ALLREDUCE_LINK_GBIT", "1")),
            "allreduce_algorithm": dict(SYSTEMS[name].env).get("PERSEUS_ALLREDUCE_ALGORITHM",
                                                              "auto"),
            "allreduce_algorithms": result.get("algorithms")}


def add_relative(rows: list) -> None:
    """Efficiency and hidden link share, against the same system's one-host row."""
    base = {(r["model"], r["system"]): r for r in rows
            if r["hosts"] == 1 and r["ranks_per_host"] == 1}
    for row in rows:
        one = base.get((row["model"], row["system"]))
        ranks = row["hosts"] * row["ranks_per_host"]
        row["efficiency"] = row["examples_per_s"] / (ranks * one["examples_per_s"]) if one \
            else None
        row["hidden"] = None
        if one and row["link_ms"] > 0:
            unhidden = max(0.0, row["step_ms"] - one["step_ms"])
            row["hidden"] = max(0.0, 1 - unhidden / row["link_ms"])


def percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def link_faults(args: argparse.Namespace) -> str:
    """The links' delay, jitter and loss for a table's title; empty without them."""
    parts = [f"{args.link_delay:g} ms delay" if args.link_delay else "",
             f"+-{args.link_jitter:g} ms jitter" if args.link_jitter else "",
             f"{args.link_loss:g}% loss" if args.link_loss else ""]
    return "".join(f", {part}" for part in parts if part)


def print_table(rows: list, args: argparse.Namespace) -> None:
    for model in dict.fromkeys(r["model"] for r in rows):
        profile = scaling_model.load_profile(model, step_scale=args.step_scale)
        print(f"\n{model}: batch {profile.batch} per rank, {profile.step_ms:.0f} ms of compute "
              f"per step, {sum(profile.tensor_elements(args.byte_scale)) * 4 / 2**20:.1f} MiB "
              f"of gradients in {len(profile.tensor_elements(1))} tensors (x{args.byte_scale:g}"
              f" of the real bytes), links {args.link_rate} (MTU {args.link_mtu or 1500}"
              f"{link_faults(args)}), "
              f"{args.steps} timed steps after {args.warmup}\n")
        print("| system | hosts x ranks | examples/s | efficiency | compute bound | "
              "compute + link bound | link hidden | CPU ms/step (all ranks) | cores busy |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            if row["model"] != model:
                continue
            if "failed" in row:
                print(f"| {row['system']} | {row['layout']} | {row['failed']} |||||||")
                continue
            cpu = "" if row["cpu_ms_per_step"] is None else f"{row['cpu_ms_per_step']:.0f}"
            print(f"| {row['system']} | {row['hosts']}x{row['ranks_per_host']} | "
                  f"{row['examples_per_s']:.0f} | {percent(row['efficiency'])} | "
                  f"{row['compute_bound_examples_per_s']:.0f} | "
                  f"{row['comm_bound_examples_per_s']:.0f} | {percent(row['hidden'])} | "
                  f"{cpu} | {percent(row['cpu_busy'])} |")
    sys.stdout.flush()


# --------------------------------------------------------------------------- the chart


def write_chart(json_path: Path, chart: Path, projection: Path | None = None) -> None:
    """Efficiency against hosts, a line per system, a panel per model, from the JSON lines;
    with `projection` (scaling_projection.py --json), its projected efficiency beyond."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in json_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("efficiency") is not None]
    projected = [json.loads(line) for line in projection.read_text().splitlines()
                 if line.strip()] if projection else []
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models) + 2.5, 4.5),
                                squeeze=False)
    # One color per system in every panel (its 2-ranks-a-host point too); gray is the ceilings'.
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # 7: gray
    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if not s.startswith("alone")]
    colors = {system: palette[index % len(palette)] for index, system in enumerate(systems)}
    for axis, model in zip(axes[0], models):
        for system in dict.fromkeys(r["system"] for r in rows if r["model"] == model):
            # one rank a host, two; the two ceilings are both gray
            styles = ("--o", "D") if system == "alone_sync" else ("-o", "s")
            for slots, style in zip((1, 2), styles):
                points = sorted((r["hosts"], r["efficiency"]) for r in rows
                                if r["model"] == model and r["system"] == system
                                and r["ranks_per_host"] == slots)
                if points:  # the 2-ranks-a-host marks share one legend entry (below)
                    axis.plot(*zip(*points), style, label=system if slots == 1 else None,
                              color=colors.get(system, "gray"))
        bound = sorted({(r["hosts"], r["comm_bound_examples_per_s"]
                         / r["compute_bound_examples_per_s"]) for r in rows
                        if r["model"] == model and r["ranks_per_host"] == 1})
        if bound:
            axis.plot(*zip(*bound), "k--", linewidth=1, label="compute + link bound")
        # The projection's lines at its last (data-centre) hop, one per layout and wire type.
        hop = projected[-1]["hop_ms"] if projected else None
        for rph, wire in dict.fromkeys((p.get("ranks_per_host", 1), p.get("wire_bytes", 1.0))
                                       for p in projected if p["model"] == model):
            points = sorted((p["hosts"], p["efficiency"]) for p in projected
                            if p["model"] == model and p["hop_ms"] == hop
                            and (p.get("ranks_per_host", 1), p.get("wire_bytes", 1.0))
                            == (rph, wire))
            axis.plot(*zip(*points), ":", linewidth=2,
                      label=f"projection, {rph} a host{', fp16' if wire < 1 else ''}")
        published = [p["horovod_published"] for p in projected
                     if p["model"] == model and p.get("horovod_published")]
        if published:
            axis.plot([128], published[:1], "k*", markersize=9,
                      label="Horovod published, 128 x 4 GPUs")
        hosts = sorted({r["hosts"] for r in rows} | {p["hosts"] for p in projected
                                                      if p["model"] == model})
        axis.set_xscale("log", base=2)
        axis.set_xticks(hosts, [str(h) for h in hosts])
        axis.set_title(model)
        axis.set_xlabel("hosts")
        axis.set_ylabel("scaling efficiency")
        axis.set_ylim(0, 1.1)
        axis.grid(alpha=0.3)
    if any(r["ranks_per_host"] == 2 for r in rows):
        axes[0][-1].plot([], [], "ks", label="square, diamond: 2 ranks a host")
    labelled = {}
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    figure.legend(labelled.values(), labelled.keys(), loc="center left", fontsize=8,
                  bbox_to_anchor=(1 - 2.4 / figure.get_figwidth(), 0.5))
    figure.tight_layout(rect=(0, 0, 1 - 2.5 / figure.get_figwidth(), 1))
    figure.savefig(chart, dpi=100)
    print(f"chart: {chart}", file=sys.stderr, flush=True)


def chart_with_any_python(json_path: Path, chart: Path, args: argparse.Namespace) -> None:
    try:
        write_chart(json_path, chart, Path(args.projection) if args.projection else None)
    except ImportError:  # matplotlib lives in the peers venv (benchmarks/requirements.txt)
        if not os.access(args.peers_python, os.X_OK):
            print("no chart: matplotlib is missing (pip install -r benchmarks/requirements.txt)",
                  file=sys.stderr, flush=True)
            return
        subprocess.run([args.peers_python, __file__, "--chart-only", str(json_path),
                        "--chart", str(chart),
                        *(["--projection", args.projection] if args.projection else [])],
                       check=False)


# --------------------------------------------------------------------------- main


def prepare(names: list, args: argparse.Namespace) -> list:
    """The systems that can run here (others are reported and dropped); builds the delay op
    for each Python they use."""
    ready, built = [], {}
    for name in names:
        python = pythons(args)[SYSTEMS[name].python]
        if not os.access(python, os.X_OK):
            print(f"{name}: skipped, {python} is missing (`make peers` builds .venv-peers, "
                  "`make compat-venvs` .venv-tf215)", file=sys.stderr, flush=True)
            continue
        if tensorflow_of(SYSTEMS[name], args) == "2.15" and SYSTEMS[name].python == "product" \
                and not list((HERE.parent / "perseus_legacy").glob("_tf_ops_tf2_15*")):
            print(f"{name}: skipped, perseus_legacy has no op library for TF 2.15 (`make "
                  "tf215-ops`; or --product-tf 2.21)", file=sys.stderr, flush=True)
            continue
        if python not in built:
            try:
                built[python] = scaling_model.build_delay_library(python)
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                print(f"{name}: skipped, {exc}", file=sys.stderr, flush=True)
                continue
        ready.append(name)
    return ready


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated, of {', '.join(scaling_model.MODELS)}")
    parser.add_argument("--hosts", default=DEFAULT_LAYOUTS,
                        help="comma-separated layouts: HOSTS or HOSTSxRANKS_PER_HOST")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS,
                        help=f"comma-separated, of {', '.join(SYSTEMS)}, or all")
    parser.add_argument("--link-rate", default="1gbit", help="each emulated host's link")
    emulated.add_link_options(parser)
    parser.add_argument("--real-link-rate", default=REAL_LINK,
                        help="the real cluster's link: gradients are scaled by link/real")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--step-scale", type=float, default=1.0,
                        help="multiplies the profile's compute time (tests)")
    parser.add_argument("--dilate", type=float, default=1.0, metavar="D",
                        help="run the same cluster D times slower: compute time, link delay "
                        "and jitter x D, link rate / D, the same bytes (docs/scaling.md)")
    parser.add_argument("--wait", choices=("op", "py_function"), default="op")
    parser.add_argument("--product-tf", choices=("2.15", "2.21"), default="2.15",
                        help="TensorFlow of this product's rows (2.15: the same as Horovod's "
                        "and the parameter servers')")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    parser.add_argument("--json", help="write one JSON object per row to this file")
    parser.add_argument("--chart", help="PNG of efficiency against hosts (default: next to "
                        "--json; `none`: no chart)")
    parser.add_argument("--projection", help="scaling_projection.py --json rows to draw beyond "
                        "the measured hosts")
    parser.add_argument("--chart-only", help="draw the chart of this --json file and exit")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--tf221-python", default=str(emulated.MPI_BIN / "python"))
    parser.add_argument("--tf215-python", default=str(emulated.TF215_PYTHON))
    parser.add_argument("--peers-python", default=str(PEERS_PYTHON))
    args = parser.parse_args()
    args.ps_layout = "colocated"  # what bench_common/emulated.py's launchers read
    if args.dilate != 1.0:
        dilate(args)
    return args


def dilate(args: argparse.Namespace) -> None:
    """--dilate D: every time of the cluster D times longer (compute, delay, jitter, the link's
    time per byte and its queue), the bytes and the ratios between those times unchanged, the
    timeout too. (A queue of the same milliseconds holds the same bytes at 1/D of the rate.)"""
    from perseusrun import emulate

    if args.dilate < 1.0:
        sys.exit(f"scaling.py: --dilate {args.dilate:g}: must be 1 or more")
    try:
        link = emulate.rate_bytes_per_second(args.link_rate)
        real = emulate.rate_bytes_per_second(args.real_link_rate)
    except emulate.EmulationError as exc:
        sys.exit(f"scaling.py: {exc}")
    args.link_rate = f"{8 * link / args.dilate:.0f}bit"
    args.real_link_rate = f"{8 * real / args.dilate:.0f}bit"
    args.step_scale *= args.dilate
    args.link_delay = args.link_delay * args.dilate if args.link_delay else args.link_delay
    args.link_jitter = args.link_jitter * args.dilate if args.link_jitter else args.link_jitter
    args.link_queue = (args.link_queue or emulate.DEFAULT_QUEUE_MS) * args.dilate
    args.timeout *= args.dilate


def main() -> None:
    args = parse_args()
    if args.chart_only:
        write_chart(Path(args.chart_only), Path(args.chart),
                    Path(args.projection) if args.projection else None)
        return
    from perseusrun import emulate

    names = list(SYSTEMS) if args.systems == "all" else args.systems.split(",")
    models = args.models.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        sys.exit(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    # Every efficiency needs the one-host row: measured first.
    layouts = sorted({(1, 1), *(parse_layout(text) for text in args.hosts.split(","))},
                     key=lambda layout: (layout[0] * layout[1], layout))
    try:
        args.link_bytes_s = emulate.rate_bytes_per_second(args.link_rate)
        args.byte_scale = args.link_bytes_s / emulate.rate_bytes_per_second(args.real_link_rate)
        emulate.check_requirements(**emulated.emulated_links(args))
        for model in models:
            scaling_model.load_profile(model)
    except (emulate.EmulationError, ValueError) as exc:
        sys.exit(f"scaling.py: {exc}")
    # The runtime's cost model takes the links' rate (dilated: 1 / D of it, as its measured step
    # latency is D times longer, so that it picks what the undilated cluster would).
    os.environ.setdefault("PERSEUS_ALLREDUCE_LINK_GBIT", f"{8e-9 * args.link_bytes_s:g}")
    names = prepare(names, args)
    json_path = Path(args.json) if args.json else None
    if json_path:
        json_path.write_text("")
    rows, started = [], time.monotonic()
    try:
        with emulated.stop_signals_raise():
            for model in models:
                for hosts, slots in layouts:
                    for name in names:
                        rows.append(measure(name, model, hosts, slots, args))
                        if json_path and "failed" not in rows[-1]:
                            add_relative([r for r in rows if "failed" not in r])
                            with json_path.open("a") as out:
                                out.write(json.dumps(rows[-1]) + "\n")
    except KeyboardInterrupt as stop:  # every launch has ended its processes and hosts
        signum = stop.args[0] if stop.args else signal.SIGINT
        print(f"stopped by signal {signum}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    measured = [r for r in rows if "failed" not in r]
    add_relative(measured)
    print_table(rows, args)
    print(f"\n{len(measured)} of {len(rows)} launches measured in "
          f"{(time.monotonic() - started) / 60:.1f} min", flush=True)
    chart = Path(args.chart) if args.chart else (json_path.with_suffix(".png") if json_path
                                                 else None)
    chart = None if args.chart == "none" else chart
    if chart and json_path and measured:
        chart_with_any_python(json_path, chart, args)
    if any(r.get("failed") == "failed" for r in rows):
        sys.exit(1)


def measure(name: str, model: str, hosts: int, slots: int, args: argparse.Namespace) -> dict:
    layout = layout_name(hosts, slots)
    started = time.monotonic()
    try:
        result = launch(name, model, hosts, slots, args)
    except Skip as skip:
        print(f"{model} {name} {layout}: skipped, {skip}", file=sys.stderr, flush=True)
        return {"model": model, "system": name, "layout": layout, "failed": "n/a"}
    except emulated.LaunchError as exc:
        print(f"{model} {name} {layout}: failed: {exc}", file=sys.stderr, flush=True)
        return {"model": model, "system": name, "layout": layout, "failed": "failed"}
    row = make_row(name, model, hosts, slots, result, args)
    rounds = "" if row["rounds_per_step"] is None else \
        f", {row['rounds_per_step']:.0f} rounds and {row['collectives_per_step']:.0f} " \
        "allreduces a step"
    print(f"{model} {name} {layout}: {row['examples_per_s']:.0f} examples/s, "
          f"{row['step_ms']:.0f} ms/step, CPU {percent(row['cpu_busy'])} of the cores{rounds} "
          f"(launch {time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return row


if __name__ == "__main__":
    main()
