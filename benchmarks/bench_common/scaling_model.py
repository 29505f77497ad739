"""The emulated accelerator of benchmarks/scaling.py: a model whose compute is time that uses no
CPU and whose gradients are real tensors of each variable's (scaled) size.

A profile (benchmarks/scaling_profiles/<model>.json, made by scaling_profiles.py) lists a real
network's trainable tensors layer by layer, each layer's share of the step's FLOPs, and one
accelerator's step time at the batch Horovod used. `build_loss()` makes one
`tf.custom_gradient` function per layer: its forward holds the layer's forward time (1/3 of
its share), its gradient the backward time (2/3) and then returns a gradient for each of the
layer's variables. Every layer takes the previous layer's output (forward) or gradient
(backward), so the waits run one after the other like kernels on one GPU stream, and the last
layers' gradients exist while backward still waits on the first layers: an allreduce can
move them meanwhile. Any optimizer's `compute_gradients(loss)` sees an ordinary model.

Variables are 1-D float32 of the real tensor's element count times `byte_scale` (at least one
element): benchmarks/scaling.py scales by emulated link rate / real link rate, so that moving
a step's gradients takes the real cluster's share of a step.

The wait is the EmulatedDelay op (scaling_delay_op.cc): an AsyncOpKernel completed by a timer
thread, built on first use for the TensorFlow that loads it, cached under build/. `--wait
py_function` (a tf.py_function that sleeps) exists to measure what that costs instead.
This module imports TensorFlow lazily: scaling.py uses its bounds without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
PROFILES = HERE / "scaling_profiles"
DELAY_SOURCE = HERE / "scaling_delay_op.cc"
BUILD_DIR = HERE.parent / "build" / "scaling_delay_op"
FORWARD_SHARE = 1 / 3  # of a layer's time; backward takes the rest (twice the forward)
MODELS = ("resnet50", "resnet101", "inception3", "vgg16")
TINY = "tiny"  # a made-up 3-layer profile for the smoke test (scaling_profiles/tiny.json)


@dataclass(frozen=True)
class Layer:
    name: str
    forward_ms: float
    backward_ms: float
    tensors: tuple  # ((name, real element count), ...) in the layer's variable order


@dataclass(frozen=True)
class Profile:
    """A model as the emulation sees it; layers in forward order."""

    model: str
    batch: int
    step_ms: float
    layers: tuple

    def tensor_elements(self, byte_scale: float) -> list[int]:
        """Element count of every emulated tensor in the order backprop produces them."""
        return [scaled(count, byte_scale) for layer in reversed(self.layers)
                for _, count in reversed(layer.tensors)]

    def backward_ready_ms(self, byte_scale: float) -> list[tuple[float, int]]:
        """(ms after backward starts, bytes) of each gradient, in the order it is produced."""
        ready, now = [], 0.0
        for layer in reversed(self.layers):
            now += layer.backward_ms
            ready += [(now, 4 * scaled(count, byte_scale))
                      for _, count in reversed(layer.tensors)]
        return ready

    @property
    def forward_ms(self) -> float:
        return sum(layer.forward_ms for layer in self.layers)

    @property
    def backward_ms(self) -> float:
        return sum(layer.backward_ms for layer in self.layers)


def scaled(count: int, byte_scale: float) -> int:
    return max(1, round(count * byte_scale))


def load_profile(model: str, step_scale: float = 1.0, min_layer_ms: float = 1.0) -> Profile:
    """The profile of `model`; `step_scale` multiplies every layer's time (smoke tests).
    Consecutive layers are merged until each lasts at least `min_layer_ms` (forward and
    backward): a batch normalization's few microseconds become part of its convolution, and
    each wait costs some CPU (docs/scaling.md). Tensors and their order stay as they are."""
    path = PROFILES / f"{model}.json"
    if not path.exists():
        known = ", ".join(p.stem for p in sorted(PROFILES.glob("*.json")))
        raise ValueError(f"no profile {path}: known models are {known}")
    data = json.loads(path.read_text())
    total_flops = sum(layer["flops"] for layer in data["layers"])
    step_ms = data["step_ms"] * step_scale
    layers = tuple(
        Layer(layer["name"], step_ms * FORWARD_SHARE * layer["flops"] / total_flops,
              step_ms * (1 - FORWARD_SHARE) * layer["flops"] / total_flops,
              tuple((t["name"], _elements(t["shape"])) for t in layer["tensors"]))
        for layer in data["layers"])
    return Profile(data["model"], data["batch"], step_ms, _merged(layers, min_layer_ms))


def _merged(layers: tuple, min_layer_ms: float) -> tuple:
    merged, pending = [], []
    for layer in layers:
        pending.append(layer)
        if sum(p.forward_ms + p.backward_ms for p in pending) >= min_layer_ms:
            merged.append(_join(pending))
            pending = []
    if pending:
        merged.append(_join(pending))
    return tuple(merged)


def _join(layers: list) -> Layer:
    if len(layers) == 1:
        return layers[0]
    return Layer(f"{layers[0].name}..{layers[-1].name}", sum(p.forward_ms for p in layers),
                 sum(p.backward_ms for p in layers),
                 tuple(t for p in layers for t in p.tensors))


def _elements(shape: list) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# --------------------------------------------------------------------------- the bounds


def allreduce_link_share(hosts: int) -> float:
    """Fraction of the gradients' bytes each host link carries each way per step: a ring (or a
    hierarchical allreduce's ring per local rank) across `hosts` hosts moves 2(H-1)/H."""
    return 2 * (hosts - 1) / hosts if hosts > 1 else 0.0


def step_bounds_ms(profile: Profile, hosts: int, byte_scale: float,
                   link_bytes_s: float) -> dict:
    """The step's bounds on `hosts` hosts: compute alone, and compute plus the communication
    that cannot hide under backward when the link moves each gradient as soon as it exists,
    in the order backprop produces them, at the link rate; and the link time of a step."""
    share = allreduce_link_share(hosts)
    link_free = 0.0
    comm_ms = 0.0
    for ready_ms, size in profile.backward_ready_ms(byte_scale):
        transfer_ms = 1e3 * share * size / link_bytes_s
        link_free = max(link_free, ready_ms) + transfer_ms
        comm_ms += transfer_ms
    compute_ms = profile.forward_ms + profile.backward_ms
    unhidden_ms = max(0.0, link_free - profile.backward_ms)
    return {"compute_ms": compute_ms, "comm_ms": comm_ms,
            "compute_comm_ms": compute_ms + unhidden_ms}


# --------------------------------------------------------------------------- the wait


def _tensorflow_version(python: str) -> str:
    # This process's TensorFlow when it is `python`'s and imported (every worker: a second
    # interpreter importing TensorFlow only for its version cost each rank seconds of CPU at
    # start-up, on cores the other ranks share); otherwise ask `python`.
    loaded = sys.modules.get("tensorflow")
    if python == sys.executable and loaded is not None:
        return loaded.__version__
    return subprocess.run(
        [python, "-c", "import tensorflow as tf; print(tf.__version__)"], capture_output=True,
        text=True, check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout.split()[-1]


def delay_library_path(python: str = sys.executable) -> Path:
    """Where the EmulatedDelay op built for `python`'s TensorFlow lives."""
    version = _tensorflow_version(python)
    digest = hashlib.sha256(DELAY_SOURCE.read_bytes()).hexdigest()[:12]
    return BUILD_DIR / f"tf{version}-{digest}" / "emulated_delay.so"


def build_delay_library(python: str = sys.executable) -> Path:
    """Compiles the EmulatedDelay op for `python`'s TensorFlow unless built; its path."""
    target = delay_library_path(python)
    if target.exists():
        return target
    flags = subprocess.run(
        [python, "-c", "import tensorflow as tf; "
         "print('\\n'.join(tf.sysconfig.get_compile_flags() + ['--'] + "
         "tf.sysconfig.get_link_flags()))"], capture_output=True, text=True, check=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout.splitlines()
    split = flags.index("--")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O2", "-w", *flags[:split],
           str(DELAY_SOURCE), "-o", str(partial), *flags[split + 1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the EmulatedDelay op for {python} failed "
                           f"(exit {proc.returncode}):\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    partial.replace(target)  # atomic: concurrent builders leave one complete library
    return target


class Wait:
    """`delay(tensor, ms)`: `tensor` after `ms` ms, by the op (default) or a py_function."""

    def __init__(self, kind: str = "op") -> None:
        import tensorflow as tf

        self.tf = tf
        self.kind = kind
        if kind == "op":
            self.ops = tf.load_op_library(str(build_delay_library()))
        elif kind != "py_function":
            raise ValueError(f"wait {kind!r}: expected op or py_function")

    def __call__(self, tensor, ms: float):
        tf = self.tf
        if self.kind == "op":
            return self.ops.emulated_delay(tensor, micros=int(round(1e3 * ms)))
        seconds = ms / 1e3

        def sleep(value):
            time.sleep(seconds)
            return value

        out = tf.py_function(sleep, [tensor], tensor.dtype)
        out.set_shape(tensor.shape)
        return out


# --------------------------------------------------------------------------- the model


def default_variable(name: str, elements: int):
    """A float32 resource variable of `elements` zeros, through tf.compat.v1.get_variable (so
    device setters and variable scopes apply, as for any TF1 model)."""
    import tensorflow as tf

    return tf.compat.v1.get_variable(name, [elements], tf.float32,
                                     initializer=tf.compat.v1.zeros_initializer(),
                                     use_resource=True)


def build_loss(profile: Profile, byte_scale: float, wait: Wait, inputs=None,
               make_variable=default_variable):
    """The emulated model's scalar loss (graph or eager); its variables are created with
    `make_variable(name, elements)`."""
    import tensorflow as tf

    x = tf.ones([1], tf.float32) if inputs is None else tf.reshape(inputs, [-1])[:1]
    for index, layer in enumerate(profile.layers):
        variables = [make_variable(f"l{index:03d}_{tensor_index}_{_clean(name)}",
                                   scaled(count, byte_scale))
                     for tensor_index, (name, count) in enumerate(layer.tensors)]
        x = _layer(x, variables, layer, wait)
    return tf.reduce_sum(x)


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name)[:60]


def _layer(x, variables: list, layer: Layer, wait: Wait):
    import tensorflow as tf

    @tf.custom_gradient
    def run(inputs):
        # Reading one element makes each variable an input of the layer (the gradient needs
        # it so); a parameter-server worker still pulls the whole variable.
        touched = inputs + 0.0 * tf.add_n([v[0] for v in variables]) if variables else inputs
        out = wait(touched, layer.forward_ms)

        def grad(upstream, variables=None):
            # A loss's gradient needs no forward value: backward starts when forward ends.
            with tf.control_dependencies([out]):
                back = wait(tf.identity(upstream), layer.backward_ms)
            value = back[0]
            return back, [tf.fill(tf.shape(v), value) for v in variables or []]

        return out, grad

    return run(x)
