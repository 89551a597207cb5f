"""The O2NC driver shared by both papers: the period clock, resolved settings, planning.

The algorithm owns the phase clock (spec 002 coupling 1): at the first step of every period
(p = 1, with p = ((t − 1) mod Σ) + 1, spec 002 [AMBIG-3]) it resets the estimator (a fresh
estimate starts the variance-reduced sum) and the privatizer (fresh tree noise, empty prefix
sum). The sampler, estimator, privatizer and update rule read the resolved numbers (period,
batch schedule, D, window, restarts, m, δ_fail) from ``run.algorithm.settings``, which each paper
fills with its theorem's defaults wherever a recipe says ``auto`` — before step 1, so the noise
can be calibrated to the sensitivity these numbers imply (spec 001 coupling 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dpregistry import Algorithm, UserError
from dpregistry.spaces import INCREMENT
from dpregistry.stages import Charge, compress

from .points import FlatView
from .tree import period_position


@dataclass
class Settings:
    """Every number the stages of one O2NC run share (resolved before step 1)."""

    dim: int
    n: int
    period: int                  # VR / tree period Σ (ZTC: the episode length T)
    batch_first: int             # B1, at p = 1
    batch_rest: int              # B2, at p > 1
    radius: float                # D: ‖Δ‖ ≤ D, so ‖w_t − w_{t−1}‖ ≤ 2D
    window: int                  # averaging window of the output (ZTC: T; KLT: M)
    restart_every: int | None    # steps between restarts of the online learner (ZTC: T; KLT: never)
    total_steps: int
    single_pass: bool            # every record in at most one step (parallel composition)
    smooth_radius: float         # δ (ZTC) / α (KLT)
    lipschitz: float             # L
    dirs: int | None = None      # m resolved from "dim"/"theory" (None: the estimator's own integer)
    delta_fail: float = 0.0      # per-use failure probability γ of high-probability bounds
    extra: dict[str, Any] = field(default_factory=dict)


def cfg(stage, key: str, default=None):
    return getattr(stage.cfg, key, default)


def is_auto(v) -> bool:
    return isinstance(v, str) and v == "auto"


def data_limit(n: int, period: int, b1: int, b2: int, whole_periods: bool) -> int:
    """The most steps a single pass over n records allows (B1 at each period start, B2 otherwise)."""
    per = b1 + (period - 1) * b2
    k, rem = divmod(n, per)
    if whole_periods or rem < b1:
        return k * period
    return k * period + 1 + min(period - 1, (rem - b1) // b2)  # a partial last period


def consumption(steps: int, period: int, b1: int, b2: int) -> int:
    """Records a single pass of ``steps`` steps reads: B1⌈T/Σ⌉ + B2(T − ⌈T/Σ⌉) (spec 002 §7.12)."""
    starts = -(-steps // period)
    return b1 * starts + b2 * (steps - starts)


def _minus(charges: list[Charge], less: list[Charge]) -> list[Charge]:
    """``charges`` less the charges ``less`` (a subset of them: a sum over fewer steps)."""
    left = {(c.event, c.partition): c.count for c in compress(charges)}
    for c in compress(less):
        left[(c.event, c.partition)] -= c.count
    return [Charge(e, p, n) for (e, p), n in left.items() if n]


class O2NCAlgorithm(Algorithm):
    """Base of the O2NC algorithms: period clock, resets, and the plan of a stream's charges."""

    #: single-pass runs end when the data is used up at a period boundary (ZTC: K = ⌊M/2T⌋)
    whole_periods = False

    def setup(self, run):
        self.view = FlatView(run.params)
        self.settings = self.resolve(run)
        s = self.settings
        if s.total_steps <= 0:
            raise UserError(f"the data ({s.n} records) does not fill one step of batch {s.batch_first}",
                            key="sampler")

    # -- what each paper provides -------------------------------------------------------------

    def resolve(self, run) -> Settings:
        raise NotImplementedError

    # -- shared helpers ------------------------------------------------------------------------

    def smoothing(self, run) -> tuple[float, float]:
        """(smoothing radius, Lipschitz constant) that the estimator declares; the theory needs both."""
        radius, L = cfg(run.estimator, "smooth_radius"), cfg(run.estimator, "lipschitz")
        if radius is None or L is None:
            raise UserError(f"algorithm {self.name!r} needs an estimator with smooth_radius and lipschitz",
                            key="estimator")
        return radius, L

    def batches(self, run, b1_auto: int, b2_auto: int) -> tuple[int, int, bool]:
        """(B1, B2, single_pass) from the sampler: a batch schedule, or every record every step."""
        n = run.n_train
        if run.sampler.name == "full_batch":
            return n, n, False
        if not hasattr(run.sampler.cfg, "batch_first"):
            raise UserError(f"algorithm {self.name!r} needs the single_pass sampler (a batch schedule over "
                            f"disjoint data) or full_batch; got {run.sampler.name!r}", key="sampler")
        b1, b2 = cfg(run.sampler, "batch_first"), cfg(run.sampler, "batch_rest")
        b1 = b1_auto if is_auto(b1) else int(b1)
        b2 = b2_auto if is_auto(b2) else int(b2)
        return b1, b2, True

    def steps_for(self, run, period: int, b1: int, b2: int, single_pass: bool) -> int:
        cap = run.recipe.train.steps
        if not single_pass:
            return cap
        return min(cap, data_limit(run.n_train, period, b1, b2, self.whole_periods))

    # -- the clock -----------------------------------------------------------------------------

    def position(self, step: int) -> tuple[int, int]:
        """(period index k ≥ 0, position p ∈ {1..Σ}) of 0-based global step ``step``."""
        P = self.settings.period
        return step // P, period_position(step + 1, P)

    def total_steps(self, run):
        return self.settings.total_steps

    def validate(self, run):
        s = self.settings
        if not getattr(run.update_rule, "o2nc", False):
            raise UserError(f"algorithm {self.name!r} needs the o2nc update rule, got {run.update_rule.name!r}",
                            key="update.name")
        if s.window * s.radius > s.smooth_radius * (1 + 1e-12):
            raise UserError(f"window × radius = {s.window} × {s.radius:.4g} exceeds the Goldstein radius "
                            f"{s.smooth_radius:g}: the averaged points would not certify it "
                            f"(spec 001 §1.3, spec 002 Prop. 2.6 needs M·D ≤ α)", key="update.window")
        if run.relation != "replace_one":
            raise UserError("the nonsmooth oracles are analysed under replace-one neighbours (both papers)",
                            key="privacy.relation")

    # -- the step ------------------------------------------------------------------------------

    def step(self, run):
        _, p = self.position(run.step)
        if p == 1:  # a new period: fresh estimate, fresh tree noise (spec 002 coupling 1)
            run.privatizer.reset()
            run.estimator.reset()
        return super().step(run)

    def plan(self, run, noise_multiplier):
        """Every charge of the rest of the run, in closed form: the privatizer's events at a period
        start (p = 1) and at the other positions (p > 1, where they are alike, see
        ``stream_events``), wrapped by the sampler in the partition of the data they touch."""
        s0, T, P = run.step, self.total_steps(run), self.settings.period
        if s0 >= T:
            return []
        steps, starts = range(s0, T), range(s0 + (-s0 % P), T, P)
        first = run.privatizer.stream_events(noise_multiplier, run, 1)
        at_starts = run.sampler.account_steps(starts, first, run)
        rest = run.privatizer.stream_events(noise_multiplier, run, 2) if P > 1 else []
        # the steps that are no period start: every step's charges less the starts'
        elsewhere = _minus(run.sampler.account_steps(steps, rest, run), run.sampler.account_steps(starts, rest, run))
        return compress(at_starts + elsewhere if s0 % P == 0 else elsewhere + at_starts)

    # -- step size -------------------------------------------------------------------------------

    def grad_bound(self, run) -> float:
        """A-priori bound G on sqrt(E‖g̃_t‖²) for η = D/(G√H) (spec 001 §3.5, spec 002 Eq. 7):
        G² = 3(V_fresh/B1 + (Σ−1)·V_vr/B2) + 3L² + 3·E‖noise‖²."""
        s = self.settings
        est = run.estimator
        v_f = est.variance(True, 0.0)
        vr = s.period > 1 and est.contribution_kind == INCREMENT  # errors add up over a period's increments
        v_v = est.variance(False, 2 * s.radius) if vr else 0.0
        noise = run.privatizer.noise_second_moment(run)
        g2 = 3 * (v_f / s.batch_first + (s.period - 1 if vr else 0) * v_v / s.batch_rest) + 3 * s.lipschitz ** 2 + 3 * noise
        return math.sqrt(g2)

    def state_dict(self):
        return {}
