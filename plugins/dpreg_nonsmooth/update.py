"""Online-to-nonconvex conversion (O2NC): projected online gradient descent on a displacement.

Spec 001 Alg. 3 / spec 002 Alg. 2. The learner plays Δ_t in the ball 𝔹_D against the linear
losses <g̃_t, ·>; the iterate moves x_{t+1} = x_t + Δ_t, and the oracle is queried at a uniformly
random point of the step, w_t = x_t + s_t·Δ_t with public s_t ~ U[0, 1] (the identity
F(x_{t+1}) − F(x_t) = E_s <∇F(w_t), Δ_t>). The parameters always hold the NEXT query point, so
‖w_{t+1} − w_t‖ ≤ (1 − s_t)‖Δ_t‖ + s_{t+1}‖Δ_{t+1}‖ ≤ 2D, which every sensitivity relies on and
which is asserted at every step. The output is the average of the query points over one window,
chosen uniformly at random before the run (data-independent, so it is post-processing).
D, the window, the restarts and the run's length are the O2NC algorithm's
(:class:`~dpreg_nonsmooth.exchange.O2NCSchedule`), and so is the bound G of the automatic step size
(:class:`~dpreg_nonsmooth.exchange.GradientBound`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from dpregistry import StageParams, UpdateRule, UserError
from dpregistry.spaces import DENSE

from .exchange import GradientBound, O2NCSchedule
from .points import FlatView


class O2NCParams(StageParams):
    radius: float | Literal["auto"] = Field(default="auto", description="D: ‖Δ‖ ≤ D (auto: the theorem's)")
    lr: float | Literal["auto"] = Field(default="auto", description="η of projected OGD (auto: D/(G·sqrt(H)))")
    lr_rule: Literal["fixed", "adagrad_norm"] = Field(
        default="fixed", description="adagrad_norm: η_t = D/sqrt(Σ_s ‖g̃_s‖²), restarted with the learner")
    window: int | Literal["auto"] = Field(default="auto", description="averaging window (ZTC: T; KLT: M)")
    restart_every: int | Literal["auto", "never"] = Field(
        default="auto", description="reset Δ to 0 every this many steps (ZTC: each episode; KLT: never)")
    output: Literal["random_window", "last_window", "last"] = Field(
        default="random_window", description="random_window carries the theorems; the others are diagnostics")
    record_points: Literal["window", "all", "none"] = Field(
        default="window", description="keep the output window's query points (certificate) or all of them")


class O2NC(UpdateRule):
    """O2NC: projected OGD on a displacement ‖Δ‖ ≤ D, a query at a random point of each step, window averages."""

    name = "o2nc"
    accepts = frozenset({DENSE})
    Params = O2NCParams
    needs = (O2NCSchedule, GradientBound)

    @dataclass
    class State:
        x: torch.Tensor | None = None                 # x_t
        delta: torch.Tensor | None = None             # Δ_t
        eta: float | None = None                      # η (fixed, or D/(G·sqrt(H)) once G is known)
        grad_sq: float = 0.0                          # Σ_s ‖g̃_s‖² since the last restart (adagrad_norm)
        selected: int = -1                            # the output window, drawn before the run
        sel_sum: torch.Tensor | None = None           # Σ of the selected window's query points
        sel_count: int = 0
        sel_points: list[torch.Tensor] = field(default_factory=list)
        cur_sum: torch.Tensor | None = None           # the current window's
        cur_points: list[torch.Tensor] = field(default_factory=list)
        last_mean: torch.Tensor | None = None         # the last complete window's mean
        last_points: list[torch.Tensor] = field(default_factory=list)
        all_points: list[torch.Tensor] = field(default_factory=list)  # record_points: all

    def setup(self, ctx):
        self.view = FlatView(ctx.params)
        self.settings = s = ctx.need(O2NCSchedule)
        self.D = s.radius
        self.M = s.window
        self.restart = s.restart_every
        x = self.view.flat(ctx.params)               # x_1 = x_init
        K = s.total_steps // self.M
        self.n_windows = K
        g = ctx.rng.generator("o2nc_output_window", 0)
        self.state = self.State(
            x=x, delta=torch.zeros_like(x),          # Δ_1 = 0, so w_1 = x_1
            eta=None if self.cfg.lr == "auto" or self.cfg.lr_rule == "adagrad_norm" else float(self.cfg.lr),
            selected=int(torch.randint(0, K, (1,), generator=g)) if K >= 1 else -1,
            sel_sum=torch.zeros_like(x), cur_sum=torch.zeros_like(x))

    def validate(self, ctx):
        if not (self.D > 0 and math.isfinite(self.D)):
            raise UserError(f"radius must be positive and finite, got {self.D}", key="update.radius")
        if self.M < 1:
            raise UserError("window must be at least 1", key="update.window")

    # -- step size -------------------------------------------------------------------------------

    def horizon(self) -> int:
        return self.restart or self.M

    def _eta(self, g: torch.Tensor, ctx) -> float:
        st = self.state
        if self.cfg.lr_rule == "adagrad_norm":
            st.grad_sq += float(g.pow(2).sum())
            return self.D / math.sqrt(st.grad_sq) if st.grad_sq > 0 else 0.0
        if st.eta is None:  # after calibration: G depends on σ (spec 001 coupling 6)
            st.eta = self.D / (ctx.need(GradientBound).value * math.sqrt(self.horizon()))
        return st.eta

    # -- windows ---------------------------------------------------------------------------------

    def _record(self, t: int, w: torch.Tensor) -> None:
        st = self.state
        keep = self.cfg.record_points != "none"
        if t % self.M == 0:
            st.cur_sum.zero_()
            st.cur_points = []
        st.cur_sum.add_(w)
        if keep:
            st.cur_points.append(w.clone())
        if self.cfg.record_points == "all":
            st.all_points.append(w.clone())
        if t // self.M == st.selected:
            st.sel_sum.add_(w)
            st.sel_count += 1
            if keep:
                st.sel_points.append(w.clone())
        if (t + 1) % self.M == 0:
            st.last_mean = st.cur_sum / self.M
            st.last_points = st.cur_points

    # -- the update --------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, params, release, ctx):
        t = ctx.step
        st = self.state
        lifted = release.value.lift(params)
        g = torch.cat([lifted[n].reshape(-1) for n in self.view.names]).to(self.view.dtype)
        w = self.view.flat(params)  # w_t, where the oracle was queried
        self._record(t, w)
        eta = self._eta(g, ctx)
        x_next = st.x + st.delta                          # x_{t+1} = x_t + Δ_t
        v = st.delta - eta * g                            # OGD on <g̃_t, ·>
        nv = float(torch.linalg.vector_norm(v))
        delta_next = v * min(1.0, self.D / nv) if nv > 0 else v   # Π_D
        if self.restart and (t + 1) % self.restart == 0:  # a new episode restarts the learner at 0
            delta_next = torch.zeros_like(delta_next)
            st.grad_sq = 0.0
        s = float(torch.rand(1, generator=ctx.rng.generator("o2nc_s", t + 1), dtype=torch.float64))
        w_next = x_next + s * delta_next
        tol = 1 + self.view.slack
        dn = float(torch.linalg.vector_norm(delta_next))
        if dn > self.D * tol:
            raise RuntimeError(f"‖Δ‖ = {dn:.6g} exceeds D = {self.D:.6g}")
        st.x, st.delta = x_next, delta_next
        self.view.write_(params, w_next)
        # measured on the point the oracle will query (rounded to the parameters' dtype)
        gap = float(torch.linalg.vector_norm(self.view.flat(params) - w))
        if gap > 2 * self.D * tol:  # spec 001 coupling 3: every sensitivity rests on this
            raise RuntimeError(f"‖w_(t+1) − w_t‖ = {gap:.6g} exceeds 2D = {2 * self.D:.6g}")

    # -- output ------------------------------------------------------------------------------------

    def _output_flat(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        mode, st = self.cfg.output, self.state
        if mode == "last":
            return None, []
        if mode == "random_window" and st.sel_count == self.M:
            return st.sel_sum / self.M, st.sel_points
        # the chosen window is incomplete (a run stopped early) or last_window: the last complete window
        return st.last_mean, st.last_points

    def output(self, params, ctx):
        flat, _ = self._output_flat()
        if flat is None:
            return None
        return {n: t.to(params[n].dtype).clone() for n, t in self.view.unflatten(flat).items()}

    def window_points(self) -> torch.Tensor | None:
        """The query points averaged into the output (the Goldstein certificate's points)."""
        flat, pts = self._output_flat()
        return torch.stack(pts) if flat is not None and pts else None

    def trajectory(self) -> torch.Tensor | None:
        """Every query point (record_points: all)."""
        pts = self.state.all_points
        return torch.stack(pts) if pts else None


UPDATE_RULES = (O2NC,)
