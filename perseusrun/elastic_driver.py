"""The elastic driver: a small authenticated service in the launcher that forms the rounds of an
elastic job (perseusrun.elastic_run starts and stops the worker processes around it).

Each worker asks it for a round (perseus_legacy.common.elastic_client): at the start, after
losing a rank, and after HostsUpdatedInterrupt. A round forms when every live worker of the
last round has asked again; a worker that has not asked is lost when its process ended or its
heartbeat stopped for HEARTBEAT_LIMIT seconds (a frozen process, a cut link), and the launcher
ends it. Workers started since (new hosts) join the next round; surviving ranks keep their
order, so rank 0 is an old rank whose state sync() broadcasts. Too few workers for --min-np
end the job: every waiting worker exits with the reason. Messages prove the job secret both
ways (elastic_wire.elastic_send).
"""

from __future__ import annotations

import errno
import secrets
import selectors
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from perseus_shared import elastic_wire

# A worker whose heartbeat (every 0.5 s) stopped this long ago, while the others regroup, is lost.
HEARTBEAT_LIMIT = 5.0
# The first round waits this long for every started worker, then forms with those that came.
START_WAIT = 300.0
# A connection must send its whole request this soon after it was accepted, or it is closed.
HANDSHAKE_SECONDS = 10.0
# Connections not yet authenticated held at once (one thread reads them all); a new one beyond
# this closes the oldest, so idle connections cannot lock workers out or exhaust descriptors.
MAX_PENDING = 128
# Round forming that keeps failing (no free port, no descriptor) this long ends the job.
ROUND_ERROR_LIMIT = 30.0
# An exit code of a worker the driver ended because too few ranks remain.
TOO_FEW_EXIT_CODE = 3


@dataclass
class Worker:
    """One worker process (a slot of a host) as the driver sees it."""

    name: str  # host/slot
    host: str
    slot: int
    address: str  # the host's address the worker listens on
    order: int  # start order: new workers rank after the survivors, in this order
    alive: bool = True
    asked: int | None = None  # the round after which it asked for a new one
    member_of: int = 0  # the last round it is a rank of
    rank: int = -1
    removed: bool = False  # its host left the discovered hosts: exits at its next request
    lost: bool = False
    last_beat: float = field(default_factory=time.monotonic)
    answer: dict | None = None
    ticket: object = None  # the request now waiting for its answer


@dataclass
class _Pending:
    """An accepted connection that has not yet sent its whole request."""

    nonce: str
    deadline: float
    data: bytearray = field(default_factory=bytearray)


def _say(message: str) -> None:
    print(f"perseusrun: elastic: {message}", file=sys.stderr, flush=True)


class Driver:
    """Rounds of workers; `ports(round, workers)` gives each member's port."""

    def __init__(self, secret: str, bind_address: str, min_np: int, max_np: int,
                 ports: Callable[[int, list[Worker]], list[int]],
                 on_lost: Callable[[Worker, str], None],
                 handshake_seconds: float = HANDSHAKE_SECONDS) -> None:
        self.secret = secret
        self.handshake_seconds = handshake_seconds
        self.min_np = min_np
        self.max_np = max_np
        self.ports = ports
        self.on_lost = on_lost
        self.round = 0
        self.workers: dict[str, Worker] = {}
        self.failure: str | None = None  # why the job ended (too few ranks)
        self.finished = False  # a member of the last round exited 0: training is over
        self.events: list[tuple[float, str]] = []  # (time.time(), what) for measurements
        self._cv = threading.Condition()
        self._started = time.monotonic()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_address, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.address = f"{bind_address}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()
        self._paused_until = 0.0  # accept() ran out of descriptors: listen again after this
        self._closed = False
        self._refusals = 0  # refused connections not yet reported
        self._reported = 0.0  # when a refusal was last reported
        self._round_error: tuple[float, str] | None = None  # (since, what) forming fails
        threading.Thread(target=self._accept, daemon=True, name="elastic-driver").start()
        threading.Thread(target=self._watch, daemon=True, name="elastic-rounds").start()

    # ---- what the launcher tells the driver --------------------------------------------------

    def add_worker(self, worker: Worker) -> None:
        with self._cv:
            self.workers[worker.name] = worker
            self._cv.notify_all()

    def worker_exited(self, name: str, code: int) -> None:
        """The launcher saw the worker's process end with `code`."""
        with self._cv:
            worker = self.workers[name]
            worker.alive = False
            if code == 0 and worker.member_of == self.round and self.round > 0 \
                    and not worker.removed:
                self.finished = True
            elif not worker.lost and not worker.removed and self.failure is None \
                    and not self.finished:
                self._lose(worker, f"its process exited with code {code}")
            self._cv.notify_all()

    def remove_host(self, host: str) -> None:
        """The host left the discovered hosts: its workers leave at the next check."""
        with self._cv:
            for worker in self.workers.values():
                if worker.host == host and worker.alive:
                    worker.removed = True
            self._cv.notify_all()

    def hosts_updated(self) -> bool:
        """Whether workers wait to join, or members must leave (a removed host)."""
        live = [w for w in self.workers.values() if w.alive and not w.lost]
        members = [w for w in live if w.member_of == self.round and self.round > 0]
        room = len(members) < self.max_np
        return any(w.member_of == 0 and w.asked is not None and room for w in live) or any(
            w.removed for w in members)

    def stop(self) -> None:
        with self._cv:
            self.finished = True
            self._closed = True
            self._cv.notify_all()

    # ---- rounds ----------------------------------------------------------------------------

    def _lose(self, worker: Worker, why: str) -> None:
        worker.lost = True
        self.events.append((time.time(), f"lost {worker.name}"))
        _say(f"lost worker {worker.name} (rank {worker.rank} of round {worker.member_of}): {why}")
        self.on_lost(worker, why)

    def _members(self) -> list[Worker]:
        return [w for w in self.workers.values()
                if w.member_of == self.round and self.round > 0 and not w.lost]

    def _try_form(self) -> None:
        """Forms the next round when every worker it waits for has asked (lock held)."""
        if self.failure or self.finished:
            return
        now = time.monotonic()
        waiting = [w for w in self.workers.values() if w.asked is not None and w.alive
                   and not w.lost]
        if not waiting:
            return
        for worker in waiting:
            if worker.removed:
                worker.answer = {"exit": "its host left the job's hosts", "code": 0}
                worker.asked = None
        if self.round == 0:
            expected = [w for w in self.workers.values() if w.alive and not w.lost]
            missing = [w for w in expected if w.asked is None]
            if missing and now - self._started < START_WAIT:
                return
        else:
            members = [w for w in self._members() if w.alive and not w.removed]
            missing = [w for w in members if w.asked is None]
            for worker in missing:
                if now - worker.last_beat > HEARTBEAT_LIMIT:
                    self._lose(worker, f"no heartbeat for {now - worker.last_beat:.1f} s while "
                                       "the others regroup (frozen, or its link is cut)")
            if any(not w.lost for w in missing):
                return
        joining = [w for w in self.workers.values() if w.asked is not None and w.alive
                   and not w.lost and not w.removed]
        if not joining:
            return
        if len(joining) < self.min_np:
            self.failure = (f"{len(joining)} rank(s) left, fewer than --min-np {self.min_np}: "
                            "ending the job")
            _say(self.failure)
            for worker in joining:
                worker.answer = {"exit": self.failure, "code": TOO_FEW_EXIT_CODE}
            return
        # Survivors keep their order (rank 0 stays an old rank), newcomers follow.
        joining.sort(key=lambda w: (w.member_of == 0, w.rank if w.member_of else w.order))
        joining = joining[:self.max_np]
        ports = self.ports(self.round + 1, joining)  # may raise: nothing has changed yet
        self.round += 1
        addresses = [f"{w.address}:{port}" for w, port in zip(joining, ports)]
        hosts = list(dict.fromkeys(w.host for w in joining))
        for rank, worker in enumerate(joining):
            same_host = [w for w in joining if w.host == worker.host]
            local_rank = same_host.index(worker)
            same_local = [h for h in hosts
                          if sum(1 for w in joining if w.host == h) > local_rank]
            worker.rank, worker.member_of, worker.asked = rank, self.round, None
            worker.answer = {"round": self.round, "rank": rank, "size": len(joining),
                             "local_rank": local_rank, "local_size": len(same_host),
                             "cross_rank": same_local.index(worker.host),
                             "cross_size": len(same_local), "addresses": addresses}
        self.events.append((time.time(), f"round {self.round} of {len(joining)}"))
        _say(f"round {self.round}: {len(joining)} ranks on {', '.join(hosts)}")

    def _watch(self) -> None:
        with self._cv:
            while not (self.finished or self.failure):
                try:
                    self._try_form()
                    self._round_error = None
                except Exception as exc:  # noqa: BLE001 (no error may end round forming)
                    self._forming_failed(exc)
                self._cv.notify_all()
                self._cv.wait(timeout=0.2)
            for worker in self.workers.values():
                if worker.asked is not None and worker.answer is None:
                    worker.answer = self._final_answer()
            self._cv.notify_all()

    def _forming_failed(self, exc: Exception) -> None:
        """Round forming raised (lock held): tried again until ROUND_ERROR_LIMIT, then the job
        ends with the error."""
        what = f"{type(exc).__name__}: {exc}"
        now = time.monotonic()
        if self._round_error is None:
            self._round_error = (now, what)
            _say(f"cannot form round {self.round + 1} yet ({what}); trying again")
        elif now - self._round_error[0] > ROUND_ERROR_LIMIT:
            self.failure = (f"round {self.round + 1} could not be formed for "
                            f"{ROUND_ERROR_LIMIT:g} s: {what}")
            _say(self.failure)

    def _final_answer(self) -> dict:
        """What a worker asking for a round gets once the job is over."""
        if self.failure:
            return {"exit": self.failure, "code": TOO_FEW_EXIT_CODE}
        return {"exit": "the job finished before this worker joined", "code": 0}

    # ---- the service -------------------------------------------------------------------------

    def _accept(self) -> None:
        """One thread: accepts connections, sends each its nonce and reads its request (no
        thread or blocking read per connection); an authenticated request gets a thread."""
        while not self._closed:
            try:
                self._accept_once()
            except Exception as exc:  # noqa: BLE001 (no error may end the service)
                _say(f"the driver's service: {type(exc).__name__}: {exc}; continuing")
                time.sleep(0.1)
        for conn in list(self._pending):
            self._drop(conn)
        self._selector.close()
        self._listener.close()

    def _accept_once(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        for key, _ in self._selector.select(timeout=0.2):
            if key.fileobj is self._listener:
                self._take_new()
            else:
                self._read_pending(key.fileobj)
        now = time.monotonic()
        while self._pending:
            conn, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                break
            self._refuse(conn, f"no whole request within {self.handshake_seconds:g} s")

    def _take_new(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return  # that connection failed (ECONNABORTED...): not the listener
                if self._pending:  # out of descriptors: the oldest waiting connection gives one
                    self._refuse(next(iter(self._pending)), "out of descriptors: the oldest "
                                 "unauthenticated connection is closed for a new one")
                    continue
                self._selector.unregister(self._listener)
                self._paused_until = time.monotonic() + 0.1
                self._report(f"accept: {exc.strerror}; listening again in 0.1 s")
                return
            if len(self._pending) >= MAX_PENDING:
                self._refuse(next(iter(self._pending)), f"{MAX_PENDING} connections wait to "
                             "authenticate: the oldest is closed for a new one")
            nonce = secrets.token_hex(16)
            try:
                conn.setblocking(False)
                conn.send((nonce + "\n").encode())  # 33 bytes into an empty send buffer
                self._selector.register(conn, selectors.EVENT_READ)
            except OSError:
                conn.close()
                continue
            self._pending[conn] = _Pending(nonce, time.monotonic() + self.handshake_seconds)

    def _read_pending(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:
            return
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(conn, exc.strerror or str(exc))
            return
        if not data:
            self._refuse(conn, "the connection closed before a request")
            return
        pending.data += data
        end = pending.data.find(b"\n")
        if end < 0:
            if len(pending.data) > elastic_wire.ELASTIC_MAX_REQUEST:
                self._refuse(conn, f"a request longer than {elastic_wire.ELASTIC_MAX_REQUEST} "
                             "bytes")
            return
        line = bytes(pending.data[:end + 1])
        try:
            request = elastic_wire.elastic_open(line, self.secret, pending.nonce,
                                                "an elastic worker's request")
        except ValueError as exc:
            self._refuse(conn, str(exc))
            return
        self._forget(conn)
        threading.Thread(target=self._serve, args=(conn, request), daemon=True,
                         name="elastic-request").start()

    def _forget(self, conn: socket.socket) -> None:
        """Stops watching `conn` as a pending connection (it stays open)."""
        self._pending.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        conn.close()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self._drop(conn)
        self._report(f"refused a connection: {why}")

    def _report(self, message: str) -> None:
        """Says `message`, at most once a second (a flood of bad connections is counted)."""
        if self.finished:
            return
        self._refusals += 1
        now = time.monotonic()
        if now - self._reported >= 1.0:
            more = f" (and {self._refusals - 1} more since the last report)" \
                if self._refusals > 1 else ""
            _say(message + more)
            self._refusals, self._reported = 0, now

    def _serve(self, conn: socket.socket, request: dict) -> None:
        with conn:
            try:
                conn.setblocking(True)
                conn.settimeout(self.handshake_seconds)  # for sends; waits are bounded apart
                answer = self._handle(request, conn)
                if answer is not None:
                    elastic_wire.elastic_send(conn, self.secret, str(request.get("nonce", "")),
                                              answer)
            except (OSError, ValueError) as exc:
                if not self.finished:
                    _say(f"a request of worker {request.get('worker')!r} failed: {exc}")

    def _handle(self, request: dict, conn: socket.socket) -> dict | None:
        name = str(request.get("worker"))
        op = request.get("op")
        with self._cv:
            worker = self.workers.get(name)
            if worker is None:
                raise ValueError(f"unknown worker {name!r}")
            worker.last_beat = time.monotonic()
            if op == "poll":
                return {"updated": self.hosts_updated()}
            if op == "rendezvous":
                if self.failure or self.finished:
                    return self._final_answer()
                worker.asked = int(request.get("round", 0))
                worker.answer = None
                worker.ticket = ticket = object()
                self.events.append((time.time(), f"asked {name}"))
                self._cv.notify_all()
        if op == "rendezvous":
            return self._wait_for_round(worker, ticket, conn)
        if op == "heartbeat":
            conn.settimeout(None)
            while conn.recv(64):
                with self._cv:
                    worker.last_beat = time.monotonic()
                conn.sendall(b".")  # the worker knows the driver is there
            return None
        raise ValueError(f"unknown request {op!r} from worker {name}")

    def _wait_for_round(self, worker: Worker, ticket: object, conn: socket.socket) -> dict | None:
        """The worker's answer once its round forms; meanwhile an empty line every
        KEEPALIVE_SECONDS tells it the driver still forms rounds (and ends this thread when the
        worker is gone)."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: worker.answer is not None or worker.ticket is not ticket,
                                  timeout=elastic_wire.KEEPALIVE_SECONDS)
                if worker.ticket is not ticket:
                    return None  # the worker asked again on another connection
                if worker.answer is not None:
                    answer, worker.answer, worker.ticket = worker.answer, None, None
                    return answer
            conn.sendall(elastic_wire.KEEPALIVE)
