"""Elastic training on the TCP transport (perseusrun --tcp --min-np/--host-discovery-script, see
perseusrun/elastic_run.py): real ranks on emulated hosts lose one (killed, frozen, link cut),
continue on the survivors within the bound, then a host added back joins (and one dropped
leaves); the final weights equal one process trained on the same global batches
(tests/workers/elastic_train.py). Too few ranks left end the job with a clear error. The driver
answers only requests that prove the job secret. Every launch has a timeout.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import faults_elastic
import numpy as np
import pytest
from harness import WORKERS, launch_env, namespaces_of, needs_emulation

from perseus_shared import elastic_wire
from perseusrun import elastic_run, launch
from perseusrun.elastic_driver import Driver, Worker

# The stall limit is also how long a silent (frozen, cut off) peer is waited for on TCP.
STALL_SECONDS = 4
LOSS_BOUND = 10.0  # seconds from a kill or a cut link to the next completed step


@pytest.mark.parametrize("argv, message", [
    (["--min-np", "1", "-np", "2", "x"], "MPI cannot re-form its world"),
    (["--tcp", "--min-np", "3", "-np", "2", "x"], "--min-np 3 <= -np 2"),
    (["--tcp", "--max-np", "0", "-np", "2", "x"], "--max-np must be at least 1"),
])
def test_bad_elastic_command_lines_exit_2_naming_the_problem(capsys, argv, message):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_discovery_output_is_host_slots_lines():
    assert elastic_run.parse_discovery("a:2\n# comment\nb\n\nc:1 # spare\n") == [
        ("a", 2), ("b", 1), ("c", 1)]
    with pytest.raises(ValueError, match="bad line 'a:x'"):
        elastic_run.parse_discovery("a:x\n")


def test_driver_answers_only_requests_that_prove_the_job_secret():
    secret = "elastic-test-secret-0123456789"
    driver = Driver(secret, "127.0.0.1", min_np=1, max_np=1, ports=lambda r, w: [0] * len(w),
                    on_lost=lambda worker, why: None)
    driver.add_worker(Worker(name="h/0", host="h", slot=0, address="127.0.0.1", order=0))
    host, port = driver.address.rsplit(":", 1)
    try:
        for key, answered in (("wrong-secret-0123456789abcdef", False), (secret, True)):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                reader = sock.makefile("r", encoding="utf-8")
                nonce = reader.readline().strip()
                elastic_wire.elastic_send(sock, key, nonce, {"op": "poll", "worker": "h/0",
                                                            "nonce": "n" * 32, "round": 0})
                if answered:
                    answer = elastic_wire.elastic_receive(reader, secret, "n" * 32, "answer")
                    assert answer == {"updated": False}
                else:
                    assert reader.readline() == ""  # closed without an answer
    finally:
        driver.stop()


def _run(tmp_path: Path, **kwargs) -> faults_elastic.ElasticRun:
    return faults_elastic.ElasticRun(tmp_path, stall_seconds=STALL_SECONDS, env=launch_env(),
                                     **kwargs)


def _finish(run: faults_elastic.ElasticRun) -> int:
    code = run.finish()
    assert namespaces_of(run.proc.pid) == [], run.output()
    return code


def _check_against_reference(run: faults_elastic.ElasticRun) -> dict:
    """The final weights equal one process's on the global batches of every completed step
    (elastic_train.reference, numpy; imported here: the worker module imports TensorFlow)."""
    sys.path.insert(0, str(WORKERS))
    try:
        import elastic_train
    finally:
        sys.path.remove(str(WORKERS))
    initial, = run.records("initial")
    final, = run.records("final")
    kernel, bias = elastic_train.reference(np.array(initial["kernel"]), np.array(initial["bias"]),
                                           final["steps"])
    np.testing.assert_allclose(final["kernel"], kernel, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(final["bias"], bias, rtol=1e-4, atol=1e-5)
    return final


@needs_emulation
@pytest.mark.parametrize("mode, losses, removed", [
    # Keras: rank 0 itself is killed (the new rank 0 gives the state); after host 4 joined,
    # host 1 leaves the discovered hosts.
    ("keras", [("kill", 0, LOSS_BOUND)], 1),
    # The tape loop: a frozen rank, then a cut link (both noticed at the stall limit).
    ("tape", [("freeze", 2, STALL_SECONDS + LOSS_BOUND), ("cut", 1, LOSS_BOUND)], None),
])
def test_lost_ranks_survivors_continue_then_hosts_join_and_leave(tmp_path, mode, losses,
                                                                 removed):
    # 5 emulated hosts, 4 in the job; each loss comes at step 20 of the group before it (or
    # later); host 4 is added once the survivors train (then `removed` is dropped), and the
    # job ends a few steps after the last change.
    rounds = len(losses) + 2 + (removed is not None)
    final_size = 4 - len(losses) + 1 - (removed is not None)
    run = _run(tmp_path, hosts=5, initial=[0, 1, 2, 3], np_=4, min_np=4 - len(losses),
               program=[str(WORKERS / "elastic_train.py"), mode, "60", str(rounds), "5000"])
    results = []
    try:
        for number, (how, host, bound) in enumerate(losses):
            run.wait_for(lambda t, n=number: t.startswith("STEP ") and f" ROUND {n + 1} " in t
                         and int(t.split()[1]) >= 20 * (n + 1), f"step {20 * (number + 1)}")
            results.append((bound, run.lose_and_resume(how, host, 4 - number - 1)))
        run.set_hosts([0, 1, 2, 3, 4])
        joined = 4 - len(losses) + 1
        run.wait_for(lambda t: t.startswith("STEP ") and
                     f" SIZE {joined} ROUND {len(losses) + 2} " in t,
                     f"a step on {joined} ranks after the new host joined")
        if removed is not None:
            run.set_hosts([h for h in range(5) if h != removed])
            run.wait_for(lambda t: t.startswith("STEP ") and f" SIZE {final_size} ROUND "
                         f"{rounds} " in t, f"a step on {final_size} ranks after host "
                         f"{removed} left")
        code = _finish(run)
    finally:
        run.kill()
    assert code == 0, run.output()
    final = _check_against_reference(run)
    assert (final["size"], final["round"]) == (final_size, rounds), final
    if removed is not None:
        assert "its host left the job's hosts" in run.output(), run.output()
    for bound, row in results:
        print(row)
        assert row["seconds_to_next_step"] < bound, f"{row}\n{run.output()}"
        assert row["steps_redone"] == 0, f"{row}\n{run.output()}"


@needs_emulation
@pytest.mark.parametrize("when", ["at_once", "during_recovery"])
def test_too_few_ranks_left_end_the_job_with_a_clear_error(tmp_path, when):
    # 3 ranks, --min-np 2: two lost at once, or the second while the survivors regroup after
    # the first: the last one ends, and the launcher says why.
    run = _run(tmp_path, hosts=3, initial=[0, 1, 2], np_=3, min_np=2,
               program=[str(WORKERS / "elastic_train.py"), "tape", "100000", "2", "100000"])
    try:
        run.wait_for(lambda t: t.startswith("STEP 10 "), "step 10")
        run.lose("kill", 1)
        if when == "during_recovery":
            worker = run.worker(2)["worker"]
            run.wait_for(lambda t: f"worker {worker} (round 1) lost a rank" in t,
                         "the survivor's recovery")
        run.lose("kill", 2)
        code = _finish(run)
    finally:
        run.kill()
    out = run.output()
    assert code == 1, out
    assert "1 rank(s) left, fewer than --min-np 2" in out, out
