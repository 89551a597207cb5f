"""DPZero plugin (Zhang et al., "DPZero: Private Fine-Tuning of Language Models without Backpropagation").

* algorithms: ``dpzero`` (Alg. 2 as in the experiments), ``dpzero_full_batch`` (Alg. 2 as stated),
  ``dpgd_0th`` and ``dpgd_0th_minibatch`` (Alg. 1);
* estimator ``zo_two_point_vector`` (the vector two-point estimate of Alg. 1; DPZero itself uses the
  baseline's ``zo_two_point`` with the generic ``gaussian`` privatizer and ``directional_sgd``);
* accountant ``kov_advanced_composition`` (Lemma 2.2, closed form);
* objectives ``causal_lm_prompt`` (OPT) and ``masked_lm_prompt`` (RoBERTa);
* :mod:`dpreg_dpzero.theory`: the parameter choices of Theorems 1–3;
* :mod:`dpreg_dpzero.synthetic`: a vectorised simulator of the §5.1 quadratic experiment.
"""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "objective": {
        "causal_lm_prompt": "dpreg_dpzero.objectives:CausalLMPrompt",
        "masked_lm_prompt": "dpreg_dpzero.objectives:MaskedLMPrompt",
    },
    "estimator": {
        "zo_two_point_vector": "dpreg_dpzero.estimators:ZOTwoPointVector",
    },
    "accountant": {
        "kov_advanced_composition": "dpreg_dpzero.accountant:KovAdvancedComposition",
    },
    "algorithm": {
        "dpgd_0th": "dpreg_dpzero.algorithms:DPGD0th",
        "dpgd_0th_minibatch": "dpreg_dpzero.algorithms:DPGD0thMinibatch",
        "dpzero": "dpreg_dpzero.algorithms:DPZero",
        "dpzero_full_batch": "dpreg_dpzero.algorithms:DPZeroFullBatch",
    },
})
