"""The one loop that watches a started job for every backend: output, deadlines, stop signals.

A job is one launcher process (mpirun, srun), or one process per rank (perseusrun --tcp, ranks
on emulated hosts). supervise() forwards whole output lines, passes SIGINT/SIGTERM/SIGHUP on to
the job, ends the job when `--timeout` runs out, when one of several ranks fails, or when a rank
has aborted an MPI job that mpirun does not end, and SIGKILLs what has not stopped `grace`
seconds after it was asked to.

Given a `lost` set (`perseusrun --restarts`), it adds every rank that the job's output says was
lost (the survivors' perseus_shared.lost_rank.lost_rank_line, or mpirun's "process rank N ...
exited on signal"), and when one of several ranks fails it first gives the others up to
SURVIVOR_SECONDS to notice, save the last completed step and exit by themselves.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from perseus_shared import lost_rank

# SIGTERM first, then SIGKILL for the whole process tree when the job is still there.
KILL_GRACE_SECONDS = 10.0
# The signals that stop a job: forwarded to its processes.
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
                     if s)
TIMEOUT_EXIT_CODE = 124
# What a rank prints (mpi_controller.cc) before MPI_Abort when another rank stopped answering.
ABORT_LINE = "]: aborting the MPI job: "
# After that line mpirun ends the job, unless it waits for the daemon of a host it can no longer
# reach (a cut link), which can last for as long as TCP retransmits: then the launcher ends it.
ABORT_GRACE_SECONDS = 15.0
# The exit code of a job a rank aborted (MPI_Abort's error code in mpi_controller.cc).
ABORT_EXIT_CODE = 1
POLL_SECONDS = 0.05
# How long survivors of a lost rank get to see it (a silent peer: 30 s), save and exit.
SURVIVOR_SECONDS = 60.0
# mpirun's report of a rank that died (its text may wrap after "exited on").
_MPIRUN_LOST = re.compile(r"noticed that process rank (\d+) with PID \d+ on node \S+ exited on")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    # mpirun puts each rank in its own process group, so kill by pid, ranks first.
    for pid in _descendants(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)  # each rank leads its own process group
        except OSError:
            pass


def lost_rank_in(text: str) -> int | None:
    """The rank a line of a job's output says was lost (a survivor's or mpirun's), or None."""
    lost = lost_rank.lost_rank_in(text)
    if lost is None:
        found = _MPIRUN_LOST.search(text)
        lost = int(found.group(1)) if found else None
    return lost


class Losses(set):
    """The ranks a run lost, and `saved`: (global step, checkpoint) a survivor saved whole after
    the loss (perseus_shared.lost_rank.saved_step_in), or None."""

    saved: tuple[int, str] | None = None

    def read(self, text: str) -> None:
        """Adds what a line of the job's output says: a lost rank, the step saved."""
        lost = lost_rank_in(text)
        if lost is not None:
            self.add(lost)
            self.saved = lost_rank.saved_step_in(text) or self.saved


def _forward_lines(stream, prefix: str, out, aborted: threading.Event,
                   lost: set | None, reported: threading.Event) -> None:
    # Whole lines only: ranks writing to one shared stdout would interleave within a line (an
    # unbuffered print() writes its newline separately).
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        if ABORT_LINE in text:
            aborted.set()
        if lost is not None and lost_rank_in(text) is not None:
            if isinstance(lost, Losses):
                lost.read(text)
            else:
                lost.add(lost_rank_in(text))
            reported.set()
        out.write(prefix + text)
        out.flush()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _say(message: str) -> None:
    print(f"perseusrun: {message}", file=sys.stderr, flush=True)


class _Job:
    """The started processes and how to signal them: a launcher's whole tree, or each rank's
    process group."""

    def __init__(self, commands: Sequence[tuple[list[str], dict]], per_rank: bool,
                 tag_output: bool, lost: set | None) -> None:
        self.per_rank = per_rank
        self.aborted = threading.Event()
        self.procs: list[subprocess.Popen] = []
        self.reported: list[threading.Event] = []  # per process: it printed a lost rank's line
        self.forwarders: list[threading.Thread] = []
        for rank, (argv, env) in enumerate(commands):
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=per_rank)
            self.procs.append(proc)
            self.reported.append(threading.Event())
            for stream, tag, out in ((proc.stdout, "stdout", sys.stdout),
                                     (proc.stderr, "stderr", sys.stderr)):
                prefix = f"[1,{rank}]<{tag}>:" if tag_output and per_rank else ""
                thread = threading.Thread(target=_forward_lines,
                                          args=(stream, prefix, out, self.aborted, lost,
                                                self.reported[-1]), daemon=True)
                thread.start()
                self.forwarders.append(thread)

    def running(self) -> list[subprocess.Popen]:
        return [proc for proc in self.procs if proc.poll() is None]

    def signal(self, signum: int) -> None:
        for proc in self.running():
            if self.per_rank:
                _signal_group(proc, signum)
            else:
                proc.send_signal(signum)  # a second Ctrl-C makes mpirun abort at once

    def kill(self) -> None:
        for proc in self.procs:
            if self.per_rank:
                _signal_group(proc, signal.SIGKILL)
            elif proc.poll() is None:
                _kill_tree(proc)

    def wait_a_moment(self) -> None:
        running = self.running()
        if running:
            try:
                running[0].wait(timeout=POLL_SECONDS)  # returns early when it ends
            except subprocess.TimeoutExpired:
                pass


def _survivors_done(job: _Job, lost: set) -> bool:
    """Whether every rank not named lost has exited or reported the loss (a survivor prints
    its line once its save, if it makes one, is complete), and some rank was named lost."""
    return bool(lost) and all(proc.poll() is not None or job.reported[rank].is_set()
                              for rank, proc in enumerate(job.procs) if rank not in lost)


def supervise(commands: Sequence[tuple[list[str], dict]], timeout: float | None = None,
              grace: float = KILL_GRACE_SECONDS, per_rank: bool = False,
              tag_output: bool = False, lost: set | None = None) -> int:
    """Starts each (argv, env) and watches them until all have ended; returns the job's code.

    `per_rank`: the commands are the ranks themselves (each in its own process group; the
    others are ended when one fails) rather than one launcher that owns its ranks (signalled
    itself, killed with its whole process tree). The code is 124 after `timeout`, 128 + N after
    signal N stopped the job, 1 after a rank aborted an MPI job, else the first failure's.
    `lost`: see the module's docstring.
    """
    job = _Job(commands, per_rank, tag_output, lost)
    job_deadline = time.monotonic() + timeout if timeout else None
    kill_deadline: list[float | None] = [None]
    abort_deadline = None
    stopped_by: list[int] = []
    failure: list[int] = []
    killed_after_abort = False
    survivor_deadline = None

    def stop(signum: int) -> None:
        job.signal(signum)
        if kill_deadline[0] is None:
            kill_deadline[0] = time.monotonic() + grace

    def forward(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        stop(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        while job.running():
            job.wait_a_moment()
            now = time.monotonic()
            for rank, proc in enumerate(job.procs):
                code = proc.poll()
                if code not in (None, 0) and not failure and not stopped_by:
                    failure.append(_exit_code(code))
                    if len(job.procs) > 1 and lost is not None:
                        _say(f"rank {rank} exited with code {code}; the other ranks get "
                             f"{SURVIVOR_SECONDS:g} s to save the last completed step and exit")
                        survivor_deadline = now + SURVIVOR_SECONDS
                    elif len(job.procs) > 1:
                        _say(f"rank {rank} exited with code {code}; terminating the other ranks")
                        stop(signal.SIGTERM)
            if survivor_deadline is not None and (now >= survivor_deadline
                                                  or _survivors_done(job, lost)):
                survivor_deadline = None
                if job.running():
                    _say("terminating the ranks still running")
                    stop(signal.SIGTERM)
            if abort_deadline is None and job.aborted.is_set():
                abort_deadline = now + ABORT_GRACE_SECONDS
            if abort_deadline is not None and now >= abort_deadline and job.running():
                _say(f"a rank aborted the job and mpirun has not ended {ABORT_GRACE_SECONDS:g} s "
                     "later (it may wait for a host it cannot reach); killing it")
                job.kill()
                killed_after_abort = True
                break
            if job_deadline is not None and now >= job_deadline:
                _say(f"timeout: the job ran longer than --timeout {timeout:g} s; terminating "
                     "all ranks")
                job_deadline = None
                stopped_by.append(-1)
                stop(signal.SIGTERM)
            if kill_deadline[0] is not None and now >= kill_deadline[0]:
                _say(f"the job did not stop within {grace:g} s; killing it")
                job.kill()
                kill_deadline[0] = float("inf")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for proc in job.procs:
        proc.wait()
    for thread in job.forwarders:
        thread.join(timeout=5)
    if killed_after_abort:
        return ABORT_EXIT_CODE
    if -1 in stopped_by:
        return TIMEOUT_EXIT_CODE
    if stopped_by:
        return 128 + stopped_by[0]
    if not failure:  # every rank ended within one poll: none was seen failing above
        failure = [_exit_code(c) for c in (p.returncode for p in job.procs) if c != 0][:1]
    return failure[0] if failure else 0
