"""The per-layer per-example gradient registry is open to plugins (issue 15): a hook kind,
``dpreg_register_grad_samplers(register)``, through which the built-in layers are registered too."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpregistry import Objective, UserError, hookimpl
from dpregistry.clipping import clip_and_sum
from dpregistry.context import Context
from dpregistry.persample import LayerHandler, LinearHandler, handler_for
from dpregistry.registry import PluginConflict, get_registry
from dpreg_baseline.estimators import PerExampleGrad


class Scale(nn.Module):
    """y = w ⊙ x: a layer no built-in handler knows."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


class ScaleHandler(LayerHandler):
    """Per-example gradient of w: Σ_t g_t ⊙ x_t, kept as a [B, d] tensor."""

    types = (Scale,)

    def on_backprop(self, use):
        g, x = use.g, use.inp
        use.state = {"weight": (g * x).reshape(g.shape[0], -1, g.shape[-1]).sum(1)}
        use.inp = use.g = None


class ScalePlugin:
    @hookimpl
    def dpreg_register_grad_samplers(self, register):
        register(Scale, ScaleHandler())


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scale(4)
        self.out = nn.Linear(4, 3).double()

    def forward(self, x):
        return self.out(torch.tanh(self.scale(x)))


class Data(Objective):
    def __init__(self, model, n=12):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.model, self.x, self.y = model, torch.randn(n, 4, generator=g, dtype=torch.float64), torch.arange(n) % 3
        self.n_train = n

    def module(self):
        return self.model

    def losses(self, idx):
        return F.cross_entropy(self.model(self.x[idx]), self.y[idx], reduction="none")


@pytest.fixture
def with_scale_plugin():
    reg = get_registry()
    plugin = ScalePlugin()
    reg.add_plugin(plugin, origin="tests (grad sampler)", name="scale-layers")
    yield reg
    reg.pm.unregister(plugin)
    reg._grad_samplers = None


def test_the_built_in_layers_are_registered_through_the_hook():
    table = get_registry().grad_samplers()
    assert {nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm} <= set(table)
    assert isinstance(handler_for(nn.Linear(2, 2)), LinearHandler)
    assert handler_for(Scale(2)) is None  # unknown layers fall back to vmap


def test_a_plugin_layer_serves_per_example_gradients_equal_to_autograd(with_scale_plugin):
    model = Model()
    obj = Data(model)
    assert isinstance(handler_for(model.scale), ScaleHandler)
    params = dict(model.named_parameters())
    ctx = Context.detached(params, n_train=obj.n_train, provides={Objective: obj})
    est = PerExampleGrad(PerExampleGrad.Params(backend="hooks"))
    est.setup(ctx)
    assert any(h.__class__ is ScaleHandler for _, h, _ in est.sampler.layers)
    contrib = next(est.contributions(obj, torch.arange(obj.n_train), ctx))
    losses = obj.losses(torch.arange(obj.n_train))
    ref = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True) for i in range(obj.n_train)]
    norms = torch.stack([sum(g.pow(2).sum() for g in r).sqrt() for r in ref])
    assert torch.allclose(contrib.norms(), norms, rtol=1e-9)
    clip = float(norms.median())
    total = clip_and_sum(contrib, clip)
    weights = torch.clamp(clip / norms, max=1.0)
    for j, k in enumerate(params):
        want = sum(w * r[j] for w, r in zip(weights, ref))
        assert torch.allclose(total.aggregate.tensors[k], want, rtol=1e-9, atol=1e-12), k


def test_two_plugins_claiming_one_layer_type_are_refused_naming_both(with_scale_plugin):
    class Again:
        @hookimpl
        def dpreg_register_grad_samplers(self, register):
            register(Scale, ScaleHandler())

    reg = with_scale_plugin
    other = Again()
    reg.add_plugin(other, origin="tests (again)", name="scale-again")
    try:
        with pytest.raises(PluginConflict, match="scale-layers.*scale-again|scale-again.*scale-layers") as e:
            reg.grad_samplers()
        assert isinstance(e.value, UserError)
    finally:
        reg.pm.unregister(other)
        reg._grad_samplers = None


class TokenBag(nn.Module):
    """A token-wise linear layer, mean over tokens, a frozen head: an example's weight gradient is
    g·(a_1 + a_2)ᵀ/2, whose ghost norm Σ_{t,s}⟨a_t,a_s⟩⟨g_t,g_s⟩ cancels when a_2 ≈ −a_1."""

    def __init__(self, d=8):
        super().__init__()
        self.lin, self.head = nn.Linear(d, d), nn.Linear(d, 1)
        self.head.requires_grad_(False)

    def forward(self, x):
        return self.head(self.lin(x).mean(1)).squeeze(1)


@pytest.mark.parametrize("mode", ["flat", "two passes", "per layer"])
def test_a_crafted_example_whose_ghost_norm_cancels_in_fp32_is_still_clipped(mode):
    """Tokens A + e and −A with ‖A‖ = 10⁷, e ⟂ A of norm 10³: the true gradient norm is in the
    hundreds, the fp32 Gram products cancelled to about 0, and the example went unclipped (a review
    measured 334·C). The norm is now an upper bound (its rounding error added; recomputed in float64
    where that error is large), so the released sum of a batch of that one example stays within C."""
    from dpregistry.clipping import clip_and_sum, clip_and_sum_per_layer
    from dpregistry.persample import GradSampler

    torch.manual_seed(0)
    model, C = TokenBag().eval(), 1.0
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(1)
    worst, true_norms = 0.0, []
    for _ in range(20):
        A = torch.randn(8, generator=g, dtype=torch.float64)
        A = A / A.norm() * 1e7
        e = torch.randn(8, generator=g, dtype=torch.float64)
        e = e - (e @ A) / (A @ A) * A
        x = torch.stack([A + e / e.norm() * 1e3, -A]).float().unsqueeze(0)
        sampler = GradSampler(model, params, passes=2 if mode == "two passes" else 1)
        with torch.enable_grad(), sampler.capture(1):
            losses = model(x)
        c = sampler.contribution(losses)
        out = (clip_and_sum_per_layer(c, C) if mode == "per layer" else clip_and_sum(c, C)).aggregate.tensors
        worst = max(worst, math.sqrt(sum(float(v.double().pow(2).sum()) for v in out.values())))
        m64 = TokenBag().double()
        m64.load_state_dict(model.state_dict())
        grads = torch.autograd.grad(m64(x.double())[0], [m64.lin.weight, m64.lin.bias])
        true_norms.append(math.sqrt(sum(float(t.pow(2).sum()) for t in grads)))
    assert max(true_norms) > 100 * C  # the examples really are far outside the clip
    assert worst <= C * (1 + 1e-2)  # the released sum's own fp32 rounding, not an unclipped example


@pytest.mark.parametrize("passes", [1, 2])
def test_a_formed_per_example_gradient_that_is_mostly_rounding_is_released_as_measured(passes):
    """A small layer's per-example gradients are formed (B·p·q ≤ the factors). Tokens s·v, ...,
    s·v, −(T−1)·s·v (s up to 10¹⁰) cancel, so the formed gradient is mostly fp32 rounding; the
    second of two passes formed it again from its own backprop and released that, which the first
    pass's norm did not bound (a review: 4.9·C). Now it releases the first pass's, as measured: the
    sum moves by at most C when the example is removed."""
    from dpregistry.clipping import clip_and_sum
    from dpregistry.persample import GradSampler, keeps_per_example

    torch.manual_seed(0)
    d, T, C = 32, 32, 1.0
    assert keeps_per_example(T, d, d)
    model = TokenBag(d).eval()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(2)
    others = torch.randn(7, T, d, generator=g)

    def released(x):
        sampler = GradSampler(model, params, passes=passes)
        with torch.enable_grad(), sampler.capture(x.shape[0]):
            losses = model(x)
        out = clip_and_sum(sampler.contribution(losses), C).aggregate.tensors
        return {k: v.double() for k, v in out.items()}

    without = released(others)
    worst = 0.0
    for _ in range(24):
        v = torch.sign(torch.randn(d, generator=g)) * 2.0 ** torch.randint(-2, 3, (d,), generator=g).float()
        rows = (v * 10 ** (8 + 2 * torch.rand(1, generator=g).item())).repeat(T, 1)
        rows[-1] *= -(T - 1)
        with_it = released(torch.cat([others, rows[None]]))
        worst = max(worst, math.sqrt(sum(float((with_it[k] - without[k]).pow(2).sum()) for k in without)))
    assert worst <= C * (1 + 1e-4)


@pytest.mark.parametrize("mode", ["flat", "two passes", "per layer"])
def test_the_share_of_an_example_whose_rows_cancel_is_summed_in_float64(mode):
    """Factors kept (ghost norms): the clipped sum is one fp32 GEMM over every example's rows, and
    for an example whose rows cancel (tokens s·v, ..., s·v, −(T−1)·s·v) its rounding there is not
    bounded by the example's norm, which is exact: one such example moved the sum by 1.36·C (a
    review's search, at d = 260 and T = 128). Where the norm had to be recomputed in float64, the
    example's share of the sum now is too."""
    from dpregistry.clipping import clip_and_sum, clip_and_sum_per_layer
    from dpregistry.persample import GradSampler, keeps_per_example

    torch.manual_seed(0)
    d, T, C = 260, 128, 1.0
    assert not keeps_per_example(T, d, d)
    model = TokenBag(d).eval()
    model.lin.bias.requires_grad_(False)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(3)
    others = torch.randn(3, T, d, generator=g)

    def released(x):
        sampler = GradSampler(model, params, passes=2 if mode == "two passes" else 1)
        with torch.enable_grad(), sampler.capture(x.shape[0]):
            losses = model(x)
        c = sampler.contribution(losses)
        out = (clip_and_sum_per_layer(c, C) if mode == "per layer" else clip_and_sum(c, C)).aggregate.tensors
        return {k: v.double() for k, v in out.items()}

    without = released(others)
    worst = 0.0
    for _ in range(30):
        v = torch.randn(d, generator=g)
        rows = (v * 10 ** (2 + 6 * torch.rand(1, generator=g).item())).repeat(T, 1)
        rows[-1] *= -(T - 1)
        with_it = released(torch.cat([others, rows[None]]))
        worst = max(worst, math.sqrt(sum(float((with_it[k] - without[k]).pow(2).sum()) for k in without)))
    assert worst <= C * (1 + 1e-4)


def test_two_passes_release_a_cancelling_examples_share_from_the_first_backward():
    """loss_i = Σ_t z_t·Σ_j lin(x_t)_j with x_t = e₁ and z = (a, 1 − a), a near 2²¹ (exact in fp32,
    summing to 1): the gradient is 1·e₁ᵀ, measured in float64; the second backward's backprops are
    fl(w·a) and fl(w·(1 − a)), whose sum is not w, and forming its share from them in float64 did not
    help: 1.22·C (a review). The share now comes from the first backward's rows."""
    from dpregistry.clipping import clip_and_sum
    from dpregistry.persample import GradSampler

    torch.manual_seed(0)
    d, C = 6, 1.0

    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(d, d, bias=False)

        def forward(self, x):
            return (self.lin(x[..., :d]).sum(-1) * x[..., d]).sum(1)

    model = Weighted().eval()
    params = dict(model.named_parameters())
    others = torch.randn(3, 2, d + 1, generator=torch.Generator().manual_seed(3))

    def released(x, passes):
        sampler = GradSampler(model, params, passes=passes)
        with torch.enable_grad(), sampler.capture(x.shape[0]):
            losses = model(x)
        return clip_and_sum(sampler.contribution(losses), C).aggregate.tensors["lin.weight"].double()

    for passes in (1, 2):
        without, worst = released(others, passes), 0.0
        for a in torch.randint(2 ** 21, 2 ** 24 - 2, (40,), generator=torch.Generator().manual_seed(5)).tolist():
            x = torch.zeros(2, d + 1)
            x[:, 0], x[0, d], x[1, d] = 1.0, a, 1.0 - a
            worst = max(worst, float((released(torch.cat([others, x[None]]), passes) - without).norm()))
        assert worst <= C, passes


def _released(model, x, mode, C, users):
    """The clipped sum of the batch x in float64: "flat", "two passes", "per layer" or "users"."""
    from dpregistry.clipping import clip_and_sum_per_layer
    from dpregistry.persample import GradSampler

    sampler = GradSampler(model, dict(model.named_parameters()), passes=2 if mode == "two passes" else 1)
    with torch.enable_grad(), sampler.capture(x.shape[0]):
        losses = model(x)
    c = sampler.contribution(losses)
    if mode == "users":
        c.groups = users
    out = (clip_and_sum_per_layer(c, C) if mode == "per layer" else clip_and_sum(c, C)).aggregate.tensors
    return {k: v.double() for k, v in out.items()}


def _distance(a, b) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in b))


class CalledTwice(nn.Module):
    """loss = s·(Σ lin(x) − Σ lin(z)) over T tokens each: with x = z the example's gradient is 0,
    and each call's piece (weight and bias) is ±s·(...)."""

    def __init__(self, d):
        super().__init__()
        self.d, self.lin = d, nn.Linear(d, d)

    def forward(self, x):  # [B, 2, T, d + 1]: the two token sets, the scale in [:, 0, 0, d]
        d = self.d
        return x[:, 0, 0, d] * (self.lin(x[:, 0, :, :d]).sum((1, 2)) - self.lin(x[:, 1, :, :d]).sum((1, 2)))


class TiedHead(nn.Module):
    """An embedding tied to a head: loss = s·(⟨emb(i), a⟩ − head(a)[j]); the table's gradient is
    s·e_i aᵀ from the lookup (rows) and −s·e_j aᵀ from the head (factors), which cancel for i = j."""

    def __init__(self, vocab, d):
        super().__init__()
        self.d, self.emb, self.head = d, nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):  # [B, d + 3]: i, a, s, j
        d = self.d
        i, a, s, j = x[:, :1].long(), x[:, 1:d + 1], x[:, d + 1], x[:, d + 2:].long()
        return s * ((self.emb(i)[:, 0] * a).sum(1) - self.head(a).gather(1, j)[:, 0])


def _called_twice(d, T, s, g):
    x = torch.zeros(2, T, d + 1)
    x[0, :, :d] = x[1, :, :d] = torch.randn(T, d, generator=g)
    x[0, 0, d] = s
    return x


def _tied(vocab, d, s, g, same=True):
    i, j = torch.randint(vocab, (2,), generator=g).float()
    return torch.cat([i[None], torch.randn(d, generator=g), torch.tensor([s]), (i if same else j)[None]])


@pytest.mark.parametrize("mode", ["flat", "two passes", "per layer", "users"])
@pytest.mark.parametrize("shape", ["called twice, formed", "called twice, factors", "tied head"])
def test_pieces_of_a_shared_parameter_that_cancel_across_calls_release_what_was_measured(mode, shape):
    """A parameter several calls reach has the sum of their pieces as per-example gradient, and its
    norm (with cross terms, recomputed in float64 where they cancel) is right; but each call's
    pieces were summed over the examples on their own, in fp32, so an example whose pieces are
    ±w·X (w·X up to 10⁷·C: the clip weight of a norm that is 0 up to its float64 rounding bound)
    absorbed the other examples' rows in both sums (0.98·C at B = 256 in a search, never 0). Such an
    example's pieces are now added up in float64 across the calls: its release is the 0 measured.
    s is a power of 2, so the lookup's backprop s·a is exact and the pieces cancel exactly. With
    user-level clipping (users of two rows, the crafted one alone) it was 0.77·C."""
    from dpregistry.persample import keeps_per_example

    torch.manual_seed(0)
    C, B, g = 1.0, 24, torch.Generator().manual_seed(4)
    if shape == "tied head":
        vocab, d = 10, 6
        model, crafted = TiedHead(vocab, d).eval(), lambda s: _tied(vocab, d, s, g)
        others = torch.stack([_tied(vocab, d, 0.5, g, same=False) for _ in range(B - 2)])
    else:
        d, T = (6, 3) if shape == "called twice, formed" else (16, 2)
        assert keeps_per_example(T, d, d) == (shape == "called twice, formed")
        model, crafted = CalledTwice(d).eval(), lambda s: _called_twice(d, T, s, g)
        others = torch.randn(B - 2, 2, T, d + 1, generator=g) * 0.3

    def released(x):
        return _released(model, x, mode, C, users=torch.arange(x.shape[0]) // 2)

    without = released(others)
    worst = max(_distance(released(torch.cat([others, crafted(2.0 ** e)[None]])), without) for e in range(12, 40, 3))
    assert worst <= 1e-4 * C


@pytest.mark.parametrize("mode", ["flat", "two passes", "per layer", "users"])
def test_a_large_running_value_on_an_embedding_row_does_not_absorb_the_other_examples(mode):
    """An embedding called twice; the first example's pieces cancel across the calls by a factor of
    100 (+X·a, then −X·a + e), under the float64 recompute's threshold, so its ±w·X (about 100·C)
    stays in the fp32 sums. ``index_add_`` added each row's tokens one by one after it, and 64,000
    tokens of the other examples on that row, each under half an ulp of 100·C, were all rounded
    away: 1.47·C released at a clip of C (a review; 2.9·C with 256,000). The rows are now summed in
    float64 and rounded once."""
    N, T, X, C, j = 1000, 64, 100.0, 1.0, 1

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(4, 1), nn.Linear(1, 1)  # the head: a second layer group

        def forward(self, x):  # [B, T, 4]: ids of the two calls, their weights
            return ((self.emb(x[..., 0].long())[..., 0] * x[..., 2]).sum(1)
                    + (self.emb(x[..., 1].long())[..., 0] * x[..., 3]).sum(1) + 0 * self.head(x[:, :1, 2]).sum(1))

    model = Twice().eval()
    others = torch.zeros(N, T, 4)
    others[..., :2] = j
    others[..., 2:] = -0.97 * 2.0 ** (math.floor(math.log2(X)) - 24)  # under half an ulp of X
    crafted = torch.zeros(1, T, 4)
    crafted[0, 0, :2] = j
    crafted[0, 0, 2], crafted[0, 0, 3] = X, -X + 1.0

    def released(x):
        return _released(model, x, mode, C, users=torch.arange(x.shape[0]))

    assert _distance(released(torch.cat([crafted, others])), released(others)) <= C * (1 + 1e-5)


def test_only_the_built_in_product_handlers_replay_in_a_second_pass():
    """A second backward rebuilds a handler's pieces from the reweighted backprop; that is w times the
    first pass's only for arithmetic known to be a plain product. A subclass that changes it (a
    projection in ``weight_product``: 22·C in a review) must not inherit the claim."""
    from dpregistry.persample import ConvHandler, EmbeddingHandler, LayerNormHandler

    class Sketched(LinearHandler):
        def weight_product(self, use, a, g):
            return super().weight_product(use, a, g)

    assert LinearHandler.second_pass_replays and ConvHandler.second_pass_replays
    assert EmbeddingHandler.second_pass_replays
    assert not any(h.second_pass_replays for h in (Sketched, ScaleHandler, LayerNormHandler, LayerHandler))


class _Bf16Gradient(torch.autograd.Function):
    """The identity, whose backward rounds the gradient to bf16 (a memory-saving custom op, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


class Narrowed(nn.Module):
    """fp32 parameters; the forward or the backward handles bf16 tensors in one of five ways."""

    def __init__(self, how):
        super().__init__()
        self.how, self.lin, self.frozen = how, nn.Linear(4, 3), nn.Linear(3, 3).to(torch.bfloat16)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        x = x.float()
        if self.how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.lin(x).float()
        h = self.lin(x)
        if self.how == "cast":
            return h.to(torch.bfloat16).float()
        if self.how == "custom Function":
            return _Bf16Gradient.apply(h)
        if self.how == "gradient hook":
            if h.requires_grad:
                h.register_hook(lambda g: g.to(torch.bfloat16).to(g.dtype))
            return h * 1.0
        return self.frozen(h.to(torch.bfloat16)).float()


@pytest.mark.parametrize("how", ["autocast", "cast", "frozen bf16 layer", "custom Function", "gradient hook"])
def test_two_passes_refuse_a_model_that_rounds_in_bf16(how):
    """The trainable parameters are fp32 (so the parameters' dtype check passes), but the second
    backward would round in bf16 (reviews: 1.09·C through a cast, a custom Function or a gradient
    hook; the linearity check lets fp16's rounding through): the setup's probe watches the dtypes
    that its forward differentiates and that its backward makes."""
    model = Narrowed(how)
    obj = Data(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for passes in (1, 2):
        ctx = Context.detached(params, n_train=obj.n_train, provides={Objective: obj})
        est = PerExampleGrad(PerExampleGrad.Params(backend="hooks", passes=passes))
        if passes == 1:
            est.setup(ctx)
        else:
            with pytest.raises(UserError, match="passes: 2 needs a float32 model: this one differentiates bfloat16"):
                est.setup(ctx)


@pytest.mark.parametrize("mode", ["flat", "two passes", "per layer"])
def test_the_sums_of_a_cell_called_many_times_are_added_up_once(mode):
    """A Linear(1, 1) cell called K times (an unrolled RNN): the crafted example's pieces are +X in
    the first call and −X + 1 in the last (under the float64 recompute), 0 between; the other
    example's are −δ in every call, δ under half an ulp of w·X. The calls' sums were added one by
    one in fp32, so after the first each middle call's −δ was rounded away: the release moved by
    K·δ more than the crafted example's own share (1.03·C at K = 10,000 in a review). Past two
    calls they are now added in float64 and rounded once."""
    K, X, C = 1000, 66.0, 1.0

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
            with torch.no_grad():
                self.lin.weight.fill_(1.0)
                self.head.weight.zero_()

        def forward(self, x):  # [B, K, 2]: each step's input and the weight of its output
            out = 0 * self.head(x[:, 0, :1])[:, 0]
            for k in range(x.shape[1]):
                out = out + self.lin(x[:, k, :1])[:, 0] * x[:, k, 1]
            return out

    model = Cell().eval()
    crafted = torch.zeros(1, K, 2)
    crafted[..., 0] = 1
    crafted[0, 0, 1], crafted[0, K - 1, 1] = X, -X + 1.0
    alone = _released(model, crafted, mode, C, users=None)
    w = float(alone["lin.weight"].sum())  # the crafted example's share, w·1
    other = torch.zeros(1, K, 2)
    other[..., 0] = 1
    other[..., 1] = -0.97 * 2.0 ** (math.floor(math.log2(w * X)) - 24)
    moved = _distance(_released(model, torch.cat([crafted, other]), mode, C, users=None),
                      _released(model, other, mode, C, users=None))
    assert abs(moved - _distance(alone, {k: torch.zeros_like(v) for k, v in alone.items()})) <= 1e-4 * C


def test_a_nan_backprop_at_a_padding_token_keeps_the_example():
    """‖emb(id)‖ at the padding row's zero vector has an infinite derivative, so the backprop there
    is NaN through a finite loss; torch gives the padding row no gradient, and the example's
    gradient is finite. The mask multiplied (NaN·0 = NaN), which dropped the whole example."""
    from dpregistry.persample import GradSampler

    emb = nn.Embedding(5, 3, padding_idx=0)
    ids = torch.tensor([[1, 2, 0], [3, 0, 0]])
    sampler = GradSampler(emb, dict(emb.named_parameters()))
    with torch.enable_grad(), sampler.capture(2):
        losses = emb(ids).pow(2).sum(-1).sqrt().sum(1)
    norms = sampler.contribution(losses).norms()
    want = torch.stack([torch.autograd.grad(emb(ids[i:i + 1]).pow(2).sum(-1).sqrt().sum(), emb.weight)[0].norm()
                        for i in range(2)])
    torch.testing.assert_close(norms, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", ["flat", "two passes", "per layer", "users"])
def test_an_example_cancelling_across_calls_below_the_norms_flag_does_not_absorb_a_large_batch(mode):
    """Linear(8, 8) called twice, one token each; the crafted example's backprops are +X·e₁ and
    (1 − X)·e₁ (X = 40, under the float64 recompute of the norm), 20,000 others' are −δ·e₁, δ under
    half an ulp of X. Each call's sum is one fp32 GEMM over the batch, which MKL runs row after row
    at this width: the crafted example first, its ±w·X rounded every other row away (a review:
    1.36·C at 10⁵ rows, 4.7·C at 10⁶; 1.36·C with user-level clipping). It is now released apart,
    in float64, since its pieces cancel across the calls by more than ``APART``."""
    N, X, C = 20000, 40.0, 1.0

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)

        def forward(self, xz):  # [B, 2, 10]: each call's input (8) and the weights of its outputs 0, 1
            return sum((self.lin(xz[:, k, :8])[:, :2] * xz[:, k, 8:]).sum(1) for k in range(2))

    model = Twice().eval()
    half_ulp = 0.5 * float(torch.tensor(X).nextafter(torch.tensor(2 * X)) - X)
    others = torch.zeros(N, 2, 10)
    others[:, :, 0], others[:, :, 8] = 1.0, -0.97 * half_ulp
    crafted = torch.zeros(1, 2, 10)
    crafted[0, :, 0] = 1.0
    crafted[0, 0, 8], crafted[0, 1, 8] = X, 1.0 - X
    def released(x):
        return _released(model, x, mode, C, users=torch.arange(x.shape[0]))

    alone = _distance(released(crafted), {"lin.weight": torch.zeros(8, 8, dtype=torch.float64)})
    moved = _distance(released(torch.cat([crafted, others])), released(others))
    assert moved <= alone + 1e-5 * C
