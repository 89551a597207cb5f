"""benchmarks/minilm_sst2_head_sim.py replays the head's DP training with closed-form per-example
gradients and exact directional derivatives: both must be what autograd and the central difference
DPZero takes give, or its ranking of settings means nothing."""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def _sim():
    spec = importlib.util.spec_from_file_location("head_sim", REPO / "benchmarks" / "minilm_sst2_head_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _head_data(n=12, dim=16, labels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = {"x": F.normalize(torch.randn(n, dim, generator=g, dtype=torch.float64), dim=-1),
         "y": torch.randint(labels, (n,), generator=g)}
    w = 5 * torch.randn(labels, dim, generator=g, dtype=torch.float64)
    b = torch.randn(labels, generator=g, dtype=torch.float64)
    return d, w, b


def test_per_example_head_gradients_match_autograd():
    sim = _sim()
    d, w, b = _head_data()
    idx = torch.tensor([0, 3, 4, 7, 11])
    r, x = sim.per_example_head_grads(d, w, b, idx)
    for k, i in enumerate(idx.tolist()):
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        F.cross_entropy((d["x"][i] @ wi.T + bi)[None], d["y"][i][None]).backward()
        torch.testing.assert_close(torch.outer(r[k], x[k]), wi.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r[k], bi.grad, rtol=1e-12, atol=1e-12)


def test_directional_derivatives_match_dpzero_central_difference():
    sim = _sim()
    d, w, b = _head_data(seed=1)
    g = torch.Generator().manual_seed(2)
    uw = torch.randn(w.shape, generator=g, dtype=torch.float64)
    ub = torch.randn(b.shape, generator=g, dtype=torch.float64)
    idx = torch.arange(len(d["y"]))
    r, x = sim.per_example_head_grads(d, w, b, idx)
    exact = sim.directional_derivatives(r, x, uw, ub)

    def losses(lam):
        return F.cross_entropy(d["x"] @ (w + lam * uw).T + b + lam * ub, d["y"], reduction="none")

    lam = 1e-4  # the central difference's error is O(λ²)
    central = (losses(lam) - losses(-lam)) / (2 * lam)
    torch.testing.assert_close(exact, central, rtol=1e-6, atol=1e-7)
    # and not merely small: the derivatives differ from example to example
    assert exact.abs().max() > 0.1 and exact.std() > 0.05
