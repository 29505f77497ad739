"""perseus_legacy.tf_compat.CHANGES is the one list of changes made to TensorFlow and
tensorflow-estimator: compat_report() shows each, docs/tf-compat.md names each, and the
distributed Estimator's wrappers are exactly its run_config() entries (in-process, no ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

import perseus_legacy  # noqa: F401, I001 (first: it selects tf-keras)
from perseus_legacy import tf_compat
from perseus_legacy.estimator import _training

DOC = Path(__file__).resolve().parents[1] / "docs" / "tf-compat.md"


def test_every_change_names_what_made_it_necessary_and_when():
    targets = [c.target for c in tf_compat.CHANGES]
    assert len(targets) == len(set(targets)), targets
    for change in tf_compat.CHANGES:
        assert change.necessary_since.strip(), change
        assert change.when in (tf_compat.AT_IMPORT, tf_compat.BEFORE_TF_IMPORT,
                               tf_compat.AT_RUN_CONFIG), change
        assert (change.make is not None) == (change.when == tf_compat.AT_IMPORT), change


def test_compat_report_shows_every_change():
    report = tf_compat.compat_report()
    missing = [c.target for c in tf_compat.CHANGES if c.target not in report]
    assert not missing, f"compat_report() leaves out {missing}: {report}"
    changes = tf_compat.compat_changes()
    assert [c["change"] for c in changes] == [c.target for c in tf_compat.CHANGES]


def test_the_estimator_wrappers_are_the_listed_run_config_changes():
    listed = {c.target for c in tf_compat.CHANGES if c.when == tf_compat.AT_RUN_CONFIG}
    assert set(_training.WRAPPERS) == listed
    with pytest.raises(ValueError, match="differ from the listed changes"):
        tf_compat.wrap_estimator({**_training.WRAPPERS, "tensorflow_estimator X.y": print})


def test_run_config_wraps_the_methods_and_the_report_says_so():
    report = tf_compat.compat_report()
    tf_compat.wrap_estimator(_training.WRAPPERS)
    after = tf_compat.compat_report()
    for target in _training.WRAPPERS:
        assert after[target] == "wrapped by perseus_legacy", (report, after)


def test_docs_name_every_change():
    text = DOC.read_text()
    for change in tf_compat.CHANGES:
        if change.target == "legacy keras":
            assert "TF_USE_LEGACY_KERAS=1" in text
            continue
        # Report keys are dotted paths or "tensorflow_estimator Class.method": the docs name
        # their last part.
        short = change.target.split(" ")[-1].split(".")[-1]
        assert short in text, f"docs/tf-compat.md does not name {change.target}"


def test_the_collectives_exempt_from_program_order_are_every_op_the_library_registers():
    from tensorflow.python.framework import op_def_registry

    from perseus_legacy.tensorflow import collectives
    from perseus_legacy.tf_compat import control_deps

    library = collectives._op_library()
    # The library's op wrappers: functions of its own module named after the op types.
    registered = {name for name, value in vars(library).items()
                  if getattr(value, "__module__", None) == library.__name__
                  and op_def_registry.get(name) is not None}
    assert registered == set(control_deps.COLLECTIVE_OP_TYPES), (
        "ops/tensorflow/kernels.cc's REGISTER_OPs and control_deps.COLLECTIVE_OP_TYPES differ")


def test_a_profiler_hook_opens_nothing_until_it_begins_then_writes_as_tensorflow_does(tmp_path):
    """Built, a ProfilerHook creates no output_dir (another rank builds one it never runs); run
    for 5 steps with save_steps=2 it writes TensorFlow's timelines of steps 2 and 4 and one
    events file with the graph and their run metadata."""
    import tensorflow as tf

    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.train.ProfilerHook(save_steps=2, output_dir=str(tmp_path / "never"))
        used = tf.compat.v1.train.ProfilerHook(save_steps=2, output_dir=str(tmp_path / "used"))
        assert not list(tmp_path.iterdir())
        increment = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredSession(hooks=[used]) as session:
            for _ in range(5):
                session.run(increment)
    tf.compat.v1.summary.FileWriterCache.get(str(tmp_path / "used")).flush()  # as a job ends
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]
    written = sorted(p.name for p in (tmp_path / "used").iterdir())
    assert [n for n in written if not n.startswith("events.")] == ["timeline-2.json",
                                                                   "timeline-4.json"], written
    [events] = [n for n in written if n.startswith("events.")]
    tags, graphs = [], 0
    for event in tf.compat.v1.train.summary_iterator(str(tmp_path / "used" / events)):
        graphs += bool(event.graph_def)
        if event.HasField("tagged_run_metadata"):
            tags.append(event.tagged_run_metadata.tag)
    assert (tags, graphs) == (["step_2", "step_4"], 1)
