"""The Philox4x32-10 Gaussian directions (dpregistry/philox.py): the generator against the published
known answers, the Gaussians against the formula computed independently in float64, the fused
sweep against the separate draw, and the settling of the compiled path."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from dpregistry import philox, progress
from dpregistry.directions import Direction
from dpregistry.rng import derive
from fake_compile import FakeCompile

# Random123's kat_vectors (counter words, key words -> output words), "philox4x32 10" lines
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_matches_the_published_known_answers(counter, key, expected):
    words = philox.philox([torch.tensor([c]) for c in counter], torch.tensor(key[0]), torch.tensor(key[1]))
    assert tuple(int(w) for w in words) == expected


def _formula(n: int, seed: int, start: int = 0) -> np.ndarray:
    """The module docstring's layout and Box–Muller, in float64 with NumPy, from the words of the
    (known-answer-checked) generator: the u of a chunk of n elements from element ``start`` on."""
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    c = start // 4 + torch.arange(-(-n // 4), dtype=torch.int64)
    zero = torch.zeros_like(c)
    words = philox.philox([c & 0xFFFFFFFF, c >> 32, zero, zero], torch.tensor(k0), torch.tensor(k1))
    w = [x.numpy().astype(np.uint64) for x in words]
    blocks = []
    for a, b in ((w[0], w[1]), (w[2], w[3])):
        rho = np.sqrt(-2.0 * np.log(((a >> np.uint64(8)) + np.uint64(1)).astype(np.float64) / 2.0 ** 24))
        theta = 2.0 * math.pi * (b >> np.uint64(8)).astype(np.float64) / 2.0 ** 24
        blocks += [rho * np.cos(theta), rho * np.sin(theta)]
    return np.concatenate(blocks)[:n]


@pytest.mark.parametrize("n", [philox.MIN_CHUNK, philox.MIN_CHUNK + 3, 1 << 20])
def test_the_fused_sweep_adds_the_formulas_gaussians(n):
    """p += s·u through the compiled kernel equals p + s·u with u computed independently in
    float64, to float32 rounding."""
    seed = derive("test-philox", n)
    p = torch.linspace(-1, 1, n)
    expected = p.double().numpy() + 0.5 * _formula(n, seed)
    philox.add_(p, seed, 0.5)
    np.testing.assert_allclose(p.double().numpy(), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("start", [0, 8, 1 << 20, (1 << 34) + 12])  # the last counts past 2³² counters
def test_a_chunk_reads_the_counters_from_its_start_on(start):
    """A chunk from element ``start`` of its tensor reads counters start/4 on, so the chunks of a
    tensor (2²⁰ elements each) never share a counter; a start off a multiple of 4 is refused."""
    n = philox.MIN_CHUNK + 3
    p = torch.zeros(n)
    philox.add_(p, 77, 1.0, start)
    np.testing.assert_allclose(p.double().numpy(), _formula(n, 77, start), rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="not a chunk for the Philox kernel"):
        philox.add_(p, 77, 1.0, start + 2)


def test_a_tensor_of_several_chunks_gets_each_chunks_formula():
    from dpregistry import directions

    k = directions.CHUNK
    tail = philox.MIN_CHUNK + 4
    t = torch.zeros(2 * k + tail)
    d = Direction(seed=4)
    d.add_([t], 1.0)
    expected = np.concatenate([_formula(k, d._seed(0), 0), _formula(k, d._seed(0), k), _formula(tail, d._seed(0), 2 * k)])
    np.testing.assert_allclose(t.double().numpy(), expected, rtol=2e-6, atol=2e-6)


def test_the_gaussians_are_standard_normal():
    z = torch.zeros(1 << 20)
    philox.add_(z, 12345, 1.0)
    z = z.double()
    assert abs(float(z.mean())) < 5 / 1024 and abs(float(z.var()) - 1) < 5 * math.sqrt(2) / 1024
    assert abs(float((z ** 4).mean()) - 3) < 0.05  # the fourth moment of a Gaussian
    assert float(z.abs().max()) <= math.sqrt(2 * 24 * math.log(2)) + 1e-5


def test_the_compiled_path_is_taken_on_this_cpu_for_large_float32_chunks():
    """CI has a C++ compiler: on the CPU, float32 tensors of at least MIN_CHUNK elements get
    Philox's Gaussians, in add_ and dense alike; shorter ones and other dtypes torch's generator."""
    d = Direction(seed=5)
    like = [torch.zeros(3, philox.MIN_CHUNK // 3 + 5), torch.zeros(philox.MIN_CHUNK), torch.zeros(11),
            torch.zeros(philox.MIN_CHUNK, dtype=torch.float64)]
    u = d.dense(like)
    for i in (0, 1):
        np.testing.assert_allclose(u[i].reshape(-1).double().numpy(), _formula(like[i].numel(), d._seed(i)),
                                   rtol=2e-6, atol=2e-6)
    for i in (2, 3):
        expected = torch.zeros_like(like[i]).normal_(generator=torch.Generator().manual_seed(d._seed(i, 0)))
        assert torch.equal(u[i], expected)
    swept = [torch.zeros_like(t) for t in like]
    d.add_(swept, 0.25)
    assert all(torch.equal(0.25 * a, b) for a, b in zip(u, swept))


def test_a_process_that_changes_its_thread_count_keeps_the_kernel():
    """The compiled loop is guarded on torch's thread count: each new count compiles another
    (dynamo stops at 8 by default, which with fullgraph is an error in the middle of a sweep).
    Nine counts in one process draw the same u, bit for bit."""
    before = torch.get_num_threads()
    expected = torch.zeros(philox.MIN_CHUNK)
    philox.add_(expected, 3, 1.0)
    try:
        for n in range(1, 10):
            torch.set_num_threads(n)
            x = torch.zeros(philox.MIN_CHUNK)
            philox.add_(x, 3, 1.0)
            assert torch.equal(x, expected), n
    finally:
        torch.set_num_threads(before)


def test_without_a_compiler_directions_come_from_torchs_generator_with_one_warning(monkeypatch):
    """Where torch.compile fails (no C++ compiler), the process settles on torch's generator, as
    before this kernel existed, says so once, and never tries again (a path switched in the middle
    of a run would change u between the sweeps of one step)."""
    fake = FakeCompile(fail={0})  # the first call compiles, and fails
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(philox, "_kernels", {})
    d, n = Direction(seed=9), philox.MIN_CHUNK
    with pytest.warns(RuntimeWarning, match="torch's generator") as caught:
        u = d.dense([torch.zeros(n)])[0]
    assert len(caught) == 1
    g = torch.Generator().manual_seed(d._seed(0, 0))
    assert torch.equal(u, torch.zeros(n).normal_(generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swept = torch.zeros(n)
        d.add_([swept], 2.0)
    assert torch.equal(swept, 2.0 * u) and fake.calls == 1


def test_with_compiling_disabled_directions_come_from_torchs_generator():
    """TORCH_COMPILE_DISABLE makes torch.compile a no-op, whose kernel would run its ops one by one
    (over 50 times slower): the process takes torch's generator instead."""
    big = torch.zeros(philox.MIN_CHUNK)
    with torch._dynamo.config.patch(disable=True):
        assert not philox.takes(big)
    assert philox.takes(big)


def test_the_user_hears_of_the_compile_once(monkeypatch):
    heard = []
    monkeypatch.setattr(philox, "_kernels", {})
    with progress.saying(heard.append):
        for _ in range(3):
            philox.add_(torch.zeros(philox.MIN_CHUNK), 1, 1.0)
    assert heard == ["random directions: compiling the Gaussian kernel for cpu, once per process (a few seconds)"]
