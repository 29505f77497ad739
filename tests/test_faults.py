"""Faults on other ranks fail the survivors clearly and within a bound: a rank frozen by SIGSTOP
and a host whose link is cut, over MPI and over TCP, and a TCP rank killed. Each survivor's error
names the lost rank and its host; the job exits non-zero; nothing waits forever. When the fault
hits Estimator training, the lowest surviving rank saves the last completed step into rank 0's
model_dir (perseus_legacy.tf1.survivor; rank 0 itself killed while it saves, too), the model_dir
names only whole checkpoints, and a rerun resumes from the last one as if training had never
stopped: no completed step is trained twice.

Workers: tests/workers/fault_rank.py (a 4 KiB allreduce loop; rank 1 fails after 20 steps and
each survivor prints `FAULT_SEEN after S s`, S counted from its last completed step) and
tests/workers/fault_checkpoint.py (an Estimator with run_config() and checkpoints every 3 steps,
its faults, and the rerun).

Every test's launch is independent of the others' (own ranks, own emulated hosts, own
directories) and spends most of its time waiting on a silence limit or its own ranks: a module
fixture starts the selected tests' launches together (harness.LaunchPool, AT_ONCE at a time)
and each test reads its own. A checkpoint scenario runs whole in its launch (fault, checks,
rerun, checks: the rerun must start from what the fault left) and the test gets what it raised.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from harness import (
    CHECKPOINT_WORKER,
    ROOT,
    LaunchPool,
    assert_resumed,
    assert_whole_checkpoints,
    end_processes,
    failure_summary,
    namespaces_of_cluster,
    needs_emulation,
    run_emulated,
    run_perseusrun,
    selected_tests,
    tf_config_cluster,
    tf_config_env,
    trajectory,
    wait_all,
)

from perseusrun import emulate, supervise

WORKER = str(ROOT / "tests" / "workers" / "fault_rank.py")

# MPI: the bound is PERSEUS_STALL_SHUTDOWN_SECS (the warning comes after the warning limit).
MPI_LIMITS = {"PERSEUS_STALL_WARNING_SECS": "2", "PERSEUS_STALL_SHUTDOWN_SECS": "6"}
MPI_BOUND_SECS = 6
# TCP: a peer silent for kPeerSilenceSecs (tcp_controller.h) is lost.
TCP_BOUND_SECS = 30
# TCP: a killed process's connections are closed by its kernel; the peers fail at once.
TCP_CLOSED_BOUND_SECS = 0
# A rank whose session closes with an error of its own first waits this long for every other
# rank to fail a step too (perseus_legacy.tf1.survivor.STEP_ERROR_AGREEMENT_SECS).
STEP_ERROR_BOUND_SECS = 5
MARGIN_SECS = 10


def assert_fault_named(out: str, survivor: int, lost: int, bound: float, where: str | None,
                       what: str = "stopped responding") -> float:
    """The survivor's FAULT_SEEN line names the lost rank, `what` befell it and `where` it ran,
    within `bound` (+ MARGIN_SECS) of the survivor's last completed step; returns the seconds."""
    seen = re.search(rf"\[rank {survivor}\] FAULT_SEEN after ([\d.]+) s: (.*)", out)
    assert seen, (f"rank {survivor} never reported the fault. Error lines:\n"
                  f"{failure_summary(out)}\n{out}")
    secs, error = float(seen.group(1)), seen.group(2)
    assert f"rank {lost} " in error and what in error, error
    if where is not None:
        assert where in error, (where, error)
    assert secs <= bound + MARGIN_SECS, (secs, error)
    print(f"rank {survivor} reported the fault after {secs} s (bound {bound} s)")
    return secs


def test_mpi_frozen_rank_is_named_in_a_warning_then_fails_the_others_within_the_bound(launch):
    code, out = launch()
    assert code != 0, out
    assert re.search(r"perseus_legacy\[rank 0\]: WARNING: waiting \d+ s for rank 1 \(host \S+\) "
                     r"to answer", out), out
    secs = assert_fault_named(out, 0, 1, MPI_BOUND_SECS, "(host ")
    assert secs >= MPI_BOUND_SECS - 1, secs  # not before the limit either
    assert "aborting the MPI job" in out, out  # not MPI_Finalize, which waits for rank 1


def test_mpi_frozen_rank_0_fails_the_others_within_the_bound_naming_it(launch):
    """The coordinator itself frozen: the other ranks wait on its answer, and name it."""
    code, out = launch()
    assert code != 0, out
    secs = assert_fault_named(out, 1, 0, MPI_BOUND_SECS, "(host ")
    assert secs >= MPI_BOUND_SECS - 1, secs
    assert "aborting the MPI job" in out, out


def cut_host(out: str) -> str:
    """The host of rank 1 (the second emulated host) named in the survivors' errors."""
    host = re.search(r"rank 1 \(host (\S+)\)", out)
    assert host and host.group(1).endswith("h1"), out
    return host.group(1)


@needs_emulation
def test_mpi_cut_link_fails_the_other_host_within_the_bound_naming_rank_and_host(launch):
    """Rank 0 fails within the bound and aborts the job; mpirun then cannot reach the cut host's
    daemon and would wait for it, so perseusrun ends the job ABORT_GRACE_SECONDS later with the
    abort's exit code, well before its --timeout (exit 124)."""
    code, out = launch()
    assert code == supervise.ABORT_EXIT_CODE, out
    assert_fault_named(out, 0, 1, MPI_BOUND_SECS, f"host {cut_host(out)}")


def test_tcp_frozen_rank_fails_the_others_within_the_silence_limit_naming_it(launch):
    code, out = launch()
    assert code != 0, out
    assert_fault_named(out, 0, 1, TCP_BOUND_SECS, "127.0.0.1:")


@needs_emulation
def test_tcp_cut_link_fails_the_other_host_within_the_silence_limit_naming_rank_and_host(
        launch):
    code, out = launch()
    assert code != 0, out
    assert_fault_named(out, 0, 1, TCP_BOUND_SECS, ".2:")


# 2 hosts x 2 ranks, rank 1 frozen: the silence limit of the test below.
FROZEN_AMONG_4_BOUND_SECS = 5


@needs_emulation
def test_tcp_frozen_rank_among_4_on_2_hosts_is_named_by_every_survivor(launch):
    """2 hosts x 2 ranks running 8 MiB allreduces (hierarchical, phases overlapped on slices):
    rank 1 freezes before its next request. Rank 0 waits on it directly; ranks 2 and 3 wait on
    rank 0's answer, and must not blame rank 0: every survivor that reports (the launcher ends
    the job after the first) names rank 1, within the silence limit (PERSEUS_STALL_SHUTDOWN_SECS,
    below 30 s)."""
    bound = FROZEN_AMONG_4_BOUND_SECS
    code, out = launch()
    assert code != 0, out
    assert_fault_named(out, 0, 1, bound, None)
    for survivor in (2, 3):
        if f"[rank {survivor}] FAULT_SEEN" in out:
            assert_fault_named(out, survivor, 1, bound, None)
    pipelined = re.search(r"\[rank 0\] pipelined hierarchical allreduces: (\d+)", out)
    assert pipelined and int(pipelined.group(1)) >= 20, out


def test_ranks_waiting_for_a_stuck_rank_0_give_up_after_the_chief_wait_limit(launch):
    code, out = launch()
    assert code not in (0, 124), out
    seen = re.search(r"\[rank 1\] CHIEF_WAIT_FAILED after ([\d.]+) s: (.*)", out)
    assert seen, out
    assert "PERSEUS_CHIEF_WAIT_SECS=3" in seen.group(2), seen.group(2)
    assert 3 <= float(seen.group(1)) <= 3 + MARGIN_SECS, seen.group(1)


# ---- checkpoints through a fault, and the rerun ------------------------------------------------

CHECKPOINT_TIMEOUT = 240
TF_CONFIG_PORT = 2222


def run_tf_config_job(tmp_path: Path, phase: str) -> tuple:
    """The worker as a TF_CONFIG chief (rank 0) and worker (rank 1), each on an emulated host of
    its own; waits for both to exit (neither ends the other). Returns (exit codes, output)."""
    procs, logs = [], []
    try:
        with emulate.emulated_hosts(2) as hosts:
            tasks = [("chief", 0), ("worker", 0)]
            cluster = tf_config_cluster(tasks, [f"{h.address}:{TF_CONFIG_PORT}" for h in hosts])
            for (task_type, index), host in zip(tasks, hosts):
                env = tf_config_env(cluster, task_type, index, {
                    "TMPDIR": str(tmp_path), "PERSEUS_SECRET": "fault-checkpoint-secret"})
                logs.append(tmp_path / f"{phase}.{task_type}.log")
                with open(logs[-1], "w") as log:
                    procs.append(host.popen(
                        [sys.executable, str(ROOT / CHECKPOINT_WORKER), str(tmp_path / "model"),
                         str(tmp_path), phase], env=env, cwd=ROOT, stdout=log,
                        stderr=subprocess.STDOUT))
            tag = hosts.tag
            deadline = time.monotonic() + CHECKPOINT_TIMEOUT
            wait_all(procs, CHECKPOINT_TIMEOUT, stop_on_failure=False)
    finally:
        end_processes(procs)
    out = "\n".join(f"--- {log.name}, exit {proc.returncode}:\n{log.read_text()}"
                    for log, proc in zip(logs, procs))
    assert time.monotonic() < deadline, f"the {phase} job outlived {CHECKPOINT_TIMEOUT} s:\n{out}"
    assert not namespaces_of_cluster(tag), out
    return [proc.returncode for proc in procs], out


def mpi_cut_link_checkpoints(work: Path, checkpoint_worker: tuple) -> None:
    """The fault, its checks, the rerun and its checks: the test below names them."""
    worker, tf = checkpoint_worker
    model_dir = work / "model"
    env = {**MPI_LIMITS, "TMPDIR": str(work)}  # the other rank's private model_dir too
    code, out = run_perseusrun(["--emulate-hosts", "2"],
                               [ROOT / CHECKPOINT_WORKER, model_dir, work, "cut"], env,
                               timeout=CHECKPOINT_TIMEOUT)
    assert code == supervise.ABORT_EXIT_CODE, out
    assert "UNEXPECTED" not in out, out
    assert_fault_named(out, 0, 1, MPI_BOUND_SECS, f"host {cut_host(out)}")
    # Behind a cut link rank 1 lives on and sees rank 0 lost too: whichever claims first saves
    # step 7 (the same variables; the checks below read what was saved).
    step = worker.FAULT_STEP
    assert re.search(rf"rank 1 was lost; (saved global step {step}|rank 1 saves the last "
                     rf"completed step \(global step {step}\))", out), out
    expected = trajectory(worker)
    saved = [*range(0, worker.FAULT_STEP + 1, worker.EVERY), worker.FAULT_STEP]
    assert_whole_checkpoints(tf, model_dir, saved, expected)

    run_emulated(["--emulate-hosts", "2"], CHECKPOINT_WORKER, model_dir, work, "resume",
                 env=env, timeout=CHECKPOINT_TIMEOUT)
    assert_resumed(work, saved[-1], expected)
    # max_to_keep=5 of the Estimator's saver: step 0's checkpoint makes room for step 12's.
    assert_whole_checkpoints(tf, model_dir, [3, 6, worker.FAULT_STEP, 10, 12], expected)


def tcp_killed_worker_checkpoints(work: Path, checkpoint_worker: tuple) -> None:
    """The fault, its checks, the rerun and its checks: the test below names them."""
    worker, tf = checkpoint_worker
    codes, out = run_tf_config_job(work, "kill")
    assert codes == [1, -9], out
    assert_fault_named(out, 0, 1, TCP_CLOSED_BOUND_SECS, f".2:{TF_CONFIG_PORT}",
                       what="the process exited or was killed")
    assert f"rank 1 was lost; saved global step {worker.FAULT_STEP}" in out, out
    expected = trajectory(worker)
    saved = [*range(0, worker.FAULT_STEP + 1, worker.EVERY), worker.FAULT_STEP]
    assert_whole_checkpoints(tf, work / "model", saved, expected)

    codes, out = run_tf_config_job(work, "resume")
    assert codes == [0, 0], out
    assert_resumed(work, saved[-1], expected)
    # max_to_keep=5 of the Estimator's saver: step 0's checkpoint makes room for step 12's.
    assert_whole_checkpoints(tf, work / "model", [3, 6, worker.FAULT_STEP, 10, 12], expected)


def chief_killed_saving_checkpoints(work: Path, checkpoint_worker: tuple) -> None:
    """The fault, its checks, the rerun and its checks: the test below names them."""
    worker, tf = checkpoint_worker
    model_dir = work / "model"
    codes, out = run_tf_config_job(work, "kill_saving")
    assert codes == [-9, 1], out
    assert "[rank 0] KILLED while saving" in out, out
    assert_fault_named(out, 1, 0, TCP_CLOSED_BOUND_SECS, f".1:{TF_CONFIG_PORT}",
                       what="the process exited or was killed")
    step = worker.SAVE_FAULT_STEP
    assert f"rank 0 was lost; saved global step {step}" in out, out
    left = sorted(os.listdir(model_dir))
    assert not [f for f in left if "_temp" in f], left  # merged by the survivor's save
    expected = trajectory(worker)
    saved = list(range(0, step + 1, worker.EVERY))
    assert_whole_checkpoints(tf, model_dir, saved, expected)

    codes, out = run_tf_config_job(work, "resume")
    assert codes == [0, 0], out
    assert_resumed(work, saved[-1], expected)
    assert_whole_checkpoints(tf, model_dir, list(range(0, worker.TOTAL_STEPS + 1, worker.EVERY)),
                             expected)


def disk_full_checkpoints(work: Path, checkpoint_worker: tuple) -> None:
    """The fault, its checks, the rerun and its checks: the test below names them."""
    worker, tf = checkpoint_worker
    model_dir = work / "model"
    model_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(model_dir)],
                   check=True, timeout=30)
    try:
        codes, out = run_tf_config_job(work, "disk_full")
        assert codes == [1, 1], out
        assert "[rank 0] FAULT disk full after" in out, out
        for rank in range(2):
            seen = re.search(rf"\[rank {rank}\] FAULT_SEEN after [\d.]+ s: (.*)", out)
            assert seen and "No space left on device" in seen.group(1), out
        # Rank 0's training ends with that error: the worker is told it once rank 0 has seen
        # that not every rank failed a step, and saves nothing (the failure may lie in what a
        # save would write).
        assert_fault_named(out, 1, 0, STEP_ERROR_BOUND_SECS, None,
                           what="rank 0 failed: ResourceExhaustedError: ")
        assert "was lost" not in out, out
        (model_dir / "filler").unlink()
        expected = trajectory(worker)
        assert_whole_checkpoints(tf, model_dir, list(range(0, worker.SAVE_FAULT_STEP,
                                                            worker.EVERY)), expected)
    finally:
        # Lazily: a rank's process may still be closing its files in it (the check above has
        # seen every rank's exit code, not its last file closed).
        subprocess.run(["umount", "--lazy", str(model_dir)], check=True, timeout=30)


@needs_emulation
def test_mpi_cut_link_mid_estimator_training_keeps_whole_checkpoints_and_a_rerun_resumes(
        launch):
    """2 hosts x 1 rank over MPI: rank 1 cuts its host's link after step 7. Rank 0 fails
    within the stall limit naming rank 1 and its host, and saves step 7 first; `checkpoint`
    names steps 0, 3, 6, 7, all whole; a healthy rerun starts every rank at step 7 and ends
    where one uninterrupted process on the global batch does."""
    launch()


@needs_emulation
def test_tcp_killed_worker_mid_estimator_training_keeps_whole_checkpoints_and_a_rerun_resumes(
        launch):
    """A TF_CONFIG chief and worker on 2 hosts (the TCP group): the worker is killed (SIGKILL)
    after step 7. The chief fails at once naming rank 1 and its address, and saves step 7 first;
    `checkpoint` names steps 0, 3, 6, 7, all whole; a healthy rerun (the pods restarted) resumes
    at step 7, losing nothing, and ends where one uninterrupted process on the global batch
    does."""
    launch()


@needs_emulation
def test_chief_killed_while_writing_a_checkpoint_leaves_the_survivor_to_save_it_and_a_rerun_resumes(
        launch):
    """A TF_CONFIG chief and worker on 2 hosts: the chief (rank 0, the only writer) kills itself
    in the save of step 6, its shard files written into `model.ckpt-6_temp/` but not merged.
    The worker fails at once naming rank 0 and, now the lowest survivor, saves the step it
    completed, 6, into the chief's model_dir: its save replaces the half-written files, and
    `checkpoint` names steps 0, 3 and 6, all whole; a rerun resumes at step 6 and ends where one
    uninterrupted process on the global batch does."""
    launch()


@needs_emulation
def test_disk_full_in_a_checkpoint_save_fails_every_rank_clearly_and_keeps_the_last_whole_one(
        launch):
    """A TF_CONFIG chief and worker on 2 hosts: rank 0's model_dir is a 512 KiB tmpfs, which it
    fills after step 5. Its save of step 6 fails saying the device has no space left; the worker
    fails with that cause within STEP_ERROR_BOUND_SECS, naming rank 0, and saves nothing;
    `checkpoint` still names steps 0 and 3, both whole."""
    launch()


# ---- every selected test's launch, started at once ---------------------------------------------

def fault_run(options: list, args: list, env: dict | None = None,
              timeout: float = 150) -> Callable[[Path], tuple[int, str]]:
    """A launch that ends with a fault: (exit code, output of all ranks)."""
    return lambda work: run_perseusrun(options, args, env, timeout)


# At most that many launches at a time: the timing bounds of these and of the other module the
# suite runs beside them hold (four at once, with another module's launches, starved a
# rendezvous test's handshakes and a tmpfs' unmount).
AT_ONCE = 2
# Each test's launch, by the test's name, longest first. A checkpoint scenario also takes the
# checkpoint_worker fixture (the worker's module and TensorFlow, for its checks).
LAUNCHES: dict[str, Callable[[Path], object]] = {
    "test_mpi_cut_link_mid_estimator_training_keeps_whole_checkpoints_and_a_rerun_resumes":
        mpi_cut_link_checkpoints,
    "test_tcp_killed_worker_mid_estimator_training_keeps_whole_checkpoints_and_a_rerun_resumes":
        tcp_killed_worker_checkpoints,
    "test_chief_killed_while_writing_a_checkpoint_leaves_the_survivor_to_save_it_and_a_rerun_"
    "resumes": chief_killed_saving_checkpoints,
    "test_disk_full_in_a_checkpoint_save_fails_every_rank_clearly_and_keeps_the_last_whole_one":
        disk_full_checkpoints,
    "test_tcp_frozen_rank_fails_the_others_within_the_silence_limit_naming_it":
        fault_run(["--tcp", "-np", "2"], [WORKER, "stop"]),
    "test_tcp_cut_link_fails_the_other_host_within_the_silence_limit_naming_rank_and_host":
        fault_run(["--tcp", "--emulate-hosts", "2"], [WORKER, "cut"]),
    "test_ranks_waiting_for_a_stuck_rank_0_give_up_after_the_chief_wait_limit":
        fault_run(["-np", "2"], [ROOT / "tests" / "workers" / "fault_chief.py"],
                  {"PERSEUS_CHIEF_WAIT_SECS": "3"}),
    "test_mpi_cut_link_fails_the_other_host_within_the_bound_naming_rank_and_host":
        fault_run(["--emulate-hosts", "2"], [WORKER, "cut"], MPI_LIMITS, timeout=300),
    "test_tcp_frozen_rank_among_4_on_2_hosts_is_named_by_every_survivor":
        fault_run(["--tcp", "--emulate-hosts", "2:2"], [WORKER, "stop", "1", str(2 << 20)],
                  {"PERSEUS_STALL_SHUTDOWN_SECS": str(FROZEN_AMONG_4_BOUND_SECS)}),
    "test_mpi_frozen_rank_is_named_in_a_warning_then_fails_the_others_within_the_bound":
        fault_run(["-np", "2"], [WORKER, "stop"], MPI_LIMITS),
    "test_mpi_frozen_rank_0_fails_the_others_within_the_bound_naming_it":
        fault_run(["-np", "2"], [WORKER, "stop", "0"], MPI_LIMITS),
}
SCENARIOS = (mpi_cut_link_checkpoints, tcp_killed_worker_checkpoints,
             chief_killed_saving_checkpoints, disk_full_checkpoints)


@pytest.fixture(scope="module")
def launches(request):
    """The launches of the selected tests that run, started at once (`-k` starts only its
    tests'; a test skipped for want of emulated hosts starts nothing)."""
    names = {item.originalname for item in selected_tests(request)
             if not any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))}
    chosen = {name: launch for name, launch in LAUNCHES.items() if name in names}
    if any(launch in SCENARIOS for launch in chosen.values()):
        worker = request.getfixturevalue("checkpoint_worker")
        chosen = {name: functools.partial(launch, checkpoint_worker=worker)
                  if launch in SCENARIOS else launch for name, launch in chosen.items()}
    pool = LaunchPool("faults_", chosen, at_once=AT_ONCE)
    yield pool
    pool.close()


@pytest.fixture
def launch(launches, request) -> Callable[[], object]:
    """This test's launch: calling it waits for its result (or raises what the launch raised)."""
    return functools.partial(launches.result, request.node.originalname)
