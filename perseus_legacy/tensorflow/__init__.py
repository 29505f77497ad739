"""perseus_legacy on TensorFlow, in any mode (tf.compat.v1 graph, tf.function, eager): the
collectives and their gradients, Adasum, compression, the gradient reducer and
DistributedGradientTape. Built on perseus_legacy.common; the TF1 and Keras layers build on it."""
