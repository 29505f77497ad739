"""Framework-free perseus_legacy: the process group over the native core, process sets, Python
objects between ranks, the TF_CONFIG cluster and timelines. Nothing here imports TensorFlow or
Keras (tests/test_layout.py checks it), so the launcher's and the TF_CONFIG evaluator's needs
are met without them."""
