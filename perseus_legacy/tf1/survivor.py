"""A lost rank costs no completed step: the lowest surviving rank saves the last one.

Synchronous training leaves every surviving rank holding the same variables, those of the last
step every rank completed: each update op of a step waits for every gradient collective of that
step (graph_rewrite.py, and GradientReducer for DistributedOptimizer), so a step in which a rank
was lost updates no variable anywhere. When a training step fails because a rank is gone (killed,
frozen past the silence limit, its link cut), the runtime's error names that rank on every
survivor ("perseus_legacy: rank L (host:port) ..."; the first failure is passed to every rank).
Each survivor then knows, without any further collective, which rank is the lowest survivor:
that rank writes a whole checkpoint of its variables into the job's checkpoint directory (where
rank 0 writes: the `model_dir` given to run_config(), or the path given to checkpoint_dir()),
with the graph's own Saver, so the `checkpoint` file names it only once it is complete. Every
survivor prints one line (perseus_shared/lost_rank.py: which rank was lost, which step was saved
and where) and the error goes on as before: the rank exits. `perseusrun --restarts` reads that
line, and a rerun, or a TF_CONFIG task restarted by its scheduler, resumes from that checkpoint.

A rank whose own program fails is not lost: a watched session closing with an error of its
own (a full disk in a checkpoint save, an op error; not the end of the input, not an error the
runtime raised) fails every rank with that cause at once (perseus_legacy.common.failure), and
no survivor saves then: the failure may lie in the state a save would write (a NaN, the disk).

SyncReplicasHook and BroadcastGlobalVariablesHook call watch() once rank 0's variables are
broadcast: a rank lost before then leaves no step to save. Over MPI, Open MPI's launcher ends the
survivors as soon as a rank dies, so none saves (docs/multi-host.md says what that costs).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import tensorflow as tf

from perseus_legacy.common import basics, failure
from perseus_shared.lost_rank import lost_rank_line

_LOST = re.compile(r"perseus_legacy: rank (\d+) \(")
_WATCHED = "_perseus_survivor_watched"
# A MonitoredSession recovers from these (it makes a new session): not an end of training.
_RECOVERED = (tf.errors.AbortedError, tf.errors.UnavailableError)
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


def lowest_survivor(lost: int, size: int) -> int:
    """The lowest rank of `size` other than `lost`."""
    return 1 if lost == 0 and size > 1 else 0


def watch(session: tf.compat.v1.Session) -> None:
    """From now on, a step of `session` failing because a rank is lost makes the lowest
    survivor save this step's variables and every survivor report it (once per session); the
    session closing with an error of this rank's own fails every rank with it."""
    if getattr(session, _WATCHED, False) or basics.size() == 1:
        return
    setattr(session, _WATCHED, True)
    run = session.run
    reported = []
    own_errors = []  # the last error of this rank's own that a step of this session raised

    def watched_run(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except tf.errors.OpError as error:
            lost = lost_rank(error)
            if lost is not None and not reported:
                reported.append(lost)
                _report(session, run, lost)
            elif lost is None and not isinstance(error, _RECOVERED):
                own_errors[:] = [error]
            raise

    close = session.close

    def watched_close() -> None:
        # MonitoredSession closes this session in its __exit__, where the error that ends
        # training is the one being handled. Only a step's own error counts: the exception
        # being handled may also be one the program caught further up, unrelated to training.
        if own_errors and sys.exc_info()[1] is own_errors[0]:
            failure.report(own_errors[0])
        own_errors.clear()
        close()

    # The instance's own attributes: MonitoredSession's wrappers call session.run and close,
    # and no other place sees a step's error while the session is still open.
    session.run = watched_run
    session.close = watched_close


def _report(session: Any, run: Any, lost: int) -> None:
    rank, directory = basics.rank(), job_checkpoint_dir()
    saver_rank = lowest_survivor(lost, basics.size())
    if directory is None:
        saved = ("nothing saved: no checkpoint directory is known (give run_config() a "
                 "model_dir, or MonitoredTrainingSession checkpoint_dir(path))")
    elif rank != saver_rank:
        saved = f"rank {saver_rank} saves the last completed step in {directory}"
    else:
        try:
            saved = _save(session, run, directory)
        except Exception as exc:  # the original error goes on; say why nothing was saved
            saved = f"saving the last completed step in {directory} failed: {exc}"
    print(lost_rank_line(rank, lost, saved), flush=True)


def _saver(graph: tf.Graph) -> Any:
    savers = graph.get_collection(tf.compat.v1.GraphKeys.SAVERS)
    if len(savers) == 1:
        return savers[0]
    # The Scaffold's saver is not in the collection when the model gave its own: a new one.
    graph._unsafe_unfinalize()  # TF internal; the session runs the new ops in this graph
    with graph.as_default():
        return tf.compat.v1.train.Saver(sharded=True, save_relative_paths=True)


def _save(session: Any, run: Any, directory: str) -> str:
    """Saves this rank's variables as the checkpoint of its global step; says what it did."""
    graph = session.graph
    step_variable = tf.compat.v1.train.get_global_step(graph)
    if step_variable is None:
        return f"nothing saved: the graph has no global step ({directory})"
    step = int(run(step_variable))
    latest = tf.train.latest_checkpoint(directory)
    if latest is not None and latest.endswith(f"-{step}"):
        return f"global step {step} was already saved by rank 0: {latest}"
    saver = _saver(graph)
    state = tf.train.get_checkpoint_state(directory)
    if state is not None and not saver.last_checkpoints:
        saver.recover_last_checkpoints(list(state.all_model_checkpoint_paths))
    os.makedirs(directory, exist_ok=True)
    # Saver.save's own runs go through `session.run`; a failure there is reported above.
    path = saver.save(session, os.path.join(directory, "model.ckpt"), global_step=step,
                      write_meta_graph=False)
    return f"saved global step {step}: {path}"
