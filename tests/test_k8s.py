"""Kubernetes as far as this machine goes: the pods of a TFJob (TF_CONFIG naming headless
services that may resolve only after a pod starts) and the launcher of an MPIJob (mpirun over a
hostfile of pod names), on emulated hosts (perseusrun/emulate.py), each host with its own
/etc/hosts. The manifests in examples/k8s/ must say the commands and environment run here.

Launches need root and iproute2 (CI runs as root); without them they are skipped with the
reason. Every process has a timeout; waits poll a line of output, never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from harness import (
    BIN,
    ROOT,
    WORKERS,
    drain,
    end_processes,
    launch_env,
    namespaces_of,
    needs_emulation,
    stream_lines,
    task_env,
    wait_for_line,
)

from perseusrun import emulate

MANIFESTS = ROOT / "examples" / "k8s"
IMAGE_ROOT = "/opt/perseus_legacy"  # where the manifests' image holds this repository
SMOKE = f"{IMAGE_ROOT}/examples/allreduce_smoke.py"  # checks itself against numpy
TFJOB_PORT = 2222  # the training operator's default port in TF_CONFIG
# A TFJob worker's command and what its manifest sets besides the operator's TF_CONFIG.
TFJOB_COMMAND = ["python", SMOKE]
TFJOB_ENV = {"PERSEUS_SECRET": "k8s-job-secret-0123456789", "PERSEUS_START_TIMEOUT": "60"}
# The MPIJob launcher's command; its ranks need no variable of ours.
MPI_HOSTFILE = "/etc/mpi/hostfile"  # written by the MPI operator
MPIJOB_COMMAND = ["mpirun", "-np", "2", "--allow-run-as-root", "--bind-to", "none",
                  "--hostfile", MPI_HOSTFILE, "python", SMOKE]
MPIJOB_ENV: dict[str, str] = {}
SMOKE_OK = "weights equal one process on the global batch (numpy): True"
TIMEOUT = 180


def manifest_commands(name: str) -> list[list[str]]:
    """Every container's `command: [...]` of a manifest (written as one-line JSON lists)."""
    text = (MANIFESTS / name).read_text()
    return [json.loads(found) for found in re.findall(r"^\s*command: (\[.*\])\s*$", text, re.M)]


def manifest_env_names(name: str) -> list[str]:
    """The names of the variables a manifest's containers set (`- name: UPPER_CASE`)."""
    text = (MANIFESTS / name).read_text()
    return re.findall(r"^\s*- name: ([A-Z][A-Z0-9_]*)\s*$", text, re.M)


def here(argv: list[str]) -> list[str]:
    """A manifest's command as it runs in this checkout: this Python and mpirun, this tree."""
    tools = {"python": sys.executable, "mpirun": str(BIN / "mpirun")}
    return [tools.get(arg, arg.replace(IMAGE_ROOT, str(ROOT))) for arg in argv]


def test_the_manifests_run_the_commands_and_environment_these_tests_run():
    tfjob = (MANIFESTS / "tfjob.yaml").read_text()
    assert manifest_commands("tfjob.yaml") == [TFJOB_COMMAND]
    assert sorted(manifest_env_names("tfjob.yaml")) == sorted(TFJOB_ENV)
    assert "secretKeyRef" in tfjob and "kind: TFJob" in tfjob
    assert re.findall(r"^    (\w+):$", tfjob, re.M) == ["Worker"], "workers only"
    mpijob = (MANIFESTS / "mpijob.yaml").read_text()
    assert "apiVersion: kubeflow.org/v2beta1" in mpijob and "kind: MPIJob" in mpijob
    assert manifest_commands("mpijob.yaml") == [MPIJOB_COMMAND, ["/usr/sbin/sshd", "-De"]]
    assert manifest_env_names("mpijob.yaml") == sorted(MPIJOB_ENV)
    for script in {TFJOB_COMMAND[-1], MPIJOB_COMMAND[-1]}:
        assert os.path.isfile(here([script])[0]), script


def tf_config(addresses: list[str], index: int) -> str:
    """The TF_CONFIG the training operator gives worker `index` of a workers-only TFJob."""
    return json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker",
                                                                  "index": index}})


def start_worker(host: emulate.EmulatedHost, addresses: list[str], index: int,
                 argv: list[str], **env: str) -> subprocess.Popen:
    return host.popen(argv, env=task_env({**TFJOB_ENV, "TF_CONFIG": tf_config(addresses, index),
                                          **env}),
                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@needs_emulation
def test_a_tfjob_worker_waits_for_a_name_published_late_and_the_job_trains_like_numpy():
    """Worker 1's host does not know worker 0's name when it starts (a headless service not yet
    in DNS): rank 1 logs that it waits for that name; once it has, the name is added to its
    /etc/hosts with two addresses, the first one dead; rank 1 resolves it, dials past the dead
    address, and the job trains to numpy's weights."""
    procs: list[subprocess.Popen] = []
    with emulate.emulated_hosts(2) as hosts:
        try:
            addresses = [f"{host.name}:{TFJOB_PORT}" for host in hosts]
            entry = f"{hosts[0].address} {hosts[0].name}\n"
            known = hosts[1].hosts_file.read_text()
            assert entry in known
            hosts[1].hosts_file.write_text(known.replace(entry, ""))
            procs = [start_worker(host, addresses, i, here(TFJOB_COMMAND))
                     for i, host in enumerate(hosts)]
            lines = [stream_lines(proc.stdout) for proc in procs]
            seen: list[list[str]] = [[], []]
            waiting = wait_for_line(lines[1], f'waiting for the name "{hosts[0].name}"',
                                    TIMEOUT, seen[1])
            with open(hosts[1].hosts_file, "a") as hosts_file:  # in place: the mount sees it
                hosts_file.write(f"::1 {hosts[0].name}\n{entry}")
            # The name's first address is host 1's own loopback, where nothing listens.
            found = subprocess.run(hosts[1].command(["getent", "ahosts", hosts[0].name]),
                                   capture_output=True, text=True, timeout=30).stdout.split()
            codes = [proc.wait(timeout=TIMEOUT) for proc in procs]
            outs = ["".join(seen[i] + drain(lines[i])) for i in range(2)]
        finally:
            end_processes(procs)
    assert namespaces_of(os.getpid()) == []
    everything = "\n".join(f"--- worker {i} exited {code}:\n{out}"
                           for i, (code, out) in enumerate(zip(codes, outs)))
    assert codes == [0, 0], everything
    # The resolver's answer depends on the machine: no such name, or no DNS server reachable.
    assert re.fullmatch(
        rf'perseus_legacy\[rank 1\]: waiting for the name "{hosts[0].name}" \(the address of '
        rf'rank 0, {addresses[0]}\) to resolve \([^)]+\); looking it up again until '
        rf'PERSEUS_START_TIMEOUT={TFJOB_ENV["PERSEUS_START_TIMEOUT"]} s', waiting.strip()), \
        everything
    assert re.search(rf'perseus_legacy\[rank 1\]: the name "{hosts[0].name}" \(the address of '
                     r'rank 0, \S+\) resolved after [0-9.]+ s', outs[1]), everything
    assert found[0] == "::1" and hosts[0].address in found, found
    assert SMOKE_OK in outs[0], everything
    assert "waiting for the name" not in outs[0], everything


# A DNS server that never answers: it takes the queries and keeps them (loopback only).
SILENT_DNS = ("import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
              "s.bind(('127.0.0.1', 53)); print('listening', flush=True); sys.stdin.read()")


@needs_emulation
def test_a_name_that_never_resolves_fails_every_rank_within_the_start_timeout_naming_it():
    """Rank 1's name is published nowhere: rank 1 cannot listen, rank 2 cannot dial it, rank 0
    waits for both; each fails within PERSEUS_START_TIMEOUT with an error naming the name. On
    host 1 (ranks 1 and 2) the DNS server never answers and the resolver would wait 30 s for
    it: the lookups are bounded by the start deadline all the same."""
    timeout = 4
    procs: list[subprocess.Popen] = []
    with emulate.emulated_hosts(2) as hosts:
        try:
            (hosts[1].hosts_file.parent / "resolv.conf").write_text(
                "nameserver 127.0.0.1\noptions timeout:30 attempts:1\n")
            procs.append(hosts[1].popen([sys.executable, "-c", SILENT_DNS], env=task_env(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True))
            assert procs[0].stdout.readline() == "listening\n"
            gone = f"{hosts.tag}gone"
            addresses = [f"{hosts[0].name}:{TFJOB_PORT}", f"{gone}:{TFJOB_PORT}",
                         f"{hosts[1].name}:{TFJOB_PORT + 1}"]
            argv = [sys.executable, str(WORKERS / "k8s_task.py")]
            ranks = [start_worker(hosts[min(i, 1)], addresses, i, argv,
                                  PERSEUS_START_TIMEOUT=str(timeout)) for i in range(3)]
            procs += ranks
            results = [(proc.wait(timeout=TIMEOUT), proc.stdout.read()) for proc in ranks]
        finally:
            end_processes(procs)
    everything = "\n".join(f"--- rank {i} exited {code}:\n{out}"
                           for i, (code, out) in enumerate(results))
    for rank, (code, out) in enumerate(results):
        failed = re.search(rf"\[rank {rank}\] INIT FAILED after ([0-9.]+) s: (.*)", out)
        assert code == 3 and failed, everything
        # The timeout, then at most kNoticeWaitSecs (2 s) closing the connections made.
        assert float(failed.group(1)) < timeout + 5, everything
        assert f'"{gone}"' in failed.group(2) and "rank 1" in failed.group(2), everything
    unanswered = "(the last lookup had no answer when the time was up)"
    assert (f'rank 1: the name "{gone}" (its own address, {addresses[1]}) did not resolve '
            f"within PERSEUS_START_TIMEOUT={timeout} s {unanswered}") in results[1][1], everything
    assert (f'rank 2: the name "{gone}" (the address of rank 1, {addresses[1]}) did not '
            f"resolve within PERSEUS_START_TIMEOUT={timeout} s {unanswered}") in results[2][1], \
        everything
    assert f'its name "{gone}" does not resolve here either' in results[0][1], everything


@needs_emulation
def test_the_mpijob_launcher_command_runs_across_hosts_named_in_its_hostfile(tmp_path):
    """The MPIJob launcher's mpirun, with a hostfile of host names as the operator writes it;
    the emulation adds only how daemons reach a host (its `ssh`) and where Open MPI lives."""
    with emulate.emulated_hosts(2) as hosts:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{host.name} slots=1\n" for host in hosts))
        argv = [arg if arg != MPI_HOSTFILE else str(hostfile) for arg in here(MPIJOB_COMMAND)]
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(argv[0])))
        argv[1:1] = [*hosts.mpirun_args(), "--prefix", prefix]
        proc = subprocess.run(argv, env=launch_env(MPIJOB_ENV), cwd=ROOT, capture_output=True,
                              text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and SMOKE_OK in out and "ranks: 2 " in out, out
