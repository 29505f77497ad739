"""The helpers of the launching side of the tests (tests/*.py, tests/estimator/*.py): every way a
test starts ranks or processes, always with a timeout, their environments, waiting for them and
ending them, emulated hosts, other TensorFlow versions' interpreters, and the workers' modules.

A test calls run_ranks(np, "tests/workers/x.py", ...) and gets the finished process; any
non-zero exit, or a launch that outlives its timeout, fails the test with every rank's output.
`controller="tcp"` launches with `perseusrun --tcp`: local ranks over the TCP controller, no MPI.
run_emulated() does the same across emulated hosts (perseusrun --emulate-hosts); processes a test
starts by hand get task_env() and end by wait_all() or finish().

The rank side's helpers (what tests/workers/*.py share) are in tests/workers/worker_util.py.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np
import pytest

from perseus_shared.mpi import MPI_LAUNCHER_VARIABLES
from perseusrun import emulate, supervise, tcp_run

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = ROOT / "tests" / "workers"
PERSEUSRUN = str(BIN / "perseusrun")

# ---- environments ------------------------------------------------------------------------------

# Several ranks share 2 cores: one thread each for TensorFlow, OpenMP and BLAS.
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


def launch_env(extra: dict | None = None) -> dict:
    """This process's environment, quiet and single-threaded, the repo and the workers importable,
    plus `extra`; without a Slurm job's variables (inside an allocation perseusrun would run the
    ranks there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env.update(QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(ROOT), str(WORKERS), env.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


def task_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """The environment of a process started by hand, not by a launcher: `base` (launch_env())
    without any launcher's, TF_CONFIG's or Keras selection's variables, plus `extra`."""
    env = launch_env() if base is None else dict(base)
    for name in ("TF_CONFIG", "TF_USE_LEGACY_KERAS", "PERSEUS_CONTROLLER", "PERSEUS_TCP_RANK",
                 "PERSEUS_TCP_ADDRESSES", *MPI_LAUNCHER_VARIABLES):
        env.pop(name, None)
    env.update(extra or {})
    return env


def rank_env(rank: int, addresses: list[str], secret: str = "rendezvous-test-secret-0123456789",
             start_timeout: float = 60) -> dict:
    """task_env() of `rank` of a TCP job at `addresses`: the variables `perseusrun --tcp` sets,
    for ranks a test starts by hand."""
    return task_env({"PERSEUS_CONTROLLER": "tcp", "PERSEUS_TCP_RANK": str(rank),
                     "PERSEUS_TCP_ADDRESSES": ",".join(addresses), "PERSEUS_SECRET": secret,
                     "PERSEUS_START_TIMEOUT": str(start_timeout)})


# ---- launches ----------------------------------------------------------------------------------

CONTROLLERS = ("mpi", "tcp")


def command(np: int, script: str, args: tuple = (), launcher: str = "perseusrun",
            timeout: float = 180, controller: str = "mpi", python: str | None = None) -> list:
    """The launch command; `python` (default: this one) runs the ranks, and perseusrun too."""
    python = python or sys.executable
    program = [python, str(ROOT / script), *map(str, args)]
    if controller not in CONTROLLERS:
        raise ValueError(f"unknown controller {controller!r}")
    if controller == "tcp" and launcher != "perseusrun":
        raise ValueError("the TCP controller is launched with perseusrun --tcp")
    if launcher == "perseusrun":
        perseusrun = ([str(BIN / "perseusrun")] if python == sys.executable
                      else [python, "-m", "perseusrun"])
        tcp = ["--tcp"] if controller == "tcp" else []
        return [*perseusrun, *tcp, "-np", str(np), "--timeout", str(int(timeout)), *program]
    if launcher == "mpirun":
        return [str(BIN / "mpirun"), "-np", str(np), "--allow-run-as-root", "--oversubscribe",
                "--bind-to", "none", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
                *[a for k in os.environ if k.startswith("PERSEUS_") for a in ("-x", k)],
                *program]
    raise ValueError(f"unknown launcher {launcher!r}")


# Lines that say why a rank failed; TensorFlow's start-up noise about CUDA is not one of them.
_FAILURE_LINE = re.compile(r"(Error|Exception|FAILED|Segmentation fault|exited on signal|"
                           r"timed out)")
_NOISE = ("cuInit", "type_inference", "Type inference")


def failure_summary(out: str, limit: int = 20) -> str:
    """The distinct lines of `out` that name an error, first ones first (at most `limit`)."""
    seen: list[str] = []
    for line in out.splitlines():
        line = line.strip()
        if _FAILURE_LINE.search(line) and not any(n in line for n in _NOISE) and line not in seen:
            seen.append(line)
    return "\n".join(seen[:limit])


def _launch(np: int, script: str, args: tuple, launcher: str, timeout: float, env: dict | None,
            controller: str, python: str | None) -> tuple[subprocess.CompletedProcess, str]:
    """Runs `script` on `np` ranks: the command, its exit code and the output of all ranks, and
    what ended a hang ("" when the ranks ended by themselves within `timeout`)."""
    cmd = command(np, script, args, launcher, timeout, controller, python)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # perseusrun ends the job itself at `timeout`; this is the backstop for mpirun.
        out, _ = proc.communicate(timeout=timeout + 20)
    except subprocess.TimeoutExpired:
        # The launcher forwards SIGTERM to its ranks (which sit in their own process groups).
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        hung = True
    else:
        hung = launcher == "perseusrun" and proc.returncode == supervise.TIMEOUT_EXIT_CODE
    return (subprocess.CompletedProcess(cmd, proc.returncode, out, ""),
            f"timed out after {timeout}s (a hang)" if hung else "")


def run_ranks(np: int, script: str, *args, launcher: str = "perseusrun", timeout: float = 180,
              env: dict | None = None, expect_failure: bool = False,
              controller: str = "mpi", python: str | None = None) -> subprocess.CompletedProcess:
    """Runs `script` on `np` ranks; asserts it exits 0 (or non-zero with expect_failure)."""
    result, hang = _launch(np, script, args, launcher, timeout, env, controller, python)
    cmd, out = result.args, result.stdout
    if hang:
        raise AssertionError(f"{' '.join(cmd)}\n{hang}. Error lines:\n{failure_summary(out)}\n"
                             f"Output:\n{out}")
    failed = result.returncode != 0
    if failed != expect_failure:
        verdict = "failed" if failed else "succeeded but was expected to fail"
        # The summary comes first: a long output may be cut where a report shows it.
        raise AssertionError(
            f"{' '.join(cmd)}\n{verdict} (exit {result.returncode}). Error lines:\n"
            f"{failure_summary(out)}\nOutput of all ranks:\n{out}")
    return result


# ---- named cases: one launch, one test per case ------------------------------------------------

class CaseLaunch:
    """One launch of a worker that runs named cases (worker_util.run_cases): each case's
    verdict on every rank, read from the output."""

    def __init__(self, result: subprocess.CompletedProcess, ranks: int, hang: str = ""):
        self.result, self.ranks, self.hang = result, ranks, hang

    def check(self, case: str) -> None:
        """Fails unless every rank printed `CASE case: OK`, showing the ranks' verdicts."""
        out = self.result.stdout
        verdicts = [line.strip() for line in out.splitlines() if f"] CASE {case}: " in line]
        if sum(line.endswith(f"CASE {case}: OK") for line in verdicts) == self.ranks:
            return
        ended = self.hang or f"exit {self.result.returncode}"
        said = "\n".join(verdicts) or f"no rank reported it: the launch ended first ({ended})"
        raise AssertionError(f"{' '.join(self.result.args)}\ncase {case!r} on {self.ranks} "
                             f"ranks:\n{said}\nError lines:\n{failure_summary(out)}\n"
                             f"Output of all ranks:\n{out}")


def run_cases(np: int, script: str, cases: list[str], *args, launcher: str = "perseusrun",
              timeout: float = 180, env: dict | None = None, controller: str = "mpi",
              python: str | None = None) -> CaseLaunch:
    """Runs `script ARGS CASES...` on `np` ranks once; CaseLaunch.check(case) is each test."""
    result, hang = _launch(np, script, (*args, *cases), launcher, timeout, env, controller,
                           python)
    return CaseLaunch(result, np, hang)


def worker_cases(script: str) -> list[str]:
    """The literal `CASES = (...)` of a worker script, read without importing it (and so without
    TensorFlow): the names a test parametrizes over."""
    tree = ast.parse((ROOT / script).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "CASES"]:
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{script} has no literal CASES")


def selected_tests(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The selected tests of the requesting fixture's module (what `-k` left of it)."""
    return [item for item in request.session.items
            if getattr(item, "module", None) is request.module]


def selected_cases(request: pytest.FixtureRequest, cases: list[str],
                   launch: tuple[str, object] | None = None) -> list[str]:
    """Of `cases`, those a selected test of this module asks for (with the same parameter as
    this module-scoped fixture, if it has one; or, given `launch` (fixture name, parameter),
    those of that fixture's launch): `-k` launches only what it runs."""
    fixturename, param = launch or (request.fixturename, getattr(request, "param", None))
    wanted = set()
    for item in selected_tests(request):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if ("case" in params and fixturename in getattr(item, "fixturenames", ())
                and (param is None or params.get(fixturename) == param)):
            wanted.add(params["case"])
    return [case for case in cases if case in wanted]


def run_perseusrun(options: list, args: list, env: dict | None = None,
                   timeout: float = 150) -> tuple[int, str]:
    """`perseusrun OPTIONS --timeout T python ARGS`: (exit code, output of all ranks). Fails when
    the launcher outlives its timeout or leaves a namespace of emulated hosts behind."""
    cmd = [PERSEUSRUN, *map(str, options), "--timeout", str(int(timeout)), sys.executable,
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 60)  # perseusrun ends the job at `timeout`
    except subprocess.TimeoutExpired:
        proc.terminate()  # perseusrun stops its ranks and removes its namespaces
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)}\nthe launcher outlived its timeout of {timeout} s"
                             f":\n{out}") from None
    assert namespaces_of(proc.pid) == [], f"namespaces left behind by {' '.join(cmd)}:\n{out}"
    return proc.returncode, out


def run_emulated(options: list, script: str, *args, timeout: float = 240,
                 env: dict | None = None, expect_failure: bool = False) -> str:
    """Runs `perseusrun OPTIONS --timeout T python SCRIPT ARGS` (OPTIONS: --emulate-hosts ...);
    asserts it exits 0 (non-zero with expect_failure, never by the timeout). The output."""
    code, out = run_perseusrun(options, [ROOT / script, *args], env, timeout)
    if (code != 0) != expect_failure or code == supervise.TIMEOUT_EXIT_CODE:
        raise AssertionError(f"perseusrun {' '.join(map(str, options))} {script}\nexit {code}. "
                             f"Error lines:\n{failure_summary(out)}\nOutput:\n{out}")
    return out


# ---- processes started by hand: waiting for them, ending them --------------------------------

def exits_within(pid: int, seconds: float) -> bool:
    """Waits on a pidfd (an event, not polling): ranks may finish dying just after mpirun."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], seconds)
        return bool(readable)
    finally:
        os.close(fd)


def end_processes(procs: list, pids: list = ()) -> None:
    """Ends what a test started (a process leading its own group: the whole group) and what may
    survive it (by pid), so nothing lingers."""
    for proc in procs:
        if proc.poll() is None:
            try:
                leads_group = os.getpgid(proc.pid) == proc.pid
            except ProcessLookupError:
                leads_group = False
            if leads_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        proc.wait()
    for pid in pids:
        if not exits_within(pid, 0):
            os.kill(pid, signal.SIGKILL)


def wait_all(procs: list, timeout: float, stop_on_failure: bool = True) -> list:
    """Exit codes; past `timeout`, or once one fails with `stop_on_failure`, the processes still
    running are ended (their codes are then negative). Waits on pidfds: an event for every exit,
    no polling."""
    deadline = time.monotonic() + timeout
    fds = {os.pidfd_open(proc.pid): proc for proc in procs}
    try:
        failed = False
        while fds and not (failed and stop_on_failure) and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                failed |= fds.pop(fd).wait() != 0
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
        end_processes(procs)
    return [proc.returncode for proc in procs]


def finish(procs: list, timeout: float) -> list[tuple[int, str]]:
    """[(exit code, output)] of processes started with stdout=PIPE; when one outlives `timeout`
    (one deadline for all), ends them all and fails with every output."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            results.append((proc.returncode, out or ""))
    except subprocess.TimeoutExpired:
        end_processes(procs)
        outputs = "\n".join(f"--- process {i} ({' '.join(map(str, p.args))}):\n"
                            f"{p.communicate()[0] or ''}" for i, p in enumerate(procs))
        raise AssertionError(f"processes hung past {timeout} s:\n{outputs}") from None
    return results


# ---- launches that run at once, and TF_CONFIG tasks started by hand ---------------------------

class LaunchPool:
    """Launches a module-scoped fixture starts at once in the background (most of a launch's time
    is spent waiting on its own ranks, not computing); the tests read each one's result by name.
    A launch is a function of its own empty output directory, and bounds its processes with a
    timeout (run_ranks, wait_all and finish do)."""

    def __init__(self, prefix: str, launches: dict[str, Callable[[Path], object]],
                 at_once: int | None = None) -> None:
        """`at_once`: at most that many launches run at a time, the next one starting as one
        ends, in the order of `launches` (default: all of them)."""
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, at_once or len(launches)))
        self._futures = {}
        for name, launch in launches.items():
            out = self.root / name
            out.mkdir()
            self._futures[name] = self._pool.submit(launch, out)

    def result(self, name: str):
        """What the launch returned; raises what it raised (a failed assertion fails the test)."""
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # every launch ends by its own timeout at the latest
        shutil.rmtree(self.root, ignore_errors=True)


def start_logged(cmd: list, log: Path, env: dict, popen: Callable = subprocess.Popen
                 ) -> subprocess.Popen:
    """Starts `cmd` in the repo, leading a process group of its own, its output to the file `log`
    (a file: no pipe fills while it waits for the others); `popen` may be an emulated host's."""
    with open(log, "w") as stream:
        return popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=stream,
                     stderr=subprocess.STDOUT, start_new_session=True)


def tf_config_cluster(tasks: list[tuple[str, int]], addresses: list[str] | None = None) -> dict:
    """The TF_CONFIG cluster of `tasks` [(type, index)] in order, one address each: `addresses`
    (host:port), or free ports on 127.0.0.1."""
    if addresses is None:
        addresses = [f"127.0.0.1:{port}" for port in tcp_run.free_local_ports(len(tasks))]
    cluster: dict = {}
    for (task_type, _), address in zip(tasks, addresses, strict=True):
        cluster.setdefault(task_type, []).append(address)
    return cluster


def tf_config_env(cluster: dict, task_type: str, index: int, extra: dict | None = None,
                  base: dict | None = None) -> dict:
    """task_env() of one task of `cluster` started by hand: its TF_CONFIG, plus `extra`."""
    config = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    return task_env({"TF_CONFIG": config, **(extra or {})}, base=base)


# ---- emulated hosts ----------------------------------------------------------------------------

def _why_no_emulation() -> str | None:
    try:
        emulate.check_requirements("1gbit")
    except emulate.EmulationError as exc:
        return str(exc)
    return None


needs_emulation = pytest.mark.skipif(_why_no_emulation() is not None,
                                     reason=f"{_why_no_emulation()}")


def namespaces_of(pid: int) -> list[str]:
    """The emulated hosts' namespaces that a launcher with this pid left."""
    return [name for name in _namespaces() if name.startswith(f"{emulate.TAG_PREFIX}{pid}x")]


def namespaces_of_cluster(tag: str) -> list[str]:
    """The namespaces of the one emulated cluster `tag` (its `EmulatedHosts.tag`), whatever
    other clusters this process runs at the same time."""
    own = re.compile(rf"{re.escape(tag)}(h\d+|v\d+|br)")
    return [name for name in _namespaces() if own.fullmatch(name)]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# ---- other TensorFlow versions (tests/estimator and the TF 2.15 runs) --------------------------
# main  - .venv, the project's TensorFlow (2.21), tf-keras, tensorflow-estimator 2.15.0
# tf216 - .venv-tf216, TF 2.16.2: the first TensorFlow without tf.estimator
# tf215 - .venv-tf215, TF 2.15.1: the real tf.estimator, nothing is patched
# `make compat-venvs` builds the last two. A missing one fails the tests under CI (the `CI`
# variable is set) and skips them elsewhere, with the reason.

VERSIONS = ("main", "tf216", "tf215")
VENVS = {"tf216": ROOT / ".venv-tf216", "tf215": ROOT / ".venv-tf215"}
# Besides QUIET_ENV: reproducible kernels and no GPU probing in the matrix's comparisons.
MATRIX_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""}
# Variables the matrix's tests set themselves when they want them.
_MATRIX_CLEARED = ("TF_USE_LEGACY_KERAS", "TF_CONFIG", "PERSEUS_NO_TF_PATCH", "KERAS_BACKEND")


def available(version: str) -> bool:
    if version == "main":
        return True
    return (VENVS[version] / ".installed").exists() and (VENVS[version] / "bin" / "python").exists()


def python_for(version: str) -> str:
    """The interpreter of `version`; fails under CI, skips elsewhere, when its venv is missing."""
    if version == "main":
        return sys.executable
    if not available(version):
        reason = (f"{VENVS[version].name} is missing: `make compat-venvs` builds it from "
                  f"tests/estimator/requirements-{version}.txt")
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return str(VENVS[version] / "bin" / "python")


def matrix_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the matrix's processes: only the repo and the workers importable."""
    result = {k: v for k, v in os.environ.items() if k not in _MATRIX_CLEARED}
    result.update(QUIET_ENV)
    result.update(MATRIX_ENV)
    result["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKERS)])
    result.update(extra or {})
    return result


def start(version: str, args: list,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts `python args...` under `version` in a process group of its own, stdout and stderr
    to one pipe."""
    return subprocess.Popen([python_for(version), *map(str, args)], cwd=ROOT,
                            env=matrix_env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_code(version: str, code: str, extra_env: dict[str, str] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs `python -c code` under `version`; returns the finished process (output in stdout)."""
    proc = start(version, ["-c", code], extra_env)
    [(returncode, out)] = finish([proc], timeout)
    return subprocess.CompletedProcess(proc.args, returncode, out, "")


# ---- what the tests read from the workers --------------------------------------------------------

def worker_module(name: str) -> ModuleType:
    """tests/workers/<name>.py imported into this process (its data, constants and numpy
    expectations), once; the workers' own imports of worker_util work."""
    path = WORKERS / f"{name}.py"
    if name in sys.modules:
        if Path(getattr(sys.modules[name], "__file__", "")) != path:
            raise ImportError(f"a module {name!r} from elsewhere is already imported: "
                              f"{sys.modules[name]}")
        return sys.modules[name]
    if str(WORKERS) not in sys.path:
        sys.path.append(str(WORKERS))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


files_under = worker_module("worker_util").files_under
momentum_trajectory = worker_module("worker_util").momentum_trajectory

ACCURACY = re.compile(r"^test accuracy: ([0-9.]+)", re.MULTILINE)


def accuracy_of(out: str) -> float:
    """The one `test accuracy:` line of an example's output (rank 0 prints it)."""
    found = ACCURACY.findall(out)
    assert len(found) == 1, f"expected one accuracy line (rank 0 only):\n{out}"
    return float(found[0])


# ---- Estimator training checked against one process: references, checkpoints, reruns ------

# float32 training (sums in another order on every rank) against float64 numpy, 12 steps of
# values up to ~7: the measured gap is <= 3e-7. Resuming with lost Momentum slots, with the
# batches of steps 0.. instead of 6.., or from fresh variables moves the final weights by >= 0.5.
RTOL, ATOL = 1e-5, 1e-6
ESTIMATOR_TIMEOUT = 480
CHECKPOINT_WORKER = "tests/workers/fault_checkpoint.py"


def start_reference(worker: str, out: Path, *args) -> subprocess.Popen:
    """The single-process reference of an estimator worker, in this namespace, in background."""
    log = open(out / "reference.log", "w")
    with log:
        return subprocess.Popen([sys.executable, str(ROOT / worker), str(out), *map(str, args)],
                                cwd=ROOT, env=task_env(), stdout=log, stderr=subprocess.STDOUT)


def finish_reference(proc: subprocess.Popen, out: Path) -> dict:
    """The reference's variables once it exited 0."""
    try:
        proc.wait(timeout=ESTIMATOR_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (out / "reference.log").read_text()[-8000:]
    return load_values(out / "reference.npz")


def assert_values_close(got: dict, expected: dict, what: str) -> None:
    """`got` holds exactly `expected`'s names, each value within RTOL/ATOL of the expected one."""
    assert sorted(got) == sorted(expected), (what, sorted(got), sorted(expected))
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: {name}")


def assert_ranks_match_reference(ranks: list[dict], expected: dict) -> None:
    """Every rank's final variables equal the single-process reference's and rank 0's exactly;
    rank 0's checkpoint (`checkpoint/...` values) equals the reference's."""
    compared = [k for k in expected if not k.startswith(("checkpoint/", "train_eval/"))]
    assert compared, sorted(expected)
    for rank, values in enumerate(ranks):
        for name in compared:
            np.testing.assert_allclose(values[name], expected[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {rank}: {name}")
            np.testing.assert_array_equal(values[name], ranks[0][name],
                                          err_msg=f"rank {rank} differs from rank 0: {name}")
    checkpoint = [k for k in expected if k.startswith("checkpoint/")]
    assert checkpoint, sorted(expected)
    for name in checkpoint:
        np.testing.assert_allclose(ranks[0][name], expected[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)


def load_values(path: Path) -> dict:
    with np.load(path) as values:
        return {k: values[k] for k in values.files}


def trajectory(worker) -> list:
    """The variables after each step 0..TOTAL_STEPS of one uninterrupted process trained on the
    global batch from the first run's rank 0 values (the same in every faulted phase): Momentum
    on the mean squared error, in float64 numpy."""
    x, y = worker.global_batches()
    return momentum_trajectory([(x[step], y[step]) for step in range(worker.TOTAL_STEPS)],
                               worker.initial_values(0, "cut"), worker.LEARNING_RATE,
                               worker.MOMENTUM)


def assert_whole_checkpoints(tf, model_dir: Path, steps: list, expected: list) -> None:
    """model_dir's `checkpoint` file names the checkpoints of `steps`, the last one as the latest;
    each is made of final files only and reads back whole: every variable there, finite, and
    equal to the uninterrupted run's at its step."""
    state = tf.train.get_checkpoint_state(str(model_dir))
    assert state is not None, f"no `checkpoint` file in {model_dir}: {os.listdir(model_dir)}"
    paths = list(state.all_model_checkpoint_paths)
    assert state.model_checkpoint_path == paths[-1], state
    named = []
    for path in paths:
        found = re.fullmatch(re.escape(str(model_dir)) + r"/model\.ckpt-(\d+)", path)
        assert found, f"the `checkpoint` file names {path!r}: not a final checkpoint of the dir"
        named.append(int(found.group(1)))
        prefix = f"model.ckpt-{named[-1]}."
        kinds = {f[len(prefix):] for f in os.listdir(model_dir) if f.startswith(prefix)}
        assert kinds - {"meta"} == {"index", "data-00000-of-00001"}, (path, sorted(kinds))
        reader = tf.train.load_checkpoint(path)
        assert sorted(reader.get_variable_to_shape_map()) == sorted(expected[0]), path
        for name, want in expected[named[-1]].items():
            value = reader.get_tensor(name)
            assert np.isfinite(value).all(), (path, name, value)
            np.testing.assert_allclose(value, want, rtol=RTOL, atol=ATOL, err_msg=f"{path}: {name}")
    assert named == steps, (named, steps)


def assert_resumed(out_dir: Path, start: int, expected: list, ranks: int = 2) -> None:
    """Every rank of the rerun started at global step `start`, ended at the last step, with the
    uninterrupted run's final variables (and rank 0's, exactly)."""
    final = expected[-1]
    values = []
    for rank in range(ranks):
        with np.load(out_dir / f"rank{rank}.npz") as saved:
            values.append(dict(saved))
    for rank in range(ranks):
        record = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert record == {"start_step": start, "end_step": int(final["global_step"])}, (
            rank, record)
        assert_values_close(values[rank], final, f"rank {rank}")
        for name in final:
            np.testing.assert_array_equal(values[rank][name], values[0][name],
                                          err_msg=f"rank {rank} differs from rank 0: {name}")


# ---- a process's output as it comes ------------------------------------------------------------

def stream_lines(stream) -> queue.Queue:
    """The stream's lines as they arrive, then None at its end; a test waits with a timeout."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, text: str, timeout: float, seen: list[str]) -> str:
    """The first line holding `text` (every line read is appended to `seen`); fails with what
    was seen when the stream ends or nothing arrives for `timeout` seconds."""
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line with {text!r} within {timeout} s:\n"
                                 f"{''.join(seen)}") from None
        if line is None:
            raise AssertionError(f"the output ended without a line with {text!r}:\n"
                                 f"{''.join(seen)}")
        seen.append(line)
        if text in line:
            return line


def drain(lines: queue.Queue, timeout: float = 30) -> list[str]:
    """The rest of the lines, up to the end of the stream."""
    rest = []
    while (line := lines.get(timeout=timeout)) is not None:
        rest.append(line)
    return rest
