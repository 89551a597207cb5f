"""The Adam arithmetic that the Adam-form update rules share (dpregistry.moments), and Adam's
per-parameter learning rates."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dpregistry import moments


def _state(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    m, v = torch.randn(shape, generator=g), torch.rand(shape, generator=g)
    return x, m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_step_in_blocks_is_the_whole_tensor_step_bit_for_bit_without_a_parameter_sized_transient(
        dtype, contiguous, monkeypatch):
    x, m, v = _state((12, 10), dtype)
    if not contiguous:
        x, m, v = x.t(), m.t(), v.t()
    expect = x - (m / (v.sqrt() + 1e-8) * 0.01).to(dtype)
    monkeypatch.setattr(moments, "BLOCK", 7)  # 120 elements: 17 full blocks and a short one
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        moments.sub_ratio_(x, m, v, 1e-8, 0.01)
    assert torch.equal(x, expect)
    largest = max(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    if contiguous:  # a transposed view falls back to the whole tensor (still one temporary, not four)
        assert largest <= 7 * 4
    else:
        assert largest <= 120 * 4


def test_moments_are_adams():
    """m ← β1·m + (1−β1)·g and v ← β2·v + (1−β2)·g², as torch.optim.Adam keeps them."""
    p = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.Adam([p], betas=(0.8, 0.9))
    m, v = torch.zeros(5), torch.zeros(5)
    for seed in range(3):
        g = torch.randn(5, generator=torch.Generator().manual_seed(seed))
        p.grad = g.clone()
        opt.step()
        moments.update_moments_(m, v, g, (0.8, 0.9))
    torch.testing.assert_close(m, opt.state[p]["exp_avg"])
    torch.testing.assert_close(v, opt.state[p]["exp_avg_sq"])


def test_adam_lr_scale_gives_matching_parameters_their_own_learning_rate():
    """update.lr_scale {regex: factor}: a matching parameter steps exactly as Adam at lr × factor,
    the others as at lr (the first matching pattern wins)."""
    from dpregistry.context import Context
    from dpregistry.spaces import DenseAggregate
    from dpregistry.stages import Release
    from dpreg_baseline.updates import Adam
    from dpregistry import UserError

    def stepped(cfg):
        params = {"head.weight": torch.ones(3), "encoder.bias": torch.ones(3), "head.bias": torch.ones(2)}
        upd = Adam(Adam.Params(**cfg))
        ctx = Context.detached(params)
        upd.setup(ctx)
        upd.validate(ctx)
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            grads = {k: torch.randn(p.shape, generator=g) for k, p in params.items()}
            upd.apply(ctx.params, Release(DenseAggregate(grads), []), ctx)
        return params

    for decay in (0.0, 0.1):  # decoupled weight decay scales with the parameter's own lr
        scaled = stepped({"lr": 1e-2, "weight_decay": decay, "lr_scale": {r"^head\.weight": 10.0, r"^head\.": 3.0}})
        for name, lr in (("head.weight", 1e-2 * 10.0), ("head.bias", 1e-2 * 3.0), ("encoder.bias", 1e-2)):
            assert torch.equal(scaled[name], stepped({"lr": lr, "weight_decay": decay})[name]), (name, decay)
    with pytest.raises(UserError, match="matches no trainable parameter"):  # a typo is refused before step 1
        stepped({"lr": 1e-2, "lr_scale": {r"^haed\.": 3.0}})
    with pytest.raises(ValueError, match="not a regular expression"):
        Adam.Params(lr=1e-2, lr_scale={"head(": 3.0})
