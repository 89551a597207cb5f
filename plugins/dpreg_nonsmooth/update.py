"""Online-to-nonconvex conversion (O2NC): projected online gradient descent on a displacement.

Spec 001 Alg. 3 / spec 002 Alg. 2. The learner plays Δ_t in the ball 𝔹_D against the linear
losses <g̃_t, ·>; the iterate moves x_{t+1} = x_t + Δ_t, and the oracle is queried at a uniformly
random point of the step, w_t = x_t + s_t·Δ_t with public s_t ~ U[0, 1] (the identity
F(x_{t+1}) − F(x_t) = E_s <∇F(w_t), Δ_t>). The parameters always hold the NEXT query point, so
‖w_{t+1} − w_t‖ ≤ (1 − s_t)‖Δ_t‖ + s_{t+1}‖Δ_{t+1}‖ ≤ 2D, which every sensitivity relies on and
which is asserted at every step. The output is the average of the query points over one window,
chosen uniformly at random before the run (data-independent, so it is post-processing).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from dpregistry import StageParams, UpdateRule, UserError
from dpregistry.spaces import DENSE

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
    o2nc = True
    accepts = frozenset({DENSE})
    Params = O2NCParams

    def setup(self, run):
        self.view = FlatView(run.params)
        self.settings = s = getattr(run.algorithm, "settings", None)
        if s is None:
            raise UserError(f"update rule o2nc needs an O2NC algorithm; got {run.algorithm.name!r}", key="update")
        self.D = s.radius
        self.M = s.window
        self.restart = s.restart_every
        self.x = self.view.flat(run.params)          # x_1 = x_init
        self.delta = torch.zeros_like(self.x)        # Δ_1 = 0, so w_1 = x_1
        self.eta: float | None = None if self.cfg.lr == "auto" or self.cfg.lr_rule == "adagrad_norm" else float(self.cfg.lr)
        self.grad_sq = 0.0
        K = s.total_steps // self.M
        self.n_windows = K
        g = run.rng.generator("o2nc_output_window", 0)
        self.selected = int(torch.randint(0, K, (1,), generator=g)) if K >= 1 else -1
        self.sel_sum = torch.zeros_like(self.x)
        self.sel_count = 0
        self.sel_points: list[torch.Tensor] = []
        self.cur_sum = torch.zeros_like(self.x)
        self.cur_points: list[torch.Tensor] = []
        self.last_mean: torch.Tensor | None = None
        self.last_points: list[torch.Tensor] = []
        self.all_points: list[torch.Tensor] = []

    def validate(self, run):
        if not (self.D > 0 and math.isfinite(self.D)):
            raise UserError(f"radius must be positive and finite, got {self.D}", key="update.radius")
        if self.M < 1:
            raise UserError("window must be at least 1", key="update.window")

    # -- step size -------------------------------------------------------------------------------

    def horizon(self) -> int:
        return self.restart or self.M

    def _eta(self, g: torch.Tensor, run) -> float:
        if self.cfg.lr_rule == "adagrad_norm":
            self.grad_sq += float(g.pow(2).sum())
            return self.D / math.sqrt(self.grad_sq) if self.grad_sq > 0 else 0.0
        if self.eta is None:  # after calibration: G depends on σ (spec 001 coupling 6)
            self.eta = self.D / (run.algorithm.grad_bound(run) * math.sqrt(self.horizon()))
        return self.eta

    # -- windows ---------------------------------------------------------------------------------

    def _record(self, t: int, w: torch.Tensor) -> None:
        keep = self.cfg.record_points != "none"
        if t % self.M == 0:
            self.cur_sum.zero_()
            self.cur_points = []
        self.cur_sum.add_(w)
        if keep:
            self.cur_points.append(w.clone())
        if self.cfg.record_points == "all":
            self.all_points.append(w.clone())
        if t // self.M == self.selected:
            self.sel_sum.add_(w)
            self.sel_count += 1
            if keep:
                self.sel_points.append(w.clone())
        if (t + 1) % self.M == 0:
            self.last_mean = self.cur_sum / self.M
            self.last_points = self.cur_points

    # -- the update --------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, params, release, run):
        t = run.step
        lifted = release.value.lift(params)
        g = torch.cat([lifted[n].reshape(-1) for n in self.view.names]).to(self.view.dtype)
        w = self.view.flat(params)  # w_t, where the oracle was queried
        self._record(t, w)
        eta = self._eta(g, run)
        x_next = self.x + self.delta                      # x_{t+1} = x_t + Δ_t
        v = self.delta - eta * g                          # OGD on <g̃_t, ·>
        nv = float(torch.linalg.vector_norm(v))
        delta_next = v * min(1.0, self.D / nv) if nv > 0 else v   # Π_D
        if self.restart and (t + 1) % self.restart == 0:  # a new episode restarts the learner at 0
            delta_next = torch.zeros_like(delta_next)
            self.grad_sq = 0.0
        s = float(torch.rand(1, generator=run.rng.generator("o2nc_s", t + 1), dtype=torch.float64))
        w_next = x_next + s * delta_next
        tol = 1 + self.view.slack
        dn = float(torch.linalg.vector_norm(delta_next))
        if dn > self.D * tol:
            raise RuntimeError(f"‖Δ‖ = {dn:.6g} exceeds D = {self.D:.6g}")
        self.x, self.delta = x_next, delta_next
        self.view.write_(params, w_next)
        # measured on the point the oracle will query (rounded to the parameters' dtype)
        gap = float(torch.linalg.vector_norm(self.view.flat(params) - w))
        if gap > 2 * self.D * tol:  # spec 001 coupling 3: every sensitivity rests on this
            raise RuntimeError(f"‖w_(t+1) − w_t‖ = {gap:.6g} exceeds 2D = {2 * self.D:.6g}")

    # -- output ------------------------------------------------------------------------------------

    def _output_flat(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        mode = self.cfg.output
        if mode == "last":
            return None, []
        if mode == "random_window" and self.sel_count == self.M:
            return self.sel_sum / self.M, self.sel_points
        # the chosen window is incomplete (a run stopped early) or last_window: the last complete window
        return self.last_mean, self.last_points

    def output(self, params, run):
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
        return torch.stack(self.all_points) if self.all_points else None

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self):
        out = {"x": self.x, "delta": self.delta, "eta": self.eta, "grad_sq": self.grad_sq,
               "selected": self.selected, "sel_sum": self.sel_sum, "sel_count": self.sel_count,
               "cur_sum": self.cur_sum}
        for key in ("sel_points", "cur_points", "last_points", "all_points"):
            pts = getattr(self, key)
            if pts:
                out[key] = torch.stack(pts)
        if self.last_mean is not None:
            out["last_mean"] = self.last_mean
        return out

    def load_state_dict(self, state):
        if not state:
            return
        self.x, self.delta = state["x"].clone(), state["delta"].clone()
        self.eta = state.get("eta")
        self.grad_sq = float(state.get("grad_sq", 0.0))
        self.selected = int(state["selected"])
        self.sel_sum, self.sel_count = state["sel_sum"].clone(), int(state["sel_count"])
        self.cur_sum = state["cur_sum"].clone()
        for key in ("sel_points", "cur_points", "last_points", "all_points"):
            setattr(self, key, list(state[key].clone().unbind(0)) if key in state else [])
        self.last_mean = state["last_mean"].clone() if "last_mean" in state else None


UPDATE_RULES = (O2NC,)
