"""An emulated Slurm cluster: slurmctld and one slurmd per emulated host, for the Slurm tests.

Each node is an emulated host of perseusrun.emulate (its own network namespace and hostname);
its hostname is its Slurm NodeName. Node 0 also runs slurmctld and is the login node where
`srun`/`sbatch` run. One `munged` in this namespace authenticates them all (its socket is a
file, which every namespace reaches). The settings need no cgroups and no systemd
(`proctrack/linuxproc`, `task/none`) and every daemon keeps its spool, pid and log files in the
cluster's own directory, so several clusters can run side by side. Needs root and the Debian
packages `slurm-wlm` and `munge` (the Makefile installs them).

    with slurm_cluster(2, cpus_per_node=2) as cluster:
        cluster.run(["srun", "-N2", "--ntasks-per-node=2", "hostname"], timeout=60)

Everything is stopped and removed when the with-block ends, whatever happens inside it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from perseusrun import emulate
from perseusrun.emulate import EmulatedHosts, EmulationError

# Binary -> the Debian package that has it.
REQUIRED_PROGRAMS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client",
                     "sbatch": "slurm-client", "sinfo": "slurm-client", "munged": "munge"}
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
PARTITION = "emulated"
# slurmd loads a cgroup plugin even when nothing uses cgroups; its autodetection fails where
# /sys/fs/cgroup is a tmpfs of v1 hierarchies (containers): name v1 and mount nothing.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nCgroupMountpoint=/sys/fs/cgroup\n"


class SlurmCluster:
    """A running emulated Slurm cluster: its hosts, its directory and how to run a client."""

    def __init__(self, hosts: EmulatedHosts, directory: Path) -> None:
        self.hosts = hosts
        self.directory = directory  # shared by every node: the job's shared directory
        self.conf = directory / "slurm.conf"
        self.node_names = [host.name for host in hosts]

    def env(self, base: dict | None = None) -> dict:
        """`base` (default os.environ) without Slurm's job variables, with SLURM_CONF naming
        this cluster's configuration."""
        # A job of another Slurm (tests run inside an allocation) must not leak into this one.
        env = {name: value for name, value in (os.environ if base is None else base).items()
               if not name.startswith(("SLURM_", "SLURMD_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` (a Slurm client command) run on the login node."""
        return self.hosts[0].command(argv)

    def run(self, argv: Sequence[str], env: dict | None = None, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs a client command on the login node; stdout and stderr as text, merged."""
        return subprocess.run(self.command(argv), env=self.env(env), timeout=timeout, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)

    def logs(self) -> str:
        """The daemons' logs (for a failing test's message)."""
        parts = []
        for log in sorted(self.directory.glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)


def check_requirements() -> None:
    """Raises EmulationError naming what is missing: root, tools, the Slurm and munge programs."""
    emulate.check_requirements()
    missing = sorted({package for program, package in REQUIRED_PROGRAMS.items()
                      if shutil.which(program, path=_sbin_path()) is None})
    if missing:
        raise EmulationError("an emulated Slurm cluster needs the Debian packages "
                             f"{', '.join(missing)} (make slurm-packages installs them)")


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _program(name: str) -> str:
    found = shutil.which(name, path=_sbin_path())
    if found is None:
        raise EmulationError(f"`{name}` not found (package {REQUIRED_PROGRAMS[name]})")
    return found


def slurm_conf(hosts: EmulatedHosts, directory: Path, cpus_per_node: int) -> str:
    """slurm.conf of a cluster whose nodes are `hosts` (controller on hosts[0])."""
    nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus_per_node} "
                    "RealMemory=1000 State=UNKNOWN\n" for h in hosts)
    return (
        "# An emulated Slurm cluster (tests/emulate_slurm.py).\n"
        "ClusterName=emulated\n"
        f"SlurmctldHost={hosts[0].name}({hosts[0].address})\n"
        "SlurmUser=root\nSlurmdUser=root\n"
        "AuthType=auth/munge\nCryptoType=crypto/munge\n"
        f"AuthInfo=socket={directory / 'munge.socket'}\n"
        # No cgroups or systemd here: processes are tracked by their parent pids.
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "MpiDefault=none\nSwitchType=switch/none\nLaunchType=launch/slurm\n"
        "SchedulerType=sched/builtin\nSelectType=select/cons_tres\n"
        "SelectTypeParameters=CR_Core\n"
        # The nodes share this machine's cores: their declared CPUs are taken as they are.
        "SlurmdParameters=config_overrides\n"
        "ReturnToService=2\nJobCompType=jobcomp/none\n"
        "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
        "KillWait=5\nMinJobAge=300\nInactiveLimit=0\nWaitTime=0\n"
        "SlurmctldTimeout=30\nSlurmdTimeout=30\nMessageTimeout=20\n"
        f"StateSaveLocation={directory / 'state'}\n"
        f"SlurmdSpoolDir={directory / 'spool-%n'}\n"
        # Per node: the nodes share this machine's /tmp, where PMIx's job directories collide.
        f"TmpFS={directory / 'tmp-%n'}\n"
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}\n"
        f"SlurmdPidFile={directory / 'slurmd-%n.pid'}\n"
        f"SlurmctldLogFile={directory / 'slurmctld.log'}\n"
        f"SlurmdLogFile={directory / 'slurmd-%n.log'}\n"
        "SlurmctldDebug=info\nSlurmdDebug=info\n"
        f"{nodes}"
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")


def _start_munged(directory: Path) -> subprocess.Popen:
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return subprocess.Popen(
        [_program("munged"), "--foreground", "--force", f"--socket={directory / 'munge.socket'}",
         f"--key-file={key}", f"--pid-file={directory / 'munged.pid'}",
         f"--log-file={directory / 'munged.log'}", f"--seed-file={directory / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _wait_ready(cluster: SlurmCluster, daemons: list[subprocess.Popen]) -> None:
    """Until every node is idle in sinfo; EmulationError with the logs when that does not come."""
    deadline = time.monotonic() + READY_TIMEOUT
    states = ""
    while time.monotonic() < deadline:
        dead = [d.args for d in daemons if d.poll() is not None]
        if dead:
            raise EmulationError(f"a Slurm daemon exited at start: {dead[0]}\n{cluster.logs()}")
        proc = cluster.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=30)
        states = proc.stdout.strip()
        idle = [line.split()[0] for line in states.splitlines()
                if len(line.split()) == 2 and line.split()[1] == "idle"]
        if proc.returncode == 0 and sorted(idle) == sorted(cluster.node_names):
            return
        time.sleep(0.25)  # daemons registering: nothing to wait on but their state
    raise EmulationError(f"the emulated Slurm nodes were not idle within {READY_TIMEOUT:g} s "
                         f"(sinfo: {states!r})\n{cluster.logs()}")


def _stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in processes:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def slurm_cluster(nodes: int, cpus_per_node: int = 2) -> Iterator[SlurmCluster]:
    """An emulated Slurm cluster of `nodes` nodes with `cpus_per_node` CPUs each, for the time of
    the with-block; its daemons, namespaces and files are removed after it."""
    check_requirements()
    with emulate.emulated_hosts(nodes) as hosts:
        directory = Path(tempfile.mkdtemp(prefix="perseus-slurm-"))
        daemons: list[subprocess.Popen] = []
        try:
            (directory / "state").mkdir()
            for host in hosts:
                (directory / f"spool-{host.name}").mkdir()
                (directory / f"tmp-{host.name}").mkdir()
            cluster = SlurmCluster(hosts, directory)
            cluster.conf.write_text(slurm_conf(hosts, directory, cpus_per_node))
            (directory / "cgroup.conf").write_text(CGROUP_CONF)
            munged = _start_munged(directory)
            daemons.append(munged)
            env = cluster.env()
            daemons.append(hosts[0].popen([_program("slurmctld"), "-D", "-i"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            for host in hosts:
                daemons.append(host.popen([_program("slurmd"), "-D", "-N", host.name], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            _wait_ready(cluster, daemons)
            yield cluster
        finally:
            # slurmd and slurmctld first (they still talk to munged), then munged; what lives on
            # in a namespace (job steps) goes with the hosts.
            _stop(daemons[1:])
            _stop(daemons[:1])
            shutil.rmtree(directory, ignore_errors=True)
