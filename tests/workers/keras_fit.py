"""Runs on every rank: Model.fit with DistributedOptimizer equals single-process fit.

Every rank builds the model from the same seed and fits on its shard (BATCH rows a step); rank 0
then fits a plain tf-keras copy of the initial model on the whole data set with the global batch
BATCH * size() and compares the final weights (RTOL, ATOL: float32, another summation order;
FP16_RTOL, FP16_ATOL with gradients sent as float16). argv[1:]: cases
"<optimizer>:<graph|eager>[:<option>+...]", options fp16, sparse_as_dense, predivide.
"""

from __future__ import annotations  # noqa: I001

import keras_common as kc
from keras_common import hvd

import sys

import numpy as np
from worker_util import agree, barrier, fail

EPOCHS = 2
RTOL, ATOL = 1e-5, 1e-6
FP16_RTOL, FP16_ATOL = 2e-2, 2e-3
OPTIONS = {
    "fp16": {"compression": hvd.Compression.fp16},
    "sparse_as_dense": {"sparse_as_dense": True},
    "predivide": {"gradient_predivide_factor": 2.0},
}


def check(case: str) -> None:
    name, mode, *options = case.split(":")
    options = options[0].split("+") if options else []
    kwargs = {k: v for option in options for k, v in OPTIONS[option].items()}
    rtol, atol = (FP16_RTOL, FP16_ATOL) if "fp16" in options else (RTOL, ATOL)
    m = kc.model(0)
    initial = m.get_weights()
    kc.compile_model(m, hvd.DistributedOptimizer(kc.OPTIMIZERS[name](), **kwargs),
                     run_eagerly=mode == "eager")
    inputs, y = kc.shard(*kc.data())
    m.fit(list(inputs), y, batch_size=kc.BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    agree(hvd.rank(), case, m.get_weights())
    if hvd.rank() == 0:
        expected = kc.reference_weights(initial, kc.OPTIMIZERS[name](), EPOCHS, hvd.size())
        moved = np.abs(kc.flat(expected) - kc.flat(initial)).max()
        if moved < 1e-2:
            fail(hvd.rank(), f"{case}: the reference barely trained (max change {moved})")
        for i, (got, want) in enumerate(zip(m.get_weights(), expected)):
            if not np.allclose(got, want, rtol=rtol, atol=atol):
                fail(hvd.rank(), f"{case}: weight {i} differs from single-process fit by "
                        f"{np.abs(got - want).max()} (rtol={rtol}, atol={atol})")
        print(f"{case}: same weights as single-process fit on the global batch", flush=True)
    barrier(case)


def main() -> None:
    hvd.init()
    for case in sys.argv[1:]:
        check(case)
    hvd.shutdown()


if __name__ == "__main__":
    main()
