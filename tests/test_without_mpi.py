"""A build without MPI (PERSEUS_WITHOUT_MPI=1), made for real: the runtime library and `_core`
only (PERSEUS_SKIP_TF_OPS=1: no TensorFlow), into a temporary directory. Nothing in it links or
loads an MPI library, it says MPI is not built, init() over MPI fails saying why, and two ranks
started by hand allreduce over TCP against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import ROOT, WORKERS, task_env

from perseusrun import tcp_run

SECRET = "without-mpi-secret-0123456789"


def build_env(lib: Path) -> dict:
    """A process started by hand with only the build under test and the workers' helpers on the
    path: not the source tree."""
    return task_env({"PYTHONPATH": os.pathsep.join([str(lib), str(WORKERS)]),
                     "PERSEUS_SECRET": SECRET})


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    """The build's directory: perseus_legacy/{_core, libperseus_common.so} and an empty
    __init__.py, so that importing the core imports nothing else."""
    base = tmp_path_factory.mktemp("tcp_only")
    env = {k: v for k, v in os.environ.items() if k != "PERSEUS_TF_PYTHON"}
    env.update(PERSEUS_WITHOUT_MPI="1", PERSEUS_SKIP_TF_OPS="1", MAKEFLAGS="")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", base / "lib",
         "--build-temp", base / "tmp"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600)
    assert proc.returncode == 0, f"the build without MPI failed:\n{proc.stdout}"
    print(f"build without MPI: {time.monotonic() - started:.1f} s")
    package = base / "lib" / "perseus_legacy"
    (package / "__init__.py").write_text("")
    return base / "lib"


def native_files(lib: Path) -> list:
    files = sorted((lib / "perseus_legacy").glob("*.so"))
    names = [f.name for f in files]
    assert "libperseus_common.so" in names and any(n.startswith("_core") for n in names), names
    assert not any(n.startswith("_tf_ops") for n in names), names
    return files


def test_nothing_in_the_build_links_an_mpi_library_or_calls_mpi(lib):
    for path in native_files(lib):
        dynamic = subprocess.run(["readelf", "-d", path], stdout=subprocess.PIPE, text=True,
                                 check=True, timeout=60).stdout
        needed = [line.split("[")[-1].rstrip("]") for line in dynamic.splitlines()
                  if "(NEEDED)" in line]
        assert needed and not [n for n in needed if "mpi" in n.lower()], f"{path}: {needed}"
        # Every library it loads, and theirs, by file name (the directory may say anything).
        resolved = subprocess.run(["ldd", path], stdout=subprocess.PIPE, text=True, check=True,
                                  timeout=60).stdout
        loaded = [Path(line.split()[0]).name for line in resolved.splitlines() if line.strip()]
        assert "not found" not in resolved and not [n for n in loaded if "mpi" in n.lower()], (
            f"{path}:\n{resolved}")
        symbols = subprocess.run(["nm", "-D", "--undefined-only", path], stdout=subprocess.PIPE,
                                 text=True, check=True, timeout=60).stdout
        assert "MPI_" not in symbols, f"{path} calls MPI: " + ", ".join(
            line.split()[-1] for line in symbols.splitlines() if "MPI_" in line)


def test_mpi_is_registered_as_not_built_and_init_over_mpi_says_so(lib):
    proc = subprocess.run([sys.executable, str(WORKERS / "without_mpi_task.py"), "info"],
                          cwd=lib, env=build_env(lib), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["core"].startswith(str(lib)), report
    assert report["transports"] == [{"name": "mpi", "built": False, "binding": "init_mpi"},
                                    {"name": "tcp", "built": True, "binding": "init_tcp"}], report
    assert report["build_info"] == {"mpi": False, "tcp": True, "nccl": False,
                                    "controller": ""}, report
    assert "this build has no MPI" in report["mpi_init"], report
    assert "PERSEUS_WITHOUT_MPI=1" in report["mpi_init"], report


def test_two_ranks_allreduce_over_tcp_against_numpy(lib):
    addresses = ",".join(f"127.0.0.1:{p}" for p in tcp_run.free_local_ports(2))
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "without_mpi_task.py"), "allreduce",
                               str(rank), addresses],
                              cwd=lib, env=build_env(lib), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = []
    deadline = time.monotonic() + 120
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        everything = "\n".join(f"--- rank {r}:\n{p.communicate()[0]}" for r, p in enumerate(procs))
        raise AssertionError(f"the ranks hung past 120 s:\n{everything}") from None
    everything = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{out}"
                           for r, (p, out) in enumerate(zip(procs, outputs)))
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, everything
        assert f"[rank {rank}] allreduce over tcp OK from {lib}" in outputs[rank], everything
