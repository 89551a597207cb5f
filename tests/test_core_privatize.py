"""Clipping and noise in every space: sensitivity, non-finite examples, noise scale and secrecy."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_run
from dpregistry.clipping import clip_and_sum
from dpregistry.directions import Direction
from dpregistry.persample import GradSampler
from dpregistry.rng import RunRNG
from dpregistry.spaces import DenseContribution, DirectionContribution, VectorZOContribution

RECIPE = {
    "algorithm": "dp_sgd",
    "objective": {"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
    "sampler": {"name": "shuffle", "batch_size": 10},
    "privatizer": {"clip": 0.7, "noise_multiplier": 1.3},
    "privacy": {"epsilon": 100.0, "delta": 1e-3},
    "train": {"steps": 3},
}


def dense(values):
    return DenseContribution(per_example={"w": values[:, :3], "b": values[:, 3:]})


def flat(agg):
    return torch.cat([agg.tensors["b"].flatten(), agg.tensors["w"].flatten()])


def test_clipped_sum_sensitivity_is_2c_under_replace_one(tmp_path):
    run = make_run(RECIPE, tmp_path)
    priv = run.privatizer
    assert priv.sensitivity() == 2 * 0.7
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for trial in range(200):
        x = torch.randn(8, 5, generator=g) * torch.rand(8, 1, generator=g) * 5
        y = x.clone()
        y[trial % 8] = torch.randn(5, generator=g) * 100  # replace one example by anything
        a, b = priv.clip_sum(dense(x)), priv.clip_sum(dense(y))
        worst = max(worst, float((flat(a.aggregate) - flat(b.aggregate)).norm()))
    assert worst <= priv.sensitivity() * (1 + 1e-6)
    assert worst > 0.9 * priv.sensitivity()  # and the bound is nearly attained


def test_every_clipped_example_has_norm_at_most_c():
    x = torch.randn(16, 5) * 3
    w_norms = []
    for i in range(16):
        single = clip_and_sum(dense(x[i:i + 1]), 0.5)
        w_norms.append(float(flat(single.aggregate).norm()))
    assert max(w_norms) <= 0.5 * (1 + 1e-6)
    small = x / x.norm(dim=1, keepdim=True) * 0.1  # below the clip: untouched
    s = clip_and_sum(dense(small), 0.5)
    assert torch.allclose(flat(s.aggregate), torch.cat([small[:, 3:].sum(0), small[:, :3].sum(0).flatten()]))
    assert s.clipped == 0


def test_nonfinite_examples_are_dropped_before_clipping():
    x = torch.randn(6, 5)
    x[2, 1] = float("nan")
    x[4, 0] = float("inf")
    losses = torch.tensor([0.1, 0.2, 0.3, float("inf"), 0.5, 0.6])
    s = clip_and_sum(DenseContribution(per_example={"w": x[:, :3], "b": x[:, 3:]}, losses=losses), 1.0)
    assert s.nonfinite == 3 and s.count == 6
    assert torch.isfinite(flat(s.aggregate)).all()
    keep = [0, 1, 5]
    ref = clip_and_sum(dense(x[keep]), 1.0)
    assert torch.allclose(flat(s.aggregate), flat(ref.aggregate))


def test_scalar_space_clip_and_noise_dimension(tmp_path):
    run = make_run(RECIPE, tmp_path)
    d = Direction(seed=5)
    vals = torch.tensor([0.3, -5.0, 2.0, float("nan")])
    c = DirectionContribution(values=vals, direction=d, names=("0.weight",))
    s = run.privatizer.clip_sum(c)
    assert math.isclose(float(s.aggregate.tensors["coeff"]), 0.3 - 0.7 + 0.7, abs_tol=1e-6)
    assert s.nonfinite == 1 and s.aggregate.numel == 1  # one scalar gets one scalar of noise


def test_vector_zo_clips_the_vector_and_lifts_to_dense():
    p = {"x": torch.zeros(10, dtype=torch.float64)}
    d = Direction(seed=1, distribution="sphere")
    u = d.dense([p["x"]])[0]
    assert math.isclose(float(u.norm()), math.sqrt(10), rel_tol=1e-9)
    c = VectorZOContribution(values=torch.tensor([[2.0], [0.01]], dtype=torch.float64), directions=(d,), params=p)
    # ‖Δ·u‖ = |Δ|·√d, so clip_C(Δu) = clip_{C/√d}(Δ)·u  (DPZero spec §8E)
    assert torch.allclose(c.norms(), torch.tensor([2 * math.sqrt(10), 0.01 * math.sqrt(10)], dtype=torch.float64))
    s = clip_and_sum(c, 1.0)
    expect = (1.0 / math.sqrt(10) + 0.01) * u
    assert torch.allclose(s.aggregate.tensors["x"], expect)


def test_noise_has_the_calibrated_scale(tmp_path):
    run = make_run(RECIPE, tmp_path)
    zero = clip_and_sum(DenseContribution(per_example={k: torch.zeros((1,) + tuple(v.shape))
                                                       for k, v in run.params.items()}), 0.7)
    draws = []
    for step in range(400):
        run.step = step
        rel = run.privatizer.release(zero.__class__(zero.aggregate.clone(), count=1), run.begin_step())
        draws.append(torch.cat([t.flatten() for t in rel.value.tensors.values()]))
    z = torch.cat(draws)
    std = z.std().item()
    expected = 1.3 * 0.7 / 10  # z·C on the sum, divided by the batch size
    assert abs(std / expected - 1) < 5 / math.sqrt(2 * len(z))  # 5 standard errors of a sample std
    ev = rel.events[0]
    assert ev.std == 1.3 * 0.7 and ev.sensitivity == 1.4 and math.isclose(ev.noise_multiplier, 1.3 / 2)


@pytest.mark.parametrize("mode", ["reproducible", "secure"])
def test_noise_is_not_any_public_seed_stream(mode):
    rng = RunRNG(seed=11, mode=mode)
    noise = rng.noise(step=3).randn((1000,))
    public = [rng.step_seed(p, 3) for p in ("direction", "poisson", "shuffle", "init")] + [11, 3]
    for s in public:  # no public seed of this step reproduces the noise
        g = torch.Generator().manual_seed(s)
        assert not torch.equal(noise, torch.randn(1000, generator=g))
    assert torch.equal(noise, rng.noise(step=3).randn((1000,)))  # a function of the key, step and call
    assert not torch.equal(noise, rng.noise(step=4).randn((1000,)))
    one, two = RunRNG(seed=11), RunRNG(seed=11)  # secure: a fresh key per run
    assert not torch.equal(one.noise(3).randn((1000,)), two.noise(3).randn((1000,)))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8, padding_idx=0)
        self.pos = torch.nn.Embedding(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)
        self.conv = torch.nn.Conv1d(8, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T]: broadcast across the batch
        h = self.norm(self.emb(ids) + self.pos(pos))
        h = torch.tanh(self.lin(h))
        h = self.conv(h.transpose(1, 2)).mean(-1)
        return self.head(h)


def test_hook_gradients_match_torch_func_per_example_gradients():
    torch.manual_seed(0)
    m = Tiny().double()
    ids = torch.randint(0, 20, (5, 6))
    ids[0, 3:] = 0  # padding
    y = torch.randint(0, 3, (5,))
    params = dict(m.named_parameters())

    def loss_one(p, i, t):
        out = torch.func.functional_call(m, p, (i.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, t.unsqueeze(0))

    ref = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(
        {k: v.detach() for k, v in params.items()}, ids, y)
    gs = GradSampler(m, params)
    with gs.capture(5):
        losses = torch.nn.functional.cross_entropy(m(ids), y, reduction="none")
    c = gs.contribution(losses)
    ref_norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    assert torch.allclose(c.norms(), ref_norms, rtol=1e-9)
    w = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.3], dtype=torch.float64)
    agg = c.weighted_sum(w)
    for k, g in ref.items():
        assert torch.allclose(agg.tensors[k], torch.einsum("b,b...->...", w, g), rtol=1e-9, atol=1e-12), k


@pytest.mark.parametrize("distribution", ["gaussian", "sphere", "rademacher"])
def test_directions_do_not_depend_on_the_thread_count(distribution):
    """A sweep draws its chunks on a thread pool; u must be the same bits with one thread, and
    add_ (the in-place sweep), dense and dot must all see that one u."""
    from dpregistry import directions

    shapes = [(3, directions.CHUNK // 3 + 7), (directions.CHUNK + 5,), (4,)]  # several chunks, a partial one
    d = Direction(seed=11, distribution=distribution)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = d.dense([torch.zeros(s) for s in shapes])
        torch.set_num_threads(2)
        threaded = d.dense([torch.zeros(s) for s in shapes])
        swept = [torch.zeros(s) for s in shapes]
        d.add_(swept, 2.0)
        v = [torch.randn(s, generator=torch.Generator().manual_seed(3)) for s in shapes]
        dot = d.dot([torch.zeros(s) for s in shapes], v)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(serial, threaded))
    assert all(torch.equal(2.0 * a, b) for a, b in zip(serial, swept))
    expect = sum(float((a.double() * b.double()).sum()) for a, b in zip(serial, v))
    assert math.isclose(dot, expect, rel_tol=1e-6)  # dense rounds sqrt(d)/‖z‖·z to fp32
