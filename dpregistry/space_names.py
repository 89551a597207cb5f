"""The names of the coordinate spaces and contribution kinds (see :mod:`dpregistry.spaces`).

Plain strings, kept apart from the tensor code so that the stage contracts (and the accountants,
which need no tensors) import without torch.
"""

DENSE = "dense"
SEEDED_DIRECTION = "seeded_direction"
VECTOR_ZO = "vector_zo"
PROJECTED = "projected"
SPACES = (DENSE, SEEDED_DIRECTION, VECTOR_ZO, PROJECTED)

GRADIENT = "gradient"    # an estimate of the gradient itself
INCREMENT = "increment"  # a change to a running estimate (SPIDER, variance reduction)
