"""KLT presets on the O2NC driver (Alg. 2): single-pass ZO (Alg. 3), multi-pass ERM (Alg. 4), first order (Alg. 5).

Alg. 3 and Alg. 4 differ only in the privatizer (spec 002 §4): the tree over increments versus
i.i.d. noise on the running noisy sum. KLT's Δ is never restarted and its averaging window M is
independent of the VR period Σ (spec 002 §4 (a)).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from dpregistry import Budget, StageParams, UserError
from dpregistry.privacy.conversions import zcdp_to_epsilon

from dpreg_nonsmooth import O2NCAlgorithm, O2NCSchedule, is_auto

from .theory import erm_settings, theory_dirs_fo, theory_dirs_zo, theory_period, theory_radius, theory_window


def klt_epsilon(budget) -> float:
    """The ε the theorems are stated at (inf without a budget)."""
    if budget.epsilon is not None:
        return budget.epsilon
    if budget.rho is not None:
        if budget.delta is None:
            raise UserError("KLT's settings are stated in (ε, δ); give privacy.epsilon and privacy.delta "
                            "(or privacy.delta next to privacy.rho)", key="privacy")
        return zcdp_to_epsilon(budget.rho, budget.delta)
    return math.inf


def _int_or(v, default):
    return default if is_auto(v) else v


def _restart(alg: O2NCAlgorithm) -> int | None:
    """KLT never restarts the learner (spec 002 §4 (a)) unless the recipe says how often."""
    v = alg.learner().cfg.restart_every
    return None if v in ("never", "auto") else int(v)


class KLTParams(StageParams):
    init_gap: float = Field(default=1.0, gt=0, description="Φ ≥ F(x₀) − inf F (sets D when auto)")
    vr_period: int | Literal["auto"] = Field(default="auto", description="Σ (auto: Thm 3.1/6.1)")
    max_dirs: int = Field(default=1_000_000, gt=0,
                          description="refuse a theorem m above this (set dirs_per_sample and privacy_mode: clip)")


class KLTSinglePass(O2NCAlgorithm):
    """KLT Alg. 2 + 3 (Thm 3.1): single-pass ZO oracle with variance reduction and the tree mechanism; (ε, δ)-DP."""

    name = "klt_sp_zo"
    Params = KLTParams
    first_order = False
    defaults = {
        "sampler": {"name": "single_pass"},                   # B1 = Σ, B2 = 1
        "estimator": {"name": "zo_sphere", "smooth_radius": 0.05, "lipschitz": 1.0, "dirs_per_sample": "theory",
                      "diff_mode": "independent_central", "privacy_mode": "paper", "delta_fail": "auto"},
        "privatizer": {"name": "tree_aggregation", "noise_multiplier": "auto"},
        "update": {"name": "o2nc", "restart_every": "never"},
        "accountant": {"name": "zcdp_fail"},
    }

    def resolve(self, ctx) -> O2NCSchedule:
        d, n = self.view.dim, ctx.n_train
        oracle, budget = self.smoothing(ctx), ctx.need(Budget)
        alpha, L = oracle.radius, oracle.lipschitz
        eps = klt_epsilon(budget)
        upd = self.learner().cfg
        T0 = max(1, min(ctx.max_steps, n // 2))  # T = Θ(n): about two records per step
        D = upd.radius
        # M = α/(4D) must be ≥ 1, so an auto D is at most α/4 (short runs; spec 002 [AMBIG-13])
        D = min(theory_radius(self.cfg.init_gap, alpha, L, T0, d, eps), alpha / 4) if is_auto(D) else float(D)
        P = _int_or(self.cfg.vr_period, None) or theory_period(alpha, eps, D, d)
        M = _int_or(upd.window, None) or theory_window(alpha, D)
        b1, b2, single = self.batches(ctx, P, 1)
        steps = self.steps_for(ctx, P, b1, b2, single)
        # δ_fail auto: half of δ for the pair of differing records, i.e. γ = δ/4 per record
        gamma = budget.delta / 4 if budget.delta else 0.0
        restart = _restart(self)
        dirs = None
        if oracle.theory_dirs:
            g = gamma if is_auto(oracle.delta_fail) else float(oracle.delta_fail)
            if g <= 0:
                raise UserError("dirs_per_sample: theory needs a failure probability (privacy.delta or "
                                "estimator.delta_fail > 0)", key="estimator.dirs_per_sample")
            dirs = (theory_dirs_fo if self.first_order else theory_dirs_zo)(d, alpha, D, g)
            if dirs > self.cfg.max_dirs:
                raise UserError(f"the theorem's m = {dirs:,} directions per record (d = {d}, α/D = {alpha / D:.0f}) "
                                f"exceeds max_dirs = {self.cfg.max_dirs:,}; set estimator.dirs_per_sample to a "
                                "practical m with privacy_mode: clip (deterministic sensitivity)",
                                key="estimator.dirs_per_sample")
        return O2NCSchedule(dim=d, n=n, period=P, batch_first=b1, batch_rest=b2, radius=D, window=M,
                            restart_every=restart, total_steps=steps, single_pass=single, smooth_radius=alpha,
                            lipschitz=L, dirs=dirs, delta_fail=gamma, extra={"epsilon": eps, "T0": T0})


class KLTFirstOrder(KLTSinglePass):
    """KLT Alg. 2 + 5 (Thm 6.1): single-pass first-order oracle at random points of the α-ball, tree mechanism."""

    name = "klt_sp_fo"
    first_order = True
    defaults = {
        **KLTSinglePass.defaults,
        "estimator": {"name": "fo_ball", "smooth_radius": 0.05, "lipschitz": 1.0, "perturbations_fresh": 1,
                      "dirs_per_sample": "theory", "privacy_mode": "paper", "delta_fail": "auto"},
    }


class KLTErmParams(StageParams):
    init_gap: float = Field(default=1.0, gt=0, description="Φ ≥ F̂(x₀) − inf F̂")
    stat_tol: float = Field(default=0.3, gt=0, description="β, the target Goldstein norm (sets D, T, Σ)")
    d_rule: Literal["balanced", "printed"] = Field(default="balanced", description="spec 002 [AMBIG-9]")
    vr_period: int | Literal["auto"] = Field(default="auto", description="Σ (auto: α/(D√d))")


class KLTMultiPass(O2NCAlgorithm):
    """KLT Alg. 2 + 4 (Thm 4.1): multi-pass ERM, full batch, i.i.d. Gaussian noise on the running VR sum; T-fold composition."""

    name = "klt_mp_zo_erm"
    Params = KLTErmParams
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {"name": "zo_sphere", "smooth_radius": 0.05, "lipschitz": 1.0, "dirs_per_sample": 16,
                      "diff_mode": "independent_central", "privacy_mode": "clip", "delta_fail": "auto"},
        "privatizer": {"name": "iid_prefix", "noise_multiplier": "auto"},
        "update": {"name": "o2nc", "restart_every": "never"},
        "accountant": {"name": "zcdp_fail"},
    }

    def resolve(self, ctx) -> O2NCSchedule:
        d, n = self.view.dim, ctx.n_train
        oracle, budget = self.smoothing(ctx), ctx.need(Budget)
        alpha, L = oracle.radius, oracle.lipschitz
        D_t, T_t, _ = erm_settings(self.cfg.init_gap, alpha, L, self.cfg.stat_tol, d, self.cfg.d_rule)
        upd = self.learner().cfg
        D = D_t if is_auto(upd.radius) else float(upd.radius)
        P = max(1, math.ceil(alpha / (D * math.sqrt(d)))) if is_auto(self.cfg.vr_period) else int(self.cfg.vr_period)
        M = _int_or(upd.window, None) or theory_window(alpha, D)
        b1, b2, single = self.batches(ctx, n, n)
        if single:
            raise UserError(f"algorithm {self.name!r} reads every record at every step (sampler: full_batch)",
                            key="sampler")
        steps = min(ctx.max_steps, T_t)  # Thm 4.1's T, capped by train.steps
        gamma = budget.delta / (4 * steps) if budget.delta else 0.0  # half of δ over T uses, 2 records
        return O2NCSchedule(dim=d, n=n, period=P, batch_first=b1, batch_rest=b2, radius=D, window=M,
                            restart_every=_restart(self), total_steps=steps, single_pass=False, smooth_radius=alpha,
                            lipschitz=L, delta_fail=gamma, extra={"theory_T": T_t})


class KLTMultiPassFO(KLTMultiPass):
    """KLT Alg. 2 + 4 with the first-order oracle (§6 remarks it applies; no theorem is stated for it)."""

    name = "klt_mp_fo_erm"
    defaults = {
        **KLTMultiPass.defaults,
        "estimator": {"name": "fo_ball", "smooth_radius": 0.05, "lipschitz": 1.0, "perturbations_fresh": 1,
                      "dirs_per_sample": 16, "privacy_mode": "clip", "delta_fail": "auto"},
    }


ALGORITHMS = (KLTSinglePass, KLTFirstOrder, KLTMultiPass, KLTMultiPassFO)
