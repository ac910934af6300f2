"""Parallelism applied from outside the model: the device mesh and the fixed parallelize order."""
