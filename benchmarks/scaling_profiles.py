"""Writes benchmarks/scaling_profiles/<model>.json, the model profiles of benchmarks/scaling.py.

    python benchmarks/scaling_profiles.py      # TF 2.21 venv; runs once, its output is committed

For resnet50, resnet101, inception3 and vgg16: every trainable tensor of the
tf.keras.applications model (built with weights=None, ImageNet input, nothing downloaded) in
forward layer order, grouped by Keras layer, with each layer's forward FLOPs per example:
convolutions 2 x output pixels x kernel size, dense layers 2 x kernel size, batch
normalization 4 x output elements (weightless layers: pooling, activations, adds, concats are
not counted). Backprop produces the gradients in the reverse of that order.

Each profile also holds one accelerator's step time at batch 64, from the NVIDIA Tesla P100
(DGX-1) synthetic-data training figures of TensorFlow's benchmarks page (tf_cnn_benchmarks,
batch 64 per GPU, the batch of Horovod's published runs): InceptionV3 142, ResNet-50 219,
ResNet-152 91.8, VGG16 154 images/s. ResNet-101 is not on that page: its time per image is
interpolated between ResNet-50's and ResNet-152's by FLOPs. docs/scaling.md cites the sources.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

OUT = Path(__file__).resolve().parent / "scaling_profiles"
BATCH = 64
P100_IMAGES_PER_S = {"inception3": 142.0, "resnet50": 219.0, "resnet152": 91.8, "vgg16": 154.0}
SOURCE = ("TensorFlow benchmarks page, NVIDIA DGX-1 (Tesla P100), synthetic data, "
          "tf_cnn_benchmarks, batch 64 per GPU")
BUILDERS = {"resnet50": "ResNet50", "resnet101": "ResNet101", "resnet152": "ResNet152",
            "inception3": "InceptionV3", "vgg16": "VGG16"}


def layer_flops(layer) -> int:
    """Forward FLOPs per example of one Keras layer with trainable weights."""
    kernel = next((w for w in layer.trainable_weights if len(w.shape) >= 2), None)
    output = [d for d in layer.output.shape[1:]]
    if kernel is not None and len(kernel.shape) == 4:  # Conv2D: kh, kw, cin, cout
        pixels = output[0] * output[1]
        return 2 * pixels * math.prod(kernel.shape) + pixels * output[2]
    if kernel is not None:  # Dense
        return 2 * math.prod(kernel.shape) + output[-1]
    return 4 * math.prod(output)  # BatchNormalization


def profile(model_name: str) -> dict:
    import tensorflow as tf

    model = getattr(tf.keras.applications, BUILDERS[model_name])(weights=None)
    layers = []
    for layer in model.layers:
        if not layer.trainable_weights:
            continue
        layers.append({"name": layer.name, "flops": layer_flops(layer),
                       "tensors": [{"name": w.name, "shape": list(w.shape)}
                                   for w in layer.trainable_weights]})
    return {"model": model_name, "keras_model": BUILDERS[model_name],
            "input": list(model.input.shape[1:]), "batch": BATCH, "layers": layers}


def total_flops(data: dict) -> int:
    return sum(layer["flops"] for layer in data["layers"])


def main() -> None:
    OUT.mkdir(exist_ok=True)
    resnet = {name: profile(name) for name in ("resnet50", "resnet152")}
    for name in ("resnet50", "resnet101", "inception3", "vgg16"):
        data = resnet.get(name) or profile(name)
        if name == "resnet101":
            low, high = (total_flops(resnet[n]) for n in ("resnet50", "resnet152"))
            per_image = [1 / P100_IMAGES_PER_S[n] for n in ("resnet50", "resnet152")]
            fraction = (total_flops(data) - low) / (high - low)
            seconds = per_image[0] + fraction * (per_image[1] - per_image[0])
            source = (f"{SOURCE}: interpolated by FLOPs between ResNet-50 "
                      f"({P100_IMAGES_PER_S['resnet50']:g} images/s) and ResNet-152 "
                      f"({P100_IMAGES_PER_S['resnet152']:g} images/s)")
        else:
            seconds = 1 / P100_IMAGES_PER_S[name]
            source = f"{SOURCE}: {P100_IMAGES_PER_S[name]:g} images/s"
        data["step_ms"] = round(1e3 * BATCH * seconds, 1)
        data["step_source"] = source
        data["parameters"] = sum(math.prod(t["shape"]) for layer in data["layers"]
                                 for t in layer["tensors"])
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{path}: {len(data['layers'])} layers, "
              f"{sum(len(layer['tensors']) for layer in data['layers'])} tensors, "
              f"{data['parameters'] / 1e6:.1f} M parameters, {total_flops(data) / 1e9:.2f} "
              f"GFLOPs per example, {data['step_ms']} ms per step of {BATCH}")


if __name__ == "__main__":
    main()
