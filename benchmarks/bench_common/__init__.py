"""What several benchmarks share (the scripts in benchmarks/ import it; none imports another
script). Each module imports only what it needs, TensorFlow only where it says so:

- timing: timed(), the one way the collective benchmarks time steps that take turns.
- tf_steps: the TF allreduce op's Session steps and mpi4py's Allreduce (imports TensorFlow;
  perseus_legacy only for its own op, so Horovod's venv can use it too).
- cnn: the small CNN of training.py and estimator.py, its barrier and launches (TensorFlow).
- training_model: the Estimator model, input and hooks of the cluster runs (TensorFlow).
- emulated: launches on emulated hosts: environments, parameter servers, perseusrun, links.
- mwms: TensorFlow's MultiWorkerMirroredStrategy row (workers: benchmarks/cluster_mwms.py).
- scaling_model: the emulated accelerator of scaling.py (TensorFlow when it builds a model).
"""
