"""Per-rank session settings and the conventions of synchronous data-parallel training.

The Estimator's run_config() is perseus_legacy.estimator.run_config.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.tf1 import survivor


def session_config(config: tf.compat.v1.ConfigProto | None = None, *,
                   thread_spinning: bool = False) -> tf.compat.v1.ConfigProto:
    """A copy of `config` (or a new ConfigProto) for this rank: its local GPU only, and no
    spinning thread pools in a job of more than one rank.

    `gpu_options.visible_device_list` becomes `str(local_rank())` and `allow_growth` is set, so
    ranks sharing a host do not claim each other's GPUs or memory. With more than one rank and
    `thread_spinning=False`, `experimental.disable_thread_spinning` is set: TensorFlow's idle
    pool threads otherwise spin for work, on the cores that the collectives' background thread
    and the other ranks of the host need, which about doubles what an allreduce adds to a step
    (docs/performance.md). Every other setting (thread pools, ...) is kept. The argument itself
    is not modified.
    """
    result = tf.compat.v1.ConfigProto()
    if config is not None:
        result.CopyFrom(config)
    result.gpu_options.visible_device_list = str(basics.local_rank())
    result.gpu_options.allow_growth = True
    if basics.size() > 1 and not thread_spinning:
        result.experimental.disable_thread_spinning = True
    return result


def is_chief() -> bool:
    """Whether this rank is rank 0, the one that writes checkpoints, summaries and logs."""
    return basics.rank() == 0


def checkpoint_dir(path: str | None) -> str | None:
    """`path` on rank 0, None on every other rank.

    Pass it as `checkpoint_dir` of MonitoredTrainingSession (or as a model_dir): only rank 0
    saves; the others get their values from it through BroadcastGlobalVariablesHook. Every rank
    remembers `path`: when a rank is lost, the lowest survivor saves the last step there.
    """
    survivor.set_job_checkpoint_dir(path)
    return path if basics.rank() == 0 else None


def scale_learning_rate(learning_rate: Any) -> Any:
    """`learning_rate * size()`: the usual scaling for a global batch size() times larger."""
    return learning_rate * basics.size()


def scale_steps(steps: int | None) -> int | None:
    """`steps // size()`, at least 1 (None stays None: train until the input ends).

    Each synchronous step consumes size() x the per-rank batch, so size() times fewer steps see
    as many examples as `steps` single-process steps.
    """
    if steps is None:
        return None
    return max(1, int(steps) // basics.size())


# Hooks that write files (checkpoints, summaries, step rates, profiles) into a directory they
# were given: one process writes each file once, so of N ranks only rank 0 runs them, in a
# distributed Estimator (perseus_legacy.estimator) as in a distributed MonitoredSession
# (perseus_legacy.tf_compat.monitored_writers).
FILE_WRITING_HOOKS = (tf.compat.v1.train.CheckpointSaverHook, tf.compat.v1.train.SummarySaverHook,
                      tf.compat.v1.train.StepCounterHook, tf.compat.v1.train.ProfilerHook)


def without_file_writers(hooks: Any) -> list:
    """`hooks` without the FILE_WRITING_HOOKS (what a rank other than 0 runs)."""
    return [h for h in hooks if not isinstance(h, FILE_WRITING_HOOKS)]


def hooks_of_this_rank(hooks: Any) -> Any:
    """The hooks a MonitoredSession runs on this rank: on a rank other than 0 of a distributed
    session (one of its hooks holds a stop agreement: SyncReplicasHook,
    BroadcastGlobalVariablesHook), `hooks` without the file writers, which it names once;
    elsewhere `hooks` itself."""
    distributed = any(getattr(h, "stop_agreement", None) is not None for h in hooks or ())
    if not distributed or basics.size() == 1 or basics.rank() == 0:
        return hooks
    kept = without_file_writers(hooks)
    dropped = sorted({type(h).__name__ for h in hooks if isinstance(h, FILE_WRITING_HOOKS)})
    if dropped and dropped != _named_last:
        _named_last[:] = dropped
        print(f"perseus_legacy[rank {basics.rank()}]: {', '.join(dropped)} run on rank 0 only "
              "(one process writes each file once)", flush=True)
    return kept


_named_last: list = []  # the writer hooks this rank last said it leaves to rank 0
