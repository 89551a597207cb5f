"""Presets for the baseline algorithms. Each fixes default stages; recipes override any of them."""

from __future__ import annotations

from dpregistry import Algorithm


class Standard(Algorithm):
    """The standard private step with no preset: the recipe names every stage."""

    name = "standard"


class DPSGD(Algorithm):
    """DP-SGD (Abadi et al. 2016): per-example clipping, Gaussian noise, Poisson sampling, RDP."""

    name = "dp_sgd"
    defaults = {
        "sampler": {"name": "poisson", "batch_size": 64},
        "estimator": {"name": "per_example_grad"},
        "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto"},
        "update": {"name": "sgd", "lr": 0.1},
        "accountant": {"name": "rdp"},
    }


class DPAdam(Algorithm):
    """DP-Adam: DP-SGD's privatized gradient fed to Adam (DP-GRAPE paper, Alg. 3)."""

    name = "dp_adam"
    defaults = {**DPSGD.defaults, "update": {"name": "adam", "lr": 1e-3}}


class MeZO(Algorithm):
    """MeZO / ZO-SGD (non-private): two forward passes on a seeded direction, no clipping, no noise."""

    name = "mezo"
    defaults = {
        "sampler": {"name": "shuffle", "batch_size": 16},
        "estimator": {"name": "zo_two_point", "lambda": 1e-3},
        "privatizer": {"name": "none"},
        "update": {"name": "directional_sgd", "lr": 1e-6},
        "accountant": {"name": "rdp"},
    }


ALGORITHMS = (Standard, DPSGD, DPAdam, MeZO)
