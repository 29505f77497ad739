"""Launch without MPI: TF_CONFIG parsing, the TCP rendezvous and its failures, perseusrun --tcp.

The collectives themselves run over TCP in tests/test_core_collectives.py (parametrized by
controller). Here: tf_config.py's rules (no launch), tasks started by hand with TF_CONFIG (the
test picks free ports and gives every process a timeout), and the local launcher.
"""

from __future__ import annotations

import hmac
import json
import re
import struct
import subprocess
import sys
from hashlib import sha256

import pytest
from harness import (
    ROOT,
    WORKERS,
    finish,
    rank_env,
    run_ranks,
    task_env,
    tf_config_cluster,
    worker_module,
)

from perseus_legacy.common import tf_config
from perseusrun import launch, supervise, tcp_run

SECRET = "test-secret-0123456789"
IMPOSTOR = worker_module("tcp_impostor")  # the handshake as a stranger speaks it


# ---- tf_config.py: rank assignment and errors, no launch ---------------------------------------

def config(cluster: dict, task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


CLUSTER = {"chief": ["a:1"], "worker": ["b:2", "a:3", "b:4"], "evaluator": ["c:5"]}


@pytest.mark.parametrize("task_type,index,rank,local_rank,local_size,cross_rank,cross_size", [
    ("chief", 0, 0, 0, 2, 0, 2),
    ("worker", 0, 1, 0, 2, 1, 2),
    ("worker", 1, 2, 1, 2, 0, 2),
    ("worker", 2, 3, 1, 2, 1, 2),
])
def test_chief_is_rank_0_then_workers_in_index_order_with_local_ranks_per_host(
        task_type, index, rank, local_rank, local_size, cross_rank, cross_size):
    cluster = tf_config.parse_tf_config(config(CLUSTER, task_type, index))
    assert cluster.addresses == ("a:1", "b:2", "a:3", "b:4")
    assert (cluster.rank, cluster.local_rank, cluster.local_size, cluster.cross_rank,
            cluster.cross_size) == (rank, local_rank, local_size, cross_rank, cross_size)
    assert cluster.is_rank and cluster.size == 4


def test_worker_0_is_rank_0_without_a_chief():
    cluster = tf_config.parse_tf_config(config({"worker": ["h:1", "h:2"]}, "worker", 1))
    assert (cluster.rank, cluster.addresses) == (1, ("h:1", "h:2"))


def test_evaluator_is_not_a_rank_listed_or_not():
    for cluster in (CLUSTER, {"chief": ["a:1"], "worker": ["b:2"]}):
        info = tf_config.parse_tf_config(config(cluster, "evaluator", 0))
        assert info.rank is None and not info.is_rank and info.local_rank is None
        assert info.size == len(cluster["chief"]) + len(cluster["worker"])


def test_cluster_from_env_prefers_perseusrun_variables_and_is_none_without_either():
    env = {"TF_CONFIG": config(CLUSTER, "worker", 0),
           "PERSEUS_TCP_RANK": "1", "PERSEUS_TCP_ADDRESSES": "127.0.0.1:7,127.0.0.1:8"}
    assert tf_config.cluster_from_env(env).addresses == ("127.0.0.1:7", "127.0.0.1:8")
    del env["PERSEUS_TCP_ADDRESSES"]
    assert tf_config.cluster_from_env(env).rank == 1  # TF_CONFIG's worker 0
    assert tf_config.cluster_from_env({}) is None


@pytest.mark.parametrize("text,fragments", [
    ("{not json", ["not valid JSON", "{not json"]),
    ("[1, 2]", ["must be a JSON object", "[1, 2]"]),
    (json.dumps({"task": {"type": "worker", "index": 0}}), ['no "cluster"']),
    (json.dumps({"cluster": {"worker": ["h:1"]}}), ['no "task"', "null"]),
    (config({"worker": ["h:1"]}, "worker", 3), ["out of range", '"index": 3', "has 1 task"]),
    (config({"worker": ["h:1"]}, "evaluator", 2), ["out of range", '"index": 2']),
    (config({"worker": ["h:1", "h:1"]}, "worker", 0), ["duplicate address 'h:1'", "ranks 0, 1"]),
    (config({"worker": ["h:1"], "ps": ["p:9"]}, "worker", 0),
     ["needs no parameter servers", "p:9"]),
    (config({"worker": ["h:1"]}, "ps", 0), ["needs no parameter servers", '"type": "ps"']),
    (config({"worker": ["h:x"]}, "worker", 0), ["cluster['worker'][0]", "h:x", "port"]),
    (config({"worker": ["h:1"]}, "trainer", 0), ["unknown task type 'trainer'"]),
    (config({"chief": ["a:1", "a:2"]}, "chief", 0), ["at most one chief"]),
    (config({"worker": ["h:1"]}, "worker", -1), ["-1", "not a non-negative integer"]),
])
def test_malformed_tf_config_errors_quote_the_offending_part(text, fragments):
    with pytest.raises(tf_config.TFConfigError) as error:
        tf_config.parse_tf_config(text)
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


@pytest.mark.parametrize("env,expected", [
    ({}, "mpi"),
    ({"TF_CONFIG": "{}"}, "tcp"),
    ({"PERSEUS_TCP_ADDRESSES": "127.0.0.1:1"}, "tcp"),
    ({"TF_CONFIG": "{}", "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({"TF_CONFIG": "{}", "PMI_SIZE": "2"}, "mpi"),
    ({"TF_CONFIG": "{}", "PMIX_RANK": "0"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "PERSEUS_CONTROLLER": "tcp"}, "tcp"),
    ({"TF_CONFIG": "{}", "PERSEUS_CONTROLLER": "MPI"}, "mpi"),
])
def test_controller_is_mpi_under_an_mpi_launcher_and_tcp_for_a_cluster(env, expected):
    assert tf_config.controller_from_env(env) == expected


def test_init_joins_over_every_registered_transport_through_the_function_it_names():
    from perseus_legacy.common import basics, native

    transports = native.core().transports()
    assert {t["name"] for t in transports} == set(basics.JOINS), transports
    for transport in transports:
        assert callable(getattr(native.core(), transport["binding"], None)), transport


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="PERSEUS_CONTROLLER='gloo'"):
        tf_config.controller_from_env({"PERSEUS_CONTROLLER": "gloo"})
    with pytest.raises(ValueError, match="PERSEUS_START_TIMEOUT='soon'"):
        tf_config.start_timeout({"PERSEUS_START_TIMEOUT": "soon"})
    assert tf_config.start_timeout({}) == 120.0
    with pytest.raises(tf_config.TFConfigError, match="needs PERSEUS_SECRET"):
        tf_config.job_secret({})
    with pytest.raises(tf_config.TFConfigError, match="PERSEUS_SECRET has 15 bytes, fewer than "
                       "16.*secrets.token_hex"):
        tf_config.job_secret({"PERSEUS_SECRET": "x" * 15})
    assert tf_config.job_secret({"PERSEUS_SECRET": "x" * 16}) == "x" * 16
    with pytest.raises(tf_config.TFConfigError, match="PERSEUS_TCP_RANK='5'"):
        tf_config.parse_perseus_variables("5", "127.0.0.1:1,127.0.0.1:2")


@pytest.mark.parametrize("secret", [b"sixteen-byte-key", b"k" * 100],
                         ids=["short secret", "secret longer than a block"])
def test_rendezvous_handshake_agrees_with_pythons_hmac_sha256(secret):
    """Rank 0 accepts a dialer whose claim carries Python's HMAC-SHA-256 and answers with the
    HMAC Python computes; the same claim with one bit of its HMAC flipped is refused."""
    addresses = [f"127.0.0.1:{port}" for port in tcp_run.free_local_ports(2)]
    env = rank_env(0, addresses, secret=secret.decode(), start_timeout=10)
    rank0 = subprocess.Popen([sys.executable, str(WORKERS / "tcp_task.py"), "init"], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sock, hello = IMPOSTOR.connect_when_listening(addresses[0], timeout=120)
        with sock:  # rank 1's data channel, honestly
            message = IMPOSTOR.claim(hello, 1, 0, 2, secret)
            sock.sendall(message)
            verdict = IMPOSTOR.read_exactly(sock, 1)
            answer = IMPOSTOR.read_exactly(sock, 32)
        header, nonce = message[:12], message[12:12 + IMPOSTOR.NONCE_BYTES]
        expected = hmac.new(secret, b"perseus-accept" + nonce + IMPOSTOR.hello_nonce(hello) +
                            struct.pack("<III", 0, 1, 0) + IMPOSTOR.job_digest(hello),
                            sha256).digest()
        assert header == struct.pack("<III", 1, 0, 2)
        job = "".join(address + "\n" for address in addresses).encode()
        assert IMPOSTOR.job_digest(hello) == sha256(b"perseus-job\n" + job).digest()
        assert (verdict, answer) == (b"\x01", expected)
        sock, hello = IMPOSTOR.connect_when_listening(addresses[0], timeout=30)
        with sock:  # rank 1's control channel, with a forged HMAC
            forged = bytearray(IMPOSTOR.claim(hello, 1, 1, 2, secret))
            forged[-1] ^= 1
            sock.sendall(bytes(forged))
            refusal = IMPOSTOR.read_exactly(sock, 1)
        # Rank 0 then waits for rank 1's control channel until PERSEUS_START_TIMEOUT.
        out, _ = rank0.communicate(timeout=120)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.communicate()
    assert refusal == b"\x00", out
    assert rank0.returncode == 3 and "INIT FAILED" in out, out
    assert re.search(r"perseus_legacy\[rank 0\]: refused a connection from 127\.0\.0\.1:\d+: "
                     r"authentication failed: it does not know this job's secret", out), out


@pytest.mark.parametrize("forged,error", [
    ("abort", r"sent control frame \d+ with a MAC that does not match its connection's key: the "
              r"frame was altered or injected on the way"),
    ("length", r"sent a control frame of 1073741824 bytes, beyond the limit of 67108864 bytes"),
], ids=["forged abort notice", "header announcing 1 GiB"])
def test_a_control_frame_injected_into_a_connection_fails_the_job_naming_the_peer(forged, error):
    """Rank 1 writes a forged frame into its control connection to rank 0, as a party on the
    path could: an abort notice without the connection's MAC, or a header announcing 1 GiB.
    Rank 0 acts on nothing of it and fails the job at once naming rank 1; the forged text
    reaches no rank."""
    out = run_ranks(2, "tests/workers/tcp_forge.py", forged, controller="tcp", timeout=120).stdout
    for rank in (0, 1):
        refused = re.search(rf"\[rank {rank}\] REFUSED: (.*)", out)
        assert refused, out
        assert re.search(r"rank 1 \(127\.0\.0\.1:\d+\) " + error, refused.group(1)), out
    assert "INJECTED" not in out, out


# ---- tasks started by hand with TF_CONFIG ----------------------------------------------------

def start_tasks(cluster: dict, tasks: list, mode: str, env: dict | None = None,
                timeout: float = 150) -> list:
    """Starts tcp_task.py once per (type, index[, extra env]); returns [(exit code, output)]."""
    procs = []
    for task in tasks:
        extra = {"TF_CONFIG": config(cluster, task[0], task[1]), "PERSEUS_SECRET": SECRET,
                 **(env or {}), **(task[2] if len(task) > 2 else {})}
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "tcp_task.py"), mode],
                                      cwd=ROOT, env=task_env(extra), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return finish(procs, timeout)


def cluster_of(ranks: int, evaluator: bool = False) -> dict:
    tasks = [("chief", 0), *(("worker", i) for i in range(ranks - 1))]
    return tf_config_cluster(tasks + [("evaluator", 0)] * evaluator)


@pytest.fixture(scope="module")
def group_run() -> list:
    """Evaluator, chief and 2 workers; the 3 ranks allreduce, then rank 2 is killed."""
    tasks = [("evaluator", 0), ("worker", 1), ("chief", 0), ("worker", 0)]
    return start_tasks(cluster_of(3, evaluator=True), tasks, "group")


def test_tf_config_chief_and_workers_form_a_group_and_the_evaluator_is_no_rank(group_run):
    everything = "\n".join(out for _, out in group_run)
    killed = 1  # worker 1 is rank 2
    assert all(code == 0 for i, (code, _) in enumerate(group_run) if i != killed), everything
    for rank in range(3):
        assert (f"[rank {rank}] tf_config group OK size=3 local_rank={rank} local_size=3 "
                "controller=tcp") in everything, everything
    evaluator = group_run[0][1]
    assert "[evaluator] not a rank; init() refused" in evaluator, everything
    assert "is not a rank" in evaluator and "tf_config group OK" not in evaluator, everything


def test_killed_peer_fails_every_other_rank_within_30_seconds_naming_it(group_run):
    everything = "\n".join(out for _, out in group_run)
    killed = re.search(r"KILLED_AT ([0-9.]+)", everything)
    assert killed, everything
    for task, rank in ((2, 0), (3, 1)):  # the chief's and worker 0's processes
        failed = re.search(rf"\[rank {rank}\] FAILED_AT ([0-9.]+): (.*)", group_run[task][1])
        assert failed, everything
        assert "rank 2 (127.0.0.1:" in failed.group(2), everything
        assert float(failed.group(1)) - float(killed.group(1)) < 30, everything


@pytest.fixture(scope="module")
def start_failure_run() -> tuple:
    """A 4-rank cluster: rank 2 knows a wrong secret, rank 3 never starts."""
    cluster = cluster_of(4)
    wrong = {"PERSEUS_SECRET": "not-the-secret-of-this-job"}
    tasks = [("chief", 0), ("worker", 0), ("worker", 1, wrong)]
    return cluster, start_tasks(cluster, tasks, "init", env={"PERSEUS_START_TIMEOUT": "5"})


def test_wrong_secret_is_refused_and_logged_and_the_job_fails_clearly(start_failure_run):
    _, [(chief_code, chief), _, (code, wrong)] = start_failure_run
    assert code == 3, wrong
    assert "refused the connection of rank 2: authentication failed" in wrong, wrong
    assert re.search(r"perseus_legacy\[rank 0\]: refused a connection from 127\.0\.0\.1:\d+: "
                     r"authentication failed", chief), chief
    assert chief_code == 3 and "INIT FAILED" in chief, chief


def test_missing_peers_fail_start_up_listing_the_ranks_that_never_arrived(start_failure_run):
    cluster, [(chief_code, chief), (worker_code, worker), _] = start_failure_run
    assert chief_code == 3 and "ranks [2, 3] never arrived at rank 0" in chief, chief
    assert "PERSEUS_START_TIMEOUT=5 s" in chief, chief
    assert cluster["worker"][2] in chief, chief  # where the missing rank 3 was expected
    assert worker_code == 3 and "ranks [2, 3] never arrived at rank 1" in worker, worker


# ---- perseusrun --tcp --------------------------------------------------------------------------

def run_tcp_launcher(capfd, *argv: str) -> tuple:
    """`perseusrun --tcp ARGV` in this process (its ranks are real processes): code, out, err."""
    code = launch.main(["--tcp", *argv])
    out, err = capfd.readouterr()
    return code, out, err


def test_perseusrun_tcp_gives_ranks_their_variables_one_secret_and_tags_output(capfd,
                                                                               monkeypatch):
    monkeypatch.delenv("PERSEUS_SECRET", raising=False)
    code, out, err = run_tcp_launcher(capfd, "-np", "3", "--tag-output", sys.executable,
                                      str(WORKERS / "tcp_launch_worker.py"), "echo")
    assert code == 0, out + err
    lines = sorted(line for line in out.splitlines() if "rank=" in line)
    assert [line.split()[:3] for line in lines] == [
        [f"[1,{r}]<stdout>:rank={r}", "size=3", "controller=tcp"] for r in range(3)], lines
    assert all(line.endswith("mpi=False") for line in lines), lines
    secrets = {re.search(r"secret=(\S*)", line).group(1) for line in lines}
    assert len(secrets) == 1 and len(secrets.pop()) == 32, lines


def test_perseusrun_tcp_ends_every_rank_when_one_fails_with_its_exit_code(capfd):
    code, out, err = run_tcp_launcher(capfd, "-np", "3", sys.executable,
                                      str(WORKERS / "tcp_launch_worker.py"), "fail", "1", "7")
    assert code == 7, out + err
    assert "rank 1 exited with code 7; terminating the other ranks" in err, err


def test_perseusrun_tcp_fails_when_every_rank_fails_at_once(capfd):
    code, out, err = run_tcp_launcher(capfd, "-np", "3", sys.executable, "-c",
                                      "import sys; sys.exit(5)")
    assert code == 5, out + err


def test_perseusrun_tcp_timeout_exits_124(capfd):
    code, out, err = run_tcp_launcher(capfd, "-np", "2", "--timeout", "2", sys.executable,
                                      str(WORKERS / "tcp_launch_worker.py"), "hang")
    assert code == supervise.TIMEOUT_EXIT_CODE, out + err
    assert "ran longer than --timeout 2 s" in err, err


def test_perseusrun_tcp_refuses_remote_hosts_and_mpi_args(capfd):
    code, _, err = run_tcp_launcher(capfd, "-np", "2", "-H", "elsewhere:2", "python", "x.py")
    assert code == 2 and "--tcp starts ranks on this machine only" in err, err
    code, _, err = run_tcp_launcher(capfd, "-np", "2", "--mpi-args=--mca btl tcp", "python",
                                    "x.py")
    assert code == 2 and "--mpi-args has no meaning with --tcp" in err, err
