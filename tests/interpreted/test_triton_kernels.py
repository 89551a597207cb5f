"""The CUDA kernels in Triton, run by Triton's interpreter on the CPU (CI has no GPU; the device
itself is checked by benchmarks/gpu_checks.py): each computes the numbers of the torch code it
replaces, from the same counters in the same layout.

* dpregistry/philox_triton.py: DPZero's sweep t += s·u, u the CPU kernel's Philox Gaussians in the
  CPU's chunk layout, for a list of tensors in one launch, from any chunk start;
* dpregistry/privacy/chacha_triton.py: a chunk of secret Gaussians, those of chacha.py's torch ops.

The interpreter computes log and cos with NumPy, so values agree to rounding; any error in a
counter, a word or a mask moves a value by O(1). Triton reads TRITON_INTERPRET when it is first
imported, so ../test_triton_kernels.py runs this file in a process of its own, with it set.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit("run by tests/test_triton_kernels.py, with TRITON_INTERPRET=1", returncode=4)

from dpregistry import philox, philox_triton  # noqa: E402
from dpregistry.directions import Direction  # noqa: E402
from dpregistry.privacy import chacha, chacha_triton, secret  # noqa: E402

LAYOUT = 4096  # the layout unit, small for the interpreter (2²⁰ in use)


@pytest.fixture(autouse=True)
def small_layout(monkeypatch):
    monkeypatch.setattr(philox_triton, "LAYOUT", LAYOUT)


def cpu_u(n: int, seed: int, start: int = 0) -> torch.Tensor:
    """u of a tensor's elements [start, start + n) by the CPU kernel's formula, chunk by chunk."""
    k0, k1 = torch.tensor(seed & 0xFFFFFFFF), torch.tensor(seed >> 32)
    return torch.cat([torch.zeros(0)] + [philox.gaussians(min(LAYOUT, start + n - s), k0, k1, torch.tensor(s))
                                         for s in range(start, start + n, LAYOUT)])


def test_the_philox_sweep_adds_the_cpu_kernels_u_to_every_tensor_in_one_launch():
    sizes = [10, 4099, 3 * LAYOUT + 4 * 130 + 3, 0, LAYOUT, 1]  # ragged tails, an empty tensor
    seeds = [5, (1 << 63) + 12345, 0xDEADBEEFCAFE, 3, (1 << 40) + 1, 9]
    ts = [torch.full((n,), 0.25) for n in sizes]
    philox_triton.add_(ts, seeds, 0.5)
    for t, n, seed in zip(ts, sizes, seeds):
        assert torch.allclose(t, 0.25 + 0.5 * cpu_u(n, seed), rtol=0, atol=1e-6), n
    # a chunk that starts at a later layout unit of its tensor continues the tensor's u
    x = torch.zeros(3 * LAYOUT + 5)
    philox_triton.add_([x[LAYOUT:]], [77], 1.0, [LAYOUT])
    assert torch.all(x[:LAYOUT] == 0)
    assert torch.allclose(x[LAYOUT:], cpu_u(2 * LAYOUT + 5, 77, LAYOUT), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of LAYOUT"):
        philox_triton.add_([x[4:]], [77], 1.0, [4])


def test_a_float16_sweep_is_the_float32_sum_rounded_once():
    t = torch.full((4099,), 0.5, dtype=torch.float16)
    philox_triton.add_([t], [7], 1e-2)
    want = (0.5 + 1e-2 * cpu_u(4099, 7)).half()
    assert (t.float() - want.float()).abs().max() <= 2 ** -11  # within one float16 step of [0.25, 1)
    assert (t != want).float().mean() < 0.01  # and equal but where the rounding of u itself decides


def test_directions_sweep_whole_tensors_with_the_same_u_as_chunk_by_chunk(monkeypatch):
    """On a CUDA GPU Direction.add_ hands every float tensor to one launch (philox.add_tensors_),
    while dense/dot draw chunk by chunk: both must be the one u. Here the kernel stands in for the
    CPU's (whole tensors on this CPU), with the layout unit, the CPU chunk and the device chunk
    made small."""
    from dpregistry import directions

    monkeypatch.setattr(philox, "_kernels", {"cpu": philox._TritonSweep(torch.device("cpu"))})
    monkeypatch.setattr(directions, "CHUNK", LAYOUT)
    shapes = [(3, LAYOUT + 7), (LAYOUT * 2 + 1,), (5,)]
    d = Direction(seed=2024)
    swept = [torch.zeros(s) for s in shapes]
    d.add_(swept, 1.0)
    for t, u, s in zip(swept, d.dense([torch.zeros(s) for s in shapes]), shapes):
        assert torch.equal(t, u)  # the same kernel, launched whole or by chunks
        assert torch.allclose(t.view(-1), cpu_u(t.numel(), d._seed(shapes.index(s))), rtol=0, atol=1e-6)


@pytest.mark.parametrize("m, start", [(16, 0), (4096, 12345), (6224, (1 << 32) - 7)])  # the last crosses 2³²
def test_the_chacha_kernel_draws_the_torch_ops_gaussians(m, start):
    key = chacha.key_words(secret.new_key(), "cpu")
    first = torch.tensor(start)
    z = chacha_triton.gaussian_chunk(key, first, m)
    want = chacha.gaussians_from_words(chacha.keystream(key, first, chacha.blocks_for(m)), m)
    assert torch.allclose(z, want, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="multiple of 16"):
        chacha_triton.gaussian_chunk(key, first, 24)
