"""The public API against the documentation: what `perseus_legacy` and `perseus_legacy.keras`
export is documented, what docs/ and README.md call exists, and the module paths they (and
examples/) name import (in-process, no ranks)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path

import perseus_legacy  # noqa: I001 (first: it selects tf-keras)
import perseus_legacy.keras

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# How the docs name the two packages: `import perseus_legacy as pl` / `... as hvd`, and
# `import perseus_legacy.keras as hvd` in the Keras pages.
ALIASES = ("hvd", "pl", "perseus_legacy")
KERAS_PAGES = ("keras.md",)


def doc_text() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def exported(module: types.ModuleType) -> list[str]:
    return [name for name in module.__all__ if not name.startswith("__")]


def public_attributes(module: types.ModuleType) -> set[str]:
    """Names the module defines for users: not private, not a module it merely imported."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or name in ("annotations",):
            continue
        if isinstance(value, types.ModuleType) and name not in module.__all__:
            continue  # a subpackage (common, tensorflow, tf1, ...) is a path, not API
        names.add(name)
    return names


def test_all_lists_every_public_name_and_each_resolves():
    for module in (perseus_legacy, perseus_legacy.keras):
        missing = public_attributes(module) - set(module.__all__)
        assert not missing, f"{module.__name__} exports {sorted(missing)} outside __all__"
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"


def test_every_exported_name_is_documented():
    text = doc_text()
    for module in (perseus_legacy, perseus_legacy.keras):
        undocumented = [name for name in exported(module)
                        if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text)]
        assert not undocumented, (f"{module.__name__} exports names that no page of docs/ or "
                                  f"README.md mentions: {undocumented}")


def _called_names(text: str) -> set[tuple[str, str]]:
    pattern = rf"(?<![\w.])({'|'.join(ALIASES)})\.([A-Za-z_]\w*)"
    return set(re.findall(pattern, text))


def test_every_documented_hvd_name_exists():
    missing = []
    for path in DOCS:
        text = path.read_text()
        for alias, name in sorted(_called_names(text)):
            # README.md shows both packages as `hvd`; docs/keras.md's aliases are
            # perseus_legacy.keras, and only the spelled-out `perseus_legacy.` is the package.
            modules = [perseus_legacy.keras] if (
                path.name in KERAS_PAGES and alias != "perseus_legacy") else [
                perseus_legacy, perseus_legacy.keras]
            if not any(hasattr(m, name) for m in modules) and not _is_module(
                    f"perseus_legacy.{name}"):
                missing.append(f"{path.name}: {name}")
    assert not missing, "the docs call names that do not exist: " + ", ".join(missing)


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False


def documented_module_paths() -> set[str]:
    """Dotted perseus_legacy.x.y paths the docs name that are modules (not functions)."""
    paths = set()
    examples = "\n".join(p.read_text() for p in sorted((ROOT / "examples").glob("*.py")))
    for match in re.findall(r"perseus_legacy(?:\.[a-z_][a-z0-9_]*)+", doc_text() + examples):
        parts = match.split(".")
        # The longest prefix that is a module: the rest is an attribute of it.
        for end in range(len(parts), 1, -1):
            candidate = ".".join(parts[:end])
            if _is_module(candidate):
                paths.add(candidate)
                break
            if end == 2:
                paths.add(candidate)  # no module: must be an attribute of the package
    return paths


def test_documented_module_paths_import():
    paths = documented_module_paths()
    assert {"perseus_legacy.keras", "perseus_legacy.common.tf_config",
            "perseus_legacy.timeline"} <= paths, paths
    failures = []
    for path in sorted(paths):
        parent, _, name = path.rpartition(".")
        try:
            importlib.import_module(path)
        except ImportError:
            if not hasattr(importlib.import_module(parent), name):
                failures.append(path)
    assert not failures, f"documented paths that neither import nor resolve: {failures}"


def test_each_module_has_one_path():
    aliased = sorted(path for path, module in sys.modules.items()
                     if path.startswith("perseus_legacy") and module is not None
                     and module.__name__ != path)
    assert not aliased, f"modules imported under a second path: {aliased}"
    assert perseus_legacy.data is importlib.import_module("perseus_legacy.tf1.data")
