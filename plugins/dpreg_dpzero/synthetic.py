"""A vectorised simulator of the synthetic experiment of DPZero §5.1 (spec §5.1, §8 N–Q).

f(x; x_i) = ½(x − x_i)ᵀA(x − x_i) with x_i ~ N(1, I_d), A = diag(a) with ‖A‖₂ = 1:
(a) a_i = 1, (b) a_i = 1/√i, (c) a_i = 1/i. Full batch, sphere directions, x_0 = 0, the last iterate,
Lemma 2.2 noise at (ε, δ); the metric is the test gradient norm ‖A(x − mean(x_test))‖.

A grid search (the paper's Table 4 has 880 points per method and d) run by run would
take days, so this module runs every grid point at once with the *same* public directions u_t
(as the spec's re-simulation did) and the same data, using two facts:

* the central difference on a quadratic is exact: Δ_i = u_tᵀA(x − x_i) = s − w_i with
  s = u_tᵀAx and w_i = x_iᵀAu_t, and w (an n-vector per step) does not depend on x, so one matrix
  product X·(AU) serves a block of steps and every grid point;
* Σ_i clip_C(s − w_i) is piecewise linear in s: with w sorted and its prefix sums, it costs
  O(log n) per grid point (examples with w_i ≤ s − C give +C, those with w_i ≥ s + C give −C).

DPGD-0th clips the vector Δ_i·u, i.e. the scalar at C/‖u‖ = C/√d on the sphere, and adds
d-dimensional noise. DP-GD clips per-example gradients A(x − x_i) in L2.

The data, the directions (``Direction`` from the run's public seeds) and, on request, the noise
(the run's noise source) are those of a real run, so a test can check this simulator against
real runs of ``dpzero_full_batch`` and ``dpgd_0th`` step by step.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from dpregistry.directions import Direction
from dpregistry.rng import RunRNG

from .accountant import kov_sigma

MODES = {"a": "identity", "b": "sqrt", "c": "harmonic"}

#: the paper's grid (Table 4)
PAPER_T = (10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120)
PAPER_ALPHA = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
PAPER_C = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)
#: the spec's reduced DP-GD grid (§8 Q footnote)
DPGD_T = (40, 160, 640, 2560)
DPGD_ALPHA = (0.01, 0.03, 0.1, 0.3, 1.0)
DPGD_C = (0.3, 1.0, 3.0, 10.0, 30.0)


@dataclass
class Problem:
    """The data of one (mode, d, seed); generated exactly as the ``quadratic`` objective does."""

    a: torch.Tensor          # [d] diagonal of A
    data: torch.Tensor       # [n, d] training points x_i
    test_mean: torch.Tensor  # [d]

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def d(self) -> int:
        return self.data.shape[1]

    def test_grad_norm(self, x: torch.Tensor) -> torch.Tensor:
        """‖A(x − mean(x_test))‖ for every row of x."""
        return (self.a * (x - self.test_mean)).norm(dim=-1)


def make_problem(hessian: str, dim: int, n: int = 10_000, n_test: int = 10_000, seed: int = 0,
                 dtype=torch.float64) -> Problem:
    hessian = MODES.get(hessian, hessian)
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(1, dim + 1, dtype=dtype)
    a = {"identity": torch.ones_like(i), "sqrt": i.rsqrt(), "harmonic": 1.0 / i}[hessian]
    data = 1.0 + torch.randn(n, dim, generator=g, dtype=dtype)
    test_mean = (1.0 + torch.randn(n_test, dim, generator=g, dtype=dtype)).mean(0)
    return Problem(a, data, test_mean)


@dataclass(frozen=True)
class Config:
    steps: int
    lr: float
    clip: float


def grid(steps: Iterable[int], lrs: Iterable[float], clips: Iterable[float]) -> list[Config]:
    return [Config(t, a, c) for t in steps for a in lrs for c in clips]


@contextmanager
def threads(n: int):
    """Run small per-step tensor ops on ``n`` threads (a thread barrier per tiny op costs more than
    the op itself, badly so on a busy machine); block matrix products keep the caller's setting."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _clipped_sums(sorted_w: torch.Tensor, prefix: torch.Tensor, s: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """Σ_i sign(s − w_i)·min(|s − w_i|, C) for each (s, C) of a row, from sorted w and its prefix sums.

    Shapes: sorted_w [S, n], prefix [S, n+1] (fp64), s and clip [S, k]; returns [S, k] in fp64.
    """
    n = sorted_w.shape[-1]
    s, clip = s.to(prefix.dtype), clip.to(prefix.dtype)
    finite = torch.isfinite(clip)
    c = torch.where(finite, clip, torch.zeros_like(clip))
    wt = sorted_w.dtype  # the sum is continuous in s, so rounding a threshold to w's dtype is harmless
    lo = torch.searchsorted(sorted_w, torch.where(finite, s - c, torch.full_like(s, -math.inf)).to(wt), right=True)
    hi = torch.searchsorted(sorted_w, torch.where(finite, s + c, torch.full_like(s, math.inf)).to(wt), right=False)
    mid = (hi - lo).to(s.dtype)
    return c * (lo - (n - hi)).to(s.dtype) + mid * s - (prefix.gather(-1, hi) - prefix.gather(-1, lo))


def simulate_zo(problem: Problem, configs: list[Config], *, method: str = "dpzero", seed: int = 0,
                **kw) -> torch.Tensor:
    """The last iterates [K, d] of DPZero (``method='dpzero'``) or DPGD-0th (``'dpgd_0th'``)."""
    return simulate_zo_methods([problem], configs, methods=(method,), seeds=[seed], **kw)[method][0]


def simulate_zo_methods(problems: list[Problem], configs: list[Config], *, seeds: list[int],
                        methods=("dpzero", "dpgd_0th"), epsilon: float = 2.0, delta: float = 1e-6,
                        direction: str = "sphere", noise: Callable[[int, int, tuple], torch.Tensor] | None = None,
                        block: int = 256, sigmas: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Last iterates [S, K, d] per method: S independent repetitions (problem s with run seed
    ``seeds[s]``), every grid point and every method on the same directions and data products.

    u_t is a real run's direction at step t for run seed ``seeds[s]``. ``noise(t, k, shape)``
    gives the standard normal draws of grid point k at step t (only with S = 1; default: seeded
    generators). ``sigmas`` overrides the Lemma 2.2 std on the mean (per config).
    """
    for m in methods:
        if m not in ("dpzero", "dpgd_0th"):
            raise ValueError(f"unknown method {m!r}")
    if len(problems) != len(seeds) or (noise is not None and len(seeds) != 1):
        raise ValueError("one seed per problem (and a custom noise only with one problem)")
    S, n, d = len(problems), problems[0].n, problems[0].d
    dt = problems[0].data.dtype
    K = len(configs)
    order = sorted(range(K), key=lambda k: -configs[k].steps)  # active grid points form a prefix
    steps = torch.tensor([configs[k].steps for k in order])
    lr = torch.tensor([configs[k].lr for k in order], dtype=dt)
    clip = torch.tensor([configs[k].clip for k in order], dtype=dt)
    sig = [kov_sigma(configs[k].clip, n, configs[k].steps, epsilon, delta) if sigmas is None else sigmas[k]
           for k in order]
    sigma = torch.tensor(sig, dtype=dt)
    xs = {m: torch.zeros(S, K, d, dtype=dt) for m in methods}
    gens = {m: torch.Generator().manual_seed(seeds[0] + 7919 * (i + 1)) for i, m in enumerate(methods)}
    rngs = [RunRNG(sd) for sd in seeds]
    template = torch.zeros(d, dtype=dt)
    t_max = int(steps.max())
    for t0 in range(0, t_max, block):
        ts = range(t0, min(t0 + block, t_max))
        # [S, b, d] directions; [S, b, n] w_{t,i} = x_iᵀAu_t, sorted with prefix sums (fp64)
        U = torch.stack([torch.stack([Direction(r.step_seed("direction", t), direction).dense([template])[0]
                                      for t in ts]) for r in rngs])
        AU = torch.stack([U[i] * p.a for i, p in enumerate(problems)])
        W = torch.stack([AU[i] @ p.data.T for i, p in enumerate(problems)])
        sorted_w = torch.from_numpy(np.sort(W.numpy(), axis=-1))  # numpy's SIMD sort: ~25x torch's on CPU
        prefix = torch.nn.functional.pad(sorted_w.cumsum(-1, dtype=torch.float64), (1, 0))
        with threads(1):
            for j, t in enumerate(ts):
                k = int((steps > t).sum())
                u = U[:, j, None, :]                               # [S, 1, d]
                sw, pf = sorted_w[:, j].contiguous(), prefix[:, j].contiguous()
                for m, x in xs.items():
                    xk = x[:, :k]
                    s = (xk @ AU[:, j, :, None])[..., 0]           # [S, k]: u_tᵀAx
                    # DPGD-0th clips ‖Δ_i·u‖ at C, i.e. the scalar Δ_i at C/‖u‖ (spec §2.2 notes)
                    cl = clip[:k] / u.norm(dim=-1) if m == "dpgd_0th" else clip[:k].expand(S, k)
                    g = (_clipped_sums(sw, pf, s, cl) / n).to(dt)  # [S, k]
                    if m == "dpzero":
                        z = _draws(noise, gens[m], t, S, k, (), dt)
                        xk -= (lr[:k] * (g + sigma[:k] * z))[..., None] * u
                    else:
                        z = _draws(noise, gens[m], t, S, k, (d,), dt)
                        xk -= lr[:k, None] * (g[..., None] * u + sigma[:k, None] * z)
    inv = torch.tensor(order)
    out = {}
    for m, x in xs.items():
        out[m] = torch.empty_like(x)
        out[m][:, inv] = x
    return out


def _draws(noise, gen, t, S, k, shape, dtype):
    """[S, k, *shape] standard normals."""
    if noise is None:
        return torch.randn((S, k) + shape, generator=gen, dtype=dtype)
    return torch.stack([noise(t, i, shape).to(dtype).reshape(shape) for i in range(k)])[None]


def simulate_dpgd(problem: Problem, configs: list[Config], *, epsilon: float = 2.0, delta: float = 1e-6,
                  seed: int = 0) -> torch.Tensor:
    """Last iterates of first-order DP-GD: per-example gradients A(x − x_i) clipped in L2, Lemma 2.2 noise."""
    n, d = problem.n, problem.d
    dt = problem.data.dtype
    K = len(configs)
    order = sorted(range(K), key=lambda k: -configs[k].steps)
    steps = torch.tensor([configs[k].steps for k in order])
    lr = torch.tensor([configs[k].lr for k in order], dtype=dt)
    clip = torch.tensor([configs[k].clip for k in order], dtype=dt)
    sigma = torch.tensor([kov_sigma(configs[k].clip, n, configs[k].steps, epsilon, delta) for k in order], dtype=dt)
    a, X = problem.a, problem.data
    AX = X * a                                   # rows A x_i
    sq_ax = AX.pow(2).sum(1)                     # ‖A x_i‖²
    x = torch.zeros(K, d, dtype=dt)
    gen = torch.Generator().manual_seed(seed + 104729)
    with threads(1):
        _dpgd_steps(steps, lr, clip, sigma, a, AX, sq_ax, x, gen, n, d, dt)
    out = torch.empty_like(x)
    out[torch.tensor(order)] = x
    return out


def _dpgd_steps(steps, lr, clip, sigma, a, AX, sq_ax, x, gen, n, d, dt):
    for t in range(int(steps.max())):
        k = int((steps > t).sum())
        ax = x[:k] * a                           # [k, d]
        cross = ax @ AX.T                        # [k, n]
        norms = (ax.pow(2).sum(1, keepdim=True) - 2 * cross + sq_ax).clamp_min(0).sqrt()
        w = (clip[:k, None] / norms).clamp(max=1.0)
        clipped = (ax * w.sum(1, keepdim=True) - w @ AX) / n   # (1/n) Σ_i w_i A(x − x_i)
        z = torch.randn(k, d, generator=gen, dtype=dt)
        x[:k] -= lr[:k, None] * (clipped + sigma[:k, None] * z)


def best(problem: Problem, configs: list[Config], finals: torch.Tensor) -> tuple[float, Config]:
    """The smallest test gradient norm over the grid (non-finite iterates excluded) and its point."""
    g = problem.test_grad_norm(finals)
    g = torch.where(torch.isfinite(g), g, torch.full_like(g, math.inf))
    k = int(torch.argmin(g))
    return float(g[k]), configs[k]
