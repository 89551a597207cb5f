"""Baseline plugin: DP-SGD, DP-Adam and MeZO with their samplers, estimators and update rules."""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "objective": {
        "hf_text_classification": "dpreg_baseline.objectives:HFTextClassification",
        "quadratic": "dpreg_baseline.objectives:Quadratic",
        "tabular": "dpreg_baseline.objectives:TabularObjective",
    },
    "sampler": {
        "full_batch": "dpreg_baseline.samplers:FullBatch",
        "poisson": "dpreg_baseline.samplers:PoissonSampler",
        "shuffle": "dpreg_baseline.samplers:ShuffleSampler",
        "uniform": "dpreg_baseline.samplers:UniformSampler",
        "user_poisson": "dpreg_baseline.samplers:UserPoisson",
    },
    "estimator": {
        "per_example_grad": "dpreg_baseline.estimators:PerExampleGrad",
        "zo_two_point": "dpreg_baseline.estimators:ZOTwoPoint",
    },
    "privatizer": {
        "gaussian": "dpreg_baseline.privatizers:GaussianPrivatizer",
        "none": "dpreg_baseline.privatizers:NoPrivatizer",
    },
    "update_rule": {
        "adam": "dpreg_baseline.updates:Adam",
        "directional_sgd": "dpreg_baseline.updates:DirectionalSGD",
        "sgd": "dpreg_baseline.updates:SGD",
    },
    "algorithm": {
        "dp_adam": "dpreg_baseline.algorithms:DPAdam",
        "dp_sgd": "dpreg_baseline.algorithms:DPSGD",
        "mezo": "dpreg_baseline.algorithms:MeZO",
        "standard": "dpreg_baseline.algorithms:Standard",
    },
})
