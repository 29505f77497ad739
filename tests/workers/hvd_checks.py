"""Runs the checks of several hvd_* workers in one launch (one TensorFlow start-up per rank).

    hvd_checks.py hvd_adasum hvd_api:check_tf1_local_variables,check_homogeneous

An argument is a worker module (all its CHECKS) or module:check,check,... Every check runs on
every rank, in order; any mismatch exits non-zero naming the rank.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as hvd

import importlib
import sys

import tensorflow as tf


def selected_checks(arguments: list) -> list:
    checks = []
    for argument in arguments:
        module_name, _, names = argument.partition(":")
        module = importlib.import_module(module_name)
        checks += ([getattr(module, name) for name in names.split(",")] if names
                   else list(module.CHECKS))
    return checks


def run_checks(checks: list, shutdown: bool = False) -> None:
    """init(), then every check on this rank in order; "[rank R] OK" once all passed."""
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for check in checks:
        check(rank, size)
        print(f"[rank {rank}] {check.__module__}.{check.__name__}: ok", flush=True)
    print(f"[rank {rank}] OK", flush=True)
    if shutdown:
        hvd.shutdown()


def main() -> None:
    run_checks(selected_checks(sys.argv[1:]))


if __name__ == "__main__":
    main()
