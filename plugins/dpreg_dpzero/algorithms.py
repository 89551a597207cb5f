"""DPZero (Alg. 2) and DPGD-0th (Alg. 1) presets. Recipes override any stage key.

* ``dpzero``: as run in the paper's experiments (§2.4 of the spec): Poisson mini-batches (what the
  accountant assumes, spec §4.2 caveat 1), Gaussian directions, scalar clip on Δ = (f₊ − f₋)/2λ,
  one scalar noise draw calibrated by RDP (std = 2·m·C/B on the mean, replace-one), directional SGD.
* ``dpzero_full_batch``: Alg. 2 as stated: full batch, sphere directions, Lemma 2.2 noise.
* ``dpgd_0th``: Alg. 1 as stated: the vector Δ_i·u clipped in L2, d-dimensional noise, plain SGD.
* ``dpgd_0th_minibatch``: Alg. 1 with the experiments' sampling and accounting.

The privatizer is the generic ``gaussian`` stage: in the seeded-direction space it clips the
per-example scalars and draws one scalar of noise; in the vector-ZO space it clips vectors and
draws d-dimensional noise (spec §7 coupling 1). The noise comes from the run's secret noise
source, never from the public direction seed (coupling 6).
"""

from __future__ import annotations

from dpregistry import Algorithm

_ZO = {"name": "zo_two_point", "lambda": 1e-3, "direction": "gaussian"}
_NOISE = {"name": "gaussian", "clip": 200.0, "noise_multiplier": "auto"}


class DPZero(Algorithm):
    """DPZero (Zhang et al. 2024, Alg. 2 as run in §5.2): scalar clip + one scalar noise draw, Poisson, RDP."""

    name = "dpzero"
    defaults = {
        "sampler": {"name": "poisson", "batch_size": 64},
        "estimator": dict(_ZO),
        "privatizer": dict(_NOISE),
        "update": {"name": "directional_sgd", "lr": 1e-6},
        "accountant": {"name": "rdp"},
    }


class DPZeroFullBatch(Algorithm):
    """DPZero, Alg. 2 as stated: full batch, sphere directions, Lemma 2.2 (advanced composition) noise."""

    name = "dpzero_full_batch"
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {**_ZO, "direction": "sphere"},
        "privatizer": {**_NOISE, "clip": 1.0},
        "update": {"name": "directional_sgd", "lr": 0.01},
        "accountant": {"name": "kov_advanced_composition"},
    }


class DPGD0th(Algorithm):
    """DPGD-0th (DPZero paper, Alg. 1): the vector Δ_i·u clipped in L2, d-dim noise, full batch, Lemma 2.2."""

    name = "dpgd_0th"
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {"name": "zo_two_point_vector", "lambda": 1e-3, "direction": "sphere"},
        "privatizer": {**_NOISE, "clip": 1.0},
        "update": {"name": "sgd", "lr": 0.01},
        "accountant": {"name": "kov_advanced_composition"},
    }


class DPGD0thMinibatch(Algorithm):
    """DPGD-0th with Poisson mini-batches, Gaussian directions and RDP (the experiments' setting)."""

    name = "dpgd_0th_minibatch"
    defaults = {
        "sampler": {"name": "poisson", "batch_size": 64},
        "estimator": {"name": "zo_two_point_vector", "lambda": 1e-3, "direction": "gaussian"},
        "privatizer": dict(_NOISE),
        "update": {"name": "sgd", "lr": 1e-6},
        "accountant": {"name": "rdp"},
    }


ALGORITHMS = (DPZero, DPZeroFullBatch, DPGD0th, DPGD0thMinibatch)
