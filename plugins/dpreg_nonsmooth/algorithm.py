"""The O2NC driver shared by both papers: the period clock, resolved settings, planning.

The algorithm owns the phase clock (spec 002 coupling 1): at the first step of every period
(p = 1, with p = ((t − 1) mod Σ) + 1, spec 002 [AMBIG-3]) it resets the estimator (a fresh
estimate starts the variance-reduced sum) and the privatizer (fresh tree noise, empty prefix
sum). Each paper resolves the numbers the stages share (period, batch schedule, D, window,
restarts, m, δ_fail) into an :class:`~dpreg_nonsmooth.exchange.O2NCSchedule`, with its theorem's
defaults wherever a recipe says ``auto``, before step 1, so the noise can be calibrated to the
sensitivity these numbers imply (spec 001 coupling 3). The sampler, estimator, privatizer and
update rule read the schedule; the algorithm reads the oracle's :class:`Smoothing` and
:class:`OracleBounds` (see :mod:`dpreg_nonsmooth.exchange`).

The algorithm composes a single_pass (or full_batch) sampler, a stream privatizer and the o2nc
update rule, and drives them by their own methods (period resets, the stream's events per
position); the oracle is the part that mixes across papers, and is reached only through what it
provides.
"""

from __future__ import annotations

import math

from dpregistry import Algorithm, Budget, UserError
from dpregistry.stages import Charge, compress

from .exchange import GradientBound, O2NCSchedule, OracleBounds, Smoothing
from .objectives import PointObjective
from .points import FlatView
from .privatizers import BoundedPrivatizer
from .samplers import SinglePass
from .update import O2NC


def is_auto(v) -> bool:
    return isinstance(v, str) and v == "auto"


def data_limit(n: int, period: int, b1: int, b2: int, whole_periods: bool) -> int:
    """The most steps a single pass over n records allows (B1 at each period start, B2 otherwise)."""
    per = b1 + (period - 1) * b2
    k, rem = divmod(n, per)
    if whole_periods or rem < b1:
        return k * period
    return k * period + 1 + min(period - 1, (rem - b1) // b2)  # a partial last period


def _minus(charges: list[Charge], less: list[Charge]) -> list[Charge]:
    """``charges`` less the charges ``less`` (a subset of them: a sum over fewer steps)."""
    left = {(c.event, c.partition): c.count for c in compress(charges)}
    for c in compress(less):
        left[(c.event, c.partition)] -= c.count
    return [Charge(e, p, n) for (e, p), n in left.items() if n]


class O2NCAlgorithm(Algorithm):
    """Base of the O2NC algorithms: period clock, resets, and the plan of a stream's charges."""

    needs = (Smoothing, OracleBounds, Budget)
    provides = (O2NCSchedule, GradientBound)
    #: single-pass runs end when the data is used up at a period boundary (ZTC: K = ⌊M/2T⌋)
    whole_periods = False

    settings: O2NCSchedule | None = None    # resolved in setup
    bounds: OracleBounds | None = None       # the oracle's, read in validate (every stage is set up by then)

    def setup(self, ctx):
        if not isinstance(self.stages.update_rule, O2NC):
            raise UserError(f"algorithm {self.name!r} needs the o2nc update rule, got "
                            f"{self.stages.update_rule.name!r}", key="update.name")
        self.view = FlatView(ctx.params)
        self.settings = self.resolve(ctx)
        s = self.settings
        if s.total_steps <= 0:
            raise UserError(f"the data ({s.n} records) does not fill one step of batch {s.batch_first}",
                            key="sampler")
        if isinstance(self.stages.objective, PointObjective):
            # its held-out metrics then include the Goldstein certificate of the output window's points
            self.stages.objective.certificate_points = self.stages.update_rule.window_points

    def provide(self, kind):
        if kind is O2NCSchedule:
            if self.settings is None:
                raise RuntimeError(f"the O2NC schedule was asked for before algorithm {self.name!r} resolved it "
                                   "in its setup")
            return self.settings
        if kind is GradientBound:
            return GradientBound(self.grad_bound())
        return super().provide(kind)

    # -- what each paper provides -------------------------------------------------------------

    def resolve(self, ctx) -> O2NCSchedule:
        raise NotImplementedError

    # -- shared helpers ------------------------------------------------------------------------

    @staticmethod
    def smoothing(ctx) -> Smoothing:
        """What the oracle declares (its smoothing radius and Lipschitz constant; the theory needs both)."""
        return ctx.need(Smoothing)

    def learner(self) -> O2NC:
        """The o2nc update rule this algorithm composes (checked in setup): its recipe's D, window, restarts."""
        return self.stages.update_rule

    def batches(self, ctx, b1_auto: int, b2_auto: int) -> tuple[int, int, bool]:
        """(B1, B2, single_pass) from the sampler: a batch schedule, or every record every step."""
        n = ctx.n_train
        sampler = self.stages.sampler
        if isinstance(sampler, SinglePass):
            b1, b2 = sampler.batch_sizes(b1_auto, b2_auto)
            return b1, b2, True
        # dpreg_baseline's sampler (a plugin imports no other plugin: it is known by its registered name)
        if sampler.name == "full_batch":
            return n, n, False
        raise UserError(f"algorithm {self.name!r} needs the single_pass sampler (a batch schedule over "
                        f"disjoint data) or full_batch; got {sampler.name!r}", key="sampler")

    def steps_for(self, ctx, period: int, b1: int, b2: int, single_pass: bool) -> int:
        cap = ctx.max_steps
        if not single_pass:
            return cap
        return min(cap, data_limit(ctx.n_train, period, b1, b2, self.whole_periods))

    # -- the clock -----------------------------------------------------------------------------

    def position(self, step: int) -> tuple[int, int]:
        """(period index k ≥ 0, position p ∈ {1..Σ}) of 0-based global step ``step``."""
        return self.settings.position(step)

    def total_steps(self, ctx):
        return self.settings.total_steps

    def validate(self, ctx):
        s = self.settings
        if not isinstance(self.stages.privatizer, BoundedPrivatizer):
            raise UserError(f"algorithm {self.name!r} needs a stream privatizer over the oracle's public bounds "
                            f"(tree_aggregation, iid_prefix, bounded_gaussian); got "
                            f"{self.stages.privatizer.name!r}", key="privatizer")
        if s.window * s.radius > s.smooth_radius * (1 + 1e-12):
            raise UserError(f"window × radius = {s.window} × {s.radius:.4g} exceeds the Goldstein radius "
                            f"{s.smooth_radius:g}: the averaged points would not certify it "
                            f"(spec 001 §1.3, spec 002 Prop. 2.6 needs M·D ≤ α)", key="update.window")
        if ctx.relation != "replace_one":
            raise UserError("the nonsmooth oracles are analysed under replace-one neighbours (both papers)",
                            key="privacy.relation")
        self.bounds = ctx.need(OracleBounds)

    # -- the step ------------------------------------------------------------------------------

    def step(self, run):
        _, p = self.position(run.ctx.step)
        if p == 1:  # a new period: fresh estimate, fresh tree noise (spec 002 coupling 1)
            run.privatizer.reset()
            run.estimator.reset()
        return super().step(run)

    def plan(self, ctx, noise_multiplier):
        """Every charge of the rest of the run, in closed form: the privatizer's events at a period
        start (p = 1) and at the other positions (p > 1, where they are alike, see
        ``stream_events``), wrapped by the sampler in the partition of the data they touch."""
        s0, T, P = ctx.step, self.total_steps(ctx), self.settings.period
        if s0 >= T:
            return []
        privatizer, sampler = self.stages.privatizer, self.stages.sampler
        steps, starts = range(s0, T), range(s0 + (-s0 % P), T, P)
        first = privatizer.stream_events(noise_multiplier, ctx, 1)
        at_starts = sampler.account_steps(starts, first, ctx)
        rest = privatizer.stream_events(noise_multiplier, ctx, 2) if P > 1 else []
        # the steps that are no period start: every step's charges less the starts'
        elsewhere = _minus(sampler.account_steps(steps, rest, ctx), sampler.account_steps(starts, rest, ctx))
        return compress(at_starts + elsewhere if s0 % P == 0 else elsewhere + at_starts)

    # -- step size -------------------------------------------------------------------------------

    def grad_bound(self) -> float:
        """A-priori bound G on sqrt(E‖g̃_t‖²) for η = D/(G√H) (spec 001 §3.5, spec 002 Eq. 7):
        G² = 3(V_fresh/B1 + (Σ−1)·V_vr/B2) + 3L² + 3·E‖noise‖²."""
        s, b = self.settings, self.bounds
        vr = b.increment is not None  # errors add up over a period's increments
        v_f = b.fresh_variance
        v_v = b.increment_variance if vr else 0.0
        noise = self.stages.privatizer.noise_second_moment()
        g2 = 3 * (v_f / s.batch_first + (s.period - 1 if vr else 0) * v_v / s.batch_rest) + 3 * s.lipschitz ** 2 + 3 * noise
        return math.sqrt(g2)
