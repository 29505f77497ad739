"""Change: five tensorflow-estimator methods wrapped for the distributed Estimator.

Necessary on every tensorflow-estimator: a RunConfig has no say in the hooks, the steps or the
evaluation of a training run, so the distributed Estimator acts through these methods. The
wrappers themselves (what they do) are perseus_legacy.estimator._training's; this module only
installs them, once, when run_config() first asks (never at import), and reports on them. Each
wrapper is called as `wrapper(original, *args, **kwargs)`.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

from perseus_legacy.tf_compat.estimator_api import PACKAGE

NECESSARY_SINCE = "every tensorflow-estimator (a RunConfig has no say in a run's hooks)"
WRAPPED = "wrapped by perseus_legacy"
NOT_YET = "not yet wrapped (the first run_config() wraps it)"

# report target -> (module under tensorflow_estimator.python.estimator, class path, method)
_METHODS = {
    "tensorflow_estimator Estimator.train": ("estimator", "Estimator", "train"),
    "tensorflow_estimator Estimator._train_with_estimator_spec":
        ("estimator", "Estimator", "_train_with_estimator_spec"),
    "tensorflow_estimator Estimator._call_model_fn": ("estimator", "Estimator", "_call_model_fn"),
    "tensorflow_estimator _TrainingExecutor.run_local":
        ("training", "_TrainingExecutor", "run_local"),
    "tensorflow_estimator _TrainingExecutor._Evaluator.evaluate_and_export":
        ("training", "_TrainingExecutor._Evaluator", "evaluate_and_export"),
}
TARGETS = tuple(_METHODS)


def _owner(target: str) -> tuple[Any, str]:
    module, class_path, method = _METHODS[target]
    owner: Any = importlib.import_module(f"{PACKAGE}.{module}")
    for part in class_path.split("."):
        owner = getattr(owner, part)
    return owner, method


def _is_wrapped(method: Any) -> bool:
    return getattr(method, "_perseus_original", None) is not None


def install(wrappers: dict[str, Callable]) -> None:
    """Wraps each target's method with its wrapper, once."""
    for target, wrapper in wrappers.items():
        owner, name = _owner(target)
        original = getattr(owner, name)
        if not _is_wrapped(original):
            setattr(owner, name, _wrap(original, wrapper))


def status(target: str) -> str:
    """WRAPPED or NOT_YET, without importing tensorflow-estimator."""
    module, class_path, method = _METHODS[target]
    loaded = sys.modules.get(f"{PACKAGE}.{module}")
    if loaded is None:
        return NOT_YET
    owner: Any = loaded
    for part in class_path.split("."):
        owner = getattr(owner, part)
    return WRAPPED if _is_wrapped(getattr(owner, method)) else NOT_YET


def _wrap(original: Callable, wrapper: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    wrapped._perseus_original = original
    return wrapped
