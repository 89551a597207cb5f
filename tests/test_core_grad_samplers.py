"""The per-layer per-example gradient registry is open to plugins (issue 15): a hook kind,
``dpreg_register_grad_samplers(register)``, through which the built-in layers are registered too."""

from __future__ import annotations

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
