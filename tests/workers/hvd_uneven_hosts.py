"""Runs on 3 ranks whose addresses put ranks 0 and 1 on one host and rank 2 on another (TCP
controller, started by hand): is_homogeneous() is False on every rank, and Adasum refuses a
rank count that is no power of 2, naming it."""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as hvd

import tensorflow as tf
from worker_util import fail


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if size != 3 or hvd.local_size() != (2, 2, 1)[rank]:
        fail(rank, f"size {size}, local_size {hvd.local_size()}: not the 2 + 1 hosts launched")
    if hvd.is_homogeneous() is not False:
        fail(rank, "is_homogeneous() is not False with 2 ranks on one host and 1 on the other")
    try:
        hvd.allreduce(tf.constant([1.0]), op=hvd.Adasum)
        fail(rank, "Adasum over 3 ranks did not raise")
    except NotImplementedError as exc:
        if "power-of-2" not in str(exc) or "one of 3" not in str(exc):
            fail(rank, f"unclear error for Adasum over 3 ranks: {exc}")
    print(f"[rank {rank}] OK", flush=True)


if __name__ == "__main__":
    main()
