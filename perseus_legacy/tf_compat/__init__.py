"""Every change perseus_legacy makes to TensorFlow and tensorflow-estimator, listed in CHANGES.

Each Change names what it changes, what made it necessary (a TensorFlow version, or a property
of every tensorflow-estimator), when it is made and which function makes it:

- `import perseus_legacy` (apply()): legacy Keras is chosen before TensorFlow is imported, then
  the TensorFlow patches are made; the estimator pieces are feature-detected (supplied only where
  TensorFlow lacks them). `PERSEUS_NO_TF_PATCH=1` turns them off (then tf.estimator does not
  import on TF >= 2.16, and the collectives of one tf.function run in program order).
- the first `run_config()` (wrap_estimator()): five tensorflow-estimator methods are wrapped with
  the distributed Estimator's wrappers (perseus_legacy.estimator._training), which act only for
  its RunConfig.

`compat_report()` shows what was found and done for each; docs/tf-compat.md explains them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from typing import Callable

import perseus_env
from perseus_legacy.tf_compat import (
    control_deps,
    estimator_api,
    estimator_wrappers,
    hooked_session,
    keras,
    monitored_writers,
    profiler_hook,
)
from perseus_legacy.tf_compat.estimator_api import TPUUnavailableError  # noqa: F401
from perseus_legacy.tf_compat.keras import Keras3AlreadyBoundError  # noqa: F401

NO_TF_PATCH_ENV = "PERSEUS_NO_TF_PATCH"
LEFT_ALONE = f"left alone ({NO_TF_PATCH_ENV}=1)"
TF_NAMESPACE = "tf.estimator, tf.compat.v1.estimator, tf.compat.v2.estimator"
AT_IMPORT = "import perseus_legacy"
BEFORE_TF_IMPORT = "import perseus_legacy, before TensorFlow is imported"
AT_RUN_CONFIG = "the first run_config()"


@dataclasses.dataclass(frozen=True)
class Change:
    """One change to TensorFlow or tensorflow-estimator."""

    target: str  # what is changed; its compat_report() key
    necessary_since: str  # the version (or property) that made it necessary
    when: str  # AT_IMPORT, BEFORE_TF_IMPORT or AT_RUN_CONFIG
    make: Callable[[], str] | None  # makes it where needed, returns what it did (AT_IMPORT)


CHANGES: tuple[Change, ...] = (
    Change("legacy keras", "TF 2.16 (tf.keras is Keras 3)", BEFORE_TF_IMPORT, None),
    Change("tensorflow.python.distribute.estimator_training", "TF 2.16 (module removed)",
           AT_IMPORT, estimator_api.supply_estimator_training),
    Change("tf_export.ESTIMATOR_API_NAME", "TF 2.16 (API name removed)", AT_IMPORT,
           estimator_api.supply_estimator_api_name),
    *(Change(f"tensorflow.python.tpu.{name}", "TF 2.16 (module removed)", AT_IMPORT,
             functools.partial(estimator_api.supply_tpu_module, name))
      for name in estimator_api.TPU_MODULES),
    Change(TF_NAMESPACE, "TF 2.16 (tf.estimator removed)", AT_IMPORT,
           estimator_api.expose_tf_estimator),
    Change("tensorflow.python.estimator", "TF 2.16 (shim package removed)", AT_IMPORT,
           estimator_api.alias_python_estimator),
    Change("auto_control_deps.ASYNC_STATEFUL_OPS",
           "TF 2.0 (tf.function runs stateful ops in program order)", AT_IMPORT,
           control_deps.exempt_collectives_from_program_order),
    Change("tf.keras.backend.set_session, get_session",
           "TF 2.0 (left out of the v2 tf.keras.backend; tf.compat.v1.keras.backend kept them)",
           AT_IMPORT, keras.supply_keras_sessions),
    Change(hooked_session.TARGET, hooked_session.NECESSARY_SINCE, AT_IMPORT,
           hooked_session.agree_on_stopping),
    Change(profiler_hook.TARGET, profiler_hook.NECESSARY_SINCE, AT_IMPORT,
           profiler_hook.open_writer_on_first_use),
    Change(monitored_writers.TARGET, monitored_writers.NECESSARY_SINCE, AT_IMPORT,
           monitored_writers.rank_0_writes),
    *(Change(target, estimator_wrappers.NECESSARY_SINCE, AT_RUN_CONFIG, None)
      for target in estimator_wrappers.TARGETS),
)

_pieces: dict[str, str] = {}


def patches_disabled() -> bool:
    """Whether PERSEUS_NO_TF_PATCH turns every TensorFlow patch off."""
    return perseus_env.read_switch(NO_TF_PATCH_ENV)


def apply() -> dict[str, str]:
    """Makes every change of `import perseus_legacy`, once (the Keras choice before TensorFlow
    is imported); returns what each did."""
    if _pieces:
        return dict(_pieces)
    disabled = patches_disabled()
    keras.select_legacy_keras(left_alone=LEFT_ALONE if disabled else None)
    if keras.tensorflow_version() is None:  # the native collectives work without TensorFlow
        return {}
    for change in CHANGES:
        if change.when == AT_IMPORT:
            _pieces[change.target] = LEFT_ALONE if disabled else change.make()
    return dict(_pieces)


def wrap_estimator(wrappers: dict[str, Callable]) -> None:
    """Makes the AT_RUN_CONFIG changes, once: `wrappers` maps each of their targets to the
    function `wrapper(original, *args, **kwargs)` that replaces the method."""
    listed = {c.target for c in CHANGES if c.when == AT_RUN_CONFIG}
    if set(wrappers) != listed:
        raise ValueError(f"perseus_legacy.tf_compat: the estimator wrappers {sorted(wrappers)} "
                         f"differ from the listed changes {sorted(listed)}")
    estimator_wrappers.install(wrappers)


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def compat_report() -> dict[str, str]:
    """What perseus_legacy found and changed in this TensorFlow, one line per change."""
    if keras.tensorflow_version() is None:
        return {"tensorflow": "not installed"}
    import tensorflow as tf

    pieces = apply()
    return {
        "tensorflow": tf.__version__,
        "tensorflow-estimator": _distribution_version("tensorflow-estimator"),
        "tf-keras": _distribution_version("tf-keras"),
        "legacy keras": keras.decision,
        **pieces,
        **{c.target: estimator_wrappers.status(c.target) for c in CHANGES
           if c.when == AT_RUN_CONFIG},
    }


def compat_changes() -> list[dict[str, str]]:
    """Every change of CHANGES with what made it necessary, when it is made and its status."""
    report = compat_report()
    return [{"change": c.target, "necessary since": c.necessary_since, "made at": c.when,
             "status": report.get(c.target, "not made (no TensorFlow)")} for c in CHANGES]
