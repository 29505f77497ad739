"""SyncReplicasHook / distribute_graph: a plain optimizer's graph rewritten to average gradients
over real ranks; plus a single-process check of the error for an update op it cannot rewrite
(this pytest process never initialises MPI). The launches of the selected tests start together,
AT_ONCE at a time (harness.LaunchPool), and each test reads its own."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from harness import LaunchPool, run_cases, run_ranks, selected_cases, selected_tests, worker_cases

HOOK = "tests/workers/train_hook.py"


AT_ONCE = 2
HOOK_RANKS = [2, 3]
STOPS = [(2, "short-first"), (3, "short-last"), (3, "stop-hook")]


def hook_cases(np_: int, cases: list[str], work: Path):
    return run_cases(np_, HOOK, cases, timeout=110)


def stop_run(np_: int, scenario: str, work: Path) -> str:
    return run_ranks(np_, "tests/workers/train_stop.py", work, scenario, timeout=120).stdout


@pytest.fixture(scope="module")
def launches(request) -> LaunchPool:
    """The launches of the selected tests, the widest first."""
    chosen = {}
    for np_ in HOOK_RANKS:
        cases = selected_cases(request, worker_cases(HOOK), ("hook_training", np_))
        if cases:
            chosen[f"hook-{np_}"] = np_, functools.partial(hook_cases, np_, cases)
    for item in selected_tests(request):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "scenario" in params:
            np_, scenario = params["np_"], params["scenario"]
            chosen[f"stop-{scenario}"] = np_, functools.partial(stop_run, np_, scenario)
    pool = LaunchPool("sync_replicas_hook_", {
        name: chosen[name][1] for name in sorted(chosen, key=lambda name: -chosen[name][0])},
        at_once=AT_ONCE)
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=HOOK_RANKS, ids=lambda n: f"{n}ranks")
def hook_training(request, launches):
    return launches.result(f"hook-{request.param}")


@pytest.mark.parametrize("case", worker_cases(HOOK))
def test_plain_optimizer_with_sync_replicas_hook_equals_single_process_on_the_global_batch(
        hook_training, case):
    """SGD (dense apply + sparse scatter), Momentum (sparse apply) and Adam (slot scatters after
    merging duplicate indices), 5 steps, ranks starting from different random values: under
    MonitoredTrainingSession + SyncReplicasHook, under a plain Session + distribute_graph +
    broadcast_global_variables (a second distribute_graph changes nothing), and with
    DistributedOptimizer + SyncReplicasHook (nothing rewritten, averaged once), the final
    variables equal a plain-TF run on the global batch from rank 0's values (rtol 1e-5,
    atol 1e-6)."""
    hook_training.check(case)


@pytest.mark.parametrize("np_,scenario", STOPS)
def test_ranks_that_stop_at_different_steps_all_end_after_the_last_common_step(np_, scenario,
                                                                                launches):
    """One rank's tf.data input ends after 4 batches while the others have 6 (rank 0 short, or
    the last rank short: rank 0 then undoes its extra step), or the last rank alone has
    StopAtStepHook(4): every rank exits 0 at global step 4, with Adam's variables equal to
    single-process training on the first 4 global batches (rtol 1e-5, atol 1e-6), and rank 0's
    latest checkpoint is step 4 with those values."""
    out = launches.result(f"stop-{scenario}")
    assert out.count("OK:") == np_, out


def test_an_update_op_that_cannot_be_rewritten_is_named_in_the_error(monkeypatch):
    import perseus_legacy as pl  # noqa: I001 (first: it selects legacy Keras)
    import tensorflow as tf
    from perseus_legacy.common import basics

    assert not pl.is_initialized()
    # Only the checks before any collective run here: pretend to be one of two ranks.
    monkeypatch.setattr(basics, "require_initialized", lambda what="": None)
    monkeypatch.setattr(basics, "size", lambda: 2)
    with tf.Graph().as_default() as graph:
        var = tf.compat.v1.Variable(tf.zeros([4, 2]), name="table", use_resource=True)
        dense = tf.compat.v1.Variable(tf.zeros([2]), name="w", use_resource=True)
        loss = tf.reduce_sum(tf.gather(var, [1, 3])) + tf.reduce_sum(dense * dense)
        grad, dense_grad = tf.gradients(loss, [var, dense])
        with tf.name_scope("MyOpt"), tf.name_scope("update_table"):
            tf.compat.v1.scatter_update(var, grad.indices, grad.values * 0.5)
        with tf.name_scope("MyOpt/update_w/"):
            tf.raw_ops.ResourceApplyGradientDescent(var=dense.handle, alpha=0.1,
                                                    delta=dense_grad)
        before = len(graph.get_operations())
        with pytest.raises(pl.GraphRewriteError) as info:
            pl.distribute_graph()
        message = str(info.value)
        assert "MyOpt/update_table/ResourceScatterUpdate" in message, message
        assert "not linear" in message and "DistributedOptimizer" in message, message
        assert "update_w" not in message, message
        assert len(graph.get_operations()) == before  # nothing was changed
