"""TF1-style training over real ranks: DistributedOptimizer, the broadcast hook, rank-0
checkpoints, data.shard and the config helpers; plus single-process checks that need no ranks
(this pytest process never initialises MPI)."""

from __future__ import annotations

import pytest
from harness import run_cases, run_ranks, selected_cases, worker_cases

MODELS = "tests/workers/train_models.py"
ACCUMULATE = "tests/workers/train_accumulate.py"
RANKS = dict(params=[2, 3], ids=lambda n: f"{n}ranks")


@pytest.fixture(scope="module", **RANKS)
def models(request, tmp_path_factory):
    return run_cases(request.param, MODELS, selected_cases(request, worker_cases(MODELS)),
                     tmp_path_factory.mktemp("models"), timeout=170)


@pytest.mark.parametrize("case", worker_cases(MODELS))
def test_distributed_optimizer_training_equals_single_process_on_the_global_batch(models, case):
    """SGD, Momentum and Adam, dense + sparse (embedding) gradients, 5 steps, ranks starting from
    different random values: under MonitoredTrainingSession + BroadcastGlobalVariablesHook and a
    plain Session + broadcast_global_variables, the final variables equal a plain-TF run on the
    concatenated global batch from rank 0's values (rtol 1e-5, atol 1e-6); Compression.fp16
    within rtol 2e-2, atol 2e-3; only rank 0 writes checkpoints into the shared directory."""
    models.check(case)


@pytest.fixture(scope="module", **RANKS)
def accumulate(request):
    return run_cases(request.param, ACCUMULATE,
                     selected_cases(request, worker_cases(ACCUMULATE)), timeout=170)


@pytest.mark.parametrize("case", worker_cases(ACCUMULATE))
def test_accumulated_passes_equal_one_single_process_step_on_their_global_batches(accumulate,
                                                                                   case):
    """SyncReplicasOptimizer with replicas_to_aggregate = size and 2 x size (MonitoredTraining-
    Session + make_session_run_hook) and DistributedOptimizer(backward_passes_per_step=2) (plain
    Session; passes summed): SGD, Momentum, Adam with a sparse embedding gradient kept sparse,
    3 updates; the global step advances once per update; final variables equal plain TF taking
    one step per group of global batches (rtol 1e-5, atol 1e-6). Backup workers, counts that are
    not a multiple of the ranks and a wrong total_num_replicas are refused, naming the rank."""
    accumulate.check(case)


def test_a_killed_job_restarts_from_rank_0s_last_checkpoint_with_identical_ranks(tmp_path):
    """SyncReplicasHook + Adam, rank 0 checkpointing every 3 steps; the last rank is SIGKILLed at
    step 7 and the job fails. A new job whose ranks start from other random values resumes at
    step 6 on every rank with exactly the checkpoint's variables, and after training to step 10
    equals uninterrupted single-process training (rtol 1e-5, atol 1e-6)."""
    killed = run_ranks(2, "tests/workers/train_restart.py", tmp_path, "kill", timeout=120,
                       expect_failure=True)
    assert "was not killed" not in killed.stdout, killed.stdout
    out = run_ranks(2, "tests/workers/train_restart.py", tmp_path, "resume", timeout=120).stdout
    assert out.count("OK:") == 2, out


def test_data_shard_gives_each_rank_its_elements_and_config_helpers_follow_the_rank():
    """Also eager broadcast_variables and an eager DistributedOptimizer step."""
    out = run_ranks(3, "tests/workers/train_data_config.py", timeout=120).stdout
    assert out.count("OK:") == 3, out


# Single process, no ranks: explicit index/count, checks that happen before any collective.

@pytest.fixture(scope="module")
def tf_and_pl():
    import perseus_legacy as pl  # noqa: I001 (first: it selects legacy Keras)
    import tensorflow as tf

    assert not pl.is_initialized()
    return tf, pl


def _shuffled_or_repeated(tf):
    base = tf.data.Dataset.range(12)
    return {
        "shuffle": base.shuffle(4),
        "shuffle then map/batch": base.shuffle(4).map(lambda x: x * 2).batch(2),
        "repeat": base.repeat(3),
        "repeat then take": base.repeat().take(30),
        "shuffle in one input of a zip": tf.data.Dataset.zip(
            (base, tf.data.Dataset.range(12).shuffle(3))),
        "shuffle_and_repeat": base.apply(tf.data.experimental.shuffle_and_repeat(4)),
    }


def test_shard_rejects_a_shuffle_or_repeat_upstream_and_explains_the_order(tf_and_pl):
    tf, pl = tf_and_pl
    for label, dataset in _shuffled_or_repeated(tf).items():
        with pytest.raises(ValueError) as info:
            pl.data.shard(dataset, index=0, count=2)
        message = str(info.value)
        for needed in ("Shard first, then shuffle, then repeat", "allow_after_shuffle",
                       "overlapping"):
            assert needed in message, (label, message)


def test_shard_rejects_a_shuffle_or_repeat_in_a_tf1_graph_dataset(tf_and_pl):
    tf, pl = tf_and_pl
    with tf.Graph().as_default():
        base = tf.compat.v1.data.Dataset.range(12)
        for dataset in (base.shuffle(4), base.shuffle(4).repeat(2), base.repeat(2).batch(3)):
            with pytest.raises(ValueError, match="allow_after_shuffle"):
                pl.data.shard(dataset, index=1, count=3)
        assert pl.data.shard(base.map(lambda x: x + 1), 1, 3) is not None


def test_shard_accepts_clean_pipelines_and_the_opt_out(tf_and_pl):
    tf, pl = tf_and_pl
    clean = tf.data.Dataset.range(12).map(lambda x: x + 100).batch(1).unbatch()
    got = [int(x) for x in pl.data.shard(clean, index=1, count=3).as_numpy_iterator()]
    assert got == [101, 104, 107, 110]
    seeded = tf.data.Dataset.range(12).shuffle(12, seed=5, reshuffle_each_iteration=False)
    order = [int(x) for x in seeded.as_numpy_iterator()]
    got = [int(x) for x in pl.data.shard(seeded, 2, 3, allow_after_shuffle=True)
           .as_numpy_iterator()]
    assert got == order[2::3]
    with pytest.raises(ValueError, match="not in"):
        pl.data.shard(clean, index=3, count=3)


def test_helpers_that_need_the_rank_say_init_is_missing(tf_and_pl):
    tf, pl = tf_and_pl
    for call in (lambda: pl.session_config(), lambda: pl.is_chief(),
                 lambda: pl.checkpoint_dir("/x"), lambda: pl.scale_learning_rate(0.1),
                 lambda: pl.scale_steps(10),
                 lambda: pl.data.shard(tf.data.Dataset.range(3))):
        with pytest.raises(pl.NotInitializedError, match="init"):
            call()


def test_fp16_compression_round_trip_and_optimizer_argument_checks(tf_and_pl):
    tf, pl = tf_and_pl
    x = tf.constant([1.0, 2.5, -3.25], tf.float64)
    sent, ctx = pl.Compression.fp16.compress(x)
    assert sent.dtype == tf.float16
    back = pl.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == tf.float64 and back.numpy().tolist() == [1.0, 2.5, -3.25]
    ints = tf.constant([1, 2], tf.int32)
    assert pl.Compression.fp16.compress(ints)[0].dtype == tf.int32
    assert pl.Compression.none.compress(x)[0] is x
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        pl.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(TypeError, match="tf.compat.v1.train.Optimizer"):
        pl.DistributedOptimizer(object())
    opt = pl.DistributedOptimizer(sgd)
    assert isinstance(opt, tf.compat.v1.train.Optimizer)
    assert opt.get_name() == "DistributedGradientDescentOptimizer"
