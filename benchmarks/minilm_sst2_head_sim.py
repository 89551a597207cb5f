"""A fast simulation of DP training of the MiniLM + SST-2 head alone, to rank settings before real runs.

When only the head trains, MiniLM's pooled features do not change, so they are computed once (the
recipe's objective, its tokenizer and its mean pooling, on the recipe's k = 512 per class and on
SST-2's long dev rows, as ``minilm_sst2_dev_search.py`` scores them) and the private training of the
770 head coordinates is replayed on them: Poisson sampling at q = B / n, the noise multiplier the
PLD accountant calibrates to the recipe's (ε, δ) for those steps, per-example clipping at C (the
head's per-example gradient is closed-form), then Adam (DP-Adam) or a two-point step along a
Gaussian direction (DPZero, with the exact directional derivative in place of the central
difference). A configuration costs about a second; real runs confirm the ranking. Dev rows only,
never the test sentences.

    python benchmarks/minilm_sst2_head_sim.py --method dpzero --batch 64 --steps 150 \\
        --lr 0.03 0.1 0.3 --clip 1.0 --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from dpregistry.moments import step_size, update_moments_

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm_sst2_dev_search import long_dev, pld_noise_multiplier  # noqa: E402

BETAS = (0.9, 0.999)  # the recipes' Adam


def features(recipe: str, data: str, cache: Path) -> dict:
    """Normalised pooled features of the training set and the long dev rows, and the step-0 head."""
    if cache.exists():
        return torch.load(cache)
    from dpregistry.api import load_recipe
    from dpregistry.run import Run

    dev = long_dev(Path(data), cache.with_suffix(".dev.tsv"))
    obj = Run(load_recipe(recipe, [f"data.path={data}", f"data.test={dev}"])).prepare().objective
    d = {"x": obj.encode(obj.train_tok), "y": obj.y_train, "x_dev": obj.encode(obj.test_tok), "y_dev": obj.y_test,
         "w": obj.model.head.weight.detach().clone(), "b": obj.model.head.bias.detach().clone()}
    torch.save(d, cache)
    return d


def per_example_head_grads(d, w, b, idx):
    """Per-example gradients of the cross-entropy w.r.t. the head: (p − y) xᵀ and p − y."""
    x = d["x"][idx]
    r = (x @ w.T + b).softmax(-1) - F.one_hot(d["y"][idx], w.shape[0]).float()
    return r, x


def directional_derivatives(r, x, uw, ub):
    """Each example's loss derivative along the direction (uw, ub): ⟨(p − y) xᵀ, uw⟩ + ⟨p − y, ub⟩."""
    return (r * (x @ uw.T + ub)).sum(1)


def simulate(d, method: str, B: float, steps: int, lr: float, C: float, sigma: float, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    n, q = len(d["y"]), B / len(d["y"])
    w, b = d["w"].clone(), d["b"].clone()
    m = [torch.zeros_like(w), torch.zeros_like(b)]
    v = [torch.zeros_like(w), torch.zeros_like(b)]
    for t in range(1, steps + 1):
        idx = (torch.rand(n, generator=g) < q).nonzero().squeeze(1)
        r, x = per_example_head_grads(d, w, b, idx)
        if method == "dp_adam":
            norms = r.norm(dim=1) * (x.norm(dim=1) ** 2 + 1).sqrt()
            rc = r * (C / norms).clamp(max=1.0)[:, None]
            grads = [rc.T @ x, rc.sum(0)]
            grads = [(s + sigma * C * torch.randn(s.shape, generator=g)) / (q * n) for s in grads]
            alpha = step_size(lr, BETAS, t)
            for p, mm, vv, gg in zip((w, b), m, v, grads):
                update_moments_(mm, vv, gg, BETAS)
                p.sub_(alpha * mm / (vv.sqrt() + 1e-8))
        else:  # dpzero: one Gaussian direction, clipped directional derivatives, one scalar noise
            uw, ub = torch.randn(w.shape, generator=g), torch.randn(b.shape, generator=g)
            deriv = directional_derivatives(r, x, uw, ub)
            est = (deriv.clamp(-C, C).sum() + sigma * C * float(torch.randn(1, generator=g))) / (q * n)
            w.sub_(lr * est * uw)
            b.sub_(lr * est * ub)
    return float(((d["x_dev"] @ w.T + b).argmax(-1) == d["y_dev"]).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="minilm_sst2_dp_adam", help="the recipe whose model, head and data to use")
    ap.add_argument("--data", default=os.environ.get("DPREG_SST2_DIR"), help="full SST-2 (train.tsv, dev.tsv)")
    ap.add_argument("--cache", default="runs/minilm_sst2_head_features.pt")
    ap.add_argument("--method", choices=["dp_adam", "dpzero"], default="dp_adam")
    ap.add_argument("--batch", type=float, nargs="+", default=[256])
    ap.add_argument("--steps", type=int, nargs="+", default=[30])
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    ap.add_argument("--clip", type=float, nargs="+", default=[1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--epsilon", type=float, default=6.0, help="inf: no noise")
    ap.add_argument("--delta", type=float, default=1e-5)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = Path(a.cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    d = features(a.recipe, a.data, cache)
    step0 = float(((d["x_dev"] @ d["w"].T + d["b"]).argmax(-1) == d["y_dev"]).float().mean())
    print(f"{a.method}, head only, {len(d['y'])} training examples, {len(d['y_dev'])} long dev rows, "
          f"step-0 dev accuracy {step0:.4f}")
    print(f"{'B':>6}{'steps':>7}{'sigma':>8}{'lr':>9}{'C':>6}{'mean dev':>10}  per seed")
    for B in a.batch:
        for T in a.steps:
            # ε = inf: no noise (with a large --clip, non-private training of the head)
            sigma = 0.0 if math.isinf(a.epsilon) else pld_noise_multiplier(B / len(d["y"]), T, a.epsilon, a.delta)
            for lr in a.lr:
                for C in a.clip:
                    accs = [simulate(d, a.method, B, T, lr, C, sigma, s) for s in a.seeds]
                    print(f"{B:>6g}{T:>7}{sigma:>8.3f}{lr:>9.3g}{C:>6g}{sum(accs) / len(accs):>10.4f}  "
                          + " ".join(f"{x:.4f}" for x in accs), flush=True)


if __name__ == "__main__":
    main()
