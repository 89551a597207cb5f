"""Gradient oracles of the smoothed loss f_δ(x) = E_{v∼U_B} f(x + δv), per example.

* ``zo_sphere``: zeroth-order, directions uniform on the unit SPHERE (spec 002 [AMBIG-5]: the
  printed Unif(𝔹_α) directions are biased). A fresh step (p = 1) emits the central two-point
  estimate GRAD (spec 001 Alg. 1, spec 002 Eq. 4 with the y_j factor, [AMBIG-1]); a
  variance-reduced step emits an INCREMENT: ZTC's coupled one-sided DIFF (the same u at w_t and
  w_{t−1}, spec 001 Alg. 2) or KLT's difference of independent central estimates (spec 002 Alg. 3).
* ``fo_ball``: first-order, ∇f at points uniform in the BALL of radius α (spec 002 Alg. 5: one
  perturbation per record at p = 1, m and m independent ones at z_t and z_{t−1} otherwise).
* ``zo_sphere_grad``: the naive oracle of ZTC App. E: a fresh estimate at every step (a GRADIENT).

Every contribution carries a public per-example norm bound (``info["bound"]``) that the
privatizer turns into the sensitivity 2·bound/B (replace-one) and enforces by clipping (spec 001
coupling 10, spec 002 §2.6 safety_clip). In ``paper`` mode the bound is the papers': it rests on
the objective being L-Lipschitz (the objective must declare it) and, for KLT's high-probability
bounds, on a concentration event whose failure probability is charged; where those hold the clip
never binds (the run is the papers' bit for bit), where they fail it keeps the sensitivity.
Directions come from per-(step, slot, side) generators, independent of the records (coupled
randomness, spec 002 §2.2): public ones where the bound holds for every draw, secret ones (from the
run's noise key) where the privatizer relies on a high-probability bound and charges its δ_fail.

Each oracle provides its :class:`~dpreg_nonsmooth.exchange.Smoothing` (to the O2NC algorithm) and
its :class:`~dpreg_nonsmooth.exchange.OracleBounds` (to the privatizer and the algorithm), and
reads the algorithm's :class:`~dpreg_nonsmooth.exchange.O2NCSchedule` (D, the period, m, δ_fail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field

from dpregistry import Estimator, Objective, StageParams, UserError
from dpregistry.spaces import DENSE, GRADIENT, INCREMENT, DenseContribution

from .exchange import O2NCSchedule, OracleBounds, Smoothing
from .points import FlatView, PointQueries, PointQuery, ball, secret_generator, sphere, step_generator

#: elements (slots × directions × d) per batched loss query
CHUNK_ELEMS = 1 << 21


def concentration_radius(b: float, m: int, gamma: float) -> float:
    """r with P(‖mean of m iid mean-zero terms, each of norm ≤ b‖ ≥ r) ≤ γ: b·sqrt(2 ln(2/γ)/m).

    Pinelis (1994) for Hilbert-space martingales; the explicit replacement for spec 002's
    Theorem C.2 with its unspecified constant ([IMPL] in spec 002 §2.2).
    """
    if gamma <= 0:
        return math.inf
    return b * math.sqrt(2 * math.log(2 / gamma) / m)


class OracleParams(StageParams):
    smooth_radius: float = Field(gt=0, description="δ (ZTC) / α (KLT): smoothing and Goldstein radius")
    lipschitz: float = Field(default=1.0, gt=0, description="L: per-record Lipschitz constant (a privacy parameter)")
    privacy_mode: Literal["paper", "clip"] = Field(
        default="paper", description="paper: the papers' accounting (bounds from L; high-probability bounds "
                                     "charged as δ_fail), each bound also clipped at as a safety net; clip: the "
                                     "same clip, no δ_fail (the sensitivity is deterministic), for objectives "
                                     "without a declared L")
    delta_fail: Annotated[float, Field(ge=0, lt=1)] | Literal["auto"] = Field(
        default=0.0, description="per-use failure probability γ of the concentration bounds (0: worst-case bounds)")


class OracleEstimator(Estimator):
    """Shared machinery: settings, the previous query point, the gap check, bounds → info."""

    space = DENSE
    contribution_kind = INCREMENT
    Params = OracleParams
    needs = (Objective, O2NCSchedule)
    provides = (Smoothing, OracleBounds)

    @dataclass
    class State:
        prev: torch.Tensor | None = None  # the previous query point w_(t−1) (None: the next estimate is fresh)

    bounds: OracleBounds | None = None   # this run's public bounds, computed in setup

    def setup(self, ctx):
        self.view = FlatView(ctx.params)
        self.d = self.view.dim
        self.query = PointQuery(ctx.need(Objective), self.view)
        self.purpose = f"{self.name}.dirs"
        self._secret_dirs = False  # set per query: does its bound rest on unknown directions?
        self.settings = ctx.need(O2NCSchedule)
        self.bounds = self._bounds()

    def validate(self, ctx):
        objective = ctx.need(Objective)
        PointQuery.check(objective, need_grad=self.first_order)
        if self.cfg.privacy_mode == "paper":
            L_obj = objective.lipschitz if isinstance(objective, PointQueries) else None
            if L_obj is None:
                raise UserError(f"objective {objective.name!r} declares no Lipschitz constant, so the paper's "
                                "sensitivity bound would be an unchecked assumption; use privacy_mode: clip",
                                key="estimator.privacy_mode")
            if self.cfg.lipschitz < L_obj * (1 - 1e-12):
                raise UserError(f"lipschitz = {self.cfg.lipschitz:g} is below the objective's constant {L_obj:g}; "
                                "the sensitivity bound would be wrong", key="estimator.lipschitz")

    first_order = False

    # -- what it declares to the other stages ---------------------------------------------------

    @property
    def theory_dirs(self) -> bool:
        """Whether the recipe leaves m to the algorithm's theorem (dirs_per_sample: theory)."""
        return False

    def provide(self, kind):
        if kind is Smoothing:  # recipe values: the algorithm reads them in its setup, before this one's
            c = self.cfg
            return Smoothing(c.smooth_radius, c.lipschitz, c.delta_fail, self.theory_dirs)
        if kind is OracleBounds:
            if self.bounds is None:
                raise RuntimeError(f"estimator {self.name!r}: its bounds are known once it is set up")
            return self.bounds
        return super().provide(kind)

    def _bounds(self) -> OracleBounds:
        """The public bounds of this run: a fresh estimate, and an increment at the worst gap (when a
        period has increments at all: Σ > 1 and an increment oracle)."""
        increments = self.settings.period > 1 and self.contribution_kind == INCREMENT
        return OracleBounds(fresh=self.public_bound(True, 0.0),
                            increment=self.public_bound(False, self.max_gap) if increments else None,
                            fresh_variance=self.variance(True, 0.0),
                            increment_variance=self.variance(False, 2 * self.settings.radius) if increments else 0.0)

    # -- parameters shared with the algorithm ---------------------------------------------------

    @property
    def gamma(self) -> float:
        """Per-use failure probability of the high-probability bounds (0: worst case only)."""
        g = self.cfg.delta_fail
        return float(self.settings.delta_fail if g == "auto" else g)

    @property
    def max_gap(self) -> float:
        """‖w_t − w_{t−1}‖ ≤ 2D for every history (Remark 4.1 of ZTC; the projection on 𝔹_D), up to
        the rounding of the points to the parameters' dtype (``FlatView.slack``)."""
        return 2 * self.settings.radius * (1 + self.view.slack)

    # -- what subclasses provide ------------------------------------------------------------------

    def bound(self, fresh: bool, gap: float) -> tuple[float, float]:
        """(R, γ): every per-example contribution has norm ≤ R, except with probability γ."""
        raise NotImplementedError

    def variance(self, fresh: bool, gap: float) -> float:
        """Bound on a per-example contribution's E‖c − E c‖² (for the step size only)."""
        raise NotImplementedError

    def _fresh(self, x, indices, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _increment(self, x, y, indices, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # -- the estimator contract -------------------------------------------------------------------

    def reset(self):
        self.state.prev = None

    def public_bound(self, fresh: bool, gap: float) -> tuple[float, float]:
        """The bound the privatizer uses: (R, γ), with γ = 0 once ``clip`` enforces R."""
        R, gamma = self.bound(fresh, gap)
        return R, (0.0 if self.cfg.privacy_mode == "clip" else gamma)

    @torch.no_grad()
    def contributions(self, objective, indices, ctx):
        x = self.view.flat(ctx.params)
        prev = self.state.prev
        fresh = prev is None or self.contribution_kind == GRADIENT
        gap = 0.0
        if not fresh:
            gap = float(torch.linalg.vector_norm(x - prev))
            if gap > self.max_gap:  # spec 001 coupling 3: the sensitivity rests on it
                raise RuntimeError(f"‖w_t − w_(t−1)‖ = {gap:.6g} exceeds 2D = {self.max_gap:.6g}")
        R, gamma = self.public_bound(fresh, gap)
        # a high-probability bound fails with probability γ over the directions only if nobody who
        # picks the data knows them: draw them from the secret noise key then (spec 002 §2.2, §2.5)
        self._secret_dirs = gamma > 0
        if fresh:
            per, losses = self._fresh(x, indices, ctx)
        else:
            per, losses = self._increment(x, prev, indices, ctx)
        self.state.prev = x
        yield DenseContribution(per_example=self.view.unflatten(per), kind=self.contribution_kind, losses=losses,
                                indices=indices, info={"bound": R, "gamma": gamma, "fresh": fresh, "gap": gap})

    # -- helpers ---------------------------------------------------------------------------------

    def _slot_chunks(self, ctx, n_local: int, per_slot: int):
        """(global slot range, this rank's rows in it, their offsets in the range), range by range.

        The ranges cover the whole batch and depend only on its size, m and d (public), and every
        rank draws the directions of every range: a slot gets the same directions whichever rank
        evaluates it, so N processes compute what one does (up to the order of the final sum)."""
        pos = ctx.comm.positions
        n = n_local if pos is None else ctx.comm.batch_size
        pos = torch.arange(n) if pos is None else pos
        size = max(1, CHUNK_ELEMS // max(per_slot, 1))
        for s in range(0, n, size):
            sl = slice(s, min(n, s + size))
            rows = ((pos >= sl.start) & (pos < sl.stop)).nonzero().squeeze(1)
            yield sl, rows, pos[rows] - sl.start

    def _generator(self, ctx, side: int) -> torch.Generator:
        if self._secret_dirs:
            return secret_generator(ctx, self.purpose, ctx.step, side)
        return step_generator(ctx, self.purpose, ctx.step, side)

    def _dirs(self, g: torch.Generator, sl: slice, m: int, dtype) -> torch.Tensor:
        """[slots, m, d] unit-sphere directions, drawn slot after slot from the step's generator."""
        return sphere(g, (sl.stop - sl.start) * m, self.d, dtype).view(-1, m, self.d)


# ------------------------------------------------------------------------------------------------
# zeroth order, sphere directions
# ------------------------------------------------------------------------------------------------


class ZOSphereParams(OracleParams):
    dirs_per_sample: int | Literal["dim", "theory"] = Field(
        default="dim", description="m directions per record (ZTC: d; KLT: a privacy knob, 'theory' = its theorem)")
    diff_mode: Literal["coupled_one_sided", "independent_central"] = Field(
        default="coupled_one_sided", description="VR increment: ZTC's DIFF (same u at both points) or KLT's "
                                                 "difference of independent central estimates")


class ZOSphere(OracleEstimator):
    """Two-point ZO estimates on unit-sphere directions, m per record; VR increments after p = 1."""

    name = "zo_sphere"
    Params = ZOSphereParams

    @property
    def theory_dirs(self) -> bool:
        return self.cfg.dirs_per_sample == "theory"

    @property
    def m(self) -> int:
        v = self.cfg.dirs_per_sample
        if v == "dim":
            m = self.d
        elif v == "theory":
            if not self.settings.dirs:
                raise UserError("dirs_per_sample: theory needs an algorithm that derives m; this one does not",
                                key="estimator.dirs_per_sample")
            m = int(self.settings.dirs)
        else:
            m = int(v)
        if m < 1:  # checked where m is first used: the bounds, in setup
            raise UserError("dirs_per_sample must be at least 1", key="estimator.dirs_per_sample")
        return m

    def bound(self, fresh, gap):
        d, L, a, m = self.d, self.cfg.lipschitz, self.cfg.smooth_radius, self.m
        gamma = self.gamma
        if fresh:
            det = d * L  # ‖(d/2δ)(f(x+δu) − f(x−δu))u‖ ≤ dL (spec 001 Lemma 3.1)
            hp = L + concentration_radius(L * (d + 1), m, gamma)  # spec 002 §2.2 [IMPL]
            return (hp, gamma) if hp < det else (det, 0.0)
        if self.cfg.diff_mode == "coupled_one_sided":
            return d * L * gap / a, 0.0  # ‖d_ij‖ ≤ dL‖x − y‖/δ (spec 001 Lemma 3.2)
        det = 2 * d * L
        smooth = min(2 * L, L * math.sqrt(d) * gap / a)  # ∇f_α is L√d/α-Lipschitz and L-bounded
        hp = smooth + 2 * concentration_radius(L * (d + 1), m, gamma / 2)  # two estimates, γ/2 each
        return (hp, gamma) if hp < det else (det, 0.0)

    def variance(self, fresh, gap):
        d, L, a, m = self.d, self.cfg.lipschitz, self.cfg.smooth_radius, self.m
        zo = 16 * d * d * L * L / m  # spec 001 Lemma 3.1 (16dL² at m = d)
        if fresh:
            return zo
        if self.cfg.diff_mode == "coupled_one_sided":
            return zo * gap * gap / (a * a)  # Lemma 3.2
        return (L * math.sqrt(d) * gap / a) ** 2 + 2 * zo

    def _central(self, x, indices, ctx, side):
        """Per-example (1/m)Σ_j (d/2δ)(f(x+δu_j) − f(x−δu_j))u_j and the mean loss, [B, d], [B]."""
        B, d, m, a = len(indices), self.d, self.m, self.cfg.smooth_radius
        cap = 2 * self.cfg.lipschitz * a
        out = x.new_zeros(B, d)
        loss = x.new_zeros(B)
        g = self._generator(ctx, side)
        for sl, rows, offs in self._slot_chunks(ctx, B, 2 * m * d):
            U = self._dirs(g, sl, m, x.dtype)[offs]                              # [b, m, d]
            if not len(rows):  # drawn all the same: the generator stays in step with other ranks
                continue
            pts = torch.cat([x + a * U, x - a * U], dim=1)                       # [b, 2m, d]
            f = self.query.losses(pts.reshape(-1, d), indices[rows].repeat_interleave(2 * m)).view(-1, 2 * m)
            diff = f[:, :m] - f[:, m:]
            if self.cfg.privacy_mode == "clip":  # spec 001 coupling 10: |f(x+δu) − f(x−δu)| ≤ 2Lδ
                diff = diff.clamp(-cap, cap)
            out[rows] = (d / (2 * a)) * (diff.unsqueeze(-1) * U).mean(1)
            loss[rows] = f.mean(1)
        return out, loss

    def _fresh(self, x, indices, ctx):
        return self._central(x, indices, ctx, side=0)

    def _increment(self, x, y, indices, ctx):
        if self.cfg.diff_mode == "independent_central":  # spec 002 Alg. 3 lines 12–16
            a, la = self._central(x, indices, ctx, side=0)
            b, lb = self._central(y, indices, ctx, side=1)
            return a - b, la
        B, d, m, a = len(indices), self.d, self.m, self.cfg.smooth_radius
        cap = self.cfg.lipschitz * float(torch.linalg.vector_norm(x - y))
        out = x.new_zeros(B, d)
        loss = x.new_zeros(B)
        g = self._generator(ctx, 0)
        for sl, rows, offs in self._slot_chunks(ctx, B, 2 * m * d):
            U = self._dirs(g, sl, m, x.dtype)[offs]
            if not len(rows):
                continue
            pts = torch.cat([x + a * U, y + a * U], dim=1)  # the SAME u at both points (spec 001 Alg. 2)
            f = self.query.losses(pts.reshape(-1, d), indices[rows].repeat_interleave(2 * m)).view(-1, 2 * m)
            diff = f[:, :m] - f[:, m:]
            if self.cfg.privacy_mode == "clip":  # |f(x+δu) − f(y+δu)| ≤ L‖x − y‖
                diff = diff.clamp(-cap, cap)
            out[rows] = (d / a) * (diff.unsqueeze(-1) * U).mean(1)
            loss[rows] = f[:, :m].mean(1)
        return out, loss


class ZOSphereGradParams(OracleParams):
    dirs_per_sample: int | Literal["dim"] = Field(default=1, description="m (ZTC App. E: one direction per record)")


class ZOSphereGrad(ZOSphere):
    """ZTC App. E's naive oracle: a fresh two-point sphere estimate at every step (a gradient)."""

    name = "zo_sphere_grad"
    contribution_kind = GRADIENT
    Params = ZOSphereGradParams

    def bound(self, fresh, gap):
        return self.d * self.cfg.lipschitz, 0.0  # ‖(d/2δ)(f(w+δu) − f(w−δu))u‖ ≤ dL

    def variance(self, fresh, gap):
        return 16 * self.d * self.d * self.cfg.lipschitz ** 2 / self.m


# ------------------------------------------------------------------------------------------------
# first order, ball perturbations
# ------------------------------------------------------------------------------------------------


class FOBallParams(OracleParams):
    perturbations_fresh: int = Field(default=1, gt=0, description="perturbations per record at p = 1 (Alg. 5: 1)")
    dirs_per_sample: int | Literal["theory"] = Field(
        default=1, description="m perturbations per record and point at p > 1 ('theory': KLT Thm. 6.1)")


class FOBall(OracleEstimator):
    """First-order oracle at random points of the α-ball: ∇f(z + y), y ~ Unif(𝔹_α) (KLT Alg. 5)."""

    name = "fo_ball"
    Params = FOBallParams
    first_order = True

    @property
    def theory_dirs(self) -> bool:
        return self.cfg.dirs_per_sample == "theory"

    @property
    def m(self) -> int:
        v = self.cfg.dirs_per_sample
        if v == "theory":
            if not self.settings.dirs:
                raise UserError("dirs_per_sample: theory needs an algorithm that derives m",
                                key="estimator.dirs_per_sample")
            return int(self.settings.dirs)
        if int(v) < 1:  # as zo_sphere's: the planned bounds read m, so validate refuses it
            raise UserError("dirs_per_sample must be at least 1", key="estimator.dirs_per_sample")
        return int(v)

    def bound(self, fresh, gap):
        L, a, d = self.cfg.lipschitz, self.cfg.smooth_radius, self.d
        if fresh:
            return L, 0.0  # a mean of gradients of an L-Lipschitz f (spec 002 Lemma 6.3)
        det = 2 * L
        smooth = min(2 * L, L * math.sqrt(d) * gap / a)
        hp = smooth + 2 * concentration_radius(2 * L, self.m, self.gamma / 2)
        return (hp, self.gamma) if hp < det else (det, 0.0)

    def variance(self, fresh, gap):
        L, a, d = self.cfg.lipschitz, self.cfg.smooth_radius, self.d
        if fresh:
            return 4 * L * L / self.cfg.perturbations_fresh
        return (L * math.sqrt(d) * gap / a) ** 2 + 8 * L * L / self.m

    def _ball_grads(self, x, indices, ctx, m, side):
        B, d, a = len(indices), self.d, self.cfg.smooth_radius
        out = x.new_zeros(B, d)
        loss = x.new_zeros(B)
        g = self._generator(ctx, side)
        for sl, rows, offs in self._slot_chunks(ctx, B, m * d):
            Y = ball(g, (sl.stop - sl.start) * m, d, a, x.dtype).view(-1, m, d)[offs]   # [b, m, d]
            if not len(rows):
                continue
            pts = (x + Y).reshape(-1, d)
            idx = indices[rows].repeat_interleave(m)
            out[rows] = self.query.grads(pts, idx).view(-1, m, d).mean(1)
            loss[rows] = self.query.losses(pts, idx).view(-1, m).mean(1)
        return out, loss

    def _fresh(self, x, indices, ctx):
        return self._ball_grads(x, indices, ctx, self.cfg.perturbations_fresh, side=0)

    def _increment(self, x, y, indices, ctx):
        a, la = self._ball_grads(x, indices, ctx, self.m, side=0)
        b, _ = self._ball_grads(y, indices, ctx, self.m, side=1)  # independent perturbations at z_(t−1)
        return a - b, la


ESTIMATORS = (ZOSphere, ZOSphereGrad, FOBall)
