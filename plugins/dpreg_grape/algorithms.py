"""Presets: DP-GRAPE (Alg. 1 with Alg. 2) and naive DP-GaLore (Alg. 5)."""

from __future__ import annotations

from dpregistry import Algorithm


class DPGrape(Algorithm):
    """DP-GRAPE: per-example gradients projected by seeded Gaussian P (r-dim), flat clip, noise in the projected space."""

    name = "dp_grape"
    defaults = {
        "sampler": {"name": "poisson", "batch_size": 64},
        "estimator": {"name": "projected_per_example_grad", "rank": 16, "refresh_every": 100},
        "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto"},
        "update": {"name": "projected_adam", "lr": 1e-4},
        "accountant": {"name": "rdp"},
    }


class DPGaLoreNaive(Algorithm):
    """Naive DP-GaLore: DP-Adam's dense privatized gradient, projected afterwards by its top-r SVD every F steps."""

    name = "dp_galore_naive"
    defaults = {
        "sampler": {"name": "poisson", "batch_size": 64},
        "estimator": {"name": "per_example_grad"},
        "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto"},
        "update": {"name": "galore_adam", "lr": 1e-4, "rank": 16, "refresh_every": 100},
        "accountant": {"name": "rdp"},
    }


ALGORITHMS = (DPGrape, DPGaLoreNaive)
