"""`perseusrun --restarts`: a lost rank costs no completed step. The lowest surviving rank saves
the last completed step where rank 0 saves checkpoints, every survivor says so, and the launcher
starts the job again without the lost host, from that checkpoint, as long as --min-np ranks
remain (else it ends with an error). Real ranks on emulated hosts over TCP, each launch bounded;
the variables are checked against numpy on the same sequence of global batches. Over MPI,
where mpirun ends the survivors at once, the restart resumes from rank 0's periodic checkpoint.

Workers: tests/workers/restart_estimator.py (an unchanged Estimator with run_config()) and
tests/workers/restart_monitored.py (MonitoredTrainingSession + SyncReplicasHook).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from harness import (
    ROOT,
    assert_resumed,
    assert_whole_checkpoints,
    failure_summary,
    needs_emulation,
    run_perseusrun,
    worker_module,
)

from perseusrun import launch, supervise

ESTIMATOR_WORKER = ROOT / "tests" / "workers" / "restart_estimator.py"
MONITORED_WORKER = ROOT / "tests" / "workers" / "restart_monitored.py"
TIMEOUT = 240


@pytest.fixture(scope="module")
def restart_worker():
    """restart_estimator (its steps, data and numpy reference) and tensorflow, for the checks."""
    worker = worker_module("restart_estimator")  # imports perseus_legacy first
    import tensorflow as tf

    return worker, tf


def processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain `text` (a test's own directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in argv:
            found.append(argv)
    return found


def assert_clean(model_dir: Path, tmp_path: Path, out: str) -> None:
    """No half-written checkpoint in model_dir, no process of the job left."""
    left = sorted(os.listdir(model_dir))
    assert not [name for name in left if "_temp" in name or "tempstate" in name], left
    assert not processes_mentioning(str(tmp_path)), out


@needs_emulation
def test_estimator_resumes_on_the_other_host_from_the_step_rank_2_saved_when_ranks_0_and_1_die(
        tmp_path, restart_worker):
    """2 hosts x 2 ranks over TCP, `--restarts 1 --min-np 2`: host h0's ranks 0 and 1 (rank 0
    the only writer) are killed after step 5, between checkpoints 4 and 8. The survivors may
    each see another of them go; they agree that rank 2, the lowest survivor, saves step 5 into
    rank 0's model_dir, and every survivor's line says so. The job restarts on h1's 2 ranks,
    saying it resumes from step 5, and does on every rank: the final variables equal numpy's on
    4-rank batches for steps 0-4, 2-rank ones after."""
    worker, tf = restart_worker
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    out_dir.mkdir()
    code, out = run_perseusrun(
        ["--tcp", "--emulate-hosts", "2:2", "--restarts", "1", "--min-np", "2"],
        [ESTIMATOR_WORKER, model_dir, out_dir, "0,1"], {"TMPDIR": str(tmp_path)},
        timeout=TIMEOUT)
    assert code == 0, f"exit {code}:\n{failure_summary(out)}\n{out}"
    fault = worker.FAULT_STEP
    for rank in (0, 1):
        assert f"[rank {rank}] KILLED after step {fault}" in out, out
    saved = f"{model_dir}/model.ckpt-{fault}"
    agreed = re.search(rf"perseus_legacy\[rank 2\]: rank [01] was lost; saved global step "
                       rf"{fault}: {re.escape(saved)} \(saver agreed in ([\d.]+) s\)", out)
    assert agreed, out
    print(f"the survivors agreed on the saver in {agreed.group(1)} s")
    # Rank 3 reads rank 2's claim, or (when it comes later) the checkpoint rank 2 saved.
    assert re.search(rf"perseus_legacy\[rank 3\]: rank [01] was lost; (rank 2 saves the last "
                     rf"completed step \(global step {fault}\) in {re.escape(str(model_dir))}|"
                     rf"global step {fault} was already saved: {re.escape(saved)})", out), out
    assert re.search(rf"perseusrun: rank 0, 1 lost with host \S+h0; restart 1 of 1 on 2 ranks "
                     rf"\(\S+h1:2\), from global step {fault}, saved by a survivor: "
                     rf"{re.escape(saved)}\n", out), out
    # The graph's guarantee behind "the survivors hold the last completed step", on every rank.
    assert len(re.findall(r"every update waits for the 2 gradient collectives", out)) == 6, out

    sizes = [worker.FIRST_SIZE] * fault + [2] * (worker.TOTAL_STEPS - fault)
    expected = worker.reference(sizes)
    assert_whole_checkpoints(tf, model_dir, [0, worker.EVERY, fault, worker.TOTAL_STEPS],
                             expected)
    assert_resumed(out_dir, fault, expected, ranks=2)
    assert_clean(model_dir, tmp_path, out)
    assert not list(model_dir.glob(".survivor-save-*")), sorted(os.listdir(model_dir))


@needs_emulation
def test_monitored_session_survivor_saves_the_last_step_and_too_few_ranks_left_is_an_error(
        tmp_path, restart_worker):
    """2 hosts over TCP, `--restarts 1` (--min-np defaults to -np 2): rank 1 is killed after
    step 5. Rank 0 saves step 5 (checkpoint_dir() told every rank where); the launcher does not
    restart on 1 rank and ends with an error saying why, with the job's failure code."""
    worker, tf = restart_worker
    model_dir = tmp_path / "model"
    code, out = run_perseusrun(["--tcp", "--emulate-hosts", "2", "--restarts", "1"],
                               [MONITORED_WORKER, model_dir], {"TMPDIR": str(tmp_path)},
                               timeout=TIMEOUT)
    assert code not in (0, supervise.TIMEOUT_EXIT_CODE), out
    fault = worker.FAULT_STEP
    assert (f"perseus_legacy[rank 0]: rank 1 was lost; saved global step {fault}: "
            f"{model_dir}/model.ckpt-{fault}") in out, out
    assert "saver agreed in 0.0 s" in out, out  # rank 0 knew it was the lowest
    assert re.search(r"perseusrun: error: rank 1 lost with host \S+h1: 1 rank\(s\) would "
                     r"remain, fewer than --min-np 2; not restarting", out), out
    assert "restart 1 of 1" not in out and "UNEXPECTED" not in out, out
    expected = worker.reference([2] * worker.TOTAL_STEPS)
    assert_whole_checkpoints(tf, model_dir, [0, worker.EVERY, fault], expected)
    assert_clean(model_dir, tmp_path, out)


@needs_emulation
def test_a_forged_frame_fails_the_job_without_dropping_the_innocent_host(tmp_path):
    """2 hosts over TCP, `--restarts 1 --min-np 1`: after step 5 rank 1 writes a forged abort
    notice into its control connection to rank 0 (as a party on the path could). Rank 0 acts on
    nothing of it and the job fails naming rank 1's frame; nobody was lost, so no survivor
    saves and the launcher does not restart without rank 1's host (before, the error's "rank 1
    (address)" made rank 0 report rank 1 lost, and the job went on without its host)."""
    code, out = run_perseusrun(
        ["--tcp", "--emulate-hosts", "2", "--restarts", "1", "--min-np", "1"],
        [MONITORED_WORKER, tmp_path / "model", "forge"], {"TMPDIR": str(tmp_path)},
        timeout=TIMEOUT)
    assert code not in (0, supervise.TIMEOUT_EXIT_CODE), out
    assert "[rank 1] FORGED a frame after step 5" in out, out
    assert re.search(r"rank 1 \(\S+\) sent control frame \d+ with a MAC that does not match",
                     out), out
    assert "was lost" not in out and "restart 1 of 1" not in out, out
    assert "perseusrun: the job failed (exit 1) without a lost rank: not restarting" in out, out
    assert "INJECTED" not in out, out


def test_mpi_job_restarts_from_rank_0s_last_periodic_checkpoint_redoing_the_steps_since(
        tmp_path, restart_worker):
    """What an MPI job loses: 4 local ranks under mpirun, `--restarts 1`; rank 0 is killed
    after step 5. mpirun ends the survivors before any can save and names the dead rank; the
    launcher starts the 4 ranks again (one machine: no host to leave out), which resume from
    rank 0's periodic checkpoint of step 4 and train step 5 again."""
    worker, tf = restart_worker
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    out_dir.mkdir()
    code, out = run_perseusrun(["-np", "4", "--restarts", "1"],
                               [ESTIMATOR_WORKER, model_dir, out_dir], {"TMPDIR": str(tmp_path)},
                               timeout=TIMEOUT)
    assert code == 0, f"exit {code}:\n{failure_summary(out)}\n{out}"
    assert "was lost;" not in out, out  # no survivor lived to save
    assert re.search(r"noticed that process rank 0 with PID \d+ on node \S+ exited on", out), out
    assert ("perseusrun: rank 0 lost; restart 1 of 1 on 4 ranks (localhost:4), from the last "
            "checkpoint rank 0 wrote (no survivor saved the last completed step)") in out, out
    expected = worker.reference([worker.FIRST_SIZE] * worker.TOTAL_STEPS)
    assert_whole_checkpoints(tf, model_dir, [0, worker.EVERY, 2 * worker.EVERY,
                                             worker.TOTAL_STEPS], expected)
    assert_resumed(out_dir, worker.EVERY, expected, ranks=4)
    assert_clean(model_dir, tmp_path, out)


def test_restarts_leave_out_the_lost_ranks_host_of_a_host_list_and_stop_below_min_np(capsys):
    """The relaunch loop on -H a:2,b:2,c:1 (mpirun's by-slot placement), with a stand-in for the
    job: rank 2 (host b) lost, then rank 0 (host a); this machine's ranks are never left out."""
    from perseusrun import restarts

    args = launch.parse_args(["-np", "5", "-H", "a:2,b:2,c:1", "--restarts", "3",
                              "--min-np", "2", "python", "x"])
    placement = restarts.placement_of([("a", 2), ("b", 2), ("c", 1)], 5)
    assert placement == ["a", "a", "b", "b", "c"]
    runs, losses = [], [{2}, {0}, {0}]

    def run_once(placed: list, lost: set, left: float | None) -> int:
        runs.append(list(placed))
        lost.update(losses[len(runs) - 1])
        if placed == placement:  # a survivor's line says which step it saved
            lost.read("perseus_legacy[rank 0]: rank 2 was lost; saved global step 7: "
                      "/m/model.ckpt-7 (saver agreed in 0.0 s)")
        return 1

    assert restarts.run_with_restarts(args, placement, run_once, local=lambda h: False) == 1
    assert runs == [["a", "a", "b", "b", "c"], ["a", "a", "c"]], runs
    err = capsys.readouterr().err
    assert ("rank 2, 3 lost with host b; restart 1 of 3 on 3 ranks (a:2, c:1), from global "
            "step 7, saved by a survivor: /m/model.ckpt-7\n") in err, err
    assert ("error: rank 0, 1 lost with host a: 1 rank(s) would remain, fewer than --min-np 2; "
            "not restarting") in err, err

    # This machine's ranks start again as many; a failure without a lost rank ends the job.
    runs.clear()
    losses[:] = [{1}, set()]
    assert restarts.run_with_restarts(args, ["localhost"] * 2, run_once) == 1
    assert runs == [["localhost"] * 2] * 2, runs
    err = capsys.readouterr().err
    assert ("rank 1 lost; restart 1 of 3 on 2 ranks (localhost:2), from the last checkpoint rank "
            "0 wrote (no survivor saved the last completed step)") in err, err
    assert "the job failed (exit 1) without a lost rank: not restarting" in err, err


def test_min_np_above_np_is_a_usage_error():
    assert launch.main(["--tcp", "-np", "2", "--restarts", "1", "--min-np", "3", "python",
                        "x"]) == 2
    assert launch.main(["--tcp", "-np", "2", "--restarts", "-1", "python", "x"]) == 2


def test_batch_norm_moving_statistics_advance_in_a_step_whose_gradient_fails(restart_worker):
    """What a survivor's checkpoint holds of batch normalization (docs/design.md): the usual
    TF1 pattern runs the moving-statistics updates (UPDATE_OPS) as control dependencies of the
    train op, next to the gradients, not after them. A step whose gradient fails (as a
    collective does when a rank is lost) leaves the weights as they were, yet the moving mean
    has advanced: the step's statistics are in what the survivor saves. Checked in one process
    with a gradient that fails on purpose, against numpy's moving mean."""
    _, tf = restart_worker
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = tf.Graph()
    with graph.as_default():
        features = tf.constant(x)
        normalized = tf.compat.v1.layers.batch_normalization(features, momentum=0.5,
                                                             training=True)
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]))
        loss = tf.reduce_mean(tf.matmul(normalized, w))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        grads = optimizer.compute_gradients(loss, [w])
        failing = [(tf.debugging.check_numerics(g / 0.0, "lost rank"), v) for g, v in grads]
        with tf.control_dependencies(tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.apply_gradients(failing)
        [moving] = [v for v in tf.compat.v1.global_variables() if "moving_mean" in v.name]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError, match="lost rank"):
                session.run(train_op)
            after, weights = session.run([moving, w])
    np.testing.assert_array_equal(weights, np.ones([3, 1]))  # no update
    np.testing.assert_allclose(after, 0.5 * x.mean(axis=0), rtol=1e-6)  # one more update
