"""A lost rank costs no completed step: the lowest surviving rank saves the last one.

Synchronous training leaves every surviving rank holding the same variables, those of the last
step every rank completed: each update op of a step waits for every gradient collective of that
step (graph_rewrite.py, and GradientReducer for DistributedOptimizer), so a step in which a rank
was lost updates no variable anywhere. When a training step fails because a rank is gone (its
connection closed, it stopped responding past the silence limit, its link cut), the runtime's
error names one lost rank on each survivor ("perseus_legacy: rank L (host:port) closed its
connection ..."); survivors may name different ones (ranks 0 and 1 of one host lost together:
one survivor sees rank 0 go, another rank 1), and the runtime, stopped, can no longer tell them
more. The survivors agree on who saves through the job's checkpoint directory instead (where
rank 0 writes: the `model_dir` given to run_config(), or the path given to checkpoint_dir()),
which the restart reads anyway: one survivor claims the save of step k by creating
`.survivor-save-<k>` there (atomically, holding its rank); the others read the claim. A survivor
that knows every lower rank lost claims at once; one that does not waits AGREEMENT_SECS for each
lower rank it does not know lost before it claims, so the lowest survivor is the one that saves
whenever the survivors notice the loss within AGREEMENT_SECS of one another (they do: the first
to notice shuts its connections, which the others see at once). Whatever the timing, only one
survivor saves, and every survivor's line names it. The saver writes a whole checkpoint of its
variables with the graph's own Saver (the `checkpoint` file names it only once it is complete)
and removes the claim. Every survivor prints one line (perseus_shared/lost_rank.py: the lost rank
it saw, which step was saved, by which rank and where) and the error goes on as before: the rank
exits. `perseusrun --restarts` takes the union of the lost ranks those lines name, says from
which step the job resumes, and a rerun, or a TF_CONFIG task restarted by its scheduler,
resumes from that checkpoint.

A rank whose own program fails is not lost, nor is a peer whose frame fails its MAC (altered or
injected on the way: the job fails, naming the peer, and is not restarted without it). A
watched session closing with an error of its own (a full disk in a checkpoint save, an op
error; not the end of the input, not an error the runtime raised) fails every rank with that
cause (perseus_legacy.common.failure), unless every rank's session closes with an error of its
own within STEP_ERROR_AGREEMENT_SECS (one small allreduce tells): a bad batch on every rank
fails nobody else, and a program that catches the error may train again. No survivor saves
after such a failure: it may lie in the state a save would write (a NaN, the disk).

SyncReplicasHook and BroadcastGlobalVariablesHook call watch() once rank 0's variables are
broadcast: a rank lost before then leaves no step to save. Over MPI, Open MPI's launcher ends the
survivors as soon as a rank dies, so none saves (docs/multi-host.md says what that costs).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf

from perseus_legacy.common import basics, failure, native
from perseus_shared.lost_rank import lost_rank_line

# What the runtime says of a lost peer, and only of one: a frame that fails its MAC names the
# peer too ("rank P (address) sent control frame ...") but loses nobody.
_LOST = re.compile(r"perseus_legacy: rank (\d+) \([^)]*\)(?:, rank \d+ \([^)]*\))* "
                   r"(?:closed its connection|connection failed|stopped responding)")
_WATCHED = "_perseus_survivor_watched"
# The report of the session watch() watched last (a rank trains one session at a time).
_last_watched: list = []
# A MonitoredSession recovers from these (it makes a new session): not an end of training.
_RECOVERED = (tf.errors.AbortedError, tf.errors.UnavailableError)
# How long a survivor waits for another's claim per lower rank it does not know lost.
AGREEMENT_SECS = 2.0
_POLL_SECS = 0.05
# How long a rank whose session closes with an error of its own waits for every other rank to
# say the same (a bad batch everywhere) before it fails them all with it.
STEP_ERROR_AGREEMENT_SECS = 5.0
_step_errors = itertools.count()
_job_checkpoint_dir: str | None = None


def set_job_checkpoint_dir(path: str | None) -> None:
    """Records where rank 0 writes checkpoints (every rank calls it with the same path)."""
    global _job_checkpoint_dir
    _job_checkpoint_dir = os.fspath(path) if path else None


def job_checkpoint_dir() -> str | None:
    """The directory rank 0 writes checkpoints to, as recorded, or None."""
    return _job_checkpoint_dir


def lost_rank(error: BaseException) -> int | None:
    """The rank a collective's error says is gone, or None when the error is something else."""
    found = _LOST.search(str(getattr(error, "message", None) or error))
    return int(found.group(1)) if found else None


def claim_wait(rank: int, known_lost: set) -> float:
    """Seconds survivor `rank` waits for a lower survivor's claim before it claims the save:
    AGREEMENT_SECS for each lower rank not in `known_lost` (0: it knows it is the lowest)."""
    return AGREEMENT_SECS * sum(1 for lower in range(rank) if lower not in known_lost)


def claim_path(directory: str, step: int) -> str:
    return os.path.join(directory, f".survivor-save-{step}")


def read_claim(path: str) -> int | None:
    """The rank that claimed the save at `path`, or None while nobody has."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def try_claim(path: str, rank: int) -> int | None:
    """Claims the save at `path` for `rank` unless another rank holds it: the holder's rank, or
    None when the claim went in between (its save done or failed: look again). The claim
    appears whole (a hard link of a written file), or not at all."""
    draft = f"{path}.{rank}.{os.getpid()}"
    with open(draft, "w") as f:
        f.write(str(rank))
    try:
        os.link(draft, path)
        return rank
    except FileExistsError:
        return read_claim(path)
    finally:
        os.unlink(draft)


def agree_on_saver(directory: str, step: int, rank: int, known_lost: set) -> int | None:
    """The survivor that saves step `step` into `directory`, as every survivor learns it; None
    when the checkpoint of `step` is complete there already."""
    path = claim_path(directory, step)
    until = time.monotonic() + claim_wait(rank, known_lost)
    while True:
        holder = read_claim(path)  # first: a saver writes the checkpoint, then releases
        if holder is None and _latest_is(directory, step):
            return None
        if holder is None and time.monotonic() >= until:
            holder = try_claim(path, rank)
        if holder is not None:
            return holder
        time.sleep(_POLL_SECS)  # a claim is a file: nothing to wait on but the next look


def _latest_is(directory: str, step: int) -> bool:
    latest = tf.train.latest_checkpoint(directory)
    return latest is not None and latest.endswith(f"-{step}")


def every_rank_failed_a_step() -> bool:
    """Whether every rank's session closes with an error of its own now, each having submitted
    as many collectives as the others (none left pending on some ranks only, which a retry
    would submit again): one Max allreduce of (-1, 1, -n, n) from each rank (n: its count),
    waited for STEP_ERROR_AGREEMENT_SECS, which a rank still in its step never joins. False
    when the wait runs out or the runtime has stopped."""
    core = native.core()
    name = f"perseus.step_error.{next(_step_errors)}"
    submitted = sum(value for key, value in core.runtime_stats().items()
                    if key.startswith("tensors_submitted."))
    mine = np.array([-1, 1, -submitted, submitted], np.int64)
    answer: list = []

    def agree() -> None:
        try:
            answer.append(core.allreduce(mine, name=name, op=basics.Max))
        except Exception:  # the runtime stopped, or this rank reported: no agreement
            pass

    thread = threading.Thread(target=agree, name="perseus-step-error", daemon=True)
    thread.start()
    thread.join(STEP_ERROR_AGREEMENT_SECS)
    # A joined rank contributes zeros: not a rank whose step failed.
    return bool(answer) and bool((answer[0] == mine).all())


def watch(session: tf.compat.v1.Session) -> None:
    """From now on, a step of `session` failing because a rank is lost makes the lowest
    survivor save this step's variables and every survivor report it (once per session); the
    session closing with an error of this rank's own fails every rank with it, unless every
    rank's session closes so at the same time."""
    if getattr(session, _WATCHED, False) or basics.size() == 1:
        return
    setattr(session, _WATCHED, True)
    run = session.run
    reported = []
    own_errors = []  # the last error of this rank's own that a step of this session raised

    def report_lost(error: BaseException) -> bool:
        """Whether `error` names a lost rank; the report and save, once per session."""
        lost = lost_rank(error)
        if lost is not None and not reported:
            reported.append(lost)
            _report(session, run, lost)
        return lost is not None

    _last_watched[:] = [report_lost]

    def watched_run(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except tf.errors.OpError as error:
            if not report_lost(error) and not isinstance(error, _RECOVERED):
                own_errors[:] = [error]
            raise

    close = session.close

    def watched_close() -> None:
        # MonitoredSession closes this session in its __exit__, where the error that ends
        # training is the one being handled. Only a step's own error counts: the exception
        # being handled may also be one the program caught further up, unrelated to training.
        if own_errors and sys.exc_info()[1] is own_errors[0]:
            if not every_rank_failed_a_step():
                failure.report(own_errors[0])
        own_errors.clear()
        close()

    # The instance's own attributes: MonitoredSession's wrappers call session.run and close,
    # and no other place sees a step's error while the session is still open.
    session.run = watched_run
    session.close = watched_close


def report_lost_rank(error: BaseException) -> None:
    """A collective between steps failed (the stop agreement after each step): when `error`
    names a lost rank, the survivors of the session watched last report and save the step it
    completed, as when a step fails."""
    if _last_watched:
        _last_watched[0](error)


def _report(session: Any, run: Any, lost: int) -> None:
    rank, directory = basics.rank(), job_checkpoint_dir()
    try:
        saved = _save_once(session, run, directory, rank, lost)
    except Exception as exc:  # the original error goes on; say why nothing was saved
        saved = f"saving the last completed step in {directory} failed: {exc}"
    print(lost_rank_line(rank, lost, saved), flush=True)


def _save_once(session: Any, run: Any, directory: str | None, rank: int, lost: int) -> str:
    """Agrees with the other survivors on who saves; saves when it is this rank. What happened."""
    if directory is None:
        return ("nothing saved: no checkpoint directory is known (give run_config() a "
                "model_dir, or MonitoredTrainingSession checkpoint_dir(path))")
    step_variable = tf.compat.v1.train.get_global_step(session.graph)
    if step_variable is None:
        return f"nothing saved: the graph has no global step ({directory})"
    step = int(run(step_variable))
    os.makedirs(directory, exist_ok=True)
    start = time.monotonic()
    saver_rank = agree_on_saver(directory, step, rank, {lost})
    agreed = f" (saver agreed in {time.monotonic() - start:.1f} s)"
    if saver_rank is None:
        return (f"global step {step} was already saved: "
                f"{tf.train.latest_checkpoint(directory)}{agreed}")
    if saver_rank != rank:
        return (f"rank {saver_rank} saves the last completed step (global step {step}) in "
                f"{directory}{agreed}")
    try:
        return _save(session, run, directory, step) + agreed
    finally:
        os.unlink(claim_path(directory, step))


def _saver(graph: tf.Graph) -> Any:
    savers = graph.get_collection(tf.compat.v1.GraphKeys.SAVERS)
    if len(savers) == 1:
        return savers[0]
    # The Scaffold's saver is not in the collection when the model gave its own: a new one.
    graph._unsafe_unfinalize()  # TF internal; the session runs the new ops in this graph
    with graph.as_default():
        return tf.compat.v1.train.Saver(sharded=True, save_relative_paths=True)


def _save(session: Any, run: Any, directory: str, step: int) -> str:
    """Saves this rank's variables as the checkpoint of global step `step`; says what it did."""
    if _latest_is(directory, step):
        return f"global step {step} was already saved: {tf.train.latest_checkpoint(directory)}"
    saver = _saver(session.graph)
    state = tf.train.get_checkpoint_state(directory)
    if state is not None and not saver.last_checkpoints:
        saver.recover_last_checkpoints(list(state.all_model_checkpoint_paths))
    # Saver.save's own runs go through `session.run`; a failure there is reported above.
    path = saver.save(session, os.path.join(directory, "model.ckpt"), global_step=step,
                      write_meta_graph=False)
    return f"saved global step {step}: {path}"
