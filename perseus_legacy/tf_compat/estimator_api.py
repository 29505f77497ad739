"""Patches: the real tensorflow-estimator 2.15 runs on TensorFlow >= 2.16.

Made necessary by TensorFlow 2.16, which removed tf.estimator together with a few internals that
tensorflow-estimator imports. Each supply_/alias_/expose_ function below supplies one of them,
and only when this TensorFlow lacks it (feature-detected: on TF <= 2.15 every check finds the
real thing and nothing is touched). They return SUPPLIED or PRESENT for compat_report().
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

from perseus_legacy.tf_compat import keras as _keras

PACKAGE = "tensorflow_estimator.python.estimator"
API_V1 = PACKAGE + ".api._v1.estimator"
API_V2 = PACKAGE + ".api._v2.estimator"

SUPPLIED = "supplied by perseus_legacy"
PRESENT = "present in TensorFlow"


class TPUUnavailableError(NotImplementedError):
    """A TPU API of tensorflow-estimator was used on a TensorFlow that no longer ships it."""


def _missing(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is None
    except ModuleNotFoundError:
        return True


def _install_module(name: str, module: types.ModuleType) -> None:
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(importlib.import_module(parent), child, module)


def supply_estimator_training() -> str:
    """tensorflow.python.distribute.estimator_training (the distribute coordinator's glue)."""
    # TF 2.16 dropped it; run_config.py, estimator.py and training.py import it.
    name = "tensorflow.python.distribute.estimator_training"
    if not _missing(name):
        return PRESENT
    from perseus_legacy.tf_compat import _estimator_training

    _install_module(name, _estimator_training)
    return SUPPLIED


def supply_estimator_api_name() -> str:
    """The `estimator` API name in tf_export, which estimator_export registers symbols under.

    With it, get_v1_names() / get_v2_names() list a symbol's estimator names again (e.g.
    `['estimator.Estimator']`), after its TensorFlow names and before its Keras names, as on
    TF 2.15.
    """
    # TF 2.16 dropped ESTIMATOR_API_NAME, its entries in API_ATTRS / API_ATTRS_V1, and the
    # estimator names in get_v1_names() / get_v2_names().
    from tensorflow.python.util import tf_export

    if hasattr(tf_export, "ESTIMATOR_API_NAME") and "estimator" in tf_export.API_ATTRS:
        return PRESENT
    attributes = type(tf_export.API_ATTRS[tf_export.TENSORFLOW_API_NAME])
    tf_export.ESTIMATOR_API_NAME = "estimator"
    tf_export.API_ATTRS["estimator"] = attributes(
        "_estimator_api_names", "_estimator_api_constants")
    tf_export.API_ATTRS_V1["estimator"] = attributes(
        "_estimator_api_names_v1", "_estimator_api_constants_v1")
    tf_export.get_v1_names = _api_names_of(tf_export, tf_export.API_ATTRS_V1, "get_v1_names")
    tf_export.get_v2_names = _api_names_of(tf_export, tf_export.API_ATTRS, "get_v2_names")
    return SUPPLIED


def _api_names_of(tf_export: Any, attributes: dict, name: str) -> Any:
    apis = (tf_export.TENSORFLOW_API_NAME, tf_export.ESTIMATOR_API_NAME, tf_export.KERAS_API_NAME)

    def api_names(symbol: Any) -> list[str]:
        names: list[str] = []
        own = getattr(symbol, "__dict__", None)
        if own is None:
            return names
        for api in apis:
            if attributes[api].names in own:
                names.extend(own[attributes[api].names])
        return names

    api_names.__name__ = api_names.__qualname__ = name
    api_names.__doc__ = f"A symbol's {name[4:6]} API names: TensorFlow, estimator and Keras."
    return api_names


class _RemovedTPUModule(types.ModuleType):
    """A TPU module TensorFlow removed: its names resolve (imports succeed), using one raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        import tensorflow as tf

        message = (
            f"{self.__name__}.{name} is not available: TensorFlow 2.16 removed {self.__name__} "
            f"and this is TensorFlow {tf.__version__}. perseus_legacy runs tf.estimator on "
            "TensorFlow >= 2.16 without TPU support (TPUEstimator, TPU embeddings); TPU "
            "Estimator code needs TensorFlow <= 2.15.")

        def unavailable(cls, *args, **kwargs):
            raise TPUUnavailableError(message)

        # A class, so that the package's isinstance() checks against it work (and are False).
        symbol = type(name, (), {"__new__": unavailable, "__module__": self.__name__})
        setattr(self, name, symbol)
        return symbol


# TF 2.16 dropped these TPUEstimator-era modules; tpu/tpu_estimator.py and
# tpu/_tpu_estimator_embedding.py import them (and tpu_embedding's optimizer classes) at module
# level, and tensorflow_estimator/__init__.py imports those through the tf.compat.v1 API.
TPU_MODULES = ("tpu_embedding", "session_support", "tpu_embedding_gradient")


def supply_tpu_module(short_name: str) -> str:
    """tensorflow.python.tpu.<short_name>: every use of one of its names raises."""
    name = f"tensorflow.python.tpu.{short_name}"
    if not _missing(name):
        return PRESENT
    _install_module(name, _RemovedTPUModule(name, "Removed in TensorFlow 2.16."))
    return SUPPLIED


# Import names that TF <= 2.15 resolved to tensorflow-estimator: the tensorflow.python.estimator
# shim modules, and the `tensorflow.estimator` API directory TF added to its own __path__.
_ALIASES = {
    "tensorflow.python.estimator": PACKAGE,
    "tensorflow.estimator": API_V2,
}
_RENAMED = {PACKAGE + ".keras": PACKAGE + ".keras_lib"}  # TF's shim was named keras.py


def _alias_target(fullname: str) -> str | None:
    for alias, target in _ALIASES.items():
        if fullname == alias or fullname.startswith(alias + "."):
            name = target + fullname[len(alias):]
            return _RENAMED.get(name, name)
    return None


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `tensorflow.python.estimator.X` as the very module tensorflow_estimator's X."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        real = _alias_target(fullname)
        if real is None:
            return None
        _keras.require_legacy_keras()
        if _missing(real):
            return None
        if fullname == "tensorflow.python.estimator":  # a namespace of its own, as TF's was
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=real)

    def create_module(self, spec: Any) -> types.ModuleType:
        if spec.loader_state is None:
            return _ShimPackage(spec.name)
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if not isinstance(module, _ShimPackage):
            # The import system stamped the alias's spec on the real module; give its own back.
            module.__spec__ = module.__spec__.loader_state


class _ShimPackage(types.ModuleType):
    """`tensorflow.python.estimator`: its attributes are its (aliased) submodules."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{self.__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{self.__name__}.{name}":
                raise
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


def alias_python_estimator() -> str:
    """`from tensorflow.python.estimator import estimator, model_fn, ...` (TF <= 2.15 shims)."""
    # TF 2.16 dropped the tensorflow/python/estimator shim package.
    if not _missing("tensorflow.python.estimator"):
        return PRESENT
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        # First, so that path-based finders never load a second copy of a package module.
        sys.meta_path.insert(0, _AliasFinder())
    return SUPPLIED


class _LazyAPI(types.ModuleType):
    """tf.estimator and friends: imports the API module on first use, then takes its place."""

    def __init__(self, parent: Any, local_name: str, target: str) -> None:
        super().__init__(f"{parent.__name__}.{local_name}")
        self._lazy_api = (parent, local_name, target)

    def _load(self) -> types.ModuleType:
        parent, local_name, target = self._lazy_api
        _keras.require_legacy_keras()
        module = importlib.import_module(target)
        setattr(parent, local_name, module)
        return module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __dir__(self) -> list[str]:
        return dir(self._load())


def expose_tf_estimator() -> str:
    """tf.estimator, tf.compat.v1.estimator and tf.compat.v2.estimator, loaded on first use."""
    # TF 2.16 dropped the lazy `estimator` attributes from tensorflow/__init__.py and compat.
    import tensorflow as tf

    if "estimator" in vars(tf):
        return PRESENT
    tf.estimator = _LazyAPI(tf, "estimator", API_V2)
    tf.compat.v1.estimator = _LazyAPI(tf.compat.v1, "estimator", API_V1)
    tf.compat.v2.estimator = _LazyAPI(tf.compat.v2, "estimator", API_V2)
    return SUPPLIED
