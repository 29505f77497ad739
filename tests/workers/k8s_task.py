"""One TF_CONFIG task whose start-up is expected to fail (tests/test_k8s.py): init() only, no
TensorFlow; prints how long init() took and its error, and exits 3.

    k8s_task.py
"""

from __future__ import annotations

import sys
import time

from perseus_legacy.common import basics, tf_config


def main() -> None:
    cluster = tf_config.cluster_from_env()
    if cluster is None or not cluster.is_rank:
        sys.exit("k8s_task.py needs the TF_CONFIG of a rank")
    started = time.monotonic()
    try:
        basics.init()
    except RuntimeError as exc:
        print(f"[rank {cluster.rank}] INIT FAILED after {time.monotonic() - started:.1f} s: "
              f"{exc}", flush=True)
        sys.exit(3)
    sys.exit(f"[rank {cluster.rank}] UNEXPECTED: init() succeeded")


if __name__ == "__main__":
    main()
