"""Stream privatizers: the tree mechanism, KLT's i.i.d.-noise prefix sum, and a per-step Gaussian.

The two stream privatizers take INCREMENTS and own the running sum, so variance reduction and
noise are one summation (spec 001 §4 coupling 1, spec 002 §4 contract): the tree releases
Σ inc + TREE(p) (ZTC Alg. 4–5, KLT Alg. 3/5); ``iid_prefix`` releases g̃_t = g̃_{t−1} + inc_t + χ_t
(KLT Alg. 4). The algorithm calls ``reset()`` at every period start.

Sensitivity (replace-one, every history): a period's stream elements read disjoint batches; the
differing record changes one element, by at most 2R/B where R is the estimator's public
per-example bound (spec 001 §2.2, spec 002 §2.2). So every element has sensitivity
s = max(2R_fresh/B1, 2R_vr(2D)/B2), and a period of the tree is one Gaussian mechanism of
sensitivity s·sqrt(⌊log2 Σ⌋ + 1) (spec 001 §2.3–2.4, with the exact node count). The bounds R
are the estimator's :class:`~dpreg_nonsmooth.exchange.OracleBounds`; the batches, the period and
its clock the algorithm's :class:`~dpreg_nonsmooth.exchange.O2NCSchedule`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from dpregistry import Budget, ClippedSum, Privatizer, Release, StageParams, UserError
from dpregistry.clipping import clip_weights
from dpregistry.privacy.events import Gaussian, TreeAggregation
from dpregistry.spaces import DENSE, GRADIENT, INCREMENT, DenseAggregate

from .accounting import ConcentrationFailure
from .exchange import O2NCSchedule, OracleBounds
from .points import FlatView
from .tree import TreeStack, nodes_per_record


class StreamParams(StageParams):
    noise_multiplier: float | Literal["auto"] = Field(
        default="auto", description="node std ÷ element sensitivity s; auto: calibrated to the budget")


class BoundedPrivatizer(Privatizer):
    """Shared: sensitivities from the estimator's public bounds, which clipping enforces."""

    accepts = frozenset({DENSE})
    Params = StreamParams
    needs = (O2NCSchedule, OracleBounds)

    @property
    def calibrates(self) -> bool:
        return self.cfg.noise_multiplier == "auto"

    def setup(self, ctx):
        z = self.cfg.noise_multiplier
        self.noise_multiplier = None if z == "auto" else float(z)
        self.view = FlatView(ctx.params)
        self.settings = ctx.need(O2NCSchedule)
        self._sens: dict[str, float] | None = None
        self._info: dict = {}

    def validate(self, ctx):
        if self.noise_multiplier is not None and self.noise_multiplier < 0:
            raise UserError("noise_multiplier must be >= 0", key="privatizer.noise_multiplier")
        self._sens = self._sensitivities(ctx.need(OracleBounds))

    # -- sensitivities ---------------------------------------------------------------------------

    def sensitivities(self) -> dict[str, float]:
        """Element sensitivities of the mean (2R/B, replace-one) and failure probabilities.

        Constants of the run (public bounds at the worst gap 2D), computed once the estimator's
        bounds exist (in ``validate``: every stage is set up by then)."""
        if self._sens is None:
            raise RuntimeError(f"privatizer {self.name!r}: the sensitivities are known once it is validated")
        return self._sens

    def _sensitivities(self, bounds: OracleBounds) -> dict[str, float]:
        # A high-probability bound must hold for the differing record of BOTH neighbouring data sets
        # (the directions are shared, every other slot cancels): conditioning on the directions,
        # P(bad) ≤ 2γ for the estimator's per-record γ, and the pair is (ε, δ + 2γ)-close.
        s = self.settings
        r_f, g_f = bounds.fresh
        out = {"fresh": 2 * r_f / s.batch_first, "gamma_fresh": 2 * g_f, "vr": 0.0, "gamma_vr": 0.0}
        if bounds.increment is not None:  # Σ > 1 and an increment oracle
            r_v, g_v = bounds.increment
            out.update(vr=2 * r_v / s.batch_rest, gamma_vr=2 * g_v)
        return out

    def stream_events(self, noise_multiplier: float, ctx, p: int) -> list:
        """The events of the release at period position ``p`` (planning and release use the same).
        They may differ between a period's start (p = 1) and its other steps, not among those
        (the plan is computed in closed form from p = 1 and p = 2)."""
        raise NotImplementedError

    def planned_events(self, noise_multiplier, ctx):
        return self.stream_events(noise_multiplier, ctx, 1)

    def prepaid(self, ctx):
        """A stream whose later steps have no events was charged whole at its period's start (a
        tree; a single pass's disjoint batches, one partition)."""
        _, p = self.settings.position(ctx.step)
        return p != 1 and not self.stream_events(self.noise_multiplier or 0.0, ctx, p)

    def noise_second_moment(self) -> float:
        """max_p E‖noise of the release at p‖² (for the step size)."""
        raise NotImplementedError

    # -- clipping --------------------------------------------------------------------------------

    def clip_sum(self, contribution):
        info = contribution.info
        if "bound" not in info:
            raise RuntimeError(f"privatizer {self.name!r} needs contributions with a public bound")
        bound = clip = float(info["bound"])
        # Paper mode clips at the bound too: where the theory holds (an L-Lipschitz objective, the
        # concentration event) no norm exceeds it and the weights are exactly 1, so the run is the
        # paper's bit for bit; where it fails (a record outside the declared domain: 10 × the
        # sensitivity in a review) the sensitivity still holds. Its δ_fail stays charged.
        # clip_and_sum's rule (NaN/inf rows are dropped, never clipped), with the norms computed once
        norms = contribution.norms()
        finite = torch.isfinite(norms)
        losses = contribution.losses
        if losses is not None and losses.numel():
            finite &= torch.isfinite(losses.to(norms.device))
        agg = contribution.weighted_sum(clip_weights(norms, clip, finite))
        over = finite & (norms > bound * (1 + 1e-6))
        self._info = dict(info, exceeded=int(over.sum()))
        loss_sum = float(losses[finite].sum()) if losses is not None and losses.numel() else 0.0
        return ClippedSum(agg, count=int(norms.numel()), clipped=int(over.sum()),
                          nonfinite=int((~finite).sum()), loss_sum=loss_sum, kind=contribution.kind)

    def _mean(self, total, ctx) -> torch.Tensor:
        """The clipped sum as a flat mean [..., d]; leading axes (a stack of independent trials,
        as an audit releases them) are kept, and noise is drawn for every entry."""
        agg = total.aggregate.lift({n: None for n in self.view.names})
        first, shape = agg[self.view.names[0]], self.view.shapes[0]
        lead = first.shape[:first.dim() - len(shape)]
        return torch.cat([agg[n].reshape(*lead, -1) for n in self.view.names], -1).to(self.view.dtype) / \
            ctx.expected_batch_size()

    def _release(self, flat: torch.Tensor, events, std: float) -> Release:
        agg = DenseAggregate({n: t.clone() for n, t in self.view.unflatten(flat).items()})
        stats = {"noise_std": std, "bound": float(self._info.get("bound", 0.0)),
                 "bound_exceeded": float(self._info.get("exceeded", 0))}
        return Release(agg, events, kind=GRADIENT, stats=stats)


# ------------------------------------------------------------------------------------------------
# the tree mechanism
# ------------------------------------------------------------------------------------------------


class TreeParams(StreamParams):
    calibration: Literal["accountant", "klt_prop25"] = Field(
        default="accountant", description="accountant: the smallest σ whose exact plan fits the budget; "
                                          "klt_prop25: KLT Prop. 2.5, σ = 4s·sqrt(log2 Σ·ln(1/δ))/ε")


class TreeAggregationPrivatizer(BoundedPrivatizer):
    """Binary tree mechanism over increments: one fresh Gaussian per node, O(log Σ) state, reset per period."""

    name = "tree_aggregation"
    accepts_kinds = frozenset({INCREMENT})
    Params = TreeParams
    needs = BoundedPrivatizer.needs + (Budget,)
    #: the binary mechanism's O(log Σ) stack of node sums (its fields are the checkpointed state)
    State = TreeStack

    @property
    def calibrates(self) -> bool:
        return super().calibrates and self.cfg.calibration != "klt_prop25"

    def validate(self, ctx):
        super().validate(ctx)
        if not self.settings.single_pass:
            # with reused data a record is in every increment, and a node's sensitivity is the SUM
            # of its elements' (not the max): the tree analysis of spec 001 §2.3 does not apply
            raise UserError("tree_aggregation needs single-pass data (sampler single_pass); for full-batch "
                            "multi-pass runs use iid_prefix (KLT Alg. 4)", key="privatizer")
        if self.cfg.calibration == "klt_prop25":
            if self.cfg.noise_multiplier != "auto":
                raise UserError("calibration: klt_prop25 sets the noise itself; leave noise_multiplier: auto",
                                key="privatizer.calibration")
            self.noise_multiplier = self.prop25_multiplier(ctx.need(Budget))

    def element_sensitivity(self) -> float:
        s = self.sensitivities()
        return max(s["fresh"], s["vr"])

    def nodes(self) -> int:
        return nodes_per_record(self.settings.period)  # ⌊log2 Σ⌋ + 1 (spec 001 §2.4 erratum)

    def prop25_multiplier(self, budget: Budget) -> float:
        """σ/s of KLT Prop. 2.5 with log2 for the depth and ln for δ ([AMBIG-6]); δ excludes δ_fail.

        The exact plan still has to fit the budget: at Σ = 1 (log2 Σ = 0) it gives σ = 0 and the
        run is refused, as it must be."""
        b = budget
        if b.epsilon is None or b.delta is None:
            raise UserError("calibration: klt_prop25 needs privacy.epsilon and privacy.delta", key="privacy")
        s = self.sensitivities()
        gamma = max(s["gamma_fresh"], s["gamma_vr"])
        if gamma >= b.delta:
            raise UserError(f"δ_fail = {gamma:g} leaves nothing of δ = {b.delta:g}", key="estimator.delta_fail")
        return 4 * math.sqrt(math.log2(self.settings.period) * math.log(1 / (b.delta - gamma))) / b.epsilon

    def stream_events(self, noise_multiplier, ctx, p):
        if p != 1:
            return []  # the whole period is charged at its first step
        s = self.sensitivities()
        sens = max(s["fresh"], s["vr"])
        events = [TreeAggregation(std=noise_multiplier * sens, sensitivity=sens, nodes_per_record=self.nodes())]
        gamma = max(s["gamma_fresh"], s["gamma_vr"])  # a record is used at one step of the period
        if gamma > 0:
            events.append(ConcentrationFailure(gamma))
        return events

    def noise_second_moment(self):
        sigma = (self.noise_multiplier or 0.0) * self.element_sensitivity()
        return self.view.dim * sigma ** 2 * self.nodes()  # popcount(p) ≤ ⌊log2 Σ⌋ + 1

    def reset(self):
        self.state.reset()

    def release(self, total, ctx, *, std=None):
        _, p = self.settings.position(ctx.step)
        stack = self.state
        if stack.t + 1 != p:  # the tree and the VR sum must restart on the same clock
            raise RuntimeError(f"tree position {stack.t + 1} != period position {p}: a reset was missed")
        sens = self.element_sensitivity()
        z = self.noise_multiplier if std is None else std / sens  # the planned z, bit for bit
        std = z * sens
        inc = self._mean(total, ctx)
        source = ctx.noise()
        out = stack.push(inc, lambda shape: source.randn(shape, dtype=inc.dtype, device=inc.device).mul_(std)
                         if std > 0 else torch.zeros(shape, dtype=inc.dtype, device=inc.device))
        return self._release(out, self.stream_events(z, ctx, p), std)


# ------------------------------------------------------------------------------------------------
# KLT Alg. 4: i.i.d. noise on the running sum
# ------------------------------------------------------------------------------------------------


class IidPrefixParams(StreamParams):
    fresh_share: float = Field(default=0.5, gt=0, lt=1,
                               description="fraction of the budget (ρ) spent on the fresh releases")


class IidPrefix(BoundedPrivatizer):
    """KLT Alg. 4: g̃_t = g̃_(t−1) + inc_t + χ_t with fresh χ_t ~ N(0, σ_p²) every step (σ1 at p = 1, σ2 after)."""

    name = "iid_prefix"
    accepts_kinds = frozenset({INCREMENT})
    Params = IidPrefixParams

    @dataclass
    class State:
        running: torch.Tensor | None = None  # g̃_(t−1), the noisy running sum (None at a period start)

    def validate(self, ctx):
        super().validate(ctx)
        if self.settings.single_pass:
            # its noise and charges assume a record in every step (sequential composition): single-
            # pass data would pay twice what it spends, under a noise multiplier of neither release
            raise UserError("iid_prefix is KLT Alg. 4's privatizer for data reused at every step (sampler "
                            "full_batch); for single-pass data use tree_aggregation or bounded_gaussian",
                            key="privatizer")

    def _counts(self) -> tuple[int, int]:
        T, P = self.settings.total_steps, self.settings.period
        k1 = -(-T // P)
        return k1, T - k1

    def stds(self, noise_multiplier: float) -> tuple[float, float]:
        """σ1 = z·s1·sqrt(K1/f), σ2 = z·s2·sqrt(K2/(1−f)): the run is then exactly 1/(2z²)-zCDP, and
        σ1 ∝ sqrt(T/Σ), σ2 ∝ sqrt(T) as in Thm. 4.1 (spec 002 §2.3)."""
        s = self.sensitivities()
        k1, k2 = self._counts()
        f = self.cfg.fresh_share if k2 else 1.0
        s1 = noise_multiplier * s["fresh"] * math.sqrt(k1 / f)
        s2 = noise_multiplier * s["vr"] * math.sqrt(k2 / (1 - f)) if k2 else 0.0
        return s1, s2

    def stream_events(self, noise_multiplier, ctx, p):
        s = self.sensitivities()
        s1, s2 = self.stds(noise_multiplier)
        if p == 1:
            events, gamma = [Gaussian(std=s1, sensitivity=s["fresh"])], s["gamma_fresh"]
        else:
            events, gamma = [Gaussian(std=s2, sensitivity=s["vr"])], s["gamma_vr"]
        if gamma > 0:  # multi-pass: a record is used at every step, so the γ's add up (spec 002 [AMBIG-11])
            events.append(ConcentrationFailure(gamma))
        return events

    def noise_second_moment(self):
        s1, s2 = self.stds(self.noise_multiplier or 0.0)
        return self.view.dim * (s1 ** 2 + (self.settings.period - 1) * s2 ** 2)

    def reset(self):
        self.state.running = None

    def release(self, total, ctx, *, std=None):
        _, p = self.settings.position(ctx.step)
        running = self.state.running
        if (p == 1) != (running is None):
            raise RuntimeError("iid_prefix: the running sum and the period clock disagree (a reset was missed)")
        s1, s2 = self.stds(self.noise_multiplier)
        sigma = (s1 if p == 1 else s2) if std is None else std
        inc = self._mean(total, ctx)
        noise = ctx.noise().randn(inc.shape, dtype=inc.dtype, device=inc.device).mul_(sigma) if sigma > 0 else 0.0
        running = (inc if running is None else running + inc) + noise  # builds on the NOISY sum
        self.state.running = running
        return self._release(running, self.stream_events(self.noise_multiplier, ctx, p), sigma)


# ------------------------------------------------------------------------------------------------
# a per-step Gaussian for gradient estimates (ZTC App. E)
# ------------------------------------------------------------------------------------------------


class BoundedGaussian(BoundedPrivatizer):
    """Per-step Gaussian on a mean of bounded gradient estimates: std = z·2R/B (ZTC App. E, corrected 2dL/B)."""

    name = "bounded_gaussian"
    accepts_kinds = frozenset({GRADIENT})

    def step_sensitivity(self) -> float:
        """2R/B at the smallest batch of the schedule: every step releases a fresh mean, and under a
        driver with B1 > B2 (ZTC's tree schedule, KLT's) the steps at p > 1 average only B2 records."""
        s = self.settings
        return self.sensitivities()["fresh"] * s.batch_first / min(s.batch_first, s.batch_rest)

    def stream_events(self, noise_multiplier, ctx, p):
        # Single pass: the steps of a period read disjoint batches, so a record meets one of them and
        # the period costs one release (adaptive parallel composition, ZTC Lemma C.1); charged at p = 1.
        if self.settings.single_pass and p != 1:
            return []
        s = self.sensitivities()
        sens = self.step_sensitivity()
        events = [Gaussian(std=noise_multiplier * sens, sensitivity=sens)]
        if s["gamma_fresh"] > 0:
            events.append(ConcentrationFailure(s["gamma_fresh"]))
        return events

    def noise_second_moment(self):
        return self.view.dim * ((self.noise_multiplier or 0.0) * self.step_sensitivity()) ** 2

    def release(self, total, ctx, *, std=None):
        sens = self.step_sensitivity()
        z = self.noise_multiplier if std is None else std / sens
        std = z * sens
        g = self._mean(total, ctx)
        if std > 0:
            g = g + ctx.noise().randn(g.shape, dtype=g.dtype, device=g.device).mul_(std)
        _, p = self.settings.position(ctx.step)
        return self._release(g, self.stream_events(z, ctx, p), std)


PRIVATIZERS = (TreeAggregationPrivatizer, IidPrefix, BoundedGaussian)
