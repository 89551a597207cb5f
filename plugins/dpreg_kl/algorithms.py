"""The three algorithms of "Private optimization under the KL condition" (spec 004) as presets.

Each owns its control flow (``step``): one engine step is one privatized release, so a checkpoint
between any two releases resumes exactly (round/call/phase counters live in each ``State``).
Everything is full batch over the n records (no amplification), stated in ρ-zCDP. Each checks at
validation that the stages it drives are the types whose methods it calls (``isinstance``).

* ``kl_spider`` (Alg. 1): the schedule fixes every charge in advance; ``plan`` precommits the
  worst case (every round runs its T_k steps) and the budget is checked before step 1.
* ``kl_proximal_point`` (Alg. 2 + Alg. 4): T proximal calls of projected noisy GD at ρ/T each.
* ``adaptive_noisy_gd`` (Alg. 3): σ_t comes from a noisy gradient norm, so the accountant must be
  a privacy filter (``adaptive = True``); it charges the σ actually used and owns termination.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch
from pydantic import Field

from dpregistry import Algorithm, Budget, BudgetExhausted, Charge, ClippedSum, StageParams, StepResult, UserError
from dpregistry.privacy.conversions import epsilon_to_zcdp
from dpregistry.privacy.events import Exponential
from dpregistry.spaces import DENSE, GRADIENT, INCREMENT, DenseAggregate

from .common import declared
from .estimators import SpiderFullBatch
from .privatizers import ScheduledGaussian, SpiderGaussian
from .schedules import (AdaptiveConstants, ProximalSchedule, SpiderSchedule, exponential_log_weights, gaussian_cost,
                        selection_epsilon)
from .updates import NormalizedStep, ProxProjectedGD

Auto = Literal["auto"]


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------


def budget_rho(budget: Budget) -> float:
    """The ρ the schedules are built for: privacy.rho, or the ρ whose standard (BS16) conversion
    meets privacy.(epsilon, delta)."""
    if budget.rho is not None:
        return budget.rho
    if budget.epsilon is not None and budget.delta is not None:
        return epsilon_to_zcdp(budget.epsilon, budget.delta)
    raise UserError("the KL algorithms need a budget: privacy.rho, or privacy.epsilon and privacy.delta",
                    key="privacy")


def require_full_batch(stages, alg: str) -> None:
    if stages.sampler.name != "full_batch":
        raise UserError(f"{alg} queries the full batch of n records (its σ's and sensitivities are for "
                        f"means over all n, spec §0); use sampler: full_batch, not {stages.sampler.name!r}",
                        key="sampler")


def resolve(objective, value, key: str) -> float:
    """The recipe's number, or the objective's declared constant where the recipe says auto."""
    return declared(objective, key, f"algorithm.{key}") if value == "auto" else float(value)


def n_params(params) -> int:
    return sum(p.numel() for p in params.values())


def norm_of(agg) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in agg.tensors.values()))


@runtime_checkable
class RhoBudgeted(Protocol):
    """An accountant that budgets in ρ-zCDP (the ``zcdp`` filter): the ρ charged so far and the ρ
    budget, for the last step that spends exactly what is left."""

    def rho(self) -> float: ...

    def budget_rho(self) -> float: ...


def full_indices(stages, ctx) -> torch.Tensor:
    """The full batch, drawn once: objectives cache their record groups for this tensor."""
    return stages.sampler.indices(ctx.at(0))


class KLParams(StageParams):
    gamma: float | Auto = Field(default="auto", description="γ of the (γ, κ)-KL* condition (auto: the objective's)")
    kappa: float | Auto = Field(default="auto", description="κ of the KL* condition (auto: the objective's)")
    f0: float | Auto = Field(default="auto", description="F0 ≥ F(w0) − F* (auto: the objective's public bound)")
    beta: float = Field(default=0.1, gt=0, lt=1, description="failure probability of the utility bound (not δ)")
    calibration: Literal["exact", "paper"] = Field(
        default="exact", description="exact: σ's from the true replace-one sensitivities (spends ≤ ρ); "
                                     "paper: the printed σ formulas (spec §0.1)")


# --------------------------------------------------------------------------------------------
# Algorithm 1: KL-Spider
# --------------------------------------------------------------------------------------------


class SpiderParams(KLParams):
    anchor_share: float | None = Field(
        default=None, gt=0, le=1,
        description="θ, the anchors' share of ρ in exact mode (default: 1 at κ = 2, else 1/2)")


class _Scheduled(Algorithm):
    """A KL algorithm with a precomputed schedule (``self.sched``): it runs until the schedule's
    worst-case number of releases (capped by ``train.steps``), or until its state says it finished."""

    logs_releases = True  # the released estimate's norm and the tests on it

    def total_steps(self, ctx):
        return min(ctx.max_steps, self.sched.worst_case_releases if self.sched else 0)

    def done(self, ctx):
        return self.state.finished or ctx.step >= self.total_steps(ctx)


class KLSpider(_Scheduled):
    """KL-Spider (Alg. 1): rounds of a noisy anchor gradient and noisy SPIDER differences, normalised steps.

    Corrected loop (spec §1.1, [AMBIG-4]): round k releases the anchor v at w, then while
    t < T_k and ‖v‖ ≥ θ_k it steps w ← w − r_k·v/‖v‖ and (unless t has reached T_k, where the query
    would be unused) releases a difference that updates v. A round that ends early (possibly with no
    step) hands its current w to the next round. ``train.steps`` caps the number of releases.
    """

    name = "kl_spider"
    Params = SpiderParams
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {"name": "spider_fullbatch"},
        "privatizer": {"name": "spider_gaussian"},
        "update": {"name": "normalized_step"},
        "accountant": {"name": "zcdp"},
    }

    needs = (Budget,)

    @dataclass
    class State:
        k: int = 0              # the round
        t: int = 0              # steps taken in the round
        fresh: bool = True      # the next release is the round's anchor
        finished: bool = False
        clipped: int = 0        # clip activations so far (a diagnostic)

    def setup(self, ctx):
        self.sched: SpiderSchedule | None = None

    def validate(self, ctx):
        stages, cfg = self.stages, self.cfg
        require_full_batch(stages, self.name)
        if not isinstance(stages.privatizer, SpiderGaussian) or not isinstance(stages.estimator, SpiderFullBatch):
            raise UserError("kl_spider needs estimator spider_fullbatch and privatizer spider_gaussian (noise "
                            "on each SPIDER query, the running estimate kept by the privatizer)", key="privatizer")
        if not isinstance(stages.update_rule, NormalizedStep):
            raise UserError("kl_spider precommits every charge; a difference query's sensitivity 2L1·r_k/n is "
                            "fixed in advance only under normalised steps of length r_k (spec §4, coupling 3); "
                            f"use update: normalized_step, not {stages.update_rule.name!r}", key="update")
        kappa = resolve(stages.objective, cfg.kappa, "kappa")
        if not 1.0 <= kappa <= 2.0:
            raise UserError(f"kl_spider needs κ in [1, 2], got {kappa:g} (use kl_proximal_point for κ ≥ 2)",
                            key="algorithm.kappa")
        priv = stages.privatizer
        self.sched = SpiderSchedule(
            n=ctx.n_train, rho=budget_rho(ctx.need(Budget)), d=n_params(ctx.params), beta=cfg.beta,
            f0=resolve(stages.objective, cfg.f0, "f0"), gamma=resolve(stages.objective, cfg.gamma, "gamma"),
            kappa=kappa, lipschitz=priv.clip, smoothness=priv.smoothness, calibration=cfg.calibration,
            anchor_share=cfg.anchor_share, relation=ctx.relation)
        s = self.sched
        if cfg.calibration == "exact" and s.share >= 1 and s.K and int(s.max_differences.max()) > 0:
            raise UserError("anchor_share = 1 leaves no budget for the difference queries this κ needs",
                            key="algorithm.anchor_share")
        if cfg.calibration == "paper":
            true = sum(s.planned_costs())
            if true > s.rho * (1 + 1e-12):
                msg = (f"calibration: paper uses the paper's σ formulas, whose true {ctx.relation.replace('_', '-')} "
                       f"cost is {true / s.rho:.4g}ρ, not ρ (the paper's Δ = L0/n convention, spec §0.1 and "
                       "[AMBIG-5]); use calibration: exact")
                if stages.accountant.notion == "zcdp":
                    raise UserError(msg, key="algorithm.calibration")
                warnings.warn(msg, stacklevel=2)
        if not s.K:
            self.state.finished = True  # K ≤ 0: return w0 with no spend (spec §1.1 [REC])
        self.idx = full_indices(stages, ctx)

    def anchor_event(self):
        return self.stages.privatizer.event(self.sched.sigma_hat * self.sched.n)

    def difference_event(self, k: int):
        priv = self.stages.privatizer
        return priv.event(float(self.sched.sigma[k]) * self.sched.n, priv.increment_clip(float(self.sched.r[k])))

    def plan(self, ctx, noise_multiplier):
        """Every remaining charge in the worst case (each round runs its T_k steps)."""
        s, st = self.sched, self.state
        if st.finished or not s.K:
            return []
        out = []
        anchors = s.K - st.k - (0 if st.fresh else 1)
        if anchors:
            out.append(Charge(self.anchor_event(), count=anchors))
        for k in range(st.k, s.K):
            m = int(s.max_differences[k])
            if k == st.k and not st.fresh:
                m = int(s.T[k]) - st.t  # differences still to come in the current round
            if m > 0:
                out.append(Charge(self.difference_event(k), count=m))
        return out

    def step(self, run):
        ctx, s, st = run.ctx, self.sched, self.state
        k, n = st.k, ctx.n_train
        if st.fresh:
            run.estimator.reset()
            run.privatizer.reset()
        std = (s.sigma_hat if st.fresh else float(s.sigma[k])) * n
        total = run.privatize_batch(self.idx)
        if total.kind != (GRADIENT if st.fresh else INCREMENT):
            raise RuntimeError("the SPIDER estimator and the controller disagree on the query type")
        release = run.privatizer.release(total, ctx, std=std)
        run.charge(release.events)
        st.fresh = False
        st.clipped += total.clipped
        v_norm = norm_of(release.value)
        theta, T_k = float(s.theta[k]), int(s.T[k])
        moved = v_norm >= theta and st.t < T_k
        if moved:
            run.update_rule.set_length(float(s.r[k]))  # a NormalizedStep (validate checked it)
            run.update_rule.apply(ctx.params, release, ctx)
            st.t += 1
        metrics = {"round": k + 1, "round_steps": st.t, "v_norm": v_norm, "threshold": theta,
                   "noise_std": std / n, "moved": float(moved), "clip_activations": st.clipped}
        if not moved or st.t >= T_k:
            st.k, st.t, st.fresh = k + 1, 0, True
            st.finished = st.k >= s.K
        return StepResult(metrics, done=st.finished)


# --------------------------------------------------------------------------------------------
# Algorithm 2: private proximal point (inner: Algorithm 4)
# --------------------------------------------------------------------------------------------


class ProximalParams(KLParams):
    weak_convexity: float | Auto = Field(
        default="auto", description="L̃1: F + (L̃1/2)‖·‖² is convex; each call adds L̃1‖w − w_{t−1}‖² (any L̃1 > 0 "
                                    "for a convex F)")
    max_inner_steps: int | None = Field(
        default=None, ge=2, description="cap on Alg. 4's T_A (privacy unchanged; Lemma 3's utility bound then void)")


class KLProximalPoint(_Scheduled):
    """Private proximal point (Alg. 2) for κ ≥ 2, weakly convex: T calls of projected noisy GD (Alg. 4).

    Call t minimises F + L̃1‖w − w_{t−1}‖² by Alg. 4 under budget ρ/T: u_1 = w_{t−1}, T_A − 1 noisy
    projected steps with η_j = 1/(L̃1 j) onto B_R(w_{t−1}), R = L0/(2L̃1), and w_t the weighted
    average 2/(T_A(T_A+1)) Σ j·u_j. With ``max_inner_steps`` T_A is capped: the noise is then set
    for the capped number of queries (each call still costs ≤ ρ/T, so the run stays ρ-zCDP), but
    Theorem 2's rate, which needs the full T_A = ⌈n²ρ_A ln²(2/β_A)/d⌉, is no longer guaranteed.
    """

    name = "kl_proximal_point"
    Params = ProximalParams
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {"name": "kl_fullbatch_grad"},
        "privatizer": {"name": "scheduled_gaussian"},
        "update": {"name": "prox_projected_gd"},
        "accountant": {"name": "zcdp"},
    }

    needs = (Budget,)

    @dataclass
    class State:
        t: int = 0              # proximal calls completed
        started: bool = False   # a call is in progress (the update rule holds its centre)
        finished: bool = False

    def setup(self, ctx):
        self.sched: ProximalSchedule | None = None

    def validate(self, ctx):
        stages, cfg = self.stages, self.cfg
        require_full_batch(stages, self.name)
        if not isinstance(stages.privatizer, ScheduledGaussian) or isinstance(stages.privatizer, SpiderGaussian):
            raise UserError("kl_proximal_point sets the noise per call: use privatizer scheduled_gaussian",
                            key="privatizer")
        if not isinstance(stages.update_rule, ProxProjectedGD):
            raise UserError("kl_proximal_point runs Alg. 4: use update prox_projected_gd", key="update")
        if stages.estimator.space != DENSE or stages.estimator.contribution_kind != GRADIENT:
            raise UserError("kl_proximal_point needs dense gradient estimates (estimator kl_fullbatch_grad)",
                            key="estimator")
        kappa = resolve(stages.objective, cfg.kappa, "kappa")
        if kappa < 2:
            raise UserError(f"kl_proximal_point needs κ ≥ 2, got {kappa:g} (use kl_spider for κ ≤ 2)",
                            key="algorithm.kappa")
        lt = resolve(stages.objective, cfg.weak_convexity, "weak_convexity")
        if not lt > 0:
            raise UserError("the objective is convex, so any weak-convexity constant L̃1 > 0 is valid; "
                            "give algorithm.weak_convexity (the strength of the proximal term)",
                            key="algorithm.weak_convexity")
        self.sched = ProximalSchedule(
            n=ctx.n_train, rho=budget_rho(ctx.need(Budget)), d=n_params(ctx.params), beta=cfg.beta,
            f0=resolve(stages.objective, cfg.f0, "f0"), gamma=resolve(stages.objective, cfg.gamma, "gamma"),
            kappa=kappa, lipschitz=stages.privatizer.clip, weak_convexity=lt, calibration=cfg.calibration,
            max_inner_steps=cfg.max_inner_steps, relation=ctx.relation)
        if self.sched.T == 0 or self.sched.T_A < 2:
            self.state.finished = True
        self.idx = full_indices(stages, ctx)

    def event(self):
        return self.stages.privatizer.event(self.sched.sigma * self.sched.n)

    def plan(self, ctx, noise_multiplier):
        s, st = self.sched, self.state
        if st.finished:
            return []
        left = (s.T - st.t) * (s.T_A - 1) - ((self.stages.update_rule.j - 1) if st.started else 0)
        return [Charge(self.event(), count=left)] if left > 0 else []

    def step(self, run):
        ctx, s, st = run.ctx, self.sched, self.state
        upd = run.update_rule  # a ProxProjectedGD (validate checked it)
        if not st.started:
            upd.begin(ctx.params, s.weak_convexity, s.radius)
            st.started = True
        total = run.privatize_batch(self.idx)
        release = run.privatizer.release(total, ctx, std=s.sigma * ctx.n_train)
        run.charge(release.events)
        upd.apply(ctx.params, release, ctx)
        metrics = {"call": st.t + 1, "inner_step": upd.j - 1, "noise_std": s.sigma}
        if upd.j >= s.T_A:
            with torch.no_grad():
                for k, w in upd.average().items():
                    ctx.params[k].copy_(w)
            st.t += 1
            st.started = False
            st.finished = st.t >= s.T
        return StepResult(metrics, done=st.finished)


# --------------------------------------------------------------------------------------------
# Algorithm 3: adaptive noisy GD with a privacy filter (and the 3-SP output selection)
# --------------------------------------------------------------------------------------------


class AdaptiveParams(StageParams):
    beta: float = Field(default=0.1, gt=0, lt=1, description="failure probability (sets ℓ = ln(n√ρ/β))")
    select: Literal["last", "exponential"] = Field(
        default="last", description="output: the last iterate, or one chosen by the exponential mechanism (3-SP)")
    selection_share: float = Field(default=1 / 3, gt=0, lt=1,
                                   description="share of ρ kept for the exponential mechanism (select: exponential)")
    stop_on_floor: bool = Field(default=False, description="stop after the first step whose σ_t is the floor σ_min")
    clamp_last: bool = Field(
        default=True, description="when the filter cannot afford σ_t, take one last step at the σ that spends exactly "
                                  "the rest of ρ, if that is at most 2σ_t (spec §2 'clamp_last'); else stop")


class AdaptiveNoisyGD(Algorithm):
    """Adaptive noisy GD (Alg. 3): a noisy gradient norm N_t sets σ_t; a zCDP filter owns termination.

    Each step releases N_t = ‖ḡ_t‖ + N(0, σ̂²) (a scalar; ḡ_t the clipped mean in the estimator's
    space) and then ḡ_t + N(0, σ_t² I) with σ_t = max{N_t/√(dℓ), σ_min}, d the number of noised
    coordinates. Both charges are the true costs of the σ's used (never the paper's closed form,
    which under-charges when N_t ≤ 0; spec §1.3). The filter refuses the first charge that does
    not fit and the run stops (fully adaptive composition: the total never exceeds ρ, and every
    step costs at least the norm query's 2√ρ/n, so T ≤ n√ρ/2). ``select: exponential`` keeps a share
    of ρ for the exponential mechanism over the iterates (Theorem 5), charged ε²/8 (bounded range).
    """

    name = "adaptive_noisy_gd"
    adaptive = True
    logs_releases = True  # the released noisy norm and the σ chosen from it
    Params = AdaptiveParams
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {"name": "kl_fullbatch_grad"},
        "privatizer": {"name": "scheduled_gaussian"},
        "update": {"name": "sgd", "lr": 0.5},
        "accountant": {"name": "zcdp"},
    }

    needs = (Budget,)

    @dataclass
    class State:
        t: int = 0                  # descent steps taken
        phase: str = "descend"      # "descend", "select" (the exponential mechanism is next) or "done"
        #: the released iterates w_0, w_1, ... (select: exponential; post-processing of releases)
        trajectory: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def setup(self, ctx):
        self.consts: AdaptiveConstants | None = None

    def validate(self, ctx):
        stages = self.stages
        require_full_batch(stages, self.name)
        if not isinstance(stages.privatizer, ScheduledGaussian) or isinstance(stages.privatizer, SpiderGaussian):
            raise UserError("adaptive_noisy_gd sets σ_t per step: use privatizer scheduled_gaussian", key="privatizer")
        if stages.estimator.contribution_kind != GRADIENT:
            raise UserError("adaptive_noisy_gd needs gradient estimates, not increments", key="estimator")
        if self.cfg.select == "exponential" and stages.estimator.space != DENSE:
            raise UserError(
                f"select: exponential scores each iterate by the exact norm of its clipped full-batch gradient "
                f"(Theorem 5); estimator {stages.estimator.name!r} yields {stages.estimator.space} estimates, whose "
                f"norm is not a gradient norm, so the selection would have no stationarity meaning; use select: last "
                f"or a dense first-order estimator", key="algorithm.select")
        rho = budget_rho(ctx.need(Budget))
        self.rho_select = rho * self.cfg.selection_share if self.cfg.select == "exponential" else 0.0
        self.consts = AdaptiveConstants(n=ctx.n_train, rho=rho - self.rho_select, beta=self.cfg.beta,
                                        lipschitz=stages.privatizer.clip, relation=ctx.relation)
        self.idx = full_indices(stages, ctx)

    @property
    def selection_event(self) -> Exponential:
        return Exponential(epsilon=selection_epsilon(self.rho_select), bounded_range=True)

    def total_steps(self, ctx):
        cap = self.consts.max_steps + (1 if self.cfg.select == "exponential" else 0) if self.consts else 0
        return min(ctx.max_steps, cap)

    def done(self, ctx):
        return self.state.phase == "done" or ctx.step >= self.total_steps(ctx)

    def plan(self, ctx, noise_multiplier):
        return []  # adaptive: the filter guards the budget

    # -- the step, and its parts (called only from it, so they see the run) ----------------------

    def _fits(self, run, event) -> bool:
        """Whether the filter affords ``event`` (with the selection's share still reserved)."""
        charges = run.sampler.account(run.ctx.step, [event], run.ctx)
        if self.cfg.select == "exponential":
            charges = charges + [Charge(self.selection_event)]
        return run.accountant.can_afford(charges)

    def _clamped_sigma(self, run, sigma: float) -> float | None:
        """The σ' whose cost Δ²/(2σ'²) is exactly the filter's remaining ρ (less the selection's
        share), if σ' ≤ 2σ_t: one last, slightly noisier step instead of stopping with budget left.
        σ' depends only on the ledger and N_t, so the filter argument is unchanged."""
        acc = run.accountant
        if not self.cfg.clamp_last or not isinstance(acc, RhoBudgeted):
            return None
        remaining = acc.budget_rho() - acc.rho() - self.rho_select
        if not remaining > 0:
            return None
        clamped = run.privatizer.sensitivity() / math.sqrt(2.0 * remaining) / run.ctx.n_train * (1 + 1e-9)
        if clamped > 2.0 * sigma or not self._fits(run, run.privatizer.event(clamped * run.ctx.n_train)):
            return None
        return clamped

    def step(self, run):
        ctx, st = run.ctx, self.state
        selecting = self.cfg.select == "exponential"
        if selecting and not st.trajectory:
            st.trajectory.append({k: v.detach().clone() for k, v in ctx.params.items()})
        # the last step train.steps allows is the selection, so 3-SP's output never falls back to w_T
        if st.phase == "select" or (selecting and ctx.step + 1 >= self.total_steps(ctx)):
            return self._select(run)
        c, priv, n = self.consts, run.privatizer, ctx.n_train
        total = run.privatize_batch(self.idx)
        dim = total.aggregate.numel
        # the scalar norm query: |‖S‖ − ‖S′‖| ≤ ‖S − S′‖, so it has the clipped sum's sensitivity
        norm_sum = ClippedSum(DenseAggregate({"norm": torch.tensor([norm_of(total.aggregate)], dtype=torch.float64)}),
                              count=total.count, kind=GRADIENT)
        if not self._fits(run, priv.event(c.sigma_norm * n)):
            ctx.undo_displacement()
            return self._select(run)
        r_norm = priv.release(norm_sum, ctx, std=c.sigma_norm * n)
        run.charge(r_norm.events)
        noisy_norm = float(r_norm.value.tensors["norm"])
        sigma = c.sigma_t(noisy_norm, dim)  # from N_t only, never from the exact norm
        clamped = False
        if not self._fits(run, priv.event(sigma * n)):
            last = self._clamped_sigma(run, sigma)
            if last is None:
                ctx.undo_displacement()
                return self._select(run)
            sigma, clamped = last, True
        release = priv.release(total, ctx, std=sigma * n)
        run.charge(release.events)
        run.update_rule.apply(ctx.params, release, ctx)
        st.t += 1
        floor = sigma == c.sigma_min
        if selecting:
            st.trajectory.append({k: v.detach().clone() for k, v in ctx.params.items()})
        metrics = {"noisy_norm": noisy_norm, "sigma": sigma, "at_floor": float(floor), "clamped": float(clamped),
                   "step_cost": c.step_cost(sigma), "clipped_fraction": total.clipped / max(total.count, 1)}
        if clamped or (floor and self.cfg.stop_on_floor):  # stop_on_floor: Lemma 11 made exact (spec §1.3)
            st.phase = "select" if selecting else "done"
        return StepResult(metrics, done=st.phase == "done")

    def _select(self, run):
        """Theorem 5: t* ∝ exp(−ε‖ḡ(w_t)‖/(2Δu)) over the released iterates, charged ε²/8."""
        ctx, st = run.ctx, self.state
        if self.cfg.select != "exponential":
            raise BudgetExhausted(f"the filter cannot afford step {ctx.step} (ρ left: less than its cost)")
        saved = {k: v.detach().clone() for k, v in ctx.params.items()}
        norms = []
        with torch.no_grad():
            for w in st.trajectory:
                for k, v in w.items():
                    ctx.params[k].copy_(v)
                norms.append(norm_of(run.privatize_batch(self.idx).aggregate) / ctx.n_train)
            for k, v in saved.items():
                ctx.params[k].copy_(v)
        event = self.selection_event
        log_p = exponential_log_weights(norms, event.epsilon, run.privatizer.sensitivity() / ctx.n_train)
        u = float(ctx.rng.secret("select_iterate", ctx.step).uniform(1))
        chosen = int(min(np.searchsorted(np.cumsum(np.exp(log_p)), u, side="right"), len(norms) - 1))
        run.charge([event])
        with torch.no_grad():
            for k, v in st.trajectory[chosen].items():
                ctx.params[k].copy_(v)
        st.phase = "done"
        return StepResult({"selected_iterate": chosen, "candidates": len(norms)}, done=True)

    # Custom serialisation of one field: the iterates are stacked into one tensor per parameter, not
    # written as one tensor per iterate (a run keeps up to n√ρ/2 of them: a checkpoint entry each).
    def state_dict(self):
        out = super().state_dict()
        traj = out.pop("trajectory")
        if traj:  # released iterates (post-processing), stacked per parameter
            out["trajectory"] = {k: torch.stack([w[k] for w in traj]) for k in traj[0]}
        return out

    def load_state_dict(self, state):
        state = dict(state)
        traj = state.pop("trajectory", None)
        super().load_state_dict(state)
        self.state.trajectory = [] if not traj else [
            {k: v[i].clone() for k, v in traj.items()} for i in range(len(next(iter(traj.values()))))]


ALGORITHMS = (KLSpider, KLProximalPoint, AdaptiveNoisyGD)

__all__ = ["ALGORITHMS", "budget_rho", "gaussian_cost"]
