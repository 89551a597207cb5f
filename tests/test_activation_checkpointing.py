"""Per-example gradients of a model with activation checkpointing on.

Non-reentrant checkpointing (Hugging Face's ``gradient_checkpointing_enable()``) frees a segment's
activations after the forward and runs the segment's forward again inside the backward. The hooks
keep each layer's input as a saved tensor of the layer's tap, so the input is freed and
recomputed with the rest, and the recomputed forward gets the same taps. The norms and clipped sums
must then be those of one-example-at-a-time autograd (``clipped`` from the autograd tests), with
micro-batches of unequal size (the recomputation must take the batch size of its own capture) and
per layer; two passes, which would recompute twice, are refused. Reentrant checkpointing hides its
segment from the hooks and is refused; a layer run under torch.no_grad alone is not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

from dpregistry import UserError
from dpregistry.clipping import clip_and_sum_per_layer
from dpregistry.persample import GradSampler
from conftest import make_run
from test_persample_autograd import Objective, clipped, reference, setup, text_batch


pytestmark = pytest.mark.usefixtures("fp64")


def bert_case(checkpointing: bool, n: int = 6):
    """BERT in training mode (Hugging Face checkpoints only then), without dropout."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg).double().train()
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids, mask = text_batch(40, n, 7, seed=0, pad=0)
    y = torch.arange(n) % 3

    def losses(idx):
        out = model(input_ids=ids[idx], attention_mask=mask[idx])
        return F.cross_entropy(out.logits, y[idx], reduction="none")

    return model, Objective(model, losses, n)


@pytest.mark.parametrize("micro", [None, 4])
def test_a_checkpointed_model_gets_the_per_example_gradients_of_autograd(micro):
    _, norms, sums = clipped(*bert_case(True), 6, micro=micro)
    _, plain_norms, plain_sums = clipped(*bert_case(False), 6, micro=micro)
    torch.testing.assert_close(norms, plain_norms, rtol=1e-12, atol=0)
    for k in sums:
        torch.testing.assert_close(sums[k], plain_sums[k], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("grape", [None, 4])
def test_two_passes_are_refused_with_checkpointing_at_setup(grape):
    """Two passes would take the norms from one recomputation of each segment and the sums from
    another; a recomputation that differs (dropout with preserve_rng_state=False) then breaks the
    bound (the review measured 1.10·C). Refused at the estimator's setup, naming the setting."""
    with pytest.raises(UserError, match="passes: 2 cannot be used with activation checkpointing") as e:
        setup(*bert_case(True), grape=grape, passes=2)
    assert e.value.key == "estimator.passes"


class DropoutSegment(nn.Module):
    """A checkpointed segment with no trainable layer in it, whose recomputation draws new dropout
    masks (preserve_rng_state=False): no hook runs inside it, and the second backward of two passes
    would see other masks than the first (the second review: sums up to 1.05·C)."""

    def __init__(self, ckpt=True):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.ckpt = ckpt

    def forward(self, x):
        def segment(t):
            return F.dropout(torch.tanh(t), 0.3, training=True)

        h = self.a(x)
        h = checkpoint(segment, h, use_reentrant=False, preserve_rng_state=False) if self.ckpt else segment(h)
        return self.b(h)


@pytest.mark.parametrize("ckpt", [True, False])
def test_two_passes_are_refused_with_a_checkpointed_segment_that_holds_no_layer(ckpt):
    """Without the checkpoint the same dropout is kept in the graph both backwards share: accepted."""
    torch.manual_seed(0)
    model = DropoutSegment(ckpt)
    x, y = torch.randn(4, 8), torch.arange(4) % 2
    gs = GradSampler(model, dict(model.named_parameters()), passes=2)
    losses = lambda idx: F.cross_entropy(model(x[idx]), y[idx], reduction="none")  # noqa: E731
    if not ckpt:
        gs.check_model(losses, 4)
        return
    with pytest.raises(UserError, match="passes: 2 cannot be used") as e:
        gs.check_model(losses, 4)
    assert e.value.key == "estimator.passes"


def test_dp_grape_on_a_checkpointed_model():
    clipped(*bert_case(True), 6, grape=4)


def per_layer_sum(checkpointing: bool, clip: float):
    model, obj = bert_case(checkpointing)
    gs = GradSampler(model, {n: p for n, p in model.named_parameters() if p.requires_grad})
    with torch.enable_grad(), gs.capture(6):
        losses = obj.losses(torch.arange(6))
    return clip_and_sum_per_layer(gs.contribution(losses), clip)


def test_per_layer_clipping_on_a_checkpointed_model():
    """Per-layer clipping closes each group inside the backward, between recomputations: the same
    sum as without checkpointing (itself checked against autograd in test_per_layer_clipping)."""
    got, plain = per_layer_sum(True, 4.0), per_layer_sum(False, 4.0)  # each example clips in some group
    assert got.clipped > 0 and (got.count, got.clipped) == (plain.count, plain.clipped)
    for k, v in plain.aggregate.tensors.items():
        torch.testing.assert_close(got.aggregate.tensors[k], v, rtol=1e-12, atol=1e-15)


class Blocks(nn.Module):
    """Two blocks of two wide linear layers, checkpointed by torch.utils.checkpoint (``ckpt``: off,
    "reentrant" or "non-reentrant")."""

    def __init__(self, width=64, ckpt="non-reentrant"):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(2))
        self.head = nn.Linear(width, 2)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = x + (b(x) if self.ckpt == "off" else checkpoint(b, x, use_reentrant=self.ckpt == "reentrant"))
        return self.head(x.mean(1))


@pytest.mark.parametrize("ckpt", ["non-reentrant", "off"])
def test_checkpointing_frees_the_inputs_the_hooks_need_until_the_backward(ckpt):
    """The input of a block's second layer (the GELU's output) exists only inside the segment: after
    the forward its storage is freed, though that layer's per-example gradient needs it; it comes
    back, recomputed, for the backward. Without checkpointing the same storage stays alive."""
    torch.manual_seed(0)
    model = Blocks(ckpt=ckpt)
    seen: list[StorageWeakRef] = []
    model.blocks[0][2].register_forward_hook(lambda m, a, o: seen.append(StorageWeakRef(a[0].untyped_storage())))
    gs = GradSampler(model, dict(model.named_parameters()))
    x, y = torch.randn(8, 5, 64), torch.arange(8) % 2
    with torch.enable_grad(), gs.capture(8):
        losses = F.cross_entropy(model(x), y, reduction="none")
    assert seen[0].expired() is (ckpt != "off")
    norms = gs.contribution(losses).norms()
    assert (len(seen) > 1) is (ckpt != "off")  # recomputed in the backward (and in the layout probe's)
    assert torch.isfinite(norms).all() and (norms > 0).all()


def test_reentrant_checkpointing_is_refused_naming_a_layer():
    """A reentrant segment runs its forward without grad and backprops itself into ``.grad``: its
    layers would be missing from the norms and the sum (and the sums left in ``.grad`` are not
    private). It is refused at the first contribution, which estimators take at setup."""
    torch.manual_seed(0)
    model = Blocks(width=8, ckpt="reentrant")
    gs = GradSampler(model, dict(model.named_parameters()))
    with pytest.raises(UserError, match=r"blocks\.0\.0 \(and 3 more\) ran without autograd.*use_reentrant=False"):
        # the input requires grad, so the segment's custom function reaches the loss (without it, plain
        # autograd too gives the segment no gradient)
        gs.check_model(lambda idx: F.cross_entropy(model(torch.randn(len(idx), 3, 8, requires_grad=True)), idx % 2,
                                                   reduction="none"), 4)
    assert all(p.grad is None for p in model.parameters())


def test_a_trainable_layer_also_called_under_no_grad_gets_the_gradients_of_autograd():
    """Pseudo-labels from the model itself, under torch.no_grad: no gradient flows through that call,
    which autograd agrees with, so nothing escapes and it is accepted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(6, 4)

    def losses(idx):
        with torch.no_grad():
            pseudo = model(x[idx]).argmax(1)
        return F.cross_entropy(model(x[idx] + 0.1), pseudo, reduction="none")

    params = dict(model.named_parameters())
    gs = GradSampler(model, params)
    gs.check_model(losses, 6)
    with torch.enable_grad(), gs.capture(6):
        norms = gs.contribution(losses(torch.arange(6))).norms()
    ref = reference(Objective(model, losses, 6), params, 6)
    torch.testing.assert_close(norms, torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values())))


def test_a_layer_input_changed_in_place_after_the_call_is_refused_where_the_gradient_needs_it():
    """An input changed in place after the layer read it would give the weight a wrong per-example
    gradient: refused in words. With the weight frozen (BitFit) the input is not needed nor kept,
    and the same forward is accepted with the bias's per-example gradients."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)

    def run(params):
        gs = GradSampler(lin, params)
        with torch.enable_grad(), gs.capture(3):
            x = torch.randn(3, 4) + 0  # not a leaf: in place is allowed on it
            out = lin(x)
            losses = out.pow(2).sum(1)
            x.mul_(2)
        return gs.contribution(losses), out

    with pytest.raises(UserError, match="the input of Linear is modified in place"):
        run(dict(lin.named_parameters()))
    lin.weight.requires_grad_(False)
    c, out = run({"bias": lin.bias})
    torch.testing.assert_close(c.norms(), (2 * out.detach()).norm(dim=1))  # ∂‖out‖²/∂bias = 2·out


def test_an_argument_of_a_vmap_fallback_layer_changed_in_place_after_the_call_is_refused():
    """The vmap fallback keeps its layer's arguments (not autograd: no version check behind it). An
    in-place change after the call that mixes the batch would make example i's "per-example"
    gradient depend on the others (here the norms drop to those of x − mean): refused in words."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x):
            return x * self.s

    torch.manual_seed(0)
    m = Scale()
    gs = GradSampler(m, dict(m.named_parameters()))
    with torch.enable_grad(), gs.capture(3):
        x = torch.randn(3, 4, dtype=torch.float64) + 0  # not a leaf: in place is allowed on it
        losses = m(x).sum(1)
        x.sub_(x.mean(0))
    with pytest.raises(UserError, match="the input of Scale is modified in place"):
        gs.contribution(losses)


def test_a_recipe_run_with_activation_checkpointing_trains_exactly_as_without(tmp_path):
    """``model.activation_checkpointing`` wraps MiniLM's six blocks (the objective runs in eval mode,
    where Hugging Face's own switch would not checkpoint); the run's steps are the same numbers."""
    from test_text_lora import RECIPE

    recipe = {**RECIPE, "objective": {"name": "hf_text_classification", "trainable": {"exclude": ["embeddings"]}}}
    ckpt = {**recipe, "model": {**recipe["model"], "activation_checkpointing": True}}
    runs = [make_run(r, tmp_path) for r in (recipe, ckpt)]
    wrapped = [m for m in runs[1].objective.model.modules() if "forward" in vars(m)]
    assert len(wrapped) == 6 and not any("forward" in vars(m) for m in runs[0].objective.model.modules())
    before = {n: p.detach().clone() for n, p in runs[0].params.items()}
    for run in runs:
        run.train()
    assert any(not torch.equal(before[n], p) for n, p in runs[0].params.items() if "encoder.layer.0." in n)
    for n, p in runs[0].params.items():
        assert torch.equal(runs[1].params[n], p), n
    assert runs[0].accountant.epsilon() == runs[1].accountant.epsilon()


def test_own_hugging_face_model_checkpointed_through_the_python_api():
    """``dpregistry.checkpoint_blocks`` on a model passed to ``dpregistry.train``: the same steps."""
    import dpregistry
    from transformers import BertConfig, BertForSequenceClassification

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 40, (24, 7), generator=g), torch.arange(24) % 2)
    recipe = {"algorithm": "dp_adam", "seed": 0, "sampler": {"batch_size": 8}, "update": {"lr": 1e-2},
              "privacy": {"epsilon": 8.0, "delta": 1e-5, "noise": "reproducible"}, "train": {"steps": 3}}

    def loss(model, batch):
        ids, y = batch
        return F.cross_entropy(model(input_ids=ids).logits, y, reduction="none")

    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                                         num_attention_heads=2, intermediate_size=32,
                                                         max_position_embeddings=16)).float()
        if ckpt:
            assert dpregistry.checkpoint_blocks(model) == 2
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        results.append(dpregistry.train(recipe, model=model, loss=loss, train_data=data, verbose=False))
    plain, ckpt = (dict(r.model.named_parameters()) for r in results)
    assert all(torch.equal(ckpt[n], p) for n, p in plain.items())
    assert not torch.equal(init["bert.encoder.layer.0.intermediate.dense.weight"],
                           plain["bert.encoder.layer.0.intermediate.dense.weight"])
    assert results[0].epsilon == results[1].epsilon

def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class SequenceFirst(nn.Module):
    """A linear layer that sees [T, B, F]: refused in the forward (T ≠ B) or by the layout check in
    the backward (T = B)."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return checkpoint(lambda h: self.lin(h.transpose(0, 1)).transpose(0, 1), x, use_reentrant=False).mean((1, 2))


@pytest.mark.parametrize("passes", [1, 2])
def test_the_hooks_leave_the_model_whatever_becomes_of_a_capture(passes):
    """The hooks stay after a capture while its backward waits, and only then: a forward that
    raises, a contribution dropped unread, and a backward that raises (in the first of two passes
    too) leave the user's model without them, so it can be copied and saved afterwards (a hook
    left behind holds the sampler and the failed forward's graph)."""
    import copy
    import gc

    torch.manual_seed(0)
    model = SequenceFirst()
    gs = GradSampler(model, dict(model.named_parameters()), passes=passes)
    with pytest.raises(UserError, match="leading dimension 5"), torch.enable_grad(), gs.capture(4):
        model(torch.randn(4, 5, 8))
    assert hooks_on(model) == 0
    copy.deepcopy(model)
    # T = B: refused inside the backward; two passes refuse the checkpointed forward before it
    with pytest.raises(UserError, match="not one example each" if passes == 1 else "passes: 2 cannot be used"):
        gs.check_model(lambda idx: model(torch.randn(len(idx), len(idx), 8)), 4)
    assert hooks_on(model) == 0

    blocks = Blocks(width=8, ckpt="non-reentrant" if passes == 1 else "off")  # two passes refuse checkpointing
    gs = GradSampler(blocks, dict(blocks.named_parameters()), passes=passes)
    x, y = torch.randn(4, 3, 8), torch.arange(4) % 2
    contributions = []
    for _ in range(2):
        with torch.enable_grad(), gs.capture(4):
            contributions.append(gs.contribution(F.cross_entropy(blocks(x), y, reduction="none")))
    assert hooks_on(blocks) > 0  # both backwards wait (a checkpointed forward runs again in them)
    contributions[0].norms()
    assert hooks_on(blocks) > 0
    del contributions[1]  # never read
    gc.collect()
    if passes == 2:  # the second pass of the first one still waits
        assert hooks_on(blocks) > 0
        contributions[0].weighted_sum(torch.ones(4))
    assert hooks_on(blocks) == 0


def beit_case(checkpointing: bool, n: int = 6):
    """BEiT: each block owns its layer-scale parameters, so the blocks themselves are vmap-fallback
    layers, whose per-example gradients re-run the (checkpointed) block under torch.func."""
    from transformers import BeitConfig, BeitForImageClassification

    from dpregistry import checkpoint_blocks

    torch.manual_seed(0)
    cfg = BeitConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32, num_labels=3, layer_scale_init_value=0.1)
    model = BeitForImageClassification(cfg).double().eval()
    if checkpointing:
        assert checkpoint_blocks(model) == 2
    x, y = torch.randn(n, 3, 8, 8), torch.arange(n) % 3
    return model, Objective(model, lambda idx: F.cross_entropy(model(pixel_values=x[idx]).logits, y[idx],
                                                                 reduction="none"), n)


def test_checkpointed_blocks_that_own_parameters_get_the_per_example_gradients_of_autograd():
    _, norms, sums = clipped(*beit_case(True), 6)
    _, plain_norms, plain_sums = clipped(*beit_case(False), 6)
    torch.testing.assert_close(norms, plain_norms, rtol=1e-12, atol=0)
    for k in sums:
        torch.testing.assert_close(sums[k], plain_sums[k], rtol=1e-12, atol=1e-15)


def test_a_copy_of_a_checkpointed_model_runs_its_own_blocks():
    import copy

    model, _ = beit_case(True)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.enable_grad():
        before = twin(pixel_values=x).logits.detach()
        with torch.no_grad():
            for p in model.beit.layers.parameters():  # the original's blocks only
                p.add_(1.0)
        torch.testing.assert_close(twin(pixel_values=x).logits, before, rtol=0, atol=0)
    assert checkpoint_blocks_twice_is_once(twin)


def checkpoint_blocks_twice_is_once(model) -> bool:
    from dpregistry import checkpoint_blocks

    forwards = [vars(m)["forward"] for m in model.modules() if "forward" in vars(m)]
    checkpoint_blocks(model)
    return forwards == [vars(m)["forward"] for m in model.modules() if "forward" in vars(m)]
