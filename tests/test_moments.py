"""The Adam arithmetic that the Adam-form update rules share (dpregistry.moments)."""

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
