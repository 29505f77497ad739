"""The package's layout: no import cycle between perseus_legacy modules, no layer importing one
above it, and perseus_legacy/common free of TensorFlow and Keras (static: the imports are read
with ast, nothing is imported); every worker of tests/workers in tests/README.md's map."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "perseus_legacy"
# Frameworks that perseus_legacy/common must not import, even inside a function.
FRAMEWORKS = ("tensorflow", "keras", "tf_keras", "tensorflow_estimator")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_names(path: Path, name: str) -> list[tuple[str, int]]:
    """(module, line) of every import in the file, at module level or inside a function: a
    lazy import is still a dependency. `from pkg import sub` names pkg.sub when sub is a
    module, else pkg."""
    known = modules()
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in known else base, node.lineno))
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target, _ in imported_names(path, name)
                   if target in known and target != name}
            for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_reports_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_perseus_legacy_modules():
    graph = import_graph()
    assert "perseus_legacy.tensorflow.collectives" in graph  # the graph covers the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# docs/design.md: imports go one way, common/ <- tensorflow/ <- tf1/ <- the layers above, with
# one exception (tf1's DistributedOptimizer hands a Keras optimizer over to keras/).
LAYERS = ("common", "tensorflow", "tf1")
ABOVE = ("keras", "estimator", "elastic")
LAYER_EXCEPTIONS = {("perseus_legacy.tf1.optimizer", "perseus_legacy.keras")}


def test_a_layer_imports_no_layer_above_it():
    offending = []
    for name, targets in import_graph().items():
        layer = name.split(".")[1] if name.count(".") else None
        if layer not in LAYERS:
            continue
        for target in sorted(targets):
            parts = target.split(".")
            above = len(parts) == 1 or parts[1] in ABOVE or (
                parts[1] in LAYERS and LAYERS.index(parts[1]) > LAYERS.index(layer))
            if above and (name, target) not in LAYER_EXCEPTIONS:
                offending.append(f"{name} imports {target}")
    assert not offending, "imports must go one way (docs/design.md):\n" + "\n".join(offending)


def test_common_imports_no_framework():
    offending = []
    for name, path in modules().items():
        if not name.startswith("perseus_legacy.common"):
            continue
        for target, line in imported_names(path, name):
            if target.split(".")[0] in FRAMEWORKS:
                offending.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not offending, "perseus_legacy/common must stay framework-free:\n" + "\n".join(
        offending)
    assert "perseus_legacy.common.basics" in modules()


def test_shared_modules_import_neither_package_nor_a_framework():
    """perseus_env and perseus_shared are imported by the launcher (no TensorFlow) and by
    perseus_legacy/common (framework-free): they import neither package, nor any framework."""
    root = PACKAGE.parent
    files = [root / "perseus_env.py", *sorted((root / "perseus_shared").glob("*.py"))]
    assert len(files) > 2
    forbidden = (*FRAMEWORKS, "perseus_legacy", "perseusrun")
    offending = [f"{path.relative_to(root)}:{line} imports {target}"
                 for path in files for target, line in imported_names(path, path.stem)
                 if target.split(".")[0] in forbidden]
    assert not offending, "shared modules must import neither package:\n" + "\n".join(offending)


def test_every_worker_is_in_the_map_of_tests_readme():
    tests = Path(__file__).resolve().parent
    text = (tests / "README.md").read_text()
    missing = [path.stem for path in sorted((tests / "workers").glob("*.py"))
               if path.stem not in text]
    assert not missing, f"tests/README.md does not name the workers {missing}"
