"""The tf.estimator surface on N ranks, one test per case of estimator_surface.py's matrix.

Every launch starts at once (module fixture) and runs its cases of tests/workers/est_surface.py
in sequence, each in a fresh graph and model_dir:
  np2       perseusrun -np 2: the "equal" and "refused" cases
  stops     perseusrun -np 2: the stopping cases, with a short PERSEUS_STALL_SHUTDOWN_SECS (a
            rank left waiting fails fast instead of stalling)
  np3       perseusrun -np 3: the cases where an odd count changes the slices
  tf_config chief + worker + evaluator started by hand with TF_CONFIG
  reference one plain process on the global batch, every case
The tests compare each case's per-rank record with the reference's: "every" values on every rank
(variables, steps: rtol 1e-5, atol 1e-6), "chief" values (metrics, predictions, exports, files
written, logs) on rank 0; on the other ranks every "chief" value must be empty (nothing written).
A hook's exception on one rank is also checked for what the other rank's error says.
Besides, the matrix must classify exactly the public symbols of the installed TensorFlow, and
docs/estimator.md's table must be the matrix's.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
from pathlib import Path

import estimator_surface as surface
import harness
import numpy as np
import pytest
from harness import ROOT, VERSIONS, command, finish, start

WORKER = "tests/workers/est_surface.py"
RTOL, ATOL = 1e-5, 1e-6  # float32 sums in another order
LAUNCH_TIMEOUT = 1200
STALL_SECS = 20  # the stopping launch: a rank left waiting fails after this
SECRET = "est-surface-secret"

LAUNCHES = {  # name -> (ranks, cases, extra environment)
    "np2": (2, surface.cases(surface.EQUAL) + surface.cases(surface.DIFFERS)
            + surface.cases(surface.REFUSED), {}),
    "stops": (2, surface.cases(surface.STOPS), {"PERSEUS_STALL_SHUTDOWN_SECS": str(STALL_SECS),
                                                "PERSEUS_STALL_WARNING_SECS": "5"}),
    "np3": (3, list(surface.ODD_CASES), {}),
}
ALL_CASES = list(dict.fromkeys(c for _, cases, _ in LAUNCHES.values() for c in cases))
REFUSAL = {  # case -> what its error must say (the estimator or op, and why)
    "kmeans": r"(?is)kmeans.*(per[- ]rank|each rank)|(per[- ]rank|each rank).*kmeans",
    "tpu_estimator": r"(?i)tpu_config\.RunConfig",
}


def run_reference(out: Path) -> dict:
    proc = start("main", [ROOT / WORKER, out, "reference", ",".join(ALL_CASES)])
    [(code, log)] = finish([proc], LAUNCH_TIMEOUT)
    return {"records": [read(out, "reference")], "code": code, "log": log}


def run_launch(name: str, out: Path) -> dict:
    ranks, cases, extra = LAUNCHES[name]
    cmd = command(ranks, WORKER, (out, "distributed", ",".join(cases)), timeout=LAUNCH_TIMEOUT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=harness.launch_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    [(code, log)] = finish([proc], LAUNCH_TIMEOUT + 60)
    return {"records": [read(out, f"rank{r}") for r in range(ranks)], "code": code, "log": log}


def run_tf_config(out: Path) -> dict:
    tasks = [("chief", 0), ("worker", 0), ("evaluator", 0)]
    cluster = harness.tf_config_cluster(tasks)
    procs, logs = [], []
    for kind, index in tasks:
        env = harness.tf_config_env(cluster, kind, index, {
            "PERSEUS_SECRET": SECRET, "PERSEUS_START_TIMEOUT": "300"}, base=harness.matrix_env())
        logs.append(out / f"{kind}{index}.log")
        procs.append(harness.start_logged(
            [ROOT / ".venv" / "bin" / "python", ROOT / WORKER, out, "task", f"{kind}{index}",
             ",".join(surface.TF_CONFIG_CASES)], logs[-1], env))
    codes = harness.wait_all(procs, LAUNCH_TIMEOUT, stop_on_failure=True)
    return {"records": {f"{k}{i}": read(out, f"{k}{i}") for k, i in tasks},
            "code": max(codes, key=abs),
            "log": "\n".join(f"--- {p.name}:\n{p.read_text()[-6000:]}" for p in logs)}


def read(out: Path, who: str) -> dict:
    path = out / f"{who}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def runs():
    """Every launch and the reference, started at once; each one's records once it ended."""
    pool = harness.LaunchPool("estimator_surface_", {
        "reference": run_reference, "tf_config": run_tf_config,
        **{name: functools.partial(run_launch, name) for name in LAUNCHES}})
    yield pool
    pool.close()


def case_data(run: dict, case: str, who: str, record: dict) -> dict:
    """One process's record of `case`; fails with its traceback, or with the launch's output
    when it ended before the case."""
    if case not in record:
        pytest.fail(f"{who} recorded no result for {case!r}: its launch exited {run['code']} "
                    f"before. Output:\n{run['log'][-8000:]}", pytrace=False)
    if not record[case]["ok"]:
        pytest.fail(f"{case!r} raised on {who}:\n{record[case]['error']}", pytrace=False)
    return record[case]["data"]


def assert_same(got, expected, path: str) -> None:
    """Floats within RTOL/ATOL, everything else (names, steps, files, strings) equal."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), (
            f"{path}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(expected)}")
        for key in expected:
            assert_same(got[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, float) or (isinstance(expected, list) and expected and all(
            isinstance(v, (float, list)) for v in expected) and np.asarray(
            expected, dtype=object).size and _numeric(expected)):
        np.testing.assert_allclose(np.asarray(got, float), np.asarray(expected, float),
                                   rtol=RTOL, atol=ATOL, err_msg=path)
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def _numeric(value) -> bool:
    try:
        return np.asarray(value, float).size > 0
    except (TypeError, ValueError):
        return False


def empty(value) -> bool:
    """Nothing written or logged: only empty lists and dicts, or None."""
    if isinstance(value, dict):
        return all(empty(v) for v in value.values())
    return value in (None, [], {})


def assert_like_one_process(runs, launch: str, case: str) -> None:
    run, reference = runs.result(launch), runs.result("reference")
    expected = case_data(reference, case, "the reference", reference["records"][0])
    for rank, record in enumerate(run["records"]):
        got = case_data(run, case, f"rank {rank}", record)
        assert_same(got.get("every"), expected.get("every"), f"rank {rank}: {case}/every")
        if rank == 0:
            assert_same(got.get("chief"), expected.get("chief"), f"rank 0: {case}/chief")
        else:
            assert empty(got.get("chief")), (rank, "wrote or logged", got.get("chief"))
            assert empty(got.get("private_files")), (rank, "private model_dir",
                                                     got["private_files"])


def expecting_differences(cases: list) -> list:
    """`cases`, those of a DIFFERS entry as expected failures naming why (strict: once one
    passes, its entry must say what it does now)."""
    return [pytest.param(case, marks=pytest.mark.xfail(strict=True, reason="; ".join(reasons)))
            if (reasons := [e.note for e in surface.ENTRIES if case in e.cases()
                            and e.outcome == surface.DIFFERS]) else case
            for case in cases]


@pytest.mark.parametrize("case", expecting_differences(
    surface.cases(surface.EQUAL) + surface.cases(surface.DIFFERS)))
def test_case_on_2_ranks_equals_one_process_on_the_global_batch(runs, case):
    assert_like_one_process(runs, "np2", case)


@pytest.mark.parametrize("case", list(surface.ODD_CASES))
def test_case_on_3_ranks_equals_one_process_on_the_global_batch(runs, case):
    assert_like_one_process(runs, "np3", case)


@pytest.mark.parametrize("case", expecting_differences(surface.cases(surface.STOPS)))
def test_every_rank_stops_after_the_step_one_process_stops_at(runs, case):
    """A stop decided on one rank only (or by a hook reading rank 0's model_dir) stops every
    rank after the same step as one process, with its variables."""
    assert_like_one_process(runs, "stops", case)


@pytest.mark.parametrize("case, hook, error", [
    ("nan_on_one_rank", "NanTensorHook", "NanLossDuringTrainingError"),
    ("hook_raises_on_one_rank", "RaiseOn", "ValueError")])
def test_a_hook_exception_on_one_rank_is_raised_by_every_rank_naming_that_rank_and_step(
        runs, case, hook, error):
    """The cases (equal to one process above) where rank 1's hook raises in after_run after
    global step 3 (NaN in the batch of step index 2; a ValueError at step 3): rank 1 raises its
    own error, rank 0 the same class, whose traceback names the hook, rank 1 and the step, not
    a lost peer."""
    run = runs.result("stops")
    said = [case_data(run, case, f"rank {rank}", record)["said"]
            for rank, record in enumerate(run["records"])]
    assert re.search(rf"{error}: ", said[1]) and "perseus_legacy" not in said[1], said
    assert re.search(rf"{error}: .*\n.*{hook}\.after_run raised {error} on rank 1 at global "
                     r"step 3; every rank raises it", said[0]), said
    own = said[1].split(": ", 1)[1].strip()  # rank 1's message, one process's
    if own != "NaN loss during training.":  # a class that keeps no message of its own
        assert f"rank 1 failed: {error}: {own} ({hook}.after_run, global step 3)" in said[0], said


@pytest.mark.parametrize("case", surface.cases(surface.REFUSED))
def test_case_is_refused_on_every_rank_before_training(runs, case):
    run = runs.result("np2")
    for rank, record in enumerate(run["records"]):
        got = case_data(run, case, f"rank {rank}", record)
        assert got["error"] is not None, f"rank {rank} trained {case!r} without an error"
        assert re.search(REFUSAL[case], got["error"]["message"]), (rank, got["error"])
        assert got["every"]["trained_step"] is None, (rank, "a checkpoint was written", got)


@pytest.mark.parametrize("case", list(surface.TF_CONFIG_CASES))
def test_tf_config_chief_worker_and_evaluator_equal_one_process(runs, case):
    """Chief and worker train like one process (the evaluator task evaluates and exports, into
    the shared model_dir): their variables equal the reference's; the evaluator's export serves
    what the reference's serves."""
    run, reference = runs.result("tf_config"), runs.result("reference")
    expected = case_data(reference, case, "the reference", reference["records"][0])
    for who, record in run["records"].items():
        got = case_data(run, case, who, record)
        if who == "evaluator0":
            assert_same(got["chief"]["served"], expected["chief"]["served"], f"{who}: served")
            continue
        every = {k: v for k, v in got["every"].items() if k not in ("metrics", "exports")}
        want = {k: v for k, v in expected["every"].items() if k not in ("metrics", "exports")}
        assert_same(every, want, f"{who}: {case}/every")


def worker_cases() -> list:
    """The names of the worker's CASES dict, read from its source (no TensorFlow here)."""
    tree = ast.parse((ROOT / WORKER).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["CASES"]:
            return [key.value for key in node.value.keys]
    raise AssertionError("no CASES in the worker")


def test_every_case_named_by_the_matrix_is_a_case_of_the_worker_and_the_reverse():
    named = {c for e in surface.ENTRIES for c in e.cases()} | set(surface.STOP_CASES)
    assert named == set(worker_cases()), (sorted(named - set(worker_cases())),
                                          sorted(set(worker_cases()) - named))
    assert named == set(ALL_CASES), ("named but run by no launch", sorted(named - set(ALL_CASES)))
    for entry in surface.ENTRIES:
        assert entry.outcome in surface.OUTCOMES and entry.tested_by, entry
        for path in (t.split("::")[0] for t in entry.tested_by if "/" in t):
            assert (ROOT / path).exists(), (entry, path)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_public_symbol_is_in_the_matrix_and_every_entry_exists(version):
    """The installed TensorFlow's public tf.estimator / tf.compat.v1.estimator symbols and
    tf.compat.v1.train hooks, listed by introspection, equal the matrix's."""
    proc = start(version, [Path(surface.__file__), "symbols"])
    [(code, out)] = finish([proc], 300)
    assert code == 0, out[-6000:]
    symbols = [line for line in out.splitlines() if line.startswith("tf.")]
    classified = surface.entries_by_symbol()
    unclassified = sorted(set(symbols) - set(classified))
    gone = sorted(set(classified) - set(symbols))
    assert not unclassified, f"symbols with no entry in estimator_surface.py: {unclassified}"
    assert not gone, f"entries of estimator_surface.py naming no symbol: {gone}"


def test_docs_table_is_the_matrix():
    text = (ROOT / "docs" / "estimator.md").read_text()
    assert surface.markdown_table() in text, (
        "docs/estimator.md's table differs from estimator_surface.py's: paste the output of "
        "`python tests/estimator/estimator_surface.py table` into it")
