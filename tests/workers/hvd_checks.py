"""Runs named cases of the hvd_* workers in one launch (one TensorFlow start-up per rank).

    hvd_checks.py hvd_api.reducescatter hvd_adasum.allreduce ...

An argument is `worker.case`: `case` is in the worker module's literal CASES (what the tests
parametrize over) and runs its `check_<case>(rank, size)`. The cases run on every rank in the
order given, each printing `[rank R] CASE worker.case: OK` or `... FAILED: why`
(worker_util.run_cases); a failed case does not stop the next.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as hvd

import importlib
import sys
from collections.abc import Callable

import tensorflow as tf
from worker_util import fail, launcher_rank, run_cases


def check_of(name: str) -> Callable[[int, int], None]:
    """The check of the case `worker.case`."""
    worker, _, case = name.partition(".")
    module = importlib.import_module(worker)
    if case not in module.CASES:
        fail(launcher_rank(), f"{worker} has no case {case!r}; its CASES: {module.CASES}")
    return getattr(module, f"check_{case}")


def main() -> None:
    names = sys.argv[1:]
    if not names:
        fail(launcher_rank(), "no case given: name them as worker.case")
    checks = {name: check_of(name) for name in names}
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    failed = run_cases(rank, {name: (lambda check=check: check(rank, size))
                              for name, check in checks.items()}, names)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
