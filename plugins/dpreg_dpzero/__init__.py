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

from .accountant import KovAdvancedComposition
from .algorithms import ALGORITHMS
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES

plugin = StagePlugin(*OBJECTIVES, *ESTIMATORS, KovAdvancedComposition, *ALGORITHMS)
