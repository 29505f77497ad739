"""A non-editable `pip install .` gives a working package: it is built from a copy of the source
tree into a separate directory, then used from outside the repository (the in-tree package is
never on the path): `perseusrun --check-build`, a 2-rank allreduce, `python -m perseus_legacy`, and
its metadata (license, dependencies)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from harness import QUIET_ENV, ROOT

RANK_SCRIPT = textwrap.dedent("""
    import sys

    import perseus_legacy as pl
    import perseus_legacy.keras  # noqa: F401  (a subpackage: it must be installed too)

    assert pl.__file__.startswith(sys.argv[1]), f"imported {pl.__file__}, not the installed copy"
    pl.init()
    import tensorflow as tf

    total = pl.allreduce(tf.constant([pl.rank() + 1.0, 2.0]), op=pl.Sum).numpy().tolist()
    expected = [pl.size() * (pl.size() + 1) / 2, 2.0 * pl.size()]
    assert total == expected, (total, expected)
    print(f"rank {pl.rank()} of {pl.size()}: allreduce {total} from {pl.__file__}", flush=True)
    pl.shutdown()
""")


def run(cmd: list, cwd, env: dict, timeout: float) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    command = " ".join(map(str, cmd))
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple:
    """(install directory, a working directory outside the repo, environment using only it)."""
    base = tmp_path_factory.mktemp("packaging")
    source, target, elsewhere = base / "source", base / "site", base / "elsewhere"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "*.so", ".pytest_cache",
        ".ruff_cache", "out"))
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MAKEFLAGS="", PIP_DISABLE_PIP_VERSION_CHECK="1")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", target, source], elsewhere, env, timeout=1200)
    env.update(QUIET_ENV, PYTHONPATH=str(target))
    return target, elsewhere, env


def test_installed_package_builds_its_native_parts_and_entry_point(installed):
    target, elsewhere, env = installed
    out = run([target / "bin" / "perseusrun", "--check-build"], elsewhere, env, timeout=300)
    assert f"loaded ({target}" in out, out  # the native core of the installed copy
    assert "TensorFlow ops: loaded into TensorFlow" in out, out
    assert "  mpi: built" in out, out


def test_installed_package_runs_a_2_rank_allreduce_from_outside_the_repo(installed):
    target, elsewhere, env = installed
    script = elsewhere / "allreduce.py"
    script.write_text(RANK_SCRIPT)
    out = run([target / "bin" / "perseusrun", "-np", "2", "--timeout", "180", sys.executable,
               script, target], elsewhere, env, timeout=240)
    for rank in range(2):
        assert f"rank {rank} of 2: allreduce [3.0, 4.0] from {target}" in out, out


def test_installed_package_prints_diagnostics_with_its_version(installed):
    target, elsewhere, env = installed
    out = run([sys.executable, "-m", "perseus_legacy"], elsewhere, env, timeout=300)
    version = re.search(r'__version__ = "(.+)"',
                        (ROOT / "perseus_legacy" / "_version.py").read_text()).group(1)
    assert f"perseus_legacy: {version} ({target / 'perseus_legacy'})" in out, out
    assert "TensorFlow ops: loaded into TensorFlow" in out, out
    assert "Keras integration: perseus_legacy.keras ready" in out, out


def test_check_build_fails_naming_the_native_part_that_is_missing(installed, tmp_path):
    target, elsewhere, env = installed
    broken = tmp_path / "site"
    shutil.copytree(target, broken, symlinks=True)
    for library in (broken / "perseus_legacy").glob("_tf_ops*.so"):
        library.unlink()
    proc = subprocess.run([str(broken / "bin" / "perseusrun"), "--check-build"], cwd=elsewhere,
                          env=dict(env, PYTHONPATH=str(broken)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout
    assert f"native core: loaded ({broken}" in proc.stdout, proc.stdout
    assert "TensorFlow ops: MISSING: ImportError" in proc.stdout, proc.stdout
    assert "BROKEN: TensorFlow ops did not load" in proc.stdout, proc.stdout


def test_installed_package_metadata_names_its_license_and_dependencies(installed):
    target, _, _ = installed
    [dist_info] = target.glob("perseus_legacy-*.dist-info")
    metadata = (dist_info / "METADATA").read_text().splitlines()
    assert "License-Expression: Apache-2.0" in metadata, metadata
    assert "License-File: LICENSE" in metadata, metadata
    assert (dist_info / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    for requirement in ("tensorflow-estimator==2.15.0", "tensorboard"):
        assert f"Requires-Dist: {requirement}" in metadata, metadata
