"""Per-example gradients through the estimators' own entry points against one-example-at-a-time
autograd, on small random-init transformers and on models that share or reuse a tensor.

Each model goes through ``per_example_grad`` (hooks backend) or ``projected_per_example_grad``
exactly as a run drives them: ``setup(ctx)``, then ``contributions(objective, indices, ctx)``, then
the privatizers' ``clip_and_sum``. The reference differentiates each example's loss on its own
(one autograd backward per example), so it shares nothing with the hooks, the ghost norms, the
cross terms of shared tensors or the book-keeping sums. The clip is the median reference norm,
so some examples are clipped and some are not: a wrong norm flips a clipping decision or scales
the example wrongly, and either moves the clipped sum. Everything runs in fp64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpregistry import UserError
from dpregistry import Objective as ObjectiveStage
from dpregistry.clipping import clip_and_sum
from dpregistry.persample import MAX_CROSS_PIECES
from dpregistry.context import Context
from dpreg_baseline.estimators import PerExampleGrad
from dpreg_grape.estimators import ProjectedPerExampleGrad
from dpreg_grape.projection import LayerSelection

RTOL, ATOL = 1e-9, 1e-11


pytestmark = pytest.mark.usefixtures("fp64")


class Objective:
    """A fixed data set and a per-example loss: what an estimator sees of a run's objective."""

    def __init__(self, model, loss_of, n):
        self.model, self.loss_of, self.n_train = model, loss_of, n

    def module(self):
        return self.model

    def losses(self, idx):
        return self.loss_of(idx)


def setup(model, objective, grape=None, micro=None, passes=1, embeddings=False):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ctx = Context.detached(params, micro_batch_size=micro, n_train=objective.n_train,
                           provides={ObjectiveStage: objective})
    if grape is None:
        est = PerExampleGrad(PerExampleGrad.Params(backend="hooks", passes=passes))
    else:
        est = ProjectedPerExampleGrad(ProjectedPerExampleGrad.Params(rank=grape, projector="gaussian", passes=passes,
                                                                     project=LayerSelection(exclude=[], embeddings=embeddings)))
    est.setup(ctx)
    return est, ctx


def reference(objective, params, n):
    """Each example's gradient, by its own backward."""
    losses = objective.losses(torch.arange(n))
    rows = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
            for i in range(n)]
    return {k: torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows])
            for j, (k, p) in enumerate(params.items())}


def check(model, objective, n, grape=None, micro=None, passes=1, embeddings=False):
    """Norms (the clipping decisions) and the clipped sum against the reference."""
    est, _, _ = clipped(model, objective, n, grape, micro, passes, embeddings)
    return est


def clipped(model, objective, n, grape=None, micro=None, passes=1, embeddings=False):
    """``check``, returning the estimator, the norms and the clipped sums."""
    est, run = setup(model, objective, grape, micro, passes, embeddings)
    contribs = list(est.contributions(objective, torch.arange(n), run))
    ref = reference(objective, run.params, n)
    if grape is not None:  # the projected space: Pᵀ·G_i or G_i·P per projected weight
        assert est.current, "no layer projected"
        for name, pr in est.current.items():
            P = pr.matrix(dtype=torch.float64)
            ref[name] = P.T @ ref[name] if pr.side == "left" else ref[name] @ P
    ref_norms = torch.sqrt(sum(g.reshape(n, -1).pow(2).sum(1) for g in ref.values()))
    norms = torch.cat([c.norms() for c in contribs])
    torch.testing.assert_close(norms, ref_norms, rtol=RTOL, atol=ATOL)

    clip = float(ref_norms.median())
    scale = (clip / ref_norms).clamp(max=1.0)
    assert 0 < int((ref_norms > clip).sum()) < n  # the clip clips some examples, not all
    totals = [clip_and_sum(c, clip).aggregate.tensors for c in contribs]
    for k, g in ref.items():
        expect = (g * scale.view(-1, *[1] * (g.dim() - 1))).sum(0)
        got = sum(t[k] for t in totals)
        torch.testing.assert_close(got, expect, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    return est, norms, {k: sum(t[k] for t in totals) for k in totals[0]}


def text_batch(vocab, n, T, seed, pad=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, T), generator=g)
    mask = torch.ones_like(ids)
    if pad is not None:  # example 1 is padded on the right
        ids[1, T - 2:] = pad
        mask[1, T - 2:] = 0
    return ids, mask


def lm_losses(model, ids, mask, labels):
    """Per-example mean token cross-entropy (labels of -100 are ignored)."""
    def losses(idx):
        logits = model(input_ids=ids[idx], attention_mask=mask[idx]).logits
        tok = F.cross_entropy(logits.transpose(1, 2), labels[idx], reduction="none", ignore_index=-100)
        return tok.sum(1) / (labels[idx] != -100).sum(1)
    return losses


# ------------------------------------------------------------------------------------------
# transformers, built from configs (random weights, no download)
# ------------------------------------------------------------------------------------------


def bert_case():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=3)
    model = BertForSequenceClassification(cfg).double().eval()
    ids, mask = text_batch(40, 6, 7, seed=0, pad=0)
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    y = torch.tensor([0, 1, 2, 0, 1, 2])

    def losses(idx):
        out = model(input_ids=ids[idx], attention_mask=mask[idx], token_type_ids=types[idx])
        return F.cross_entropy(out.logits, y[idx], reduction="none")

    return model, Objective(model, losses, 6)


def test_bert_sequence_classification():
    check(*bert_case(), 6)


@pytest.fixture(scope="module")
def roberta_mlm():
    return roberta_case()[0]


def roberta_objective(model):
    ids, mask = text_batch(50, 6, 6, seed=1, pad=1)
    labels = torch.full_like(ids, -100)
    labels[:, [1, 3]] = ids[:, [1, 3]]     # two masked positions per example
    ids = ids.clone()
    ids[:, [1, 3]] = 4                     # the <mask> id
    return Objective(model, lm_losses(model, ids, mask, labels), 6)


def test_roberta_masked_lm_with_its_tied_head(roberta_mlm):
    """``lm_head.bias`` is ``lm_head.decoder.bias`` (one tensor, two modules; it was summed twice)
    and the decoder's weight is the word embedding (one tensor, an Embedding and a Linear)."""
    model = roberta_mlm
    assert model.lm_head.bias is model.lm_head.decoder.bias
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    est = check(model, roberta_objective(model), 6)
    held = [m for m, _, local in est.sampler.layers if "lm_head.bias" in local.values()]
    assert held == [model.lm_head.decoder]  # by the decoder only; lm_head itself is not hooked
    assert sum("roberta.embeddings.word_embeddings.weight" in local.values()
               for _, _, local in est.sampler.layers) == 2


def test_roberta_masked_lm_dp_grape(roberta_mlm):
    """The projected estimator on the same model: projected encoder weights, the tied head dense."""
    est = check(roberta_mlm, roberta_objective(roberta_mlm), 6, grape=4)
    assert "lm_head.dense.weight" in est.current and "roberta.embeddings.word_embeddings.weight" not in est.current


def opt_case():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(2)
    cfg = OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                    max_position_embeddings=20, word_embed_proj_dim=16)
    model = OPTForCausalLM(cfg).double().eval()
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    ids, mask = text_batch(50, 6, 14, seed=2)
    labels = torch.cat([ids[:, 1:], torch.full((6, 1), -100)], 1)
    return model, Objective(model, lm_losses(model, ids, mask, labels), 6)


def test_opt_causal_lm_with_tied_head_and_micro_batches():
    """T = 14: the tied head's per-example gradients are materialised, the embedding's are rows;
    two micro-batches, as a run with train.micro_batch_size splits a batch."""
    check(*opt_case(), 6, micro=3)


def test_gpt2_lm_head_with_tied_embeddings():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    cfg = GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).double().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, mask = text_batch(50, 6, 6, seed=3)
    labels = torch.cat([ids[:, 1:], torch.full((6, 1), -100)], 1)
    check(model, Objective(model, lm_losses(model, ids, mask, labels), 6), 6)


def vit_case():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(4)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=32, num_labels=3)
    model = ViTForImageClassification(cfg).double().eval()
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    return model, Objective(model, lambda i: F.cross_entropy(model(pixel_values=x[i]).logits, y[i],
                                                             reduction="none"), 6)


def test_vit_image_classification():
    check(*vit_case(), 6)


# ------------------------------------------------------------------------------------------
# one tensor in several modules, a module called twice
# ------------------------------------------------------------------------------------------


class Gate(nn.Module):
    """A module with a parameter of its own (vmap fallback) that also registers its child's bias."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(16))
        self.inner = nn.Linear(16, 16)
        self.bias = self.inner.bias       # one tensor, registered by the parent and the child

    def forward(self, h):
        return torch.tanh(self.inner(h)) * self.alpha


class Shared(nn.Module):
    """Every way this module's tensors are shared, with each pair of per-example forms:

    * ``emb`` is ``head``'s weight (an Embedding's rows × a Linear's factors);
    * ``a``, ``b`` and ``c`` share one weight and one bias: ``a`` is called twice on 3 tokens
      (factors), ``b`` on one pooled row (factors), ``c`` on 40 positions (materialised);
    * ``gate`` (vmap fallback) is called twice (dense × dense) and holds ``gate.inner.bias`` too.
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.c.weight = self.a.weight
        self.b.bias = self.c.bias = self.a.bias
        self.gate = Gate()
        self.wide = nn.Linear(16, 40)
        self.head = nn.Linear(16, 30)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)                                         # [B, 3, 16]
        h = self.gate(self.a(torch.tanh(self.a(h))))
        s = torch.tanh(self.wide(h)).transpose(1, 2)              # [B, 40, 3]
        h = h + self.c(s @ h).mean(1, keepdim=True)               # c sees 40 positions
        h = self.gate(h) + self.b(h.mean(1, keepdim=True))
        return self.head(h).mean(1)                               # [B, 30]


def shared_case():
    torch.manual_seed(5)
    model = Shared()
    ids = torch.randint(0, 30, (8, 3))
    ids[2, 1] = ids[2, 0]  # a repeated token
    y = torch.randint(0, 30, (8,))
    return model, Objective(model, lambda i: F.cross_entropy(model(ids[i]), y[i], reduction="none"), 8)


@pytest.mark.parametrize("grape", [None, 4])
def test_tensors_shared_between_modules(grape):
    model, obj = shared_case()
    est = check(model, obj, 8, grape=grape)
    held = {n: [m for m, _, local in est.sampler.layers if n in local.values()] for n in ("a.weight", "gate.bias")}
    assert held == {"a.weight": [model.a, model.b, model.c], "gate.bias": [model.gate.inner]}
    if grape is not None:  # the tied weight stays dense; gate.inner's (called twice) is projected
        assert set(est.current) == {"wide.weight", "gate.inner.weight"}


class Loop(nn.Module):
    """A cell called once per step of a loop: more calls than pairwise cross terms are worth."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.cell = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = x
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h) + x)
        return self.head(h)


def loop_case(steps):
    torch.manual_seed(9)
    model = Loop(steps)
    xs, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    return model, Objective(model, lambda i: F.cross_entropy(model(xs[i]), y[i], reduction="none"), 6)


@pytest.mark.parametrize("steps", [MAX_CROSS_PIECES, MAX_CROSS_PIECES + 1])
def test_a_layer_called_in_a_loop(steps):
    check(*loop_case(steps), 6)


# ------------------------------------------------------------------------------------------
# two passes: the norms from a first backward, the clipped sum from a second, weighted one
# ------------------------------------------------------------------------------------------

TWO_PASS_CASES = {
    "bert": (bert_case, 6, {}),
    "roberta-mlm-tied": (lambda: roberta_case(), 6, {}),
    "roberta-mlm-dp-grape": (lambda: roberta_case(), 6, {"grape": 4}),
    "opt-micro-batches": (opt_case, 6, {"micro": 3}),
    "vit-vmap-fallback": (vit_case, 6, {}),
    "reused-tensors": (shared_case, 8, {}),
    "reused-tensors-dp-grape": (shared_case, 8, {"grape": 4}),
    "loop": (lambda: loop_case(MAX_CROSS_PIECES + 1), 6, {}),
}


def roberta_case():
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(1)
    cfg = RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=20, pad_token_id=1)
    model = RobertaForMaskedLM(cfg).double().eval()
    return model, roberta_objective(model)


@pytest.mark.parametrize("case", list(TWO_PASS_CASES))
def test_two_passes_agree_with_autograd_and_with_one_pass(case):
    """Both modes against one-example-at-a-time autograd (``clipped`` checks each), and against
    each other: the norms are the same numbers (the same terms, taken in the first backward),
    the clipped sums agree to rounding (the second backward carries w_i from the loss down, the
    book-keeping sum multiplies it in at each layer)."""
    build, n, kw = TWO_PASS_CASES[case]
    model, obj = build()
    _, norms1, sums1 = clipped(model, obj, n, passes=1, **kw)
    _, norms2, sums2 = clipped(model, obj, n, passes=2, **kw)
    assert torch.equal(norms1, norms2)
    for k in sums1:
        torch.testing.assert_close(sums2[k], sums1[k], rtol=1e-12, atol=1e-14, msg=lambda m: f"{k}: {m}")


# ------------------------------------------------------------------------------------------
# a parameter used where no hook sees it: refused at setup, naming it
# ------------------------------------------------------------------------------------------


class ReusedOutside(nn.Module):
    """``lin``'s weight is used again outside ``lin``, in this module's forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(torch.tanh(F.linear(h, self.lin.weight)))


class ParentUsesTiedBias(nn.Module):
    """A parent registers its child's bias (the run names it ``bias``) and also adds it itself,
    outside the child's call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = self.lin.bias
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)) + self.bias)


class SideChannel(nn.Module):
    """A layer keeps a value computed inside its call; the parent uses it past the layer's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.lin.register_forward_hook(lambda m, args, out: setattr(self, "kept", out * 2))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(h + self.kept)


class NeverCalled(nn.Module):
    """A layer whose weight is read by its parent and which is never called itself (as torch's
    MultiheadAttention does with ``out_proj``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, self.proj.weight, self.proj.bias)))


@pytest.mark.parametrize("cls, x, match", [
    (ReusedOutside, (6, 4), r"parameter lin\.weight is used outside the layer that holds it \(lin\)"),
    (ParentUsesTiedBias, (6, 4), r"parameter bias is used outside the layer that holds it \(lin\)"),
    (NeverCalled, (6, 4), r"parameter proj\.(weight|bias) is used outside the layer that holds it \(proj\)"),
    (SideChannel, (6, 4), r"layer lin \(Linear\) passes on a value other than through its output"),
], ids=["F.linear_in_parent", "parent_adds_tied_bias", "layer_never_called", "side_channel"])
@pytest.mark.parametrize("grape", [None, 2])
def test_a_use_that_no_hook_accounts_for_is_refused_at_setup(cls, x, match, grape):
    torch.manual_seed(6)
    model = cls()
    xs, y = torch.randn(*x), torch.randint(0, 2, (x[0],))
    obj = Objective(model, lambda i: F.cross_entropy(model(xs[i]), y[i], reduction="none"), x[0])
    params = {n: p for n, p in model.named_parameters()}
    ref = reference(obj, params, x[0])
    total = torch.autograd.grad(obj.losses(torch.arange(x[0])).sum(), list(params.values()))
    for (k, g), t in zip(ref.items(), total):  # the model is fine for autograd; only the hooks would miss a use
        torch.testing.assert_close(g.sum(0), t)
    with pytest.raises(UserError, match=match) as e:
        setup(model, obj, grape=grape)
    assert "\n" not in str(e.value)


def test_refused_before_any_contribution_even_without_a_setup_check():
    """An objective that cannot say how many examples it has (n_train = 0) skips the setup check;
    the first micro-batch runs it instead, before a norm or a sum exists."""
    torch.manual_seed(7)
    model = ReusedOutside()
    xs, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    obj = Objective(model, lambda i: F.cross_entropy(model(xs[i]), y[i], reduction="none"), 0)
    est, run = setup(model, obj)
    with pytest.raises(UserError, match=r"lin\.weight"):
        next(est.contributions(obj, torch.arange(4), run))


def test_the_cli_refuses_such_a_model_before_writing_anything(tmp_path, monkeypatch):
    """``dpreg run``: one line naming the parameter, exit 2, no run folder (the check runs when the
    run is prepared, before step 0's checkpoint)."""
    from dpreg_baseline.objectives import TabularObjective
    from test_core_cli import dpreg

    def reuses_the_first_weight(self, idx):
        x = self.x_train[idx]
        extra = F.linear(x, self.model[0].weight).pow(2).mean(1, keepdim=True)  # 0.weight, outside layer 0
        return self._loss(self.model(x) + extra, self.y_train[idx])

    monkeypatch.setattr(TabularObjective, "batch_losses", reuses_the_first_weight)
    torch.set_default_dtype(torch.float32)  # the quickstart's model and data (the fixture restores)
    res = dpreg("run", "quickstart", "--out", tmp_path / "out", "-q")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "parameter 0.weight is used outside the layer that holds it (0)" in res.stderr
    assert not (tmp_path / "out").exists()


class KeptReference(nn.Module):
    """A custom layer (vmap fallback) whose forward reads its weight through a reference kept in a
    plain list: the per-example vmap substitutes the attribute, not the list's entry."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) / 2)
        self.refs = [self.weight]

    def forward(self, x):
        return torch.tanh(x @ self.weight.T) @ self.refs[0].T


def test_a_custom_layer_reading_its_weight_through_another_reference_is_refused():
    torch.manual_seed(8)
    model = nn.Sequential(KeptReference(), nn.Linear(4, 2))
    xs, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    obj = Objective(model, lambda i: F.cross_entropy(model(xs[i]), y[i], reduction="none"), 4)
    with pytest.raises(UserError, match=r"parameter 0\.weight is reached in the forward of layer 0 \(KeptReference\)"):
        setup(model, obj)


class TwoTables(nn.Module):
    """A tall table (V > H: projected on the right, R_i = G_i·P, kept as rows) with a padding row,
    and a wide one (V ≤ H: on the left, R_i = Pᵀ·G_i, kept as factors P[ids]ᵀ·g)."""

    def __init__(self):
        super().__init__()
        self.tall = nn.Embedding(40, 12, padding_idx=0)
        self.wide = nn.Embedding(10, 24)
        self.mix = nn.Linear(24, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, ids):
        h = self.tall(ids) + self.mix(torch.tanh(self.wide(ids % 10)))
        return self.head(torch.tanh(h)).mean(1)


@pytest.mark.parametrize("passes", [1, 2])
def test_dp_grape_projects_embedding_tables_where_the_selection_lets_it(passes):
    """With ``embeddings: true`` the tables are projected too: their norms (clipping decisions) and
    clipped sums in the projected space equal one-example-at-a-time autograd's G_i·P or Pᵀ·G_i,
    and the kept pieces are B·T·r rows (right) or factors (left), never a V×H table per example."""
    torch.manual_seed(11)
    model = TwoTables().double()
    ids = torch.randint(0, 40, (7, 5))
    ids[1, 2:] = 0                    # padding
    ids[3, 1] = ids[3, 0]             # a repeated row
    y = torch.randint(0, 3, (7,))
    obj = Objective(model, lambda i: F.cross_entropy(model(ids[i]), y[i], reduction="none"), 7)
    assert not {"tall.weight", "wide.weight"} & set(check(model, obj, 7, grape=4).current)  # the paper's default
    est = check(model, obj, 7, grape=4, passes=passes, embeddings=True)
    assert est.current["tall.weight"].side == "right" and est.current["wide.weight"].side == "left"
    handlers = {type(h).__name__ for _, h, local in est.sampler.layers if set(local.values()) & {"tall.weight",
                                                                                                 "wide.weight"}}
    assert handlers == {"ProjectedEmbeddingHandler"}


# ------------------------------------------------------------------------------------------
# models a review broke the bound with (2026-11-26): each example's clipped gradient must be its own


class PairGate(nn.Module):
    """A layer without a handler of its own (the vmap fallback) whose inputs come nested: a tuple
    and a dict of batch tensors. Passed whole to each example's call, they made its "per-example"
    gradient read every example of the batch."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.temperature = nn.Parameter(torch.tensor(1.5))  # a 0-dim parameter: per-example gradients [B]
        self.lin = nn.Linear(4, 4)

    def forward(self, pair, extra):
        a, b = pair
        return self.lin(a * self.scale + b * extra["w"]) * self.temperature


class NestedInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.head = PairGate(), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.gate((x, x.flip(-1)), {"w": x.pow(2)})).squeeze(-1)


def regression(model, n, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    X, Y = torch.randn(n, *shape, generator=g), torch.randn(n, generator=g)
    return Objective(model, lambda idx: (model(X[idx]) - Y[idx]).pow(2), n)


@pytest.mark.parametrize("passes", [1, 2])
def test_a_fallback_layer_with_nested_inputs_gets_each_examples_own_gradient(passes):
    torch.manual_seed(0)
    model = NestedInputs()
    check(model, regression(model, 6, (4,)), 6, passes=passes)


class Centred(nn.Module):
    """Subtracts the batch mean before the first hooked layer: every example's input (and so its
    gradient) depends on the others', which the backprop layout check cannot see."""

    def __init__(self, norm: nn.Module | None = None):
        super().__init__()
        self.norm, self.lin = norm, nn.Linear(4, 1)

    def forward(self, x):
        x = self.norm(x) if self.norm is not None else x - x.mean(0, keepdim=True)
        return self.lin(x).squeeze(-1)


@pytest.mark.parametrize("norm, match", [
    (None, "mixes the examples of a batch"),
    (nn.BatchNorm1d(4, track_running_stats=False), "statistics of the batch"),
    (nn.BatchNorm1d(4).train(), "statistics of the batch"),
])
def test_a_forward_that_mixes_examples_before_any_hooked_layer_is_refused(norm, match):
    model = Centred(norm)
    if norm is not None:
        norm.train(norm.training)  # the model's eval() is not called here: the layer's mode stands
    with pytest.raises(UserError, match=match):
        setup(model, regression(model, 6, (4,)))


@pytest.mark.parametrize("recipe", [
    {"algorithm": "dpzero", "estimator": {"name": "zo_two_point"}, "update": {"name": "directional_sgd", "lr": 1e-3}},
    {"algorithm": "dpgd_0th", "update": {"name": "sgd", "lr": 1e-3}},
])
def test_zeroth_order_estimators_refuse_a_forward_that_mixes_examples(recipe):
    """The two-point difference of one example is clipped, but with batch centring one replaced
    example moved every example's difference: the released sum by 9.6 × the charged 2C in a review.
    The estimators run the first-order setup's probe (persample.check_examples_independent)."""
    import dpregistry
    from torch.utils.data import TensorDataset

    X, Y = torch.randn(16, 4), torch.randn(16)
    recipe = {**recipe, "sampler": {"name": "poisson", "batch_size": 8},
              "privatizer": {"clip": 0.5, "noise_multiplier": 1.0}, "accountant": "rdp",
              "privacy": {"epsilon": 1e6, "delta": 1e-5}, "train": {"steps": 1}}
    loss = lambda out, y: (out - y) ** 2  # noqa: E731
    with pytest.raises(UserError, match="mixes the examples of a batch"):
        dpregistry.train(recipe, model=Centred(), loss=loss, train_data=TensorDataset(X, Y), verbose=False)
    model = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))  # per example: trains
    assert dpregistry.train(recipe, model=model, loss=loss, train_data=TensorDataset(X, Y), verbose=False).run.step == 1


class Cumulative(nn.Module):
    """Each example sees the mean of the examples before it in the batch: example 0 alone and in a
    batch agree, the last does not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        before = torch.cumsum(x, 0) - x
        return self.lin(x + before / torch.arange(1, len(x) + 1).unsqueeze(1)).squeeze(-1)


def _one_step(recipe, model, X, Y):
    """One step of ``recipe`` (a mixing probe's case) on (X, Y) with a binary loss."""
    import dpregistry
    from torch.utils.data import TensorDataset

    recipe = {**recipe, "sampler": {"name": "poisson", "batch_size": 8},
              "privatizer": {"clip": 0.5, "noise_multiplier": 1.0}, "accountant": "rdp",
              "privacy": {"epsilon": 1e6, "delta": 1e-5}, "train": {"steps": 1}}
    loss = lambda out, y: F.binary_cross_entropy_with_logits(out, y.float(), reduction="none")  # noqa: E731
    return dpregistry.train(recipe, model=model, loss=loss, train_data=TensorDataset(X, Y), verbose=False)


@pytest.mark.parametrize("case", ["zero head", "duplicated rows", "mix over the examples before",
                                  "zero head and a mix over the examples before"])
@pytest.mark.parametrize("recipe", [
    {"algorithm": "dp_sgd", "update": {"lr": 1e-3}},
    {"algorithm": "dpzero", "estimator": {"name": "zo_two_point"}, "update": {"name": "directional_sgd", "lr": 1e-3}},
])
def test_the_mixing_probe_is_not_fooled_by_a_zero_head_copies_or_a_one_sided_mix(case, recipe):
    """A review passed the probe (example 0 alone against beside example 1, losses only, at the
    initial parameters) three ways: a zero-initialised last layer (every loss log K; a replaced
    example then moved a DP-SGD sum by 63 × and a DPZero sum by 47 × the charged 2C), rows 0 and 1
    alike (77 ×), and a mix over the examples before each one. The probe now takes 8 examples
    spread over the data, compares the first and the last alone, the hooks compare gradient
    norms too, and the zeroth-order estimators probe again at x + λu."""
    torch.manual_seed(0)
    X, Y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    model = Cumulative() if "mix" in case else Centred()
    if case.startswith("zero head"):
        nn.init.zeros_(model.lin.weight), nn.init.zeros_(model.lin.bias)
    if case == "duplicated rows":
        X[1] = X[0]
    with pytest.raises(UserError, match="mixes the examples of a batch"):
        _one_step(recipe, model, X, Y)


class Standardised(nn.Module):
    """(x − batch mean) / batch std, with noise drawn in the forward when ``noise``: alone, the
    std of one example is NaN, and a random forward differs from any other random state."""

    def __init__(self, noise: float = 0.0):
        super().__init__()
        self.lin, self.noise = nn.Linear(4, 1), noise

    def forward(self, x):
        x = (x - x.mean(0)) / x.std(0)
        return self.lin(x + self.noise * torch.randn_like(x)).squeeze(-1)


class Noisy(nn.Module):
    """Noise drawn in the forward, each example its own: no mix."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x + 0.1 * torch.randn_like(x)).squeeze(-1)


@pytest.mark.parametrize("case", ["std of the batch", "noise in the forward", "a NaN in the first record"])
@pytest.mark.parametrize("recipe", [
    {"algorithm": "dp_sgd", "update": {"lr": 1e-3}},
    {"algorithm": "dpzero", "estimator": {"name": "zo_two_point"}, "update": {"name": "directional_sgd", "lr": 1e-3}},
])
def test_the_mixing_probe_is_not_switched_off_by_a_value_it_cannot_compare(case, recipe):
    """The probe compared an example alone with the batch and left it out where the value alone was
    not finite (the std of one example), was random (noise of 10⁻⁶ in the forward), or was not
    finite in the batch (a NaN in one record spreads through the batch's mean): with both probed
    examples left out nothing was compared, and a review moved the sum by 8.2, 8.3 and 12.2 × the
    charged 2C. Each probed example is now compared in two batches of the same size and random
    state, the others swapped for other records; a value finite in one and not the other is a mix.
    A random forward that does not mix still trains."""
    torch.manual_seed(0)
    X, Y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    model = {"std of the batch": Standardised(), "noise in the forward": Standardised(1e-6),
             "a NaN in the first record": Centred()}[case]
    if case == "a NaN in the first record":
        X[0, 0] = float("nan")
    with pytest.raises(UserError, match="mixes the examples of a batch"):
        _one_step(recipe, model, X, Y)
    assert _one_step(recipe, Noisy(), X, Y).run.step == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_probe_allows_for_the_rounding_of_a_low_precision_model(dtype):
    """The shipped MiniLM in bf16 or fp16: padding to the probe batch's longest sentence moves an
    example's loss by that dtype's rounding (3e-4 in fp16, 5e-4 in bf16), which a tolerance set by
    the fp32 loss refused (a review). The tolerance follows the parameters' dtype; the probe
    batch never exceeds the physical batch."""
    import dpregistry
    from conftest import SST2_SUBSET
    from dpregistry.persample import probe_indices

    recipe = {"algorithm": "dp_sgd", "seed": 0,
              "objective": {"name": "hf_text_classification",
                            "model": {"path": "minilm", "dtype": dtype, "max_length": 64, "pooling": "mean"},
                            "data": {"path": str(SST2_SUBSET), "labels": ["0", "1"], "k_per_class": 32, "seed": 0,
                                     "max_test": 8}},
              "sampler": {"name": "poisson", "batch_size": 16}, "privatizer": {"clip": 1.0, "noise_multiplier": 1.0},
              "update": {"lr": 1e-3}, "accountant": "rdp", "privacy": {"epsilon": 1e6, "delta": 1e-5},
              "train": {"steps": 1, "eval_every": 1000, "micro_batch_size": 4}}
    assert dpregistry.train(recipe, verbose=False).run.step == 1
    assert probe_indices(64, 4).tolist() == [0, 21, 42, 63] and len(probe_indices(64, 1)) == 2


def test_batch_norm_with_running_statistics_in_eval_mode_is_per_example():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    norm.running_mean.normal_(), norm.running_var.uniform_(0.5, 2.0)
    model = Centred(norm).eval()
    check(model, regression(model, 6, (4,)), 6)


def test_a_convolution_padded_other_than_with_zeros_is_refused():
    model = nn.Sequential(nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten(0))
    with pytest.raises(UserError, match="padding_mode"):
        setup(model, Objective(model, lambda idx: model(torch.randn(len(idx), 2, 5)), 4))


class ClampedGradient(nn.Module):
    """A hook that clamps a hidden gradient (common in recurrent code): the backward is then not
    linear in the gradient it receives, which the two-pass mode's second backward assumes."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        return self.b(torch.tanh(h)).squeeze(-1)


def test_two_passes_refuse_a_backward_that_is_not_linear_in_its_gradient():
    torch.manual_seed(0)
    model = ClampedGradient()
    objective = regression(model, 6, (4,))
    for passes in (1, 2):
        est, ctx = setup(model, objective, passes=passes)
        (c,) = list(est.contributions(objective, torch.arange(6), ctx))
        norms = c.norms()
        clip = float(norms.min()) / 2  # every example clipped: weights well below 1
        if passes == 1:  # one backward: the norms and the sums come from the same backprops
            out = clip_and_sum(c, clip).aggregate.tensors
            assert math.sqrt(sum(float(v.pow(2).sum()) for v in out.values())) <= 6 * clip * (1 + 1e-9)
        else:
            with pytest.raises(UserError, match="not linear in the gradient"):
                clip_and_sum(c, clip)
