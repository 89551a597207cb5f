"""KL-condition plugin (spec 004): KL-Spider, private proximal point, adaptive noisy GD with a filter.

Objectives with known KL constants (the axis-design least squares and quartic, ridge least squares
and logistic regression on scikit-learn's bundled tables), full-batch estimators (per-record
gradients; SPIDER's anchor and differences), per-call Gaussian privatizers, and the update rules
of Alg. 1 (normalised steps) and Alg. 4 (projected GD with a weighted average).

What the stages exchange is typed (``dpreg_kl.common``, ``dpreg_kl.updates``): an objective of
another package takes part by subclassing ``DeclaresKLConstants`` (its ``KLConstants``, for the
``auto`` settings) and ``GroupedRecords`` (closed-form per-record gradients); ``normalized_step``
provides the ``StepBound`` that ``spider_fullbatch`` needs.
"""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "objective": {
        "kl_least_squares": "dpreg_kl.objectives:LeastSquares",
        "kl_logistic": "dpreg_kl.objectives:Logistic",
        "kl_power": "dpreg_kl.objectives:PowerObjective",
    },
    "estimator": {
        "kl_fullbatch_grad": "dpreg_kl.estimators:FullBatchGrad",
        "spider_fullbatch": "dpreg_kl.estimators:SpiderFullBatch",
    },
    "privatizer": {
        "scheduled_gaussian": "dpreg_kl.privatizers:ScheduledGaussian",
        "spider_gaussian": "dpreg_kl.privatizers:SpiderGaussian",
    },
    "update_rule": {
        "normalized_step": "dpreg_kl.updates:NormalizedStep",
        "prox_projected_gd": "dpreg_kl.updates:ProxProjectedGD",
    },
    "algorithm": {
        "adaptive_noisy_gd": "dpreg_kl.algorithms:AdaptiveNoisyGD",
        "kl_proximal_point": "dpreg_kl.algorithms:KLProximalPoint",
        "kl_spider": "dpreg_kl.algorithms:KLSpider",
    },
})
