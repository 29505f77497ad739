"""perseusrun: starts the ranks of a perseus_legacy job (`perseusrun` or `python -m perseusrun`).

A package beside perseus_legacy rather than inside it: importing perseus_legacy imports
TensorFlow (seconds of CPU), and starting ranks needs none of it. Only `--check-build` loads
perseus_legacy. The launcher is `perseusrun.launch`.
"""

# Variables the launcher hands to its ranks; perseus_legacy reads them.
RANK_VARIABLE = "PERSEUS_TCP_RANK"  # `--tcp`: this process's rank
ADDRESSES_VARIABLE = "PERSEUS_TCP_ADDRESSES"  # `--tcp`: host:port of every rank, in rank order
# Set beside TF_USE_LEGACY_KERAS when `import perseus_legacy` chose legacy Keras in a process,
# so that its child processes can tell that choice from the user's own.
LEGACY_KERAS_SET_HERE = "PERSEUS_SET_TF_USE_LEGACY_KERAS"
