"""Per-layer clipping (``privatizer.clipping: per_layer``) against an independent reference.

The reference takes each example's gradient by its own autograd backward, splits it into the
groups a reader of the model would name (one per layer that holds parameters, a tied table's
layers as one), clips each group to C/√G and sums. The hooks instead clip each group inside the
one backward, as its backprops arrive; both must agree, every example must move the sum by at
most C (the sensitivity the noise is calibrated to), and a layer's state must be gone before the
earlier layers' backprops arrive.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_run
from test_core_engine import RECIPE as ENGINE_RECIPE
from dpregistry import UserError
from dpregistry.clipping import clip_and_sum_per_layer
from dpregistry.persample import GradSampler, _LayerClip


class Tied(nn.Module):
    """Embedding tied to the output layer, a layer called twice, a LayerNorm and a bias-free layer."""

    def __init__(self, V=11, H=6):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.proj = nn.Linear(H, H, bias=False)
        self.out = nn.Linear(H, V)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = torch.tanh(self.mix(torch.tanh(self.mix(h))))
        return self.out(self.proj(self.norm(h)))


#: the groups of ``Tied`` as a reader names them: the tied table and the output layer are one (the
#: module lists the tied tensor once, as emb.weight)
GROUPS = [["emb.weight", "out.bias"], ["mix.weight", "mix.bias"], ["norm.weight", "norm.bias"],
          ["proj.weight"]]


def batch(B=5, T=4, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def losses_of(model, ids, targets):
    logits = model(ids)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1)


def per_example(model, loss_of, n):
    """Each example's gradient by its own backward (``loss_of(i)``: example i's loss), stacked; a
    parameter the loss does not reach gets zeros."""
    params = dict(model.named_parameters())
    out = {k: [] for k in params}
    for i in range(n):
        grads = torch.autograd.grad(loss_of(i), list(params.values()), allow_unused=True)
        for (k, p), g in zip(params.items(), grads):
            out[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(v) for k, v in out.items()}


def per_example_reference(model, ids, targets):
    return per_example(model, lambda i: losses_of(model, ids[i:i + 1], targets[i:i + 1])[0], ids.shape[0])


def per_example_classifier(model, x, y):
    return per_example(model, lambda i: F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), x.shape[0])


def group_norms(per_ex, names):
    return torch.sqrt(sum(per_ex[k].flatten(1).pow(2).sum(1) for k in names))


def clipped_reference(per_ex, groups, clip, keep=None):
    """Σ_i Σ_g min(1, C_g/‖G_i^g‖)·G_i^g, C_g = C/√G, over the examples ``keep`` says."""
    cg = clip / math.sqrt(len(groups))
    B = next(iter(per_ex.values())).shape[0]
    keep = torch.ones(B, dtype=torch.bool) if keep is None else keep
    out = {k: torch.zeros_like(v[0]) for k, v in per_ex.items()}
    for names in groups:
        w = torch.where(keep, (cg / group_norms(per_ex, names)).clamp(max=1.0), torch.zeros(()))
        for k in names:
            out[k] += (per_ex[k] * w.view(-1, *[1] * (per_ex[k].dim() - 1))).sum(0)
    return out


def contribution(model, ids, targets, passes=1):
    params = dict(model.named_parameters())
    gs = GradSampler(model, params, passes=passes)
    with torch.enable_grad(), gs.capture(ids.shape[0]):
        losses = losses_of(model, ids, targets)
    return gs, gs.contribution(losses)


@pytest.mark.usefixtures("fp64")
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("clip", [0.05, 1.0, 1e3])
def test_per_layer_sum_equals_the_reference(clip, passes):
    torch.manual_seed(0)
    model = Tied()
    ids, targets = batch()
    gs, c = contribution(model, ids, targets, passes)
    assert gs.n_clip_groups == len(GROUPS)
    got = clip_and_sum_per_layer(c, clip)
    per_ex = per_example_reference(model, ids, targets)
    expect = clipped_reference(per_ex, GROUPS, clip)
    for k, v in expect.items():
        torch.testing.assert_close(got.aggregate.tensors[k], v, atol=1e-10, rtol=1e-9, msg=lambda m: f"{k}: {m}")
    cg = clip / math.sqrt(len(GROUPS))
    clipped = sum(group_norms(per_ex, names) > cg for names in GROUPS) > 0
    assert (got.count, got.nonfinite, got.clipped) == (5, 0, int(clipped.sum()))


class UnusedCall(nn.Module):
    """A tied pair whose second layer's call never reaches the loss: its group closes only when
    the backward ends (the tap of the unused call sees no backprop)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.b.weight = self.a.weight

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.b(h)  # computed, never used
        return self.out(torch.tanh(self.a(h)))


@pytest.mark.usefixtures("fp64")
def test_a_group_with_a_call_outside_the_loss_is_still_summed():
    torch.manual_seed(3)
    model = UnusedCall()
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    gs = GradSampler(model, dict(model.named_parameters()))
    with torch.enable_grad(), gs.capture(5):
        losses = F.cross_entropy(model(x), y, reduction="none")
    got = clip_and_sum_per_layer(gs.contribution(losses), 0.3)
    expect = clipped_reference(per_example_classifier(model, x, y),
                               [["a.weight", "a.bias", "b.bias"], ["out.weight", "out.bias"]], 0.3)
    for k, v in expect.items():
        torch.testing.assert_close(got.aggregate.tensors[k], v, atol=1e-10, rtol=1e-9, msg=lambda m: f"{k}: {m}")
    assert float(expect["a.weight"].abs().max()) > 0


def _sum_without(model, ids, targets, clip, drop):
    keep = [i for i in range(ids.shape[0]) if i != drop]
    _, c = contribution(model, ids[keep], targets[keep])
    return clip_and_sum_per_layer(c, clip).aggregate.tensors


def _distance(a, b):
    return math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in a))


@pytest.mark.usefixtures("fp64")
def test_every_example_moves_the_sum_by_at_most_the_clip_and_a_wrong_group_bound_is_caught(monkeypatch):
    """The end-to-end sensitivity: the sum with and without example i differ by at most C (add or
    remove one example). With small C every group clips, so the distance is exactly √(G·C_g²) = C;
    a group bound of C instead of C/√G (a plausible slip) moves it by C·√G, and the check sees it."""
    torch.manual_seed(1)
    model = Tied()
    ids, targets = batch(B=4)
    clip = 1e-3

    def distances():
        _, c = contribution(model, ids, targets)
        full = clip_and_sum_per_layer(c, clip).aggregate.tensors
        return [_distance(full, _sum_without(model, ids, targets, clip, i)) for i in range(ids.shape[0])]

    d = distances()
    assert max(d) <= clip * (1 + 1e-9)
    assert min(d) >= clip * (1 - 1e-6)  # every group clipped: the bound is attained
    broken = _LayerClip.__init__

    def per_group_clip_of_c(self, sampler, uses, clip, finite):
        broken(self, sampler, uses, clip, finite)
        self.clip = clip
    monkeypatch.setattr(_LayerClip, "__init__", per_group_clip_of_c)
    assert min(distances()) > clip * math.sqrt(len(GROUPS)) * (1 - 1e-6)


@pytest.mark.usefixtures("fp64")
def test_a_nonfinite_example_is_dropped_and_counted():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    x[3] = float("nan")
    params = dict(model.named_parameters())
    gs = GradSampler(model, params)
    with torch.enable_grad(), gs.capture(5):
        losses = F.cross_entropy(model(x), y, reduction="none")
    got = clip_and_sum_per_layer(gs.contribution(losses), 0.5)
    keep = [0, 1, 2, 4]
    expect = clipped_reference(per_example_classifier(model, x[keep], y[keep]),
                               [["0.weight", "0.bias"], ["2.weight", "2.bias"]], 0.5)
    for k, v in expect.items():
        torch.testing.assert_close(got.aggregate.tensors[k], v, atol=1e-10, rtol=1e-9)
    assert got.nonfinite == 1 and math.isfinite(got.loss_sum)


@pytest.mark.usefixtures("fp64")
def test_each_group_is_summed_and_dropped_before_the_earlier_layers_backprops_arrive(monkeypatch):
    """The point of per-layer clipping: when a group closes, no other group's state is alive (the
    later layers' were summed and dropped, the earlier layers' backprops have not arrived)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    params = dict(model.named_parameters())
    gs = GradSampler(model, params)
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    with torch.enable_grad(), gs.capture(7):
        losses = F.cross_entropy(model(x), y, reduction="none")
    c = gs.contribution(losses)
    uses = c.pending.uses
    live_at_close, order = [], []
    close = _LayerClip._close

    def spy(self, g):
        live_at_close.append(sum(1 for u in uses if u.state))
        order.append(g)
        close(self, g)
    monkeypatch.setattr(_LayerClip, "_close", spy)
    clip_and_sum_per_layer(c, 1.0)
    assert order == [2, 1, 0]             # the last layer's group closes first, inside the backward
    assert live_at_close == [1, 1, 1]      # only the closing group's own call holds state
    assert all(not u.state and u.inp is None for u in uses)


@pytest.mark.usefixtures("fp64")
def test_a_contribution_is_clipped_per_layer_once_and_not_after_flat_reads():
    torch.manual_seed(4)
    model = Tied()
    ids, targets = batch()
    _, c = contribution(model, ids, targets)
    clip_and_sum_per_layer(c, 1.0)
    with pytest.raises(RuntimeError, match="once"):
        c.clipped_sum_per_layer(1.0)
    _, c = contribution(model, ids, targets)
    c.norms()
    with pytest.raises(RuntimeError, match="once"):
        c.clipped_sum_per_layer(1.0)


RECIPE = {**ENGINE_RECIPE, "train": {"steps": 4}}


def test_a_per_layer_run_spends_exactly_what_a_flat_run_spends(tmp_path):
    """Same sensitivity (C), so the same calibrated noise and the same ledger; only the sum differs."""
    flat = make_run(RECIPE, tmp_path)
    per_layer = make_run(RECIPE, tmp_path, sets=["privatizer.clipping=per_layer"])
    assert per_layer.privatizer.noise_multiplier == flat.privatizer.noise_multiplier
    assert per_layer.privatizer.sensitivity() == flat.privatizer.sensitivity()
    flat.train()
    per_layer.train()
    assert per_layer.accountant.ledger.to_json() == flat.accountant.ledger.to_json()
    assert per_layer.accountant.epsilon() == flat.accountant.epsilon()
    assert any(not torch.equal(per_layer.params[k], flat.params[k]) for k in flat.params)


def test_per_layer_clipping_needs_an_estimator_that_offers_it(tmp_path):
    recipe = {**RECIPE, "algorithm": "standard", "estimator": {"name": "zo_two_point"},
              "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0, "clipping": "per_layer"},
              "update": {"name": "directional_sgd", "lr": 0.01}, "accountant": "rdp",
              "privacy": {"epsilon": None, "delta": 1e-3}}
    with pytest.raises(UserError, match="needs LayerGradients.*per_example_grad"):
        make_run(recipe, tmp_path)


@pytest.mark.usefixtures("fp64")
def test_dp_grape_per_layer_clips_the_projected_gradients_with_the_contributions_own_projectors():
    """DP-GRAPE's layers are clipped in the projected space (Pᵀ·G_i), each to C/√G. The backward
    runs when the contribution is read, possibly after the estimator moved on to the next step's
    projectors (refreshed every step here): the sum uses the projectors the contribution carries."""
    from test_grape import FixedData, Seq, estimator

    torch.manual_seed(0)
    model = Seq()
    ids, y = torch.randint(1, 20, (5, 9)), torch.randint(0, 3, (5,))
    data = FixedData(model, ids, y)
    est, ctx = estimator(model, data, rank=6, refresh=1)
    per_ex = per_example_classifier(model, ids, y)
    c0 = next(est.contributions(data, torch.arange(5), ctx))
    own = dict(c0.projectors)
    next(est.contributions(data, torch.arange(5), ctx.at(1)))  # the estimator now holds step 1's projectors
    assert any(own[k].seed != est.current[k].seed for k in own)
    projected = {}
    for k, G in per_ex.items():
        pr = own.get(k)
        P = pr.matrix(dtype=torch.float64) if pr is not None else None
        projected[k] = G if pr is None else (P.T @ G if pr.side == "left" else G @ P)
    groups = [["emb.weight"], ["ln.weight", "ln.bias"], ["up.weight", "up.bias"], ["down.weight", "down.bias"],
              ["head.weight", "head.bias"]]
    expect = clipped_reference(projected, groups, 0.05)
    got = clip_and_sum_per_layer(c0, 0.05).aggregate
    for k, v in expect.items():
        torch.testing.assert_close(got.tensors[k].double(), v, atol=1e-7, rtol=1e-4, msg=lambda m: f"{k}: {m}")


def test_a_backward_that_failed_leaves_the_contribution_unreadable(monkeypatch):
    """Not empty: a retry must not read a zero sum as the batch's clipped sum."""
    from dpregistry.persample import LinearHandler

    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    gs = GradSampler(model, dict(model.named_parameters()))
    with torch.enable_grad(), gs.capture(5):
        losses = F.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 2, (5,)), reduction="none")
    c = gs.contribution(losses)
    original = LinearHandler.on_backprop

    def out_of_memory(self, use):
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(LinearHandler, "on_backprop", out_of_memory)
    with pytest.raises(RuntimeError, match="simulated"):
        clip_and_sum_per_layer(c, 1.0)
    monkeypatch.setattr(LinearHandler, "on_backprop", original)
    for read in (c.norms, lambda: c.clipped_sum_per_layer(1.0), lambda: c.records):
        with pytest.raises(RuntimeError, match="failed"):
            read()


def test_empty_poisson_batches_pass(tmp_path):
    """Poisson draws an empty batch now and then (here about one step in three): its sum is zero."""
    run = make_run({**RECIPE, "sampler": {"name": "poisson", "batch_size": 1}, "train": {"steps": 8}}, tmp_path,
                   sets=["privatizer.clipping=per_layer"])
    sizes = []
    spy = run.privatize_batch

    def record(indices):
        total = spy(indices)
        sizes.append(total.count)
        return total
    run.privatize_batch = record
    run.train()
    assert 0 in sizes and len(sizes) == 8


@pytest.mark.parametrize("estimator, message", [
    ({"name": "per_example_grad", "backend": "functorch"}, "needs per-example gradients from the hooks"),
    ({"name": "per_example_grad", "passes": 2}, "passes: 2 does not apply"),
])
def test_per_layer_clipping_is_refused_before_the_run_starts(tmp_path, estimator, message):
    recipe = {**RECIPE, "estimator": estimator, "privatizer": {**RECIPE["privatizer"], "clipping": "per_layer"}}
    with pytest.raises(UserError, match=message) as e:
        make_run(recipe, tmp_path)
    assert "recipe.yaml:" in str(e.value)  # located in the recipe (file and line)
