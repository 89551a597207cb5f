"""ZTC presets: the variance-reduced tree oracle inside O2NC (Theorem 4.9) and App. E's naive baseline."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from dpregistry import Budget, StageParams, UserError
from dpregistry.privacy.conversions import epsilon_to_zcdp

from dpreg_nonsmooth import O2NCAlgorithm, O2NCSchedule, is_auto

from .theory import naive_T, theory_T


def ztc_rho(budget) -> float:
    """The paper's ρ (ρ²/2-zCDP) of the run's budget; inf without one (a non-private run)."""
    if budget.rho is not None:
        return math.sqrt(2 * budget.rho)
    if budget.epsilon is not None and budget.delta is not None:
        return math.sqrt(2 * epsilon_to_zcdp(budget.epsilon, budget.delta))
    return math.inf


def _learner(alg: O2NCAlgorithm, T: int, delta: float) -> tuple[float, int, int | None]:
    """(D, window, restarts) of the o2nc update rule: the recipe's, or Theorem 4.9's D = δ/T and an
    averaging window and a restart every episode."""
    upd = alg.learner().cfg
    D = delta / T if is_auto(upd.radius) else float(upd.radius)
    M = T if is_auto(upd.window) else int(upd.window)
    v = upd.restart_every
    restart = T if is_auto(v) else None if v == "never" else int(v)
    return D, M, restart


class ZTCParams(StageParams):
    episode_len: int | Literal["auto"] = Field(default="auto", description="T (auto: Theorem 4.9 with the max rule)")
    init_gap: float = Field(default=1.0, gt=0, description="F* ≥ F(x₁) − inf F (sets T when auto)")
    t_rule: Literal["max", "min"] = Field(default="max", description="max (correct) or the printed min (ablation)")


class ZTCTree(O2NCAlgorithm):
    """ZTC (ICLR 2024) Thm 4.9: O2NC with restarts, VR zeroth-order oracle (GRAD + DIFF), tree mechanism; ρ²/2-zCDP."""

    name = "ztc_o2nc_tree"
    Params = ZTCParams
    whole_periods = True  # K = ⌊M/(2T)⌋ whole episodes; leftover records are dropped (spec 001 §1.6)
    defaults = {
        "sampler": {"name": "single_pass"},                 # B1 = T + 1, B2 = 1
        "estimator": {"name": "zo_sphere", "smooth_radius": 0.05, "lipschitz": 1.0,
                      "dirs_per_sample": "dim", "diff_mode": "coupled_one_sided"},
        "privatizer": {"name": "tree_aggregation", "noise_multiplier": "auto"},
        "update": {"name": "o2nc"},                         # D = δ/T, restarts and windows every T
        "accountant": {"name": "zcdp"},
    }

    def resolve(self, ctx) -> O2NCSchedule:
        d, n = self.view.dim, ctx.n_train
        oracle, budget = self.smoothing(ctx), ctx.need(Budget)
        delta, L = oracle.radius, oracle.lipschitz
        T = self.cfg.episode_len
        if is_auto(T):
            T = theory_T(d, L, delta, n, self.cfg.init_gap, ztc_rho(budget), self.cfg.t_rule)
        b1, b2, single = self.batches(ctx, T + 1, 1)
        D, M, restart = _learner(self, T, delta)
        return O2NCSchedule(dim=d, n=n, period=T, batch_first=b1, batch_rest=b2, radius=D, window=M,
                            restart_every=restart, total_steps=self.steps_for(ctx, T, b1, b2, single),
                            single_pass=single, smooth_radius=delta, lipschitz=L,
                            extra={"rho_paper": ztc_rho(budget)})


class ZTCNaiveParams(ZTCParams):
    batch_size: int = Field(default=1, gt=0, description="B: records per step (App. E sets B = 1)")


class ZTCNaive(O2NCAlgorithm):
    """ZTC App. E baseline: O2NC with a fresh one-direction ZO estimate plus Gaussian noise each step (no VR, no tree)."""

    name = "ztc_naive"
    Params = ZTCNaiveParams
    whole_periods = True
    defaults = {
        "sampler": {"name": "single_pass"},
        "estimator": {"name": "zo_sphere_grad", "smooth_radius": 0.05, "lipschitz": 1.0, "dirs_per_sample": 1},
        "privatizer": {"name": "bounded_gaussian", "noise_multiplier": "auto"},
        "update": {"name": "o2nc"},
        "accountant": {"name": "zcdp"},
    }

    def resolve(self, ctx) -> O2NCSchedule:
        d, n = self.view.dim, ctx.n_train
        oracle, budget = self.smoothing(ctx), ctx.need(Budget)
        delta, L = oracle.radius, oracle.lipschitz
        B = self.cfg.batch_size
        T = self.cfg.episode_len
        if is_auto(T):
            T = naive_T(d, L, delta, n, self.cfg.init_gap, ztc_rho(budget), B)
        b1, b2, single = self.batches(ctx, B, B)
        if single and b1 != b2:
            raise UserError("the naive oracle reads the same batch size at every step", key="sampler.batch_first")
        D, M, restart = _learner(self, T, delta)
        # period = episode: its T disjoint batches form one partition, charged once (parallel composition)
        return O2NCSchedule(dim=d, n=n, period=T, batch_first=b1, batch_rest=b2, radius=D, window=M,
                            restart_every=restart, total_steps=self.steps_for(ctx, T, b1, b2, single),
                            single_pass=single, smooth_radius=delta, lipschitz=L, extra={"rho_paper": ztc_rho(budget)})


ALGORITHMS = (ZTCTree, ZTCNaive)
