"""DP-GRAPE plugin (seed 003): projected per-example gradients, projected Adam/SGD, naive DP-GaLore.

Mulrooney et al., "Memory-Efficient Differentially Private Training with Gradient Random
Projection"; the implementation follows specs/003_dpgrape.md (section numbers cited in code).
"""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "objective": {
        "image_classification": "dpreg_grape.objectives:ImageClassification",
    },
    "estimator": {
        "projected_per_example_grad": "dpreg_grape.estimators:ProjectedPerExampleGrad",
    },
    "update_rule": {
        "galore_adam": "dpreg_grape.updates:GaLoreAdam",
        "projected_adam": "dpreg_grape.updates:ProjectedAdam",
        "projected_sgd": "dpreg_grape.updates:ProjectedSGD",
    },
    "algorithm": {
        "dp_galore_naive": "dpreg_grape.algorithms:DPGaLoreNaive",
        "dp_grape": "dpreg_grape.algorithms:DPGrape",
    },
})
