"""Emulated hosts: several "machines" on this one, each a Linux network namespace.

Every host gets its own network namespace (loopback up, an `eth0` with an address in a private
/24 of 10.77.0.0/16), its own hostname (a UTS namespace per started process) and an /etc/hosts
that names every host. The launch (this) namespace holds the subnet's .254 address: Open MPI's
daemons call mpirun back there, as compute nodes call a login node. `mtu` sets every link's MTU
(default 1500; jumbo frames: 9000). Needs root and iproute2 (`ip`, `tc`) and util-linux `unshare`.

Two kinds of link. Without a delay, jitter or loss each eth0 is one end of a veth whose other
end is on a bridge here, and `link_rate` limits it in both directions with tc tbf on both ends.
With `delay_ms`, `jitter_ms` or `loss` (this kernel has no netem), each eth0 is a TAP device and
perseusrun/link_emulator (ops/tools/link_emulator.cc, built with the package) moves the frames:
a learning switch in user space that holds every frame leaving a host for the delay (+- the
jitter, in order), drops it with probability `loss` percent, and serialises it at `link_rate`
on the host's uplink and again on the destination's downlink (tbf's bucket and queue limit).
A host-to-host round trip takes 2 x delay. The emulator ends with its launcher, even a killed
one (its standard input closes; PR_SET_PDEATHSIG), and its TAP devices with it.

    with emulated_hosts(2, link_rate="1gbit") as hosts:
        proc = hosts[1].popen([sys.executable, "task.py"], env=env)

Names carry the job's tag `pl<pid>x<k>`; everything of a tag is removed when the context
exits (normally, on an exception or a signal turned into one). A launcher that was killed
leaves its tag behind: the next emulated_hosts() removes every tag whose pid is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET_PREFIX = "10.77"  # host i of a job is 10.77.N.(i + 1); the launch side is 10.77.N.254
LAUNCH_HOST = 254
MAX_HOSTS = 64
MIN_MTU, MAX_MTU = 576, 65535  # IPv4's smallest datagram every host must take; a veth's largest
MAX_DELAY_MS = 10_000.0
# A rate-limited link's queue: tbf's bucket of at least 4 ms of traffic (tbf needs a burst above
# rate / HZ) and, by default, 10 ms of waiting frames before it drops (--link-queue); the
# user-space link queues as much.
MIN_BURST_BYTES, BURST_SECONDS, DEFAULT_QUEUE_MS = 512 * 1024, 0.004, 10.0
LINK_EMULATOR = Path(__file__).with_name("link_emulator")
NETNS_RUN = Path("/run/netns")  # where `ip netns add` mounts each namespace
COMMAND_TIMEOUT = 30.0
# How long a launcher waits for another one's setup or removal of emulated hosts (each of their
# commands is bounded by COMMAND_TIMEOUT), and how often it looks.
LOCK_TIMEOUT = 120.0
LOCK_POLL = 0.05
TAG_PREFIX = "pl"
# pl<pid>x<k> followed by h<i> (namespace), v<i> (veth, launch side) or br (bridge).
_NAME = re.compile(rf"^({TAG_PREFIX}(\d+)x\d+)(h\d+|v\d+|br)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
# Each namespace's /etc/<file> is bind-mounted from here by `ip netns exec`.
NETNS_ETC = Path("/etc/netns")
_job_numbers = itertools.count()


class EmulationError(RuntimeError):
    """Emulated hosts cannot be built here; the text says what is missing or what failed."""


@dataclass(frozen=True)
class EmulatedHost:
    """One emulated machine: its hostname, network namespace and address."""

    index: int
    name: str
    namespace: str
    address: str

    @property
    def hosts_file(self) -> Path:
        """The /etc/hosts that this host's processes read (`ip netns exec` bind-mounts it over
        /etc/hosts): append to it in place to publish a name late, as a cluster's DNS does."""
        return NETNS_ETC / self.namespace / "hosts"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host: its network namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "/bin/sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def popen(self, argv: Sequence[str], env: dict | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts `argv` on this host (subprocess.Popen keywords apply); its pid is argv's."""
        return subprocess.Popen(self.command(argv), env=env, **kwargs)


class EmulatedHosts(Sequence):
    """The hosts of one emulated cluster (index them) and what mpirun needs to reach them."""

    def __init__(self, tag: str, subnet: int, hosts: list[EmulatedHost], agent: str,
                 link_emulator: subprocess.Popen | None = None) -> None:
        self.tag = tag
        self.link_emulator = link_emulator  # the user-space links' process, if they have one
        self.subnet = f"{SUBNET_PREFIX}.{subnet}.0/24"
        self.launch_address = f"{SUBNET_PREFIX}.{subnet}.{LAUNCH_HOST}"
        self.agent = agent  # the `ssh` of Open MPI's daemons: runs a command on a host
        self._hosts = hosts

    def __getitem__(self, index):
        return self._hosts[index]

    def __len__(self) -> int:
        return len(self._hosts)

    def mpirun_args(self) -> list[str]:
        """mpirun options that start its daemons on these hosts and keep traffic on the subnet."""
        return ["--prtemca", "plm_ssh_agent", self.agent,
                "--prtemca", "plm_ssh_no_tree_spawn", "1",
                "--prtemca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet]


def check_requirements(link_rate: str | None = None, mtu: int | None = None,
                       delay_ms: float | None = None, jitter_ms: float | None = None,
                       loss: float | None = None, queue_ms: float | None = None) -> None:
    """Raises EmulationError naming what is missing (root, `ip`, `unshare`, `tc`, the built
    link emulator) or what is wrong with the links' rate, MTU, delay, jitter, loss or queue."""
    missing = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    tools = {"ip": "iproute2", "unshare": "util-linux"}
    if link_rate:
        tools["tc"] = "iproute2"
    missing += [f"`{tool}` on PATH (package {package})" for tool, package in tools.items()
                if shutil.which(tool) is None]
    if user_space_links(delay_ms, jitter_ms, loss) and not os.access(LINK_EMULATOR, os.X_OK):
        missing.append(f"{LINK_EMULATOR} for a link delay, jitter or loss (built from "
                       "ops/tools/link_emulator.cc with the package: `make build`)")
    if missing:
        raise EmulationError("emulated hosts need " + " and ".join(missing))
    if link_rate:
        rate_bytes_per_second(link_rate)
    if mtu is not None and not MIN_MTU <= mtu <= MAX_MTU:
        raise EmulationError(f"link MTU {mtu}: expected {MIN_MTU} to {MAX_MTU} bytes "
                             "(1500 is Ethernet's, 9000 jumbo frames)")
    if delay_ms is not None and not 0 <= delay_ms <= MAX_DELAY_MS:
        raise EmulationError(f"link delay {delay_ms:g} ms: expected 0 to {MAX_DELAY_MS:g} ms "
                             "(one way, per link)")
    if jitter_ms is not None and not 0 <= jitter_ms <= (delay_ms or 0):
        raise EmulationError(f"link jitter {jitter_ms:g} ms: expected 0 to the link delay "
                             f"({delay_ms or 0:g} ms): each frame is held delay +- jitter")
    if loss is not None and not 0 <= loss < 100:
        raise EmulationError(f"link loss {loss:g}%: expected 0 to less than 100 percent")
    if queue_ms is not None and not 0 < queue_ms <= MAX_DELAY_MS:
        raise EmulationError(f"link queue {queue_ms:g} ms: expected more than 0 to "
                             f"{MAX_DELAY_MS:g} ms of traffic at the link rate")
    if queue_ms is not None and not link_rate:
        raise EmulationError(f"link queue {queue_ms:g} ms: a queue is a rate-limited link's; "
                             "give the rate too (--link-rate)")


def user_space_links(delay_ms: float | None = None, jitter_ms: float | None = None,
                     loss: float | None = None) -> bool:
    """Whether the links need the user-space emulator (a delay, jitter or loss): veths and tbf
    carry everything else."""
    return bool(delay_ms or jitter_ms or loss)


def rate_bytes_per_second(rate: str) -> float:
    """tc's rate syntax (`1gbit`, `100mbit`, `125mbps`) in bytes per second."""
    match = _RATE.match(rate.strip())
    if not match:
        raise EmulationError(f"link rate {rate!r}: expected tc syntax such as 1gbit, 10gbit, "
                             "100mbit or 125mbps")
    number, unit, kind = match.groups()
    value = float(number) * _UNITS[unit.lower()]
    value = value / 8 if kind.lower() == "bit" else value
    if value <= 0:
        raise EmulationError(f"link rate {rate!r} must be positive")
    return value


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if check and proc.returncode != 0:
        raise EmulationError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): "
                             f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _state_dir() -> Path:
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    path = base / "perseusrun-emulate"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(state: Path, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Serialises setup and removal between launchers (subnets, stale tags). An EmulationError
    naming the holder's pid when another launcher holds the lock for `timeout` seconds."""
    with open(state / "lock", "a+") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    lock.seek(0)
                    holder = lock.read().strip() or "unknown"
                    raise EmulationError(
                        f"another launcher (pid {holder}) has held {state / 'lock'} for "
                        f"{timeout:.0f} s while setting up or removing emulated hosts; "
                        "stop it, or remove the lock if that process is gone") from None
                time.sleep(LOCK_POLL)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def _tags(state: Path) -> dict[str, int]:
    """tag -> launcher pid of everything emulated that exists now."""
    names = _namespaces() + _links() + [p.name + "br" for p in state.iterdir() if p.is_dir()]
    return {m.group(1): int(m.group(2)) for m in map(_NAME.match, names) if m}


def _kill_namespace_processes(namespace: str) -> None:
    # Processes keep a deleted namespace (and its veth) alive: end them first, by pid.
    out = _run("ip", "netns", "pids", namespace, check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def remove_tag(tag: str, state: Path | None = None) -> None:
    """Removes every namespace, veth, bridge and file of one emulated cluster."""
    state = state or _state_dir()
    namespaces = [n for n in _namespaces() if n.startswith(tag + "h")]
    for namespace in namespaces:
        _kill_namespace_processes(namespace)
    for namespace in namespaces:
        _run("ip", "netns", "delete", namespace, check=False)
        shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
    for link in _links():
        match = _NAME.match(link)
        if match and match.group(1) == tag:
            _run("ip", "link", "delete", link, check=False)
    for stale_etc in NETNS_ETC.glob(tag + "h*") if NETNS_ETC.is_dir() else ():
        shutil.rmtree(stale_etc, ignore_errors=True)
    with contextlib.suppress(OSError):  # /etc/netns itself, when nothing else uses it
        NETNS_ETC.rmdir()
    shutil.rmtree(state / tag, ignore_errors=True)


def remove_stale(state: Path | None = None) -> list[str]:
    """Removes the emulated clusters of launchers that no longer run; returns their tags."""
    state = state or _state_dir()
    stale = sorted(tag for tag, pid in _tags(state).items() if not _pid_alive(pid))
    for tag in stale:
        remove_tag(tag, state)
    return stale


def _free_subnet() -> int:
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    used = {int(m) for m in re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", out)}
    for subnet in range(256):
        if subnet not in used:
            return subnet
    raise EmulationError(f"every {SUBNET_PREFIX}.N.0/24 subnet is in use on this machine")


def _agent_script(hosts: list[EmulatedHost]) -> str:
    """Open MPI calls it as `agent [ssh options] host command...` (ssh's interface)."""
    cases = "".join(f"  {h.address}|{h.name}) exec {shlex.join(h.command(['/bin/sh', '-c']))}"
                    ' "$*" ;;\n' for h in hosts)
    return ("#!/bin/sh\n"
            "# ssh for Open MPI's daemons: runs the command inside the emulated host.\n"
            'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
            'host=$1; shift\n'
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "perseusrun emulated hosts: unknown host $host" >&2; exit 255 ;;\n'
            "esac\n")


def _burst_bytes(bytes_per_second: float) -> int:
    return max(MIN_BURST_BYTES, int(bytes_per_second * BURST_SECONDS))


def _limit(device: str, rate: str, bytes_per_second: float, queue_ms: float,
           namespace: str | None) -> None:
    netns = ["-n", namespace] if namespace else []
    _run("tc", *netns, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
         "burst", str(_burst_bytes(bytes_per_second)), "latency", f"{queue_ms:g}ms")


def _start_link_emulator(tag: str, hosts: list[EmulatedHost], bytes_per_second: float | None,
                         delay_ms: float, jitter_ms: float, loss: float, queue_ms: float,
                         job_dir: Path) -> subprocess.Popen:
    """The user-space switch with every host's eth0 and the launch side's TAP `<tag>br`, once
    it has created them. Its standard input is a pipe that only this process holds: it ends
    when the pipe closes, so with this launcher whatever kills it."""
    burst = _burst_bytes(bytes_per_second) if bytes_per_second else 0
    argv = [str(LINK_EMULATOR), "--rate", f"{bytes_per_second or 0:.0f}",
            "--burst-bytes", str(burst),
            "--queue-bytes", str(int((bytes_per_second or 0) * queue_ms / 1000)),
            "--delay-us", str(round(delay_ms * 1000)), "--jitter-us", str(round(jitter_ms * 1000)),
            "--loss", f"{loss / 100:.6f}",
            "--seed", str(os.getpid()), "--launch-tap", f"{tag}br",
            *(str(NETNS_RUN / h.namespace) for h in hosts)]
    with open(job_dir / "link_emulator.log", "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True)  # a terminal's Ctrl-C is for the job
    ready, _, _ = select.select([proc.stdout], [], [], COMMAND_TIMEOUT)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        _stop_link_emulator(proc)
        error = (job_dir / "link_emulator.log").read_text(errors="replace").strip()
        raise EmulationError(f"`{shlex.join(argv)}` did not start: "
                             f"{error or f'no answer in {COMMAND_TIMEOUT:.0f} s'}")
    return proc


def _stop_link_emulator(proc: subprocess.Popen) -> None:
    """Closes its standard input (it exits), killing it when it does not in a few seconds."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def _build(tag: str, count: int, link_rate: str | None, state: Path, mtu: int | None,
           delay_ms: float | None = None, jitter_ms: float | None = None,
           loss: float | None = None, queue_ms: float | None = None) -> EmulatedHosts:
    subnet = _free_subnet()
    launch_link = f"{tag}br"  # the bridge, or the launch side's TAP of the user-space links
    hosts = [EmulatedHost(i, f"{tag}h{i}", f"{tag}h{i}", f"{SUBNET_PREFIX}.{subnet}.{i + 1}")
             for i in range(count)]
    job_dir = state / tag
    job_dir.mkdir(mode=0o700)
    rate = rate_bytes_per_second(link_rate) if link_rate else None
    queue_ms = queue_ms or DEFAULT_QUEUE_MS
    mtu_args = ["mtu", str(mtu)] if mtu else []
    user_space = user_space_links(delay_ms, jitter_ms, loss)
    if not user_space:
        _run("ip", "link", "add", launch_link, "type", "bridge")
    for host in hosts:
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        if not user_space:
            veth = f"{tag}v{host.index}"
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
                 host.namespace)
            _run("ip", "link", "set", veth, *mtu_args, "master", launch_link, "up")
            if rate is not None:
                _limit(veth, link_rate, rate, queue_ms, None)  # into the host
                _limit("eth0", link_rate, rate, queue_ms, host.namespace)  # out of the host
    emulator = (_start_link_emulator(tag, hosts, rate, delay_ms or 0, jitter_ms or 0, loss or 0,
                                     queue_ms, job_dir) if user_space else None)
    try:
        _run("ip", "addr", "add", f"{SUBNET_PREFIX}.{subnet}.{LAUNCH_HOST}/24", "dev",
             launch_link)
        _run("ip", "link", "set", launch_link, *mtu_args, "up")
        etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
        for host in hosts:
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.namespace, "link", "set", "eth0", *mtu_args, "up")
            with contextlib.suppress(OSError):  # only the hostnames' resolution depends on it
                (NETNS_ETC / host.namespace).mkdir(parents=True, exist_ok=True)
                host.hosts_file.write_text(etc_hosts)
        agent = job_dir / "agent"
        agent.write_text(_agent_script(hosts))
        agent.chmod(0o700)
    except BaseException:
        if emulator is not None:
            _stop_link_emulator(emulator)
        raise
    return EmulatedHosts(tag, subnet, hosts, str(agent), emulator)


@contextlib.contextmanager
def emulated_hosts(count: int, link_rate: str | None = None, mtu: int | None = None,
                   delay_ms: float | None = None, jitter_ms: float | None = None,
                   loss: float | None = None,
                   queue_ms: float | None = None) -> Iterator[EmulatedHosts]:
    """`count` emulated hosts for the time of the with-block; everything is removed after it.
    `delay_ms` (one way, per link), `jitter_ms` and `loss` (percent of the frames leaving a
    host) put the user-space links in place of veths (see the module's description).
    `queue_ms`: how much traffic, in milliseconds at `link_rate`, a link holds before it drops
    frames (default DEFAULT_QUEUE_MS).

    Removal also runs when the block raises (KeyboardInterrupt included); SIGINT and SIGTERM are
    ignored while it runs so that a second Ctrl-C cannot leave half a cluster behind.
    """
    if not 1 <= count <= MAX_HOSTS:
        raise EmulationError(f"emulated hosts: {count} requested, 1 to {MAX_HOSTS} supported")
    check_requirements(link_rate, mtu, delay_ms, jitter_ms, loss, queue_ms)
    state = _state_dir()
    tag = f"{TAG_PREFIX}{os.getpid()}x{next(_job_numbers)}"
    if len(f"{tag}h{count - 1}") > 15:  # Linux interface names
        raise EmulationError(f"emulated host names of tag {tag!r} exceed 15 characters")
    hosts = None
    try:
        with _locked(state):
            remove_stale(state)
            hosts = _build(tag, count, link_rate, state, mtu, delay_ms, jitter_ms, loss,
                           queue_ms)
        yield hosts
    finally:
        previous, deferred = _defer_stop_signals()
        try:
            if hosts is not None and hosts.link_emulator is not None:
                _stop_link_emulator(hosts.link_emulator)  # it holds the namespaces' TAPs
            with _locked(state):
                remove_tag(tag, state)
        finally:
            _restore(previous, deferred)


def _defer_stop_signals() -> tuple[dict, list[int]]:
    """While the hosts are removed (bounded: the lock and every command have a timeout), a stop
    signal is recorded instead of interrupting the removal; _restore delivers it afterwards."""
    deferred: list[int] = []
    try:
        return {s: signal.signal(s, lambda signum, _frame: deferred.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}, deferred
    except ValueError:  # not the main thread: signals stay as they are
        return {}, deferred


def _restore(previous: dict, deferred: list[int]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    if deferred:
        signal.raise_signal(deferred[0])
