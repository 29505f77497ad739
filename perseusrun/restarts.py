"""`--restarts K` and `--min-np M`: the job relaunched after a lost rank, without its host.

When a rank is lost, the lowest survivor saves the last completed step where rank 0 saves
checkpoints and every survivor exits with a line naming a lost rank and the saved step
(perseus_legacy.tf1.survivor); the lost ranks are the union of what those lines name (ranks of
one host lost together: each survivor may name another); mpirun, which ends the survivors
itself, names a rank that died. run_with_restarts() then starts the job again, at most K
times: without the lost ranks' hosts when they are other machines (emulated hosts, hosts of
-H/--hostfile), with as many ranks when every rank ran on this machine, and never with fewer
than `--min-np` ranks (default: -np), which ends the job with an error instead. It says the
step the job resumes from: the one a survivor saved, else rank 0's last checkpoint. A job
that fails without a lost rank (a rank's own error, a frame that fails its MAC) is not
restarted, and the launcher says so. The program resumes from the checkpoint by itself
(Estimator, MonitoredTrainingSession), so no completed step is trained twice.

A job is described by its placement: the host of each rank, in rank order.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from perseusrun.job import UsageError, is_local_host
from perseusrun.supervise import TIMEOUT_EXIT_CODE, Losses

# run_once(placement, lost ranks to fill in, seconds left or None) -> exit code
RunOnce = Callable[[list, set, "float | None"], int]


def check_restart_args(args: argparse.Namespace) -> None:
    """--restarts >= 0 and 1 <= --min-np <= -np."""
    if args.restarts < 0:
        raise UsageError(f"--restarts must be 0 or more, got {args.restarts}")
    if args.min_np is not None and not 1 <= args.min_np <= (args.np or args.min_np):
        raise UsageError(f"--min-np must be between 1 and -np {args.np}, got {args.min_np}")


def placement_of(hosts: list[tuple[str, int]], np: int) -> list[str]:
    """The host of each of `np` ranks filling `hosts`' slots in order (mpirun's by-slot
    mapping; past the last slot, round again)."""
    slots = [name for name, count in hosts for _ in range(count)]
    return [slots[rank % len(slots)] for rank in range(np)] if slots else ["localhost"] * np


def hosts_of(placement: list) -> list[tuple]:
    """(host, ranks on it) in first-seen order."""
    counts: dict = {}
    for host in placement:
        counts[host] = counts.get(host, 0) + 1
    return list(counts.items())


def _say(message: str) -> None:
    print(f"perseusrun: {message}", file=sys.stderr, flush=True)


def _name(host) -> str:
    return str(getattr(host, "name", host))


def resumed_from(lost: Losses) -> str:
    """Where the restart resumes: the step a survivor saved, or rank 0's last checkpoint."""
    saved = lost.saved
    if saved is None:
        return ("the last checkpoint rank 0 wrote (no survivor saved the last completed "
                "step)")
    return f"global step {saved[0]}, saved by a survivor: {saved[1]}"


def run_with_restarts(args: argparse.Namespace, placement: list, run_once: RunOnce,
                      local: Callable[[object], bool] = lambda host: is_local_host(str(host))
                      ) -> int:
    """Runs the job, and again after each lost rank (at most args.restarts times); returns the
    last run's exit code. `local(host)`: the host is this machine (never dropped)."""
    min_np = args.min_np or len(placement)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    for attempt in range(args.restarts + 1):
        lost = Losses()
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        code = run_once(placement, lost, left)
        if code == 0 or args.restarts == 0:
            return code
        if not lost:
            if code != TIMEOUT_EXIT_CODE and attempt < args.restarts:
                _say(f"the job failed (exit {code}) without a lost rank: not restarting")
            return code
        gone = sorted({placement[r] for r in lost if r < len(placement)}, key=placement.index)
        dropped = [h for h in gone if not local(h)]
        remaining = [h for h in placement if h not in dropped]
        # Every rank of a dropped host leaves with it, whether or not a survivor named it.
        leaving = set(lost) | {r for r, host in enumerate(placement) if host in dropped}
        what = (f"rank {', '.join(map(str, sorted(leaving)))} lost"
                + (f" with host {', '.join(map(_name, dropped))}" if dropped else ""))
        if attempt == args.restarts:
            _say(f"{what}; no restart left (--restarts {args.restarts})")
            return code
        if len(remaining) < min_np:
            _say(f"error: {what}: {len(remaining)} rank(s) would remain, fewer than --min-np "
                 f"{min_np}; not restarting")
            return code
        if deadline is not None and time.monotonic() >= deadline:
            return code
        placement = remaining
        where = ", ".join(f"{_name(h)}:{n}" for h, n in hosts_of(placement))
        _say(f"{what}; restart {attempt + 1} of {args.restarts} on {len(placement)} ranks "
             f"({where}), from {resumed_from(lost)}")
    return code
