"""perseus_legacy.run_config() under TF_CONFIG: chief, worker and evaluator started by hand as
separate processes on free localhost ports (no launcher), on TF 2.21 (.venv) and on the real
tf.estimator of TF 2.15.1 (.venv-tf215).

Every job of tests/workers/est_tf_config.py starts at once in the background (its processes
mostly wait on each other); each has a deadline, and the first process of a job that should
succeed and fails ends the others. The chief's final checkpoint is compared with a plain
single-process run on the global batch (the reference, no perseus_legacy code) with numpy:
variables and evaluation metrics within rtol 1e-5, atol 1e-6 (float32 sums in another order).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from harness import (
    ROOT,
    LaunchPool,
    assert_values_close,
    available,
    files_under,
    load_values,
    matrix_env,
    python_for,
    start_logged,
    tf_config_cluster,
    tf_config_env,
    wait_all,
)

WORKER = ROOT / "tests" / "workers" / "est_tf_config.py"
STEPS = 6  # est_tf_config.STEPS
RTOL, ATOL = 1e-5, 1e-6
JOB_TIMEOUT = 360
SECRET = "est-tf-config-secret"

# job -> (TensorFlow, cluster jobs and their sizes, tasks started: (type, index, max_steps),
#         extra environment, whether every task should exit 0)
JOBS = {
    "main": ("main", {"chief": 1, "worker": 1, "evaluator": 1},
             [("evaluator", 0, STEPS), ("chief", 0, STEPS), ("worker", 0, STEPS)], {}, True),
    "tf215": ("tf215", {"chief": 1, "worker": 1, "evaluator": 1},
              [("evaluator", 0, STEPS), ("chief", 0, STEPS), ("worker", 0, STEPS)], {}, True),
    "no_evaluator": ("main", {"chief": 1, "worker": 1},
                     [("chief", 0, STEPS), ("worker", 0, STEPS)], {}, True),
    "ps": ("main", {"chief": 1, "worker": 1, "ps": 1},
           [("chief", 0, STEPS), ("worker", 0, STEPS), ("ps", 0, STEPS)], {}, False),
    "max_steps": ("main", {"chief": 1, "worker": 1},
                  [("chief", 0, STEPS), ("worker", 0, STEPS + 2)], {}, False),
    "deleted_checkpoint": ("main", {"chief": 1, "worker": 1, "evaluator": 1},
                           [("evaluator", 0, STEPS), ("chief", 0, STEPS), ("worker", 0, STEPS)],
                           {"EST_DELETED_CHECKPOINT": "1"}, True),
    "evaluator_timeout": ("main", {"chief": 1, "worker": 1, "evaluator": 1},
                          [("evaluator", 0, STEPS)], {"PERSEUS_EVALUATOR_TIMEOUT_SECS": "3"},
                          False),
}


def job_env(version: str, cluster: dict, task_type: str, index: int, extra: dict) -> dict:
    result = tf_config_env(cluster, task_type, index, {
        "PERSEUS_SECRET": SECRET, "PERSEUS_START_TIMEOUT": "300", **extra}, base=matrix_env())
    if version == "tf215":
        result["TF_USE_LEGACY_KERAS"] = "0"  # TF 2.15's tf.keras is Keras 2 (no tf-keras there)
    return result


def run_reference(version: str, out: Path) -> dict:
    log = out / "reference.log"
    proc = start_logged([python_for(version), WORKER, out, out / "model", "reference"], log,
                        matrix_env())
    codes = wait_all([proc], JOB_TIMEOUT, stop_on_failure=True)
    assert codes == [0], f"the reference exited {codes}:\n{log.read_text()[-8000:]}"
    return {"record": json.loads((out / "reference.json").read_text()),
            "variables": load_values(out / "reference.npz")}


def run_job(name: str, out: Path) -> dict:
    version, sizes, tasks, extra, ok = JOBS[name]
    cluster = tf_config_cluster([(job, i) for job, n in sizes.items() for i in range(n)])
    model_dir = out / "model"
    procs = []
    for task_type, index, max_steps in tasks:
        who = f"{task_type}{index}"
        procs.append(start_logged(
            [python_for(version), WORKER, out, model_dir, "task", who, max_steps],
            out / f"{who}.log", job_env(version, cluster, task_type, index, extra)))
    codes = wait_all(procs, JOB_TIMEOUT, stop_on_failure=ok)
    result = {"codes": {}, "outputs": {}, "records": {}, "variables": {},
              "model_dir": model_dir, "cluster": cluster}
    for (task_type, index, _), code in zip(tasks, codes):
        who = f"{task_type}{index}"
        result["codes"][who] = code
        result["outputs"][who] = (out / f"{who}.log").read_text()
        if (out / f"{who}.json").exists():
            result["records"][who] = json.loads((out / f"{who}.json").read_text())
        if (out / f"{who}.npz").exists():
            result["variables"][who] = load_values(out / f"{who}.npz")
    result["everything"] = "\n".join(f"--- {who} exited {result['codes'][who]}:\n{text}"
                                     for who, text in result["outputs"].items())
    return result


class Jobs:
    """Every job and reference, started at once; results per job."""

    def __init__(self) -> None:
        versions = sorted({spec[0] for spec in JOBS.values() if available(spec[0])})
        launches = {f"{v}_reference": functools.partial(run_reference, v) for v in versions}
        launches.update({name: functools.partial(run_job, name) for name, spec in JOBS.items()
                         if available(spec[0])})
        self.pool = LaunchPool("tf_config_estimator_", launches)

    def job(self, name: str) -> dict:
        python_for(JOBS[name][0])  # skips or fails, with the reason, when the venv is missing
        return self.pool.result(name)

    def reference(self, version: str) -> dict:
        return self.pool.result(f"{version}_reference")


@pytest.fixture(scope="module")
def jobs():
    result = Jobs()
    yield result
    result.pool.close()


@pytest.mark.parametrize("name", ["main", "tf215"])
def test_chief_worker_and_evaluator_train_like_one_process_and_the_evaluator_exports(jobs, name):
    """Chief + worker train synchronously over the TCP group, no TF server anywhere; the
    evaluator, no rank, evaluates the chief's checkpoints up to the final one, writes
    model_dir/eval and a LatestExporter export, and exits. The chief's final checkpoint and the
    evaluator's final metrics equal the reference's; the worker wrote only into its private
    (removed) model_dir, and nothing there."""
    job = jobs.job(name)
    everything = job["everything"]
    assert job["codes"] == {"evaluator0": 0, "chief0": 0, "worker0": 0}, everything
    reference = jobs.reference(JOBS[name][0])
    chief_values = job["variables"]["chief0"]
    assert int(chief_values["global_step"]) == STEPS
    assert_values_close(chief_values, reference["variables"], f"{name} chief checkpoint")

    records = job["records"]
    for who, record in records.items():
        assert record["servers"] == [], (who, record)
    for who in ("chief0", "worker0"):  # TF would see a distributed config, theirs is local
        record = records[who]
        assert not record["cluster_spec"] and record["plain_cluster_spec"], (who, record)
    assert (records["chief0"]["rank"], records["worker0"]["rank"]) == (0, 1)
    assert records["chief0"]["result"] is None and records["worker0"]["result"] is None
    assert records["worker0"]["model_dir"] != str(job["model_dir"])
    assert records["worker0"]["private_files"] == [], records["worker0"]
    assert not Path(records["worker0"]["model_dir"]).exists()  # removed at exit

    evaluator = records["evaluator0"]
    assert evaluator["rank"] is None and evaluator["model_dir"] == str(job["model_dir"])
    final = evaluator["eval_events"][str(STEPS)]
    expected = reference["record"]["metrics"]
    for tag in ("accuracy", "loss", "average_loss"):
        np.testing.assert_allclose(final[tag], expected[tag], rtol=RTOL, atol=ATOL, err_msg=tag)
    assert max(int(step) for step in evaluator["eval_events"]) == STEPS
    assert any(f.endswith("saved_model.pb") for f in evaluator["exports"]), evaluator["exports"]
    written = files_under(job["model_dir"])
    assert "checkpoint" in written and f"model.ckpt-{STEPS}.index" in written, written
    assert any(f.startswith("eval/") for f in written), written


def test_without_an_evaluator_the_chief_evaluates_and_every_rank_returns_its_metrics(jobs):
    """TF_CONFIG with chief + worker only: train_and_evaluate evaluates on the chief, as under
    perseusrun; both ranks return the chief's final metrics, equal to the reference's."""
    job = jobs.job("no_evaluator")
    assert job["codes"] == {"chief0": 0, "worker0": 0}, job["everything"]
    expected = jobs.reference("main")["record"]["metrics"]
    for who, record in job["records"].items():
        got = record["result"]
        assert got is not None and got.keys() == expected.keys(), (who, got)
        assert got["global_step"] == STEPS, (who, got)
        np.testing.assert_allclose([got[k] for k in sorted(got)],
                                   [expected[k] for k in sorted(expected)],
                                   rtol=RTOL, atol=ATOL, err_msg=who)
        assert record["servers"] == [], (who, record)
    assert any(f.startswith("eval/") for f in files_under(job["model_dir"]))


def test_ps_tasks_fail_every_process_clearly(jobs):
    job = jobs.job("ps")
    for who, code in job["codes"].items():
        assert code > 0, (who, job["everything"])
        assert "allreduce training needs no parameter servers" in job["outputs"][who], \
            job["everything"]


def test_ranks_given_different_max_steps_fail_naming_ranks_and_values(jobs):
    job = jobs.job("max_steps")
    for who, code in job["codes"].items():
        assert code > 0, (who, job["everything"])
        assert (f"different max_steps (rank 0: {STEPS}, rank 1: {STEPS + 2})"
                in job["outputs"][who]), job["everything"]
    assert not (job["model_dir"] / "checkpoint").exists()


def test_evaluator_evaluates_the_latest_checkpoint_when_the_chief_deletes_the_one_it_chose(jobs):
    """keep_checkpoint_max=1: the chief deletes step 0's checkpoint after the evaluator chose it
    and before it read it (a file handshake, est_tf_config.py). Before, the evaluator failed;
    now it says so and evaluates the latest checkpoint, up to the final one, whose metrics equal
    the reference's."""
    job = jobs.job("deleted_checkpoint")
    assert job["codes"] == {"evaluator0": 0, "chief0": 0, "worker0": 0}, job["everything"]
    chosen = (job["model_dir"].parent / "chosen").read_text()
    assert chosen == str(job["model_dir"] / "model.ckpt-0"), chosen
    assert (f"perseus_legacy evaluator: {chosen} was deleted before it could be read (the chief "
            "keeps keep_checkpoint_max=1 checkpoints)") in job["outputs"]["evaluator0"], \
        job["everything"]
    events = job["records"]["evaluator0"]["eval_events"]
    assert "0" not in events and max(int(step) for step in events) == STEPS, events
    expected = jobs.reference("main")["record"]["metrics"]
    for tag in ("accuracy", "loss", "average_loss"):
        np.testing.assert_allclose(events[str(STEPS)][tag], expected[tag], rtol=RTOL, atol=ATOL,
                                   err_msg=tag)
    checkpoints = [f for f in files_under(job["model_dir"])
                   if f.startswith("model.ckpt") and f.endswith(".index")]
    assert checkpoints == [f"model.ckpt-{STEPS}.index"], checkpoints


def test_evaluator_without_checkpoints_times_out_clearly(jobs):
    job = jobs.job("evaluator_timeout")
    assert job["codes"]["evaluator0"] > 0, job["everything"]
    output = job["outputs"]["evaluator0"]
    assert "EvaluatorTimeoutError" in output and "no new checkpoint at all" in output, output
    assert "PERSEUS_EVALUATOR_TIMEOUT_SECS" in output, output


def test_evaluator_config_joins_no_group_and_takes_its_timeout(monkeypatch, tmp_path):
    """In this process (no launch): the evaluator's run_config() is tf.estimator's evaluator
    config, initialises nothing, and reads its timeout from the argument or the variable."""
    import perseus_legacy as pl

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "evaluator", "index": 0}}))
    monkeypatch.setenv("PERSEUS_EVALUATOR_TIMEOUT_SECS", "7")
    config = pl.run_config(model_dir=str(tmp_path))
    assert (config.task_type, config.model_dir, config.evaluator_timeout_secs) == (
        "evaluator", str(tmp_path), 7.0)
    assert not config.cluster_spec and not pl.is_initialized()
    unlimited = pl.run_config(model_dir=str(tmp_path), evaluator_timeout_secs=0)
    assert unlimited.evaluator_timeout_secs == 0
    monkeypatch.setenv("PERSEUS_EVALUATOR_TIMEOUT_SECS", "soon")
    with pytest.raises(ValueError, match="PERSEUS_EVALUATOR_TIMEOUT_SECS='soon'"):
        pl.run_config(model_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"evaluator_timeout_secs=-1\)"):
        pl.run_config(model_dir=str(tmp_path), evaluator_timeout_secs=-1)


def test_evaluator_fails_after_five_deleted_checkpoints_in_a_row(monkeypatch, tmp_path):
    """In this process: an evaluation pass whose checkpoint is always gone by the time it is
    read (each a new one) is retried on the latest; the fifth in a row fails, telling the user
    to raise keep_checkpoint_max. A failure while the checkpoint still exists is not retried."""
    import types

    import perseus_legacy as pl
    from perseus_legacy.estimator import _training

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "evaluator", "index": 0}}))
    config = pl.run_config(model_dir=str(tmp_path), keep_checkpoint_max=2)
    chosen = []

    def latest_checkpoint() -> str:  # a newer checkpoint each time, deleted at once
        chosen.append(str(tmp_path / f"model.ckpt-{2 * len(chosen)}"))
        return chosen[-1]

    def evaluate(executor):
        raise ValueError(f"The passed save_path is not a valid checkpoint: {chosen[-1]}")

    estimator = types.SimpleNamespace(config=config, model_dir=str(tmp_path),
                                      latest_checkpoint=latest_checkpoint)
    executor = types.SimpleNamespace(_estimator=estimator)
    with pytest.raises(_training.CheckpointDeletedError,
                       match=r"deleted 5 checkpoints in a row .* the last .*model\.ckpt-\d+ "
                             r"\(keep_checkpoint_max=2\).* raise keep_checkpoint_max"):
        _training._evaluate_and_export(evaluate, executor)
    assert len(set(chosen)) >= 5, chosen  # each retry took the latest checkpoint anew

    (tmp_path / "model.ckpt-0.index").write_bytes(b"")  # still there: a failure of its own
    estimator.latest_checkpoint = lambda: str(tmp_path / "model.ckpt-0")
    chosen.append(estimator.latest_checkpoint())
    with pytest.raises(ValueError, match="not a valid checkpoint"):
        _training._evaluate_and_export(evaluate, executor)
