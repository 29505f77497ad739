"""Several machines on one: jobs across emulated hosts (perseusrun --emulate-hosts, one network
namespace per host, see perseusrun/emulate.py).

The launches need root and iproute2 (CI runs as root); without them they are skipped with the
reason. The command-line checks at the top run anywhere. Every launch has a timeout, and every
test checks that its namespaces are gone afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from harness import (
    ATOL,
    ESTIMATOR_TIMEOUT,
    PERSEUSRUN,
    ROOT,
    RTOL,
    assert_ranks_match_reference,
    end_processes,
    exits_within,
    finish_reference,
    launch_env,
    load_values,
    namespaces_of,
    needs_emulation,
    run_emulated,
    start_reference,
    tf_config_cluster,
    tf_config_env,
    wait_all,
    worker_cases,
)

from perseusrun import emulate, launch

COLLECTIVES = "tests/workers/multihost_collectives.py"


# ---- the command line, no launch -------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--emulate-hosts", "0", "x"], "bad slot count '0'"),
    (["--emulate-hosts", "2:x", "x"], "bad slot count 'x'"),
    (["--emulate-hosts", "2", "-H", "a:2", "x"], "drop -H/--hostfile"),
    (["--link-rate", "1gbit", "-np", "2", "x"], "add --emulate-hosts"),
    (["--link-mtu", "9000", "-np", "2", "x"], "add --emulate-hosts"),
    (["--emulate-hosts", "2", "--link-mtu", "100", "x"], "link MTU 100: expected 576 to"),
    (["--tcp", "--emulate-hosts", "2", "-np", "3", "x"], "-np 3 needs 3 slots"),
])
def test_bad_emulation_options_exit_2_naming_the_problem(capsys, argv, message):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_emulation_without_root_or_ip_exits_2_saying_what_is_missing(capsys, monkeypatch):
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(emulate.shutil, "which", lambda tool: None if tool == "ip" else "/bin/x")
    assert launch.main(["--emulate-hosts", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert "emulated hosts need root" in err and "`ip` on PATH (package iproute2)" in err, err


@pytest.mark.parametrize("rate,expected", [("1gbit", 125e6), ("10Gbit", 1.25e9),
                                           ("100mbit", 12.5e6), ("125mbps", 125e6)])
def test_link_rates_use_tc_syntax(rate, expected):
    assert emulate.rate_bytes_per_second(rate) == expected


def test_bad_link_rate_is_named():
    with pytest.raises(emulate.EmulationError, match="link rate '1 gigabit'"):
        emulate.rate_bytes_per_second("1 gigabit")


# ---- collectives across hosts ------------------------------------------------------------------

def layout(out: str) -> dict:
    """rank -> host of every rank's layout line (checked by the worker itself)."""
    found = re.findall(r"\[rank (\d+)\] layout host=(\S+) local_rank=", out)
    return {int(rank): host for rank, host in found}


def assert_two_by_two(out: str) -> dict:
    hosts = layout(out)
    assert sorted(hosts) == [0, 1, 2, 3], out
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    for rank in range(4):
        for case in worker_cases("tests/workers/core_collectives.py"):
            assert f"[rank {rank}] CASE {case}: OK" in out, out
    return hosts


@needs_emulation
def test_mpi_on_2_hosts_x_2_slots_has_the_layout_matches_numpy_and_uses_sm_within_tcp_across():
    """mpirun places ranks 0, 1 on host 0 and 2, 3 on host 1: local/cross ranks say so, every
    collective matches numpy, and Open MPI's transport choice (btl_base_verbose) is shared
    memory between ranks of one host and TCP between hosts, never anything else."""
    out = run_emulated(["--emulate-hosts", "2:2", "--mpi-args", "--mca btl_base_verbose 100"],
                       COLLECTIVES, 2, 2)
    hosts = assert_two_by_two(out)
    choices = re.findall(r"\[([^:\]]+):\d+\] mca: bml: Using (\w+) btl for send to "
                         r"\[\[\d+,\d+\],(\d+)\] on node (\S+)", out)
    assert choices, out
    seen = set()
    for sender_host, btl, receiver, receiver_host in choices:
        assert receiver_host == hosts[int(receiver)], (receiver, receiver_host, hosts)
        if sender_host == receiver_host:
            assert btl in ("self", "sm"), (sender_host, btl, receiver)
        else:
            assert btl == "tcp", (sender_host, btl, receiver)
        seen.add(btl)
    assert {"sm", "tcp"} <= seen, choices


@needs_emulation
def test_tcp_controller_on_2_hosts_x_2_slots_has_the_layout_and_matches_numpy():
    """perseusrun --tcp: rank i listens on its host's namespace address (the ranks of a host on
    distinct ports), so local/cross ranks follow the hosts; every collective matches numpy."""
    out = run_emulated(["--tcp", "--emulate-hosts", "2:2"], COLLECTIVES, 2, 2)
    assert_two_by_two(out)


# ---- the launcher removes what it built ---------------------------------------------------------

LAUNCH_WORKER = "tests/workers/launch_worker.py"


@needs_emulation
def test_emulated_hosts_have_names_addresses_loopback_rate_limits_both_ways_and_mtu_then_vanish():
    with emulate.emulated_hosts(2, link_rate="100mbit", mtu=9000) as hosts:
        tag = hosts.tag
        for host in hosts:
            shell = ("hostname; ip -o -4 addr show; ip -o link show lo; ip -o link show eth0; "
                     "tc qdisc show dev eth0; getent hosts " + hosts[1 - host.index].name)
            out = subprocess.run(host.command(["/bin/sh", "-c", shell]), capture_output=True,
                                 text=True, timeout=30).stdout
            assert out.splitlines()[0] == host.name, out
            assert f"inet {host.address}/24" in out and "127.0.0.1/8" in out, out
            assert "state UNKNOWN" in out or "LOOPBACK,UP" in out, out
            assert "tbf" in out and "rate 100Mbit" in out, out  # out of the host
            assert hosts[1 - host.index].address in out, out  # the other host's name resolves
            into = subprocess.run(["tc", "qdisc", "show", "dev", f"{tag}v{host.index}"],
                                  capture_output=True, text=True, timeout=30).stdout
            assert "tbf" in into and "rate 100Mbit" in into, into  # into the host
            for link in (f"{tag}v{host.index}", f"{tag}br"):  # the veth's end here, the bridge
                shown = subprocess.run(["ip", "-o", "link", "show", link], capture_output=True,
                                       text=True, timeout=30).stdout
                assert " mtu 9000 " in shown, shown
            assert out.count(" mtu 9000 ") == 1, out  # eth0 (lo keeps its own)
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert tag not in out and not namespaces_of(os.getpid()), out


@needs_emulation
@pytest.mark.parametrize("tcp", [False, True], ids=["mpi", "tcp"])
def test_namespaces_are_removed_after_a_failing_rank(tcp):
    options = ["--emulate-hosts", "2"] + (["--tcp"] if tcp else [])
    script = "tests/workers/tcp_launch_worker.py" if tcp else LAUNCH_WORKER
    # run_emulated checks that no namespace of the launcher is left
    run_emulated(options, script, "fail", 1, 3, timeout=120, expect_failure=True)


def _start_hanging_job(*options: str) -> tuple:
    """A launcher whose 2 ranks hang after printing `ready pid=P`; returns it and their pids."""
    proc = subprocess.Popen([PERSEUSRUN, *options, "--timeout", "150", sys.executable,
                             str(ROOT / LAUNCH_WORKER), "hang"], cwd=ROOT, env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = []
    for line in proc.stdout:  # the job's --timeout bounds this wait
        if line.startswith("ready pid="):
            pids.append(int(line.split("=")[1]))
            if len(pids) == 2:
                return proc, pids
    raise AssertionError(f"the job ended (exit {proc.wait()}) before both ranks were ready")


@needs_emulation
@pytest.mark.parametrize("tcp", [False, True], ids=["mpi", "tcp"])
def test_sigint_to_the_launcher_stops_the_ranks_and_removes_the_namespaces(tcp):
    proc, pids = _start_hanging_job("--emulate-hosts", "2", *(["--tcp"] if tcp else []))
    try:
        assert len(namespaces_of(proc.pid)) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGINT
        for pid in pids:
            assert exits_within(pid, 30), f"rank {pid} outlived the interrupted job"
        assert namespaces_of(proc.pid) == []
    finally:
        end_processes([proc], pids)


@needs_emulation
def test_namespaces_of_a_killed_launcher_are_removed_at_the_next_start():
    """SIGKILL leaves the launcher no chance to clean up: its namespaces (with the ranks still
    inside) stay until the next emulated launch, which ends those ranks and removes them."""
    proc, pids = _start_hanging_job("--tcp", "--emulate-hosts", "2")
    try:
        proc.kill()
        proc.wait()
        assert len(namespaces_of(proc.pid)) == 2  # the dead launcher's
        run_emulated(["--tcp", "--emulate-hosts", "1"], "tests/workers/tcp_launch_worker.py",
                     "echo", timeout=120)
        assert namespaces_of(proc.pid) == []
        for pid in pids:
            assert exits_within(pid, 30), f"rank {pid} of the killed launcher still runs"
        assert not (emulate._state_dir() / f"{emulate.TAG_PREFIX}{proc.pid}x0").exists()
    finally:
        end_processes([proc], pids)



# ---- an unchanged Estimator across hosts -------------------------------------------------------

@needs_emulation
def test_estimator_with_run_config_on_2_hosts_trains_like_one_process_on_the_global_batch(
        tmp_path):
    """tests/workers/est_distributed.py (custom model_fn with and without estimator_hooks(), a
    DNNClassifier, retraining from rank 0's checkpoint) on 2 emulated hosts over MPI: every
    rank's final variables equal the single-process reference's and each other's."""
    worker = "tests/workers/est_distributed.py"
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = start_reference(worker, reference_dir, "reference")
    try:
        run_emulated(["--emulate-hosts", "2"], worker, tmp_path, "distributed",
                     timeout=ESTIMATOR_TIMEOUT)
    finally:
        expected = finish_reference(reference, reference_dir)
    assert_ranks_match_reference([load_values(tmp_path / f"rank{r}.npz") for r in range(2)],
                                 expected)


@needs_emulation
def test_tf_config_chief_2_workers_and_evaluator_on_4_hosts_train_and_evaluate_like_one_process(
        tmp_path):
    """Chief, worker 0, worker 1 and the evaluator each on an emulated host, TF_CONFIG naming
    the hosts' real addresses: train_and_evaluate trains over the TCP group; the chief's final
    checkpoint and the evaluator's final metrics equal one plain process on the global batch."""
    worker = "tests/workers/multihost_est_tf_config.py"
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = start_reference(worker, reference_dir, reference_dir / "model", "reference")
    model_dir = tmp_path / "model"
    tasks = [("chief", 0), ("worker", 0), ("worker", 1), ("evaluator", 0)]
    procs = []
    try:
        with emulate.emulated_hosts(len(tasks)) as hosts:
            cluster = tf_config_cluster(tasks, [f"{host.address}:2222" for host in hosts])
            for (task_type, index), host in zip(tasks, hosts):
                who = f"{task_type}{index}"
                env = tf_config_env(cluster, task_type, index, {
                    "PERSEUS_SECRET": "multihost-job-secret", "PERSEUS_START_TIMEOUT": "300"})
                with open(tmp_path / f"{who}.log", "w") as log:
                    procs.append(host.popen([sys.executable, str(ROOT / worker), str(tmp_path),
                                             str(model_dir), "task", who], env=env, cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT))
            codes = wait_all(procs, ESTIMATOR_TIMEOUT)
    finally:
        end_processes(procs)
        expected = finish_reference(reference, reference_dir)
    logs = "\n".join(f"--- {t}{i} exited {c}:\n{(tmp_path / f'{t}{i}.log').read_text()[-4000:]}"
                     for (t, i), c in zip(tasks, codes))
    assert codes == [0] * len(tasks), logs
    records = {f"{t}{i}": json.loads((tmp_path / f"{t}{i}.json").read_text()) for t, i in tasks}
    assert [records[w]["rank"] for w in ("chief0", "worker0", "worker1")] == [0, 1, 2], records
    assert all(r["servers"] == [] for r in records.values()), records
    chief = load_values(tmp_path / "chief0.npz")
    assert sorted(chief) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(chief[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    reference_metrics = json.loads((reference_dir / "reference.json").read_text())["metrics"]
    final = records["evaluator0"]["eval_events"][str(int(chief["global_step"]))]
    for tag in ("accuracy", "loss", "average_loss"):
        np.testing.assert_allclose(final[tag], reference_metrics[tag], rtol=RTOL, atol=ATOL,
                                   err_msg=tag)

