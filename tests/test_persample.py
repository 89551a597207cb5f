"""Hook-based per-example gradients (dpregistry.persample) against an independent reference.

The reference differentiates each example's loss separately on the same batch (one autograd
backward per example), so it shares nothing with the hooks, the ghost norms or the book-keeping
sums. Every check compares norms and weighted sums with weights above and below 1 (a clip weight
bug that squares the weights shows up), at fp64 so that the tolerance is tight.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpregistry import UserError
from dpregistry.persample import GradSampler, Outer


pytestmark = pytest.mark.usefixtures("fp64")


def reference(model, params, losses_fn):
    """Per-example gradients by one backward per example on the same batch."""
    losses = losses_fn()
    out = []
    for i in range(losses.shape[0]):
        gs = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
        out.append([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params.values())])
    return {k: torch.stack([o[j] for o in out]) for j, k in enumerate(params)}


def ours(model, params, losses_fn, B, passes=1):
    gs = GradSampler(model, params, passes=passes)
    with torch.enable_grad(), gs.capture(B):
        losses = losses_fn()
    return gs.contribution(losses)


def check(model, losses_fn, B, atol=1e-9):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref = reference(model, params, losses_fn)
    c = ours(model, params, losses_fn, B)
    ref_norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    torch.testing.assert_close(c.norms(), ref_norms, atol=atol, rtol=1e-9)
    w = torch.linspace(0.25, 2.5, B)
    agg = c.weighted_sum(w)
    for k, g in ref.items():
        expect = (g * w.view(-1, *[1] * (g.dim() - 1))).sum(0)
        torch.testing.assert_close(agg.tensors[k], expect, atol=atol, rtol=1e-9, msg=lambda m: f"{k}: {m}")
    return c


def test_mlp_one_token_per_example():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    check(m, lambda: F.cross_entropy(m(x), y, reduction="none"), 6)


class SeqModel(nn.Module):
    """Embedding with padding, LayerNorm, a wide and a narrow Linear on sequences, Conv1d."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16, padding_idx=0)
        self.ln = nn.LayerNorm(16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)  # factors (16·48 > 7·64), ghost norm
        self.wide = nn.Linear(16, 40)   # factors (16·40 > 7·56), ghost norm (T² = 49 ≤ 640)
        self.narrow = nn.Linear(40, 1)  # 40·1 ≤ T·41: per-example gradients materialised
        self.head = nn.Linear(7, 2)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        s = self.narrow(torch.tanh(self.wide(h))).squeeze(-1)  # [B, T]
        return self.head(s)


def test_sequences_embedding_padding_layernorm_conv():
    torch.manual_seed(1)
    m = SeqModel()
    ids = torch.randint(1, 11, (5, 7))
    ids[:, -2:] = 0            # padding positions: the padding row gets no gradient
    ids[1, :3] = 4             # repeated tokens within an example
    y = torch.randint(0, 2, (5,))
    c = check(m, lambda: F.cross_entropy(m(ids), y, reduction="none"), 5)
    kept = {type(h).__name__ + ":" + u[0].plan["weight"] for h, _, u in c.records if "weight" in u[0].plan}
    assert kept == {"LinearHandler:ghost", "LinearHandler:per_example", "ConvHandler:ghost", "EmbeddingHandler:rows",
                    "LayerNormHandler:per_example"}


@pytest.mark.parametrize("T,p,q", [(1, 8, 8), (3, 16, 40), (7, 40, 1), (10, 3, 50), (12, 6, 6), (40, 16, 16),
                                   (6, 64, 64), (70, 64, 64)])
def test_the_cost_model_picks_each_layer_form_and_both_forms_agree(T, p, q):
    """Each call keeps the smaller of its factors (B·T·(p+q)) and its per-example gradients
    (B·p·q); the norms from factors use Gram products where T² ≤ p·q. Both forms, forced either
    way, give the norms, weighted sums and per-example gradients of the materialised product."""
    B = 4
    u, v = torch.randn(B, T, p), torch.randn(B, T, q)
    ref = torch.einsum("btp,btq->bpq", u, v)
    w = torch.tensor([0.5, 0.0, 2.0, 1.0])
    assert Outer(u, v).materialised == (p * q <= T * (p + q))
    for form in (True, False):
        o = Outer(u, v, per_example=form)
        assert o.materialised == form
        torch.testing.assert_close(o.sq_norms(), ref.pow(2).sum((1, 2)))
        torch.testing.assert_close(o.weighted(w), (ref * w.view(-1, 1, 1)).sum(0))
        torch.testing.assert_close(o.per_example(), ref)
    # where factors are kept, the ghost norm is also the cheaper norm (time and scratch)
    if not Outer(u, v).materialised:
        assert T * T <= p * q and T * (p + q) < p * q


def test_outer_stores_the_smaller_form():
    u, v = torch.randn(2, 10, 3), torch.randn(2, 10, 50)
    assert Outer(u, v).materialised            # 3·50 ≤ 10·53
    assert not Outer(u[:, :2], v[:, :2]).materialised
    ref = torch.einsum("btp,btq->bpq", u, v)
    torch.testing.assert_close(Outer(u, v).per_example(), ref)
    torch.testing.assert_close(Outer(u[:, :2], v[:, :2]).per_example(), torch.einsum("btp,btq->bpq", u[:, :2], v[:, :2]))


class Conv2dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 5, 2)
        self.fc = nn.Linear(5 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.c2(torch.tanh(self.c1(x)))).flatten(1))


def test_conv2d():
    torch.manual_seed(2)
    m = Conv2dNet()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    check(m, lambda: F.cross_entropy(m(x), y, reduction="none"), 4)


class Reuse(nn.Module):
    """A layer called twice, a tied weight, and a broadcast position embedding."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.pos = nn.Embedding(6, 4)
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 9, bias=False)
        self.out.weight = self.tok.weight  # tied

    def forward(self, ids):
        T = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(T).unsqueeze(0))  # [1, T] ids: broadcast
        h = self.lin(torch.tanh(self.lin(h)))
        return self.out(h).mean(1)


def test_reused_layer_tied_weight_broadcast_embedding():
    torch.manual_seed(3)
    m = Reuse()
    ids = torch.randint(0, 9, (4, 5))
    y = torch.randint(0, 9, (4,))
    check(m, lambda: F.cross_entropy(m(ids), y, reduction="none"), 4)


class WithToken(nn.Module):
    """Parameters owned by a custom module (a ViT's class token and position embeddings)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 6, 4))

    def forward(self, x):
        h = self.proj(x)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1)
        return h + self.pos


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = WithToken()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x))[:, 0])


def test_module_owned_parameters_use_the_vmap_fallback():
    torch.manual_seed(4)
    m = TokenNet()
    x, y = torch.randn(3, 5, 3), torch.randint(0, 2, (3,))
    check(m, lambda: F.cross_entropy(m(x), y, reduction="none"), 3)


@pytest.mark.parametrize("passes", [1, 2])
def test_nonfinite_example_is_dropped_exactly(passes):
    """In the two-pass mode the NaN example's rows carry 0·NaN = NaN through the second backward;
    every layer masks them out of its sum."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 4)
    x[2] = float("nan")
    y = torch.randint(0, 2, (4,))
    params = dict(m.named_parameters())
    c = ours(m, params, lambda: F.cross_entropy(m(x), y, reduction="none"), 4, passes=passes)
    n = c.norms()
    assert math.isnan(n[2]) and torch.isfinite(n[[0, 1, 3]]).all()
    w = torch.tensor([1.0, 0.5, 0.0, 1.0])
    agg = c.weighted_sum(w)
    keep = [0, 1, 3]
    ref = reference(m, params, lambda: F.cross_entropy(m(x[keep]), y[keep], reduction="none"))
    for k, g in ref.items():
        expect = (g * w[keep].view(-1, *[1] * (g.dim() - 1))).sum(0)
        torch.testing.assert_close(agg.tensors[k], expect)


def test_inplace_modification_is_refused():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 1))
    params = dict(m.named_parameters())
    gs = GradSampler(m, params)
    with pytest.raises((UserError, RuntimeError)):
        with torch.enable_grad(), gs.capture(2):
            losses = m(torch.randn(2, 3)).squeeze(-1)
        gs.contribution(losses)


def test_no_weight_gradient_is_computed():
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    params = dict(m.named_parameters())
    gs = GradSampler(m, params)
    x = torch.randn(4, 3)
    with torch.enable_grad(), gs.capture(4):
        losses = m(x).squeeze(-1)
    c = gs.contribution(losses)
    c.weighted_sum(c.norms())  # (a contribution runs its backward when first read)
    with torch.enable_grad(), gs.capture(4):
        losses = m(x).squeeze(-1)
    gs.contribution(losses).clipped_sum_per_layer(1.0)
    assert all(p.grad is None for p in m.parameters())


def _tiny_hf(kind):
    from transformers import (BertConfig, BertModel, RobertaConfig, RobertaModel, ViTConfig,
                              ViTForImageClassification)

    if kind == "bert":
        cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16)
        return BertModel(cfg, add_pooling_layer=False)
    if kind == "roberta":
        cfg = RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=20, pad_token_id=1)
        return RobertaModel(cfg, add_pooling_layer=False)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=32, num_labels=3)
    return ViTForImageClassification(cfg)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_hf_text_encoders(kind):
    torch.manual_seed(6)
    enc = _tiny_hf(kind).double().eval()
    head = nn.Linear(16, 2).double()
    model = nn.ModuleDict({"enc": enc, "head": head})
    ids = torch.randint(3, 50, (3, 6))
    mask = torch.ones_like(ids)
    ids[0, 4:] = 1
    mask[0, 4:] = 0  # padding
    y = torch.tensor([0, 1, 1])

    def losses():
        h = enc(input_ids=ids, attention_mask=mask).last_hidden_state
        mm = mask.unsqueeze(-1).double()
        return F.cross_entropy(head((h * mm).sum(1) / mm.sum(1)), y, reduction="none")

    check(model, losses, 3, atol=1e-8)


def test_hf_vit_with_class_token_and_position_embeddings():
    torch.manual_seed(7)
    vit = _tiny_hf("vit").double().eval()
    x, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 2, 1])
    check(vit, lambda: F.cross_entropy(vit(pixel_values=x).logits, y, reduction="none"), 3, atol=1e-8)


class Folded(nn.Module):
    """A feed-forward applied to [B·T, F] rows, as OPT's decoder layer does."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, ids):
        h = self.emb(ids)
        shape = h.shape
        h = h + self.fc(torch.tanh(self.ln(h.reshape(-1, shape[-1])))).view(shape)
        return self.head(h.mean(1))


def test_batch_major_flattened_layers():
    torch.manual_seed(8)
    m = Folded()
    ids = torch.randint(0, 12, (4, 5))
    y = torch.randint(0, 2, (4,))
    check(m, lambda: F.cross_entropy(m(ids), y, reduction="none"), 4)


def test_hf_opt_decoder():
    from transformers import OPTConfig, OPTModel

    torch.manual_seed(9)
    cfg = OPTConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                    max_position_embeddings=16, word_embed_proj_dim=16)
    enc = OPTModel(cfg).double().eval()
    head = nn.Linear(16, 2).double()
    model = nn.ModuleDict({"enc": enc, "head": head})
    ids = torch.randint(3, 40, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    y = torch.tensor([0, 1, 1])

    def losses():
        h = enc(input_ids=ids, attention_mask=mask).last_hidden_state
        return F.cross_entropy(head(h[:, -1]), y, reduction="none")

    check(model, losses, 3, atol=1e-8)


@pytest.mark.parametrize("passes", [1, 2])
def test_a_contribution_is_summed_once(passes):
    """The sum drops the per-example state (one pass) or frees the graph (the second backward): a
    second sum, or norms asked for after the sum, would need it again, so they are refused rather
    than returning zeros."""
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    x = torch.randn(4, 3)
    c = ours(m, dict(m.named_parameters()), lambda: m(x).squeeze(-1), 4, passes=passes)
    c.weighted_sum(torch.ones(4))
    with pytest.raises(RuntimeError, match="once"):
        c.weighted_sum(torch.ones(4))
    with pytest.raises(RuntimeError, match="before"):
        c.norms()


def test_the_two_pass_mode_frees_the_state_of_each_layer_after_its_norm():
    """After the first backward a two-pass contribution holds norms² ([B] per parameter) and the
    per-example gradients it formed (the narrow layer's, the biases', LayerNorm's: released as
    measured), not the factors or embedding rows that the book-keeping mode keeps for its sum."""
    torch.manual_seed(0)
    m = SeqModel()
    ids, y = torch.randint(1, 11, (5, 7)), torch.randint(0, 2, (5,))
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    one = ours(m, params, lambda: F.cross_entropy(m(ids), y, reduction="none"), 5, passes=1)
    two = ours(m, params, lambda: F.cross_entropy(m(ids), y, reduction="none"), 5, passes=2)
    assert all(u.state for _, _, uses in one.records for u in uses)
    kept = [(u.plan, u.state) for _, _, uses in two.records for u in uses]
    assert all(set(state) == {k for k, kind in plan.items() if kind == "per_example"} for plan, state in kept)
    assert {"ghost", "rows"} <= {kind for plan, _ in kept for kind in plan.values()}
    assert all(v.shape == (5,) for _, _, uses in two.records for u in uses for v in u.sq.values())


def test_the_book_keeping_sum_drops_each_layers_state_before_forming_the_earlier_layers_sums(monkeypatch):
    """One pass: when the first layer's sum (an embedding table's, the largest) is formed, every
    later layer's factors are already gone, so the peak never holds the kept state and the full-size
    sums together; the sum is the same as the reference's."""
    torch.manual_seed(0)
    m = SeqModel()
    ids, y = torch.randint(1, 11, (5, 7)), torch.randint(0, 2, (5,))
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    c = ours(m, params, lambda: F.cross_entropy(m(ids), y, reduction="none"), 5)
    first_h, _, first_uses = c.records[0]
    later = [u for _, _, uses in c.records[1:] for u in uses]
    assert first_uses and later and all(u.state for u in later)
    seen = []
    weighted = first_h.weighted

    def spy(use, w):
        seen.append([bool(u.state) for u in later])
        return weighted(use, w)

    monkeypatch.setattr(first_h, "weighted", spy)  # the registry's shared handler: restored after the test
    c.norms()
    w = torch.linspace(0.5, 1.5, 5)
    agg = c.weighted_sum(w)
    assert seen and not any(any(s) for s in seen)
    ref = reference(m, params, lambda: F.cross_entropy(m(ids), y, reduction="none"))
    for k, g in ref.items():
        torch.testing.assert_close(agg.tensors[k], (g * w.view(-1, *[1] * (g.dim() - 1))).sum(0), rtol=1e-9, atol=1e-9)


def test_a_layer_called_many_times_holds_one_running_sum_not_one_per_call(monkeypatch):
    """A cell in a loop: its K calls' sums are added as they are formed, so at most the running
    total and the newest sum are alive (not K parameter-sized sums); the total is the reference's."""
    import weakref

    torch.manual_seed(0)
    cell, head = nn.Linear(6, 6), nn.Linear(6, 1)
    m = nn.ModuleDict({"cell": cell, "head": head})
    x = torch.randn(3, 6)

    def losses():
        h = x
        for _ in range(6):
            h = torch.tanh(cell(h))
        return head(h).squeeze(-1)

    params = dict(m.named_parameters())
    c = ours(m, params, losses, 3)
    h = next(hh for hh, _, uses in c.records if uses and uses[0].module is cell)
    formed, most_alive = [], [0]
    weighted = h.weighted

    def spy(use, w):  # the handler is the registry's one Linear handler: the head's call passes too
        most_alive[0] = max(most_alive[0], sum(r() is not None for r in formed))
        sums = weighted(use, w)
        if use.module is cell:
            formed.extend(weakref.ref(v) for v in sums.values())
        return sums

    monkeypatch.setattr(h, "weighted", spy)
    c.norms()
    w = torch.tensor([0.5, 1.0, 2.0])
    agg = c.weighted_sum(w)
    assert len(formed) == 12 and most_alive[0] <= 4  # weight and bias: the running totals and the newest pair
    ref = reference(m, params, losses)
    for k, g in ref.items():
        torch.testing.assert_close(agg.tensors[k], (g * w.view(-1, *[1] * (g.dim() - 1))).sum(0), rtol=1e-9, atol=1e-9)
