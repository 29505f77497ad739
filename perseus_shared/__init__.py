"""What the launcher (perseusrun) and the ranks (perseus_legacy) share besides the settings table
(perseus_env): Slurm's variables as ranks, the elastic driver's wire, the lost-rank line, mpirun.

A package outside both: perseusrun imports no TensorFlow, and importing anything under
perseus_legacy imports it (its __init__ does). Nothing here imports TensorFlow, perseus_legacy or
perseusrun (tests/test_layout.py checks it).
"""
