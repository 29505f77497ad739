"""Jobs under a real Slurm on emulated hosts (tests/emulate_slurm.py): srun without MPI (the
TCP controller from Slurm's own variables), srun --mpi=pmix (MPI), and sbatch with perseusrun
inside the allocation, each on 2 nodes x 2 tasks and checked against a one-process run.

The rules that turn a Slurm step's variables into ranks (perseus_shared/slurm.py) and
perseusrun's rules in an allocation are tested first, without a cluster. The cluster needs root,
iproute2 and the packages slurm-wlm, munge and libpmix-dev (`make slurm-packages`); without them
its tests are skipped with the reason. Every cluster is started by the test that uses it and stopped
(daemons, namespaces, files) after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import zlib

import emulate_slurm
import pytest
from harness import (
    BIN,
    CHECKPOINT_WORKER,
    ESTIMATOR_TIMEOUT,
    ROOT,
    assert_ranks_match_reference,
    assert_resumed,
    assert_whole_checkpoints,
    drain,
    failure_summary,
    finish_reference,
    launch_env,
    load_values,
    start_reference,
    stream_lines,
    trajectory,
)

from perseus_shared import slurm
from perseus_shared.slurm import SlurmEnvironmentError, slurm_tcp_settings
from perseusrun import emulate, launch, slurm_run

PERSEUSRUN = str(BIN / "perseusrun")
TRAIN = str(ROOT / "tests" / "workers" / "slurm_train.py")
ESTIMATOR = "tests/workers/est_distributed.py"
PREEMPTED_STEP = 5  # tests/workers/slurm_preempt.py's WAIT_STEP + 1
SECRET = "slurm-test-secret-0123456789"
JOB_TIMEOUT = 240


# ---- Slurm's variables -> ranks, no cluster ----------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("node7", ["node7"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[08-11,20],login", ["n08", "n09", "n10", "n11", "n20", "login"]),
    ("r[1-2]c[3,5]", ["r1c3", "r1c5", "r2c3", "r2c5"]),
    ("a-1,b[0-1]-x", ["a-1", "b0-x", "b1-x"]),
])
def test_host_lists_expand_as_scontrol_show_hostnames(text, expected):
    assert slurm.expand_hostlist(text) == expected


@pytest.mark.parametrize("text", ["n[1-", "n[3-1]", "n[a]", "n]1["])
def test_a_malformed_host_list_is_named(text):
    with pytest.raises(SlurmEnvironmentError, match="host list"):
        slurm.expand_hostlist(text)


def test_tasks_per_node_and_the_block_and_cyclic_placements():
    assert slurm.expand_tasks_per_node("2(x2),1") == [2, 2, 1]
    assert slurm.slurm_placement([2, 1]) == [(0, 0), (0, 1), (1, 0)]
    assert slurm.slurm_placement([2, 1], "cyclic:block") == [(0, 0), (1, 0), (0, 1)]
    with pytest.raises(SlurmEnvironmentError, match="SLURM_DISTRIBUTION='plane=2'"):
        slurm.slurm_placement([2, 2], "plane=2")


def step_env(**changes: str | None) -> dict:
    """Task 3 of a step of job 42 on 2 nodes x 2 tasks (localhost's names: they resolve)."""
    env = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "localhost,127.0.0.1",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "PERSEUS_SECRET": SECRET}
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


def settings_of(**changes) -> dict[str, str]:
    """The settings of step_env(**changes), this process reserving no port."""
    return slurm_tcp_settings(step_env(**changes), reserve=False)


def derived_port(job: int, step: int, most_local: int = 2) -> int:
    """The default first port of a step: a CRC-32 of "job.step" over the ports from 20000 up to
    the ephemeral range (32768) that leave room for the node's tasks."""
    return 20000 + zlib.crc32(f"{job}.{step}".encode()) % (32768 - 20000 - most_local + 1)


def test_a_step_without_mpi_gives_rank_addresses_from_nodes_and_local_ids():
    settings = settings_of()
    port = derived_port(42, 0)
    assert settings == {
        "PERSEUS_CONTROLLER": "tcp", "PERSEUS_TCP_RANK": "3", "PERSEUS_SECRET": SECRET,
        "PERSEUS_TCP_ADDRESSES": f"localhost:{port},localhost:{port + 1},"
                                 f"127.0.0.1:{port},127.0.0.1:{port + 1}"}
    # Another step of the job gets other ports; PERSEUS_SLURM_PORT chooses them.
    other = settings_of(SLURM_STEP_ID="1")["PERSEUS_TCP_ADDRESSES"]
    assert other.startswith(f"localhost:{derived_port(42, 1)},")
    chosen = settings_of(PERSEUS_SLURM_PORT="31000")["PERSEUS_TCP_ADDRESSES"]
    assert chosen.endswith("127.0.0.1:31000,127.0.0.1:31001")
    # Slurm's own reservation for the step (srun --resv-ports) comes first.
    reserved = settings_of(SLURM_STEP_RESV_PORTS="12000-12003", PERSEUS_SLURM_PORT="31000")
    assert reserved["PERSEUS_TCP_ADDRESSES"].endswith("127.0.0.1:12000,127.0.0.1:12001")


@pytest.mark.parametrize("first, second", [
    ((42, 0), (42 + 80, 0)),  # jobs J and J+80 shared their ports
    ((42, 8), (43, 0)),  # job J's step 8 shared job J+1's step 0
])
def test_steps_that_once_shared_ports_get_others_below_the_ephemeral_range(first, second):
    ports = []
    for job, step in (first, second):
        addresses = settings_of(SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step))
        ports.append([int(a.rsplit(":", 1)[1])
                      for a in addresses["PERSEUS_TCP_ADDRESSES"].split(",")])
    assert not set(ports[0]) & set(ports[1]), ports
    assert all(20000 <= port < 32768 for port in ports[0] + ports[1]), ports


def test_a_port_another_process_of_the_node_holds_is_refused_naming_it(tmp_path):
    # A job id of this test run only: another run of these tests on the machine holds others.
    env = step_env(SLURM_JOB_ID=str(os.getpid() + 1_000_000))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import json, sys; from perseus_shared import slurm; "
         "slurm.slurm_tcp_settings(json.loads(sys.argv[1])); print('held', flush=True); "
         "sys.stdin.read()", json.dumps(env)],
        cwd=ROOT, env=launch_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SlurmEnvironmentError, match="is already taken on this node by "
                           "another perseus_legacy step") as error:
            slurm_tcp_settings(env)
        assert f"port {derived_port(int(env['SLURM_JOB_ID']), 0) + 1} (rank 3 of step 0)" in \
            str(error.value)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    slurm_tcp_settings(env)  # free again once the holder ended; held by this process now


@pytest.mark.parametrize("changes", [
    {"SLURM_STEP_ID": None}, {"PMIX_RANK": "3"}, {"PMI_SIZE": "4"},
    {"OMPI_COMM_WORLD_SIZE": "4"}, {"PERSEUS_CONTROLLER": "mpi"},
    {"TF_CONFIG": '{"cluster": {}}'}, {"PERSEUS_TCP_ADDRESSES": "a:1"},
], ids=["batch-script", "pmix", "pmi2", "mpirun", "forced-mpi", "tf-config", "perseusrun-tcp"])
def test_slurm_variables_are_ignored_where_something_else_says_who_is_which_rank(changes):
    assert settings_of(**changes) == {}


@pytest.mark.parametrize("changes,message", [
    ({"SLURM_STEP_NUM_TASKS": "5"}, "places 4 task(s) on 2 node(s), but SLURM_STEP_NUM_TASKS=5"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,1"}, "SLURM_NODEID=1 SLURM_LOCALID=1, but the block"),
    ({"SLURM_STEP_NODELIST": "localhost,no-such-node.invalid"},
     "node 'no-such-node.invalid' of SLURM_STEP_NODELIST does not resolve"),
    ({"PERSEUS_SECRET": None},
     "export PERSEUS_SECRET before srun (srun forwards it), or set PERSEUS_SECRET_FILE"),
    ({"SLURM_NODEID": "one"}, "SLURM_NODEID='one' is not a non-negative integer"),
    ({"SLURM_LOCALID": "-1"}, "SLURM_LOCALID='-1' is not a non-negative integer"),
    ({"SLURM_STEP_RESV_PORTS": "12000-12000"}, "SLURM_STEP_RESV_PORTS='12000-12000' reserves "
     "fewer ports than the 2 tasks of a node"),
    ({"PERSEUS_SECRET": None, "PERSEUS_SECRET_FILE": "/no/such/dir/secret"},
     "its directory /no/such/dir does not exist on this node"),
    ({"PERSEUS_SLURM_PORT": "65535"}, "PERSEUS_SLURM_PORT='65535'"),
])
def test_a_bad_allocation_is_an_error_naming_the_task_and_the_variable(changes, message):
    with pytest.raises(SlurmEnvironmentError) as error:
        settings_of(**changes)
    assert message in str(error.value) and "Slurm task 3 (job 42)" in str(error.value)


def test_a_huge_host_list_is_refused_before_it_is_expanded():
    start = time.monotonic()
    with pytest.raises(SlurmEnvironmentError, match="more than 65536 names"):
        slurm.expand_hostlist("n[0-99999999]")
    with pytest.raises(SlurmEnvironmentError, match="more than 65536 names"):
        slurm.expand_hostlist("r[0-999]n[0-999]")
    with pytest.raises(SlurmEnvironmentError, match="more than 65536 nodes"):
        slurm.expand_tasks_per_node("1(x99999999)")
    assert time.monotonic() - start < 1.0


def test_node_names_that_do_not_resolve_in_time_are_an_error_in_bound(monkeypatch):
    release = threading.Event()

    def slow_lookup(name, *args, **kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(slurm, "RESOLVE_SECONDS", 0.5)
    monkeypatch.setattr(slurm.socket, "getaddrinfo", slow_lookup)
    start = time.monotonic()
    try:
        with pytest.raises(SlurmEnvironmentError, match=r"2 node name\(s\) of SLURM_STEP_NODELIST "
                           r"did not resolve within 0.5 s \(first: '127.0.0.1'\)"):
            settings_of(SLURM_JOB_ID="4242")  # not cached
    finally:
        release.set()
    assert time.monotonic() - start < 3.0


def test_the_secret_is_read_from_a_file_in_a_shared_directory(tmp_path):
    (tmp_path / "secret").write_text(SECRET + "\n")
    (tmp_path / "secret").chmod(0o600)
    env = step_env(PERSEUS_SECRET=None, PERSEUS_SECRET_FILE=str(tmp_path / "secret"))
    assert slurm_tcp_settings(env, reserve=False)["PERSEUS_SECRET"] == SECRET


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_secret_file_others_can_read_or_change_is_refused_naming_it_and_its_mode(tmp_path,
                                                                                   mode):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    with pytest.raises(SlurmEnvironmentError) as error:
        settings_of(PERSEUS_SECRET=None, PERSEUS_SECRET_FILE=str(path))
    assert f"PERSEUS_SECRET_FILE='{path}' has mode {mode:04o}" in str(error.value)
    assert f"chmod 600 {path}" in str(error.value) and "Slurm task 3 (job 42)" in str(error.value)


# ---- a real Slurm on emulated hosts ------------------------------------------------------------

def _why_no_slurm() -> str | None:
    try:
        emulate_slurm.check_requirements()
    except emulate.EmulationError as exc:
        return str(exc)
    return None


needs_slurm = pytest.mark.skipif(_why_no_slurm() is not None, reason=f"{_why_no_slurm()}")


def _namespaces_of_this_process() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    tag = f"{emulate.TAG_PREFIX}{os.getpid()}x"
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


@pytest.fixture
def cluster():
    """A 2-node emulated Slurm cluster for one test; nothing of it is left afterwards."""
    with emulate_slurm.slurm_cluster(2, cpus_per_node=2) as running:
        yield running
    assert _namespaces_of_this_process() == []


def run_on_login_node(cluster: emulate_slurm.SlurmCluster, argv: list[str],
                      env: dict | None = None, expect_failure: bool = False,
                      timeout: float = JOB_TIMEOUT) -> str:
    """Runs a Slurm client command on the login node from ROOT; its output (stdout + stderr)."""
    try:
        proc = cluster.run(argv, env=launch_env(env), timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = exc.output or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        raise AssertionError(f"{' '.join(argv)} hung past {timeout} s:\n{out}\n"
                             f"{cluster.logs()}") from None
    if (proc.returncode != 0) != expect_failure:
        raise AssertionError(f"{' '.join(argv)}\nexit {proc.returncode}. Error lines:\n"
                             f"{failure_summary(proc.stdout)}\nOutput:\n{proc.stdout}\n"
                             f"{cluster.logs()}")
    return proc.stdout


def assert_trained_on_two_nodes(out: str, cluster: emulate_slurm.SlurmCluster,
                                controller: str) -> None:
    for rank in range(4):
        node = cluster.node_names[rank // 2]
        assert f"[rank {rank}] layout host={node} controller={controller} " \
               f"local_rank={rank % 2} cross_rank={rank // 2}" in out, out
        assert f"[rank {rank}] slurm training OK on {node}" in out, out


def srun(*options: str, kill_on_bad_exit: bool = True) -> list[str]:
    return ["srun", "-N2", "--ntasks-per-node=2", f"--kill-on-bad-exit={int(kill_on_bad_exit)}",
            *map(str, options)]


@needs_slurm
def test_the_emulated_nodes_are_slurm_nodes_named_by_their_hostnames(cluster):
    out = run_on_login_node(cluster, srun("--label", "hostname"), timeout=60)
    names = sorted(line.split(": ")[1] for line in out.splitlines() if ": " in line)
    assert names == sorted(cluster.node_names * 2), out
    listed = run_on_login_node(cluster, ["scontrol", "show", "hostnames",
                                         f"{cluster.node_names[0][:-1]}[0-1]"], timeout=60)
    assert listed.split() == cluster.node_names == slurm.expand_hostlist(
        f"{cluster.node_names[0][:-1]}[0-1]")


@needs_slurm
def test_srun_without_mpi_trains_over_tcp_like_one_process(cluster):
    """srun -N2 --ntasks-per-node=2 python train.py: no MPI, no launcher; the tasks form the TCP
    controller from SLURM_PROCID/SLURM_STEP_NODELIST/... and a secret file in the shared
    directory; local/cross ranks follow the nodes; Adam ends where one process ends."""
    secret = cluster.directory / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    out = run_on_login_node(
        cluster, srun(sys.executable, TRAIN, "tcp", 2, 2, cluster.directory / "tcp"),
        env={"PERSEUS_SECRET_FILE": str(secret)})
    assert_trained_on_two_nodes(out, cluster, "tcp")


@needs_slurm
def test_srun_mpi_pmix_trains_over_mpi_like_one_process(cluster):
    """srun --mpi=pmix: Slurm's PMIx server (Debian's libpmix2 4.2) starts the Open MPI 5 wheel's
    ranks; they take the MPI controller; pmi2 is no choice (Open MPI 5 speaks only PMIx)."""
    out = run_on_login_node(
        cluster, srun("--mpi=pmix", sys.executable, TRAIN, "mpi", 2, 2,
                      cluster.directory / "mpi"))
    assert_trained_on_two_nodes(out, cluster, "mpi")


@needs_slurm
def test_a_missing_or_world_readable_secret_file_is_named_by_every_task(cluster):
    """Each task of a real step reads its own variables and names the problem. (What init()
    reads, without its TensorFlow start-up: the srun tests above go through init().)"""
    missing = cluster.directory / "not-shared" / "secret"
    readable = cluster.directory / "readable-secret"
    readable.write_text(SECRET)
    readable.chmod(0o644)
    reads = "import os; from perseus_shared import slurm; slurm.slurm_tcp_settings(os.environ)"
    for path, problem in ((missing, f"its directory {missing.parent} does not exist on this "
                                    "node"),
                          (readable, "has mode 0644: the job secret must be readable by its "
                                     "owner only")):
        out = run_on_login_node(
            cluster, srun(sys.executable, "-c", reads, kill_on_bad_exit=False),
            env={"PERSEUS_SECRET": "", "PERSEUS_SECRET_FILE": str(path)}, expect_failure=True)
        for rank in range(4):
            assert f"Slurm task {rank} (job " in out and f"PERSEUS_SECRET_FILE='{path}'" in out, \
                out
        assert out.count(problem) == 4, out


@needs_slurm
def test_two_jobs_whose_ports_once_collided_run_together_on_one_node(cluster):
    """Job J's step 8 and job J+1's step 0 (which shared their ports) run at the same time on
    one node, each task holding its port as init() does: both hold their own."""
    ready = cluster.directory / "ready"
    ready.mkdir()
    node = cluster.node_names[0]
    holder = f"{sys.executable} {ROOT / 'tests' / 'workers' / 'slurm_port_holder.py'} {ready} 2"
    jobs = []
    for wrap in ("for i in 0 1 2 3 4 5 6 7; do srun true || exit 1; done; " f"srun {holder}",
                 f"srun {holder}"):  # steps 0-7 end before the last one starts
        argv = ["sbatch", "--wait", "--parsable", "-w", node, "-N1", "-n1",
                f"--output={cluster.directory}/%j.out", "--wrap", wrap]
        proc = subprocess.Popen(cluster.command(argv), env=cluster.env(launch_env(
            {"PERSEUS_SECRET": SECRET})), cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        jobs.append((proc, int(proc.stdout.readline().strip().split(";")[0])))
    for proc, _ in jobs:
        try:
            proc.wait(timeout=JOB_TIMEOUT)
        finally:
            proc.kill()
    out = "".join((cluster.directory / f"{job}.out").read_text() for _, job in jobs)
    first, second = (job for _, job in jobs)
    assert second == first + 1, out
    held = re.findall(r"HELD job (\d+) step (\d+) port (\d+)", out)
    assert sorted((int(job), int(step)) for job, step, _ in held) == [(first, 8), (second, 0)], \
        f"{out}\n{cluster.logs()}"
    assert held[0][2] != held[1][2], out
    assert [proc.returncode for proc, _ in jobs] == [0, 0], out


@needs_slurm
@pytest.mark.parametrize("controller", ["mpi", "tcp"])
def test_sbatch_script_with_perseusrun_runs_on_the_allocation_without_hosts(cluster, controller):
    """An sbatch script calls `perseusrun python train.py` with no -H and no -np: the launcher
    reads the allocation (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE) and starts 4 ranks with
    mpirun --host (Open MPI reaches the other node through srun), or with --tcp one srun step
    of tasks that form the TCP controller with the secret perseusrun exported."""
    shared = cluster.directory / controller
    script = cluster.directory / "job.sh"
    tcp = "--tcp " if controller == "tcp" else ""
    script.write_text("#!/bin/sh\n"
                      f"exec {PERSEUSRUN} -v {tcp}--timeout {JOB_TIMEOUT - 40} "
                      f"{sys.executable} {TRAIN} {controller} 2 2 {shared}\n")
    output = cluster.directory / "job.out"
    run_on_login_node(cluster, ["sbatch", "--wait", "-N2", "--ntasks-per-node=2",
                                f"--output={output}", str(script)])
    out = output.read_text()
    assert_trained_on_two_nodes(out, cluster, controller)
    if controller == "tcp":
        assert "srun --ntasks=4 --distribution=block --mpi=none" in out, out
    else:
        assert f"--host {cluster.node_names[0]}:2,{cluster.node_names[1]}:2" in out, out


# ---- perseusrun in an allocation, no cluster ---------------------------------------------------

BATCH_ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
             "SLURM_TASKS_PER_NODE": "2(x2)", "PATH": os.environ["PATH"]}


def test_perseusrun_in_an_allocation_takes_its_nodes_and_slots_and_not_in_a_step():
    args = launch.parse_args(["python", "train.py"])
    assert launch.choose_backend(args, BATCH_ENV) is slurm_run
    assert slurm_run.allocation_hosts(BATCH_ENV) == [("n1", 2), ("n2", 2)]
    assert launch.choose_backend(args, dict(BATCH_ENV, SLURM_STEP_ID="0")) is not slurm_run
    with_hosts = launch.parse_args(["-H", "a:2", "python", "train.py"])
    assert launch.choose_backend(with_hosts, BATCH_ENV) is not slurm_run
    run = slurm_run.prepare(args, dict(BATCH_ENV))
    assert args.np == 4 and args.hosts == "n1:2,n2:2" and callable(run)


def test_perseusrun_refuses_a_secret_file_others_can_read_before_launching(capsys, monkeypatch,
                                                                           tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o644)
    for name, value in dict(BATCH_ENV, PERSEUS_SECRET_FILE=str(path)).items():
        monkeypatch.setenv(name, value)
    assert launch.main(["--tcp", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"perseusrun: error: perseusrun: PERSEUS_SECRET_FILE='{path}' has mode 0644" in err, err


def test_perseusrun_in_a_bad_allocation_exits_2_naming_it(capsys, monkeypatch):
    for name, value in dict(BATCH_ENV, SLURM_TASKS_PER_NODE="2").items():
        monkeypatch.setenv(name, value)
    assert launch.main(["python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "Slurm job 7: SLURM_TASKS_PER_NODE='2' gives 1 node(s) but SLURM_JOB_NODELIST=" \
           "'n[1-2]' names 2" in err, err
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    assert launch.main(["--tcp", "-np", "5", "python", "train.py"]) == 2
    assert "-np 5 needs 5 task slots but Slurm job 7 has n1:2,n2:2" in capsys.readouterr().err


@needs_slurm
def test_the_estimator_under_srun_with_and_without_mpi_and_perseusrun_like_one_process(
        cluster, tmp_path):
    """tests/workers/est_distributed.py (custom model_fn with and without estimator_hooks(), a
    DNNClassifier, retraining from rank 0's checkpoint, train_and_evaluate with rank 0
    evaluating) as three steps of one sbatch job on 2 nodes x 1 task (the Estimator is
    costly: the other tests place 2 tasks per node): `srun` without MPI (the TCP transport from
    Slurm's variables), `srun --mpi=pmix` (MPI through Slurm's PMIx) and `perseusrun` with no
    -H (mpirun on the allocation). Every rank of each equals the one-process reference."""
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = start_reference(ESTIMATOR, reference_dir, "reference")
    steps = {"tcp": "srun --mpi=none --kill-on-bad-exit=1",
             "pmix": "srun --mpi=pmix --kill-on-bad-exit=1",
             "perseusrun": f"exec {PERSEUSRUN} --timeout {ESTIMATOR_TIMEOUT - 60}"}
    outs = {step: cluster.directory / f"estimator-{step}" for step in steps}
    program = f"{sys.executable} {ROOT / ESTIMATOR}"
    script = cluster.directory / "estimator.sh"
    script.write_text("#!/bin/sh\n" + "".join(
        f"{launch} {program} {outs[step]} distributed{'' if step == 'perseusrun' else ' || exit 1'}"
        "\n" for step, launch in steps.items()))
    for out in outs.values():
        out.mkdir()
    output = cluster.directory / "estimator.out"
    try:
        run_on_login_node(cluster, ["sbatch", "--wait", "-N2", "--ntasks-per-node=1",
                                    f"--output={output}", str(script)],
                          env={"PERSEUS_SECRET": SECRET}, timeout=ESTIMATOR_TIMEOUT)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- the job's output:\n"
                             f"{output.read_text() if output.exists() else ''}") from None
    finally:
        expected = finish_reference(reference, reference_dir)
    for out in outs.values():
        assert_ranks_match_reference([load_values(out / f"rank{r}.npz") for r in range(2)],
                                     expected)


@needs_slurm
def test_scancel_signal_mid_training_stops_every_rank_at_one_step_with_a_whole_checkpoint(
        cluster, checkpoint_worker):
    """An Estimator job with PreemptionHook gets `scancel --signal=USR1` mid-training: every
    rank stops after the same step and exits 0 saying so, and rank 0's checkpoint of that step
    is whole (no temporary files, the `checkpoint` file names it) and equal to one
    uninterrupted run's at that step. (Resuming from such a checkpoint is the requeue test's.)"""
    worker, tf = checkpoint_worker
    model_dir = cluster.directory / "model"
    env = {"PERSEUS_SECRET": SECRET}
    argv = srun(sys.executable, ROOT / "tests" / "workers" / "slurm_preempt.py", model_dir)
    job = subprocess.Popen(cluster.command(argv), env=cluster.env(launch_env(env)), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = stream_lines(job.stdout)
    seen: list[str] = []
    try:
        while sum("waiting for the preemption signal" in line for line in seen) < 4:
            line = lines.get(timeout=JOB_TIMEOUT)
            assert line is not None, "".join(seen)
            seen.append(line)
        job_id = run_on_login_node(cluster, ["squeue", "--noheader", "--format=%i"]).split()
        assert len(job_id) == 1, job_id
        run_on_login_node(cluster, ["scancel", "--signal=USR1", job_id[0]])
        assert job.wait(timeout=JOB_TIMEOUT) == 0, "".join(seen) + "".join(drain(lines))
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    out = "".join(seen + drain(lines))
    stop = PREEMPTED_STEP
    for rank in range(4):
        assert f"[rank {rank}] PREEMPTED by SIGUSR1 at step {stop}" in out, out
        assert f"perseus_legacy[rank {rank}]: preempted by SIGUSR1: training stopped on every " \
               f"rank after global step {stop}" in out, out
    expected = trajectory(worker)
    assert not [f for f in os.listdir(model_dir) if "temp" in f], os.listdir(model_dir)
    assert_whole_checkpoints(tf, model_dir, [0, worker.EVERY, stop], expected)


def poll(what: str, check, timeout: float, context) -> object:
    """check()'s first true answer, asked every 0.2 s; fails after `timeout` seconds saying
    `what` and context()."""
    deadline = time.monotonic() + timeout
    while not (answer := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s\n{context()}")
        time.sleep(0.2)  # the polling interval, not a synchronisation
    return answer


def job_field(cluster: emulate_slurm.SlurmCluster, job_id: str, field: str) -> str:
    """One field (JobState, Restarts, ...) of `scontrol show job`."""
    out = run_on_login_node(cluster, ["scontrol", "show", "job", job_id], timeout=60)
    found = re.search(rf"\b{field}=(\S+)", out)
    assert found, out
    return found.group(1)


@needs_slurm
def test_the_time_limit_sigterm_checkpoints_like_scancel_and_the_requeued_job_resumes(
        cluster, checkpoint_worker):
    """An `sbatch --requeue` job (2 nodes x 1 task) has its time limit end (`EndTime=now`)
    once every rank waits mid-training: Slurm's SIGTERM at the time limit stops every rank
    after the same step, each saying so, with rank 0's whole checkpoint of that step. Requeued
    (`scontrol requeuehold`, a longer time limit and a start of now, `scontrol release`), the
    job runs its batch script again (SLURM_RESTART_COUNT=1): it resumes from that checkpoint and
    ends where one uninterrupted run on the global batch ends."""
    worker, tf = checkpoint_worker
    model_dir = cluster.directory / "model"
    rerun = cluster.directory / "rerun"
    rerun.mkdir()
    output = cluster.directory / "requeue.out"
    script = cluster.directory / "requeue.sh"
    preempt = ROOT / "tests" / "workers" / "slurm_preempt.py"
    script.write_text(
        "#!/bin/sh\n"
        'echo "run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID"\n'
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        f"  exec srun --kill-on-bad-exit=1 {sys.executable} {preempt} {model_dir}\n"
        "fi\n"
        f"exec srun --kill-on-bad-exit=1 {sys.executable} {ROOT / CHECKPOINT_WORKER} "
        f"{model_dir} {rerun} resume\n")
    submitted = run_on_login_node(
        cluster, ["sbatch", "--parsable", "--requeue", "--open-mode=append", "--time=10",
                  "-N2", "--ntasks-per-node=1", f"--output={output}", str(script)],
        env={"PERSEUS_SECRET": SECRET}, timeout=60)
    job_id = submitted.strip().split(";")[0]

    def job_output() -> str:
        return output.read_text() if output.exists() else ""

    def context() -> str:
        return f"--- the job's output:\n{job_output()}\n{cluster.logs()}"

    poll("every rank waiting mid-training",
         lambda: job_output().count("waiting for the preemption signal") == 2, JOB_TIMEOUT,
         context)
    # The time limit ends now; slurmctld enforces limits every 30 s (TimeLimit counts minutes
    # from the job's start, which would add up to a minute more).
    run_on_login_node(cluster, ["scontrol", "update", f"JobId={job_id}", "EndTime=now"],
                      timeout=60)
    poll("the job ended by its time limit",
         lambda: job_field(cluster, job_id, "JobState") == "TIMEOUT", JOB_TIMEOUT, context)
    first = job_output()
    stop = PREEMPTED_STEP
    assert "DUE TO TIME LIMIT" in first, context()
    for rank in range(2):
        assert f"[rank {rank}] PREEMPTED by SIGTERM at step {stop}" in first, context()
        assert f"perseus_legacy[rank {rank}]: preempted by SIGTERM: training stopped on every " \
               f"rank after global step {stop}" in first, context()
    expected = trajectory(worker)
    assert not [f for f in os.listdir(model_dir) if "temp" in f], os.listdir(model_dir)
    assert_whole_checkpoints(tf, model_dir, [0, worker.EVERY, stop], expected)

    # Requeued held, so that the rerun gets its time back before it starts, and now rather than
    # after the 2 minutes Slurm waits before it starts a requeued job again.
    run_on_login_node(cluster, ["scontrol", "requeuehold", job_id], timeout=60)
    run_on_login_node(cluster, ["scontrol", "update", f"JobId={job_id}", "TimeLimit=10",
                                "StartTime=now"], timeout=60)
    run_on_login_node(cluster, ["scontrol", "release", job_id], timeout=60)
    poll("the requeued job's completion",
         lambda: job_field(cluster, job_id, "JobState") == "COMPLETED", JOB_TIMEOUT, context)
    assert job_field(cluster, job_id, "Restarts") == "1", context()
    assert f"run 1 of job {job_id}" in job_output(), context()
    assert_resumed(rerun, stop, expected, ranks=2)
