"""The small CNN of the training benchmarks (benchmarks/training.py, benchmarks/estimator.py),
their barrier, and their launches: each configuration on its own perseusrun launch of the
script's `--worker PATH` mode, taking turns, the median repeat kept.

Imports perseus_legacy, then TensorFlow.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

BATCH = 32  # images per rank and step
IMAGE, CLASSES = 28, 10
THREADS = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def cnn(images: tf.Tensor) -> tf.Tensor:
    """Logits of conv(5x5, 32) - pool - conv(5x5, 64) - pool - dense(256) - dense(10)."""
    def weight(name: str, shape: list) -> tf.Variable:
        init = tf.compat.v1.glorot_uniform_initializer()
        return tf.compat.v1.get_variable(name, shape, initializer=init)

    def bias(name: str, n: int) -> tf.Variable:
        return tf.compat.v1.get_variable(name, [n], initializer=tf.zeros_initializer())

    x = tf.nn.relu(tf.nn.conv2d(images, weight("c1", [5, 5, 1, 32]), 1, "SAME") + bias("b1", 32))
    x = tf.nn.max_pool2d(x, 2, 2, "SAME")
    x = tf.nn.relu(tf.nn.conv2d(x, weight("c2", [5, 5, 32, 64]), 1, "SAME") + bias("b2", 64))
    x = tf.reshape(tf.nn.max_pool2d(x, 2, 2, "SAME"), [-1, 7 * 7 * 64])
    x = tf.nn.relu(tf.matmul(x, weight("d1", [7 * 7 * 64, 256])) + bias("b3", 256))
    return tf.matmul(x, weight("d2", [256, CLASSES])) + bias("b4", CLASSES)


def barrier(name: str) -> None:
    """Returns once every rank has called it with this name (a one-float allreduce)."""
    pl.common.basics.core().allreduce(np.zeros(1, np.float32), name=name)


def share(a: dict, b: dict) -> str:
    """a's examples/s as a percentage of b's."""
    return f"{100 * a['examples_per_s'] / b['examples_per_s']:.1f}%"


def launch(path: str, ranks: int, steps: int, script: str, bind_to: str = "core") -> dict:
    """Runs `script --worker path` on `ranks` ranks; examples/s and ms/step of its RESULT line."""
    perseusrun = Path(sys.executable).parent / "perseusrun"
    cmd = [str(perseusrun), "-np", str(ranks), "--timeout", "600", "--bind-to", bind_to,
           *[a for k, v in THREADS.items() for a in ("-x", f"{k}={v}")],
           sys.executable, script, "--worker", path, "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=660)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n"
                         f"{out.stdout}\n{out.stderr}")
    result = json.loads(lines[-1][len("RESULT "):])
    return {"examples_per_s": BATCH * ranks * result["steps"] / result["seconds"],
            "step_ms": 1e3 * result["seconds"] / result["steps"]}


def median_runs(configs: list, steps: int, repeats: int, script: str, **launch_options) -> dict:
    """Launches every (path, ranks) config `repeats` times, taking turns; the median of each."""
    runs: dict = {c: [] for c in configs}
    for _ in range(repeats):
        for config in configs:
            runs[config].append(launch(*config, steps, script, **launch_options))
    return {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]}
            for c in configs}
