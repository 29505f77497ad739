"""A stop requested by a hook on some ranks stops every rank after the same step, equal to one
process on the global batch with the same hook; every rank logs which hook asked, where, when.

The cases of tests/workers/stop_requests.py (early stopping in train_and_evaluate,
make_stop_at_checkpoint_step_hook, a user hook asking on the last rank alone, in an Estimator and
in MonitoredTrainingSession code with SyncReplicasHook or BroadcastGlobalVariablesHook +
DistributedOptimizer) run in four launches at once: perseusrun -np 2 and -np 3, and TF_CONFIG
tasks started by hand (chief + worker, and chief + worker + evaluator). Every rank's variables
and global step are checked against one plain process running the same cases on the whole global
batch (the reference, no perseus_legacy code). A short stall limit makes a rank left waiting in
a collective fail the launch quickly instead of hanging.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import (
    ROOT,
    LaunchPool,
    load_values,
    run_ranks,
    start_logged,
    task_env,
    tf_config_cluster,
    tf_config_env,
    wait_all,
)

WORKER = "tests/workers/stop_requests.py"
MAX_STEPS = 30  # stop_requests.MAX_STEPS
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 300
SECRET = "stop-requests-secret-0123"
# Well above a rank's start-up on a busy machine, well below the 300 s default: a rank left in
# a collective fails the launch in a minute.
STALL = {"PERSEUS_STALL_SHUTDOWN_SECS": "60", "PERSEUS_STALL_WARNING_SECS": "30"}
EVERY = ("early_stopping", "stop_at_checkpoint_step", "request_stop_last_rank",
         "session_sync_replicas", "session_broadcast_hook")
# launch -> (how, ranks, cases)
LAUNCHES = {
    "perseusrun_2": ("perseusrun", 2, EVERY),
    "perseusrun_3": ("perseusrun", 3, ("request_stop_last_rank", "session_sync_replicas")),
    "tf_config": ("tf_config", 2, ("early_stopping", "request_stop_last_rank")),
    "tf_config_evaluator": ("tf_config_evaluator", 2, ("early_stopping",)),
}
# case -> (the hook class the log names, the ranks that ask: "0", "last" or "all")
ASKING = {
    "early_stopping": ("_StopOnPredicateHook", "0"),
    "stop_at_checkpoint_step": ("StopAtStepHook", "all"),
    "request_stop_last_rank": ("StopOnLastRank", "last"),
    "session_sync_replicas": ("StopOnLastRank", "last"),
    "session_broadcast_hook": ("StopOnLastRank", "last"),
}
LOG = re.compile(r"perseus_legacy\[rank (\d+)\]: (\w+) on ranks? ([\d, ]+) requested a stop at "
                 r"global step (\d+); every rank stops after this step")


def run_reference(out: Path) -> Path:
    log = out / "reference.log"
    proc = start_logged([sys.executable, ROOT / WORKER, out, out / "m", "reference", *EVERY], log,
                        task_env())
    assert wait_all([proc], TIMEOUT) == [0], log.read_text()[-8000:]
    return out


def run_launch(name: str, out: Path) -> tuple:
    how, np_, cases = LAUNCHES[name]
    if how == "perseusrun":
        done = run_ranks(np_, WORKER, out, out / "m", "rank", *cases, timeout=TIMEOUT, env=STALL)
        return out, {r: done.stdout for r in range(np_)}
    tasks = [("chief", 0), ("worker", 0)]
    if how == "tf_config_evaluator":
        tasks.append(("evaluator", 0))
    cluster = tf_config_cluster(tasks)
    procs, logs = [], []
    for task_type, index in tasks:
        env = tf_config_env(cluster, task_type, index, {
            "PERSEUS_SECRET": SECRET, "PERSEUS_START_TIMEOUT": "240", **STALL})
        mode = "evaluator" if task_type == "evaluator" else "rank"
        logs.append(out / f"{task_type}.log")
        procs.append(start_logged([sys.executable, ROOT / WORKER, out, out / "m", mode, *cases],
                                  logs[-1], env))
    # The evaluator never ends by itself when early stopping stops training before
    # max_steps (as with tf.estimator): it is ended once the ranks are done.
    codes = wait_all(procs[:2], TIMEOUT)
    wait_all(procs[2:], 0)
    text = {r: logs[r].read_text() for r in range(2)}
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n".join(
        f"--- rank {r}:\n{t[-6000:]}" for r, t in text.items())
    return out, text


@pytest.fixture(scope="module")
def launches():
    """The reference and every launch, started at once in the background."""
    pool = LaunchPool("stop_requests_", {"reference": run_reference, **{
        name: functools.partial(run_launch, name) for name in LAUNCHES}})
    yield pool
    pool.close()


CASES = [(name, case) for name, (_, _, cases) in LAUNCHES.items() for case in cases]


@pytest.mark.parametrize("launch,case", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_every_rank_stops_after_the_same_step_as_one_process_and_logs_the_hook(launches, launch,
                                                                               case):
    out, outputs = launches.result(launch)
    _, size, cases = LAUNCHES[launch]
    ranks = [load_values(out / f"{case}.rank{r}.npz") for r in range(size)]
    for rank, values in enumerate(ranks):
        for name in values:
            np.testing.assert_array_equal(values[name], ranks[0][name],
                                          err_msg=f"rank {rank} differs from rank 0: {name}")
    step = int(ranks[0]["global_step"])
    # With an evaluator task, the early stopping predicate reads the evaluations it wrote by
    # then: when training stops depends on its pace, so only the agreement is checked.
    timed = launch == "tf_config_evaluator" and case == "early_stopping"
    if not timed:
        expected = load_values(launches.result("reference") / f"{case}.reference.npz")
        assert 0 < int(expected["global_step"]) < MAX_STEPS, "the reference did not stop early"
        assert step == int(expected["global_step"]), (step, int(expected["global_step"]))
        for name in expected:
            np.testing.assert_allclose(ranks[0][name], expected[name], rtol=RTOL, atol=ATOL,
                                       err_msg=name)
    hook, asking = ASKING[case]
    if timed and step == MAX_STEPS:  # the evaluator was too slow: max_steps stopped training
        hook, asking = "StopAtStepHook", "all"
    asked = {"0": "0", "last": str(size - 1),
             "all": ", ".join(map(str, range(size)))}[asking]
    position = cases.index(case)
    for rank in range(size):
        lines = [m for m in LOG.finditer(outputs[rank]) if int(m.group(1)) == rank]
        assert len(lines) == len(cases), (rank, [m.group(0) for m in lines])
        got = lines[position].groups()
        assert got == (str(rank), hook, asked, str(step)), got
