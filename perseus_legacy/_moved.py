"""Module paths that moved inside perseus_legacy and keep working: one table, one import hook.

`import perseus_legacy.tf_config`, `perseus_legacy.data.shard(...)` and
`python -m perseus_legacy.timeline merge ...` name modules that now live in common/, tensorflow/,
tf1/ or keras/. MOVED maps each old path to its module; the finder below imports an old path as
that very module (never a second copy), and perseus_legacy.__getattr__ resolves the attribute.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

MOVED = {
    "perseus_legacy.basics": "perseus_legacy.common.basics",
    "perseus_legacy.process_sets": "perseus_legacy.common.process_sets",
    "perseus_legacy.objects": "perseus_legacy.common.objects",
    "perseus_legacy.tf_config": "perseus_legacy.common.tf_config",
    "perseus_legacy.timeline": "perseus_legacy.common.timeline",
    "perseus_legacy.ops": "perseus_legacy.tensorflow.collectives",
    "perseus_legacy.adasum": "perseus_legacy.tensorflow.adasum",
    "perseus_legacy.compression": "perseus_legacy.tensorflow.compression",
    "perseus_legacy.reduction": "perseus_legacy.tensorflow.reduction",
    "perseus_legacy.gradient_tape": "perseus_legacy.tensorflow.gradient_tape",
    "perseus_legacy.hooks": "perseus_legacy.tf1.hooks",
    "perseus_legacy.graph_rewrite": "perseus_legacy.tf1.graph_rewrite",
    "perseus_legacy.optimizer": "perseus_legacy.tf1.optimizer",
    "perseus_legacy.data": "perseus_legacy.tf1.data",
    "perseus_legacy.config": "perseus_legacy.tf1.config",
    "perseus_legacy.sync_batch_norm": "perseus_legacy.keras.sync_batch_norm",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of MOVED as the module it moved to; `python -m` runs its code."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=MOVED[fullname])

    def create_module(self, spec: Any) -> types.ModuleType:
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the old path's spec on the module; give its own back.
        if isinstance(module.__spec__.loader_state, importlib.machinery.ModuleSpec):
            module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname: str) -> Any:
        """The code of the module `fullname` moved to (what runpy runs for `python -m`)."""
        target = MOVED[fullname]
        return importlib.util.find_spec(target).loader.get_code(target)

    def is_package(self, fullname: str) -> bool:
        return False


def install() -> None:
    """Puts the finder on sys.meta_path, once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def attribute(package: str, name: str) -> types.ModuleType | None:
    """The module that `package.name` names, if that path moved; else None."""
    target = MOVED.get(f"{package}.{name}")
    return importlib.import_module(target) if target is not None else None
