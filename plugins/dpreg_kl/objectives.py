"""Objectives with known KL constants, in closed form (spec 004 §0, §5 D).

Each is a linear model on params ``{"w": [d]}`` (float64 by default) with closed-form per-record
losses and gradients, so the estimators never need autograd. Records that are identical (the axis
design repeats d distinct records n/d times) are *grouped*: ``record_groups(indices)`` returns the
distinct records and their multiplicities, and the clipped sum weighs each distinct record by its
count. That is exactly the clipped sum over all n records (identical records have identical
gradients and clip weights), at a cost independent of n, so n√ρ can reach 1e8 (spec §5 D).

``kl_constants()`` declares constants that do not depend on the private data (only on the public
design, the regularisation and public bounds): L0 (Lipschitz on the declared ball), L1 (per-sample
smoothness), (γ, κ) of the KL* condition, F0 ≥ F(w0) − F*, and the weak-convexity constant
(:class:`~dpreg_kl.common.KLConstants`). The algorithms and privatizers read them when a recipe
says ``auto``. A wrong constant hurts utility, never privacy: privacy comes from clipping (spec §4,
coupling 8).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from dpregistry import Objective, StageParams, UserError
from dpregistry.data import load_tabular

from .common import DeclaresKLConstants, GroupedRecords, KLConstants

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class LinearKLObjective(Objective, DeclaresKLConstants, GroupedRecords):
    """Shared machinery: params {"w"}, grouped records, exact full-batch values, evaluation."""

    def setup(self, ctx):
        self.dtype = DTYPES[self.cfg.dtype]
        self.build()
        self.w = torch.zeros(self.d, dtype=self.dtype)
        self._groups_key = None
        self._groups = None
        self._all = None

    # -- subclasses (and per_record_losses, per_record_grads, kl_constants: see .common) -------

    def build(self) -> None:
        raise NotImplementedError

    def record_keys(self, indices: torch.Tensor) -> torch.Tensor:
        """The distinct record each training index refers to (identity unless records repeat)."""
        return indices

    def distinct_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct records, multiplicities) of the whole training set."""
        raise NotImplementedError

    def optimum_value(self) -> float:
        """F* = min F (non-private: only for the excess-risk diagnostic)."""
        raise NotImplementedError

    # -- the objective contract ---------------------------------------------------------------

    def params(self):
        return {"w": self.w}

    def record_groups(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct records, counts) among ``indices``; cached for a repeated index tensor."""
        if indices is self._groups_key:
            return self._groups
        keys = self.record_keys(indices)
        if keys is indices:
            out = (indices, torch.ones(len(indices), dtype=self.dtype))
        else:
            counts = torch.bincount(keys, minlength=self.n_distinct)
            present = counts.nonzero().squeeze(1)
            out = (present, counts[present].to(self.dtype))
        self._groups_key, self._groups = indices, out
        return out

    def functional_losses(self, params, indices):
        return self.per_record_losses(params["w"], self.record_keys(indices))

    def losses(self, indices):
        return self.functional_losses({"w": self.w}, indices)

    def full_loss(self, w: torch.Tensor | None = None) -> float:
        """F(w) exactly (weighted over the distinct records)."""
        w = self.w if w is None else w
        keys, counts = self.distinct_weights()
        return float((self.per_record_losses(w, keys) * counts).sum() / counts.sum())

    def full_grad(self, w: torch.Tensor | None = None, clip: float | None = None) -> torch.Tensor:
        """∇F(w) exactly; with ``clip``, the mean of per-record gradients clipped to that norm."""
        w = self.w if w is None else w
        keys, counts = self.distinct_weights()
        g = self.per_record_grads(w, keys)
        if clip is not None:
            norms = g.norm(dim=1)
            g = g * (clip / norms).clamp(max=1.0).nan_to_num(1.0).unsqueeze(1)
        return (g * counts.unsqueeze(1)).sum(0) / counts.sum()

    def excess_risk(self, w: torch.Tensor | None = None) -> float:
        return self.full_loss(w) - self.optimum_value()

    def evaluate(self):
        """The excess empirical risk F(w) − F* (the papers' measure) and ‖∇F(w)‖: computed on the
        private training data, so diagnostics that the guarantee does not cover (like a training
        loss); the tabular objectives add held-out metrics."""
        return {"train_excess_risk": self.excess_risk(), "train_grad_norm": float(self.full_grad().norm())}


# ------------------------------------------------------------------------------------------
# the axis design: f_i(w) = |w_j − w*_j|^p / p, j = i mod d
# ------------------------------------------------------------------------------------------


class PowerParams(StageParams):
    dim: int = Field(default=5, gt=0, description="d")
    n: int = Field(default=100_000, gt=0, description="records (a multiple of dim)")
    power: float = Field(default=2.0, gt=1, description="p: 2 is least squares (PL), 4 the κ = 4/3 quartic")
    radius: float = Field(default=1.0, gt=0, description="ball around w* on which L0 and L1 are declared")
    seed: int = Field(default=0, description="public seed of w* (a unit vector)")
    dtype: Literal["float32", "float64"] = "float64"


class PowerObjective(LinearKLObjective):
    """Axis design f_i(w) = |w_j − w*_j|^p/p (j = i mod d): least squares at p = 2, quartic at p = 4.

    F(w) = (1/(pd)) Σ_j |w_j − w*_j|^p with ‖w*‖ = 1 and w0 = 0. It satisfies KL* exactly with
    κ = p/(p − 1) and γ^κ = d^{κ − p/q}/p, q = 2(p − 1) (p ≥ 2; equality when all |w_j − w*_j| agree),
    or γ^κ = d^{κ−1}/p (1 < p < 2). p = 2: γ = √(d/2), i.e. μ-PL with μ = 1/d (spec §5 D1);
    p = 4: γ = √(2d)/4 (spec §5 D2). On the ball ‖w − w*‖ ≤ radius a record's gradient norm is at
    most radius^{p−1} (L0) and its smoothness (p − 1)·radius^{p−2} (L1, p ≥ 2).
    """

    name = "kl_power"
    Params = PowerParams

    def build(self):
        p = self.cfg
        if p.n % p.dim:
            raise UserError(f"n = {p.n} must be a multiple of dim = {p.dim} (every axis record equally often)",
                            key="objective.n")
        self.d = self.n_distinct = p.dim
        self.n_train = p.n
        g = torch.Generator().manual_seed(p.seed)
        w_star = torch.randn(p.dim, generator=g, dtype=torch.float64)
        self.w_star = (w_star / w_star.norm()).to(DTYPES[p.dtype])
        self._distinct = (torch.arange(p.dim), torch.full((p.dim,), float(p.n // p.dim), dtype=DTYPES[p.dtype]))

    def record_keys(self, indices):
        return indices % self.d

    def distinct_weights(self):
        return self._distinct

    def per_record_losses(self, w, keys):
        u = w[keys] - self.w_star[keys]
        return u.abs().pow(self.cfg.power) / self.cfg.power

    def per_record_grads(self, w, keys):
        u = w[keys] - self.w_star[keys]
        g = torch.zeros(len(keys), self.d, dtype=w.dtype)
        g[torch.arange(len(keys)), keys] = u.abs().pow(self.cfg.power - 1) * u.sign()
        return g

    def optimum_value(self):
        return 0.0

    def kl_constants(self):
        p, d, R = self.cfg.power, self.d, self.cfg.radius
        kappa = p / (p - 1)
        q = 2 * (p - 1)
        gamma_k = d ** (kappa - p / q) / p if p >= 2 else d ** (kappa - 1) / p
        return KLConstants(kappa=kappa, gamma=gamma_k ** (1 / kappa), lipschitz=R ** (p - 1),
                           f0=float(self.w_star.abs().pow(p).sum()) / (p * d), weak_convexity=0.0,
                           smoothness=(p - 1) * R ** (p - 2) if p >= 2 else None)


# ------------------------------------------------------------------------------------------
# real tabular data (scikit-learn's bundled sets): ridge least squares and logistic regression
# ------------------------------------------------------------------------------------------


class TabularKLParams(StageParams):
    dataset: str = Field(description="a scikit-learn bundled data set")
    regularization: float = Field(default=0.1, gt=0, description="λ of (λ/2)‖w‖²: F is λ-strongly convex, so λ-PL")
    radius: float = Field(default=2.0, gt=0, description="ball ‖w‖ ≤ radius on which L0 is declared")
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    seed: int = 0
    dtype: Literal["float32", "float64"] = "float64"


class TabularKL(LinearKLObjective):
    """Rows scaled to ‖a_i‖ ≤ 1 (a per-record transform) after public standardisation."""

    task = ""
    _full_key = None

    def build(self):
        t = load_tabular(self.cfg.dataset, test_fraction=self.cfg.test_fraction, seed=self.cfg.seed,
                         dtype=torch.float64)
        if t.task != self.task:
            raise UserError(f"{self.name} needs a {self.task} data set; {self.cfg.dataset!r} is {t.task}",
                            key="objective.dataset")
        dt = DTYPES[self.cfg.dtype]
        self.x_train, self.x_test = _unit_rows(t.x_train).to(dt), _unit_rows(t.x_test).to(dt)
        self.y_train, self.y_test = self.targets(t.y_train, t), self.targets(t.y_test, t)
        self.n_train = self.n_distinct = len(self.y_train)
        self.d = self.x_train.shape[1]
        self._distinct = (torch.arange(self.n_train), torch.ones(self.n_train, dtype=dt))
        self._fstar = None

    def rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, targets) of records ``keys``; the whole table without a gather when keys is
        the full set in order (an indexed gather costs more than the model on a small table)."""
        if keys is self._distinct[0] or keys is self._full_key:
            return self.x_train, self.y_train
        if len(keys) == self.n_train and torch.equal(keys, self._distinct[0]):
            self._full_key = keys
            return self.x_train, self.y_train
        return self.x_train[keys], self.y_train[keys]

    def targets(self, y, table):
        raise NotImplementedError

    def distinct_weights(self):
        return self._distinct

    def optimum_value(self):
        if self._fstar is None:
            self._fstar = self.full_loss(self._solve())
        return self._fstar

    def _solve(self) -> torch.Tensor:
        """Newton's method on the strongly convex F (non-private, for the diagnostic only)."""
        w = torch.zeros(self.d, dtype=torch.float64)
        for _ in range(50):
            g = self.full_grad(w.to(self.dtype)).double()
            H = self.hessian(w)
            step = torch.linalg.solve(H, g)
            w = w - step
            if float(step.norm()) < 1e-13:
                break
        return w.to(self.dtype)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp(min=1.0)


class LeastSquaresParams(TabularKLParams):
    dataset: str = "diabetes"
    target_bound: float = Field(default=3.0, gt=0, description="|y| ≤ Y: targets are clamped to [−Y, Y]")


class LeastSquares(TabularKL):
    """Ridge least squares ½(aᵀw − y)² + (λ/2)‖w‖² on a bundled regression set (κ = 2, μ = λ).

    Declared constants: L1 = 1 + λ (‖a‖ ≤ 1), γ = 1/√(2λ), L0 = radius + Y + λ·radius on
    ‖w‖ ≤ radius, F0 = Y²/2 ≥ F(0) − F*.
    """

    name = "kl_least_squares"
    task = "regression"
    Params = LeastSquaresParams

    def targets(self, y, table):
        Y = self.cfg.target_bound
        return y.clamp(-Y, Y).to(DTYPES[self.cfg.dtype])

    def per_record_losses(self, w, keys):
        a, y = self.rows(keys)
        r = a @ w - y
        return 0.5 * r * r + 0.5 * self.cfg.regularization * (w * w).sum()

    def per_record_grads(self, w, keys):
        a, y = self.rows(keys)
        r = a @ w - y
        return r.unsqueeze(1) * a + self.cfg.regularization * w

    def hessian(self, w):
        a = self.x_train.double()
        return a.T @ a / len(a) + self.cfg.regularization * torch.eye(self.d, dtype=torch.float64)

    def kl_constants(self):
        lam, R, Y = self.cfg.regularization, self.cfg.radius, self.cfg.target_bound
        return KLConstants(kappa=2.0, gamma=1.0 / math.sqrt(2 * lam), lipschitz=R + Y + lam * R,
                           smoothness=1.0 + lam, f0=0.5 * Y * Y, weak_convexity=0.0)

    @torch.no_grad()
    def evaluate(self):
        out = super().evaluate()
        r = self.x_test @ self.w - self.y_test
        out["test_mse"] = float((r * r).mean())
        return out


class LogisticParams(TabularKLParams):
    dataset: str = "breast_cancer"


class Logistic(TabularKL):
    """L2-regularised logistic regression log(1 + e^{−y aᵀw}) + (λ/2)‖w‖², y = ±1 (κ = 2, μ = λ).

    Declared constants: L1 = 1/4 + λ, γ = 1/√(2λ), L0 = 1 + λ·radius, F0 = ln 2 = F(0) ≥ F(0) − F*.
    """

    name = "kl_logistic"
    task = "classification"
    Params = LogisticParams

    def targets(self, y, table):
        if table.n_classes != 2:
            raise UserError(f"kl_logistic needs two classes; {self.cfg.dataset!r} has {table.n_classes}",
                            key="objective.dataset")
        return (2.0 * y - 1.0).to(DTYPES[self.cfg.dtype])

    def per_record_losses(self, w, keys):
        a, y = self.rows(keys)
        m = y * (a @ w)
        return torch.nn.functional.softplus(-m) + 0.5 * self.cfg.regularization * (w * w).sum()

    def per_record_grads(self, w, keys):
        a, y = self.rows(keys)
        s = torch.sigmoid(-y * (a @ w))
        return (-y * s).unsqueeze(1) * a + self.cfg.regularization * w

    def hessian(self, w):
        a = self.x_train.double()
        p = torch.sigmoid(a @ w.double())
        return (a.T * (p * (1 - p))) @ a / len(a) + self.cfg.regularization * torch.eye(self.d, dtype=torch.float64)

    def kl_constants(self):
        lam, R = self.cfg.regularization, self.cfg.radius
        return KLConstants(kappa=2.0, gamma=1.0 / math.sqrt(2 * lam), lipschitz=1.0 + lam * R,
                           smoothness=0.25 + lam, f0=math.log(2.0), weak_convexity=0.0)

    @torch.no_grad()
    def evaluate(self):
        out = super().evaluate()
        out["test_accuracy"] = float(((self.x_test @ self.w) * self.y_test > 0).double().mean())
        return out


OBJECTIVES = (PowerObjective, LeastSquares, Logistic)
