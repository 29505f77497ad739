"""perseusrun: starts the ranks of a perseus_legacy job (`perseusrun` or `python -m perseusrun`).

A package beside perseus_legacy rather than inside it: importing perseus_legacy imports
TensorFlow (seconds of CPU), and starting ranks needs none of it. Only `--check-build` loads
perseus_legacy. The launcher is `perseusrun.launch`; what it shares with the library is the
settings table `perseus_env` and the package `perseus_shared`.
"""
