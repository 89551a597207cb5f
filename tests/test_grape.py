"""DP-GRAPE plugin: the properties of spec 003 §7 (section numbers in the test names' docstrings)."""

from __future__ import annotations

import math
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_run
from dpregistry import Objective
from dpregistry.clipping import clip_and_sum
from dpregistry.context import Context
from dpregistry.rng import RunRNG
from dpregistry import moments
from dpregistry.spaces import ProjectedAggregate, Projector
from dpregistry.stages import ClippedSum, Release

from dpreg_grape.estimators import ProjectedPerExampleGrad, select_layers
from dpreg_grape.objectives import build_from_config
from dpreg_grape.projection import LayerSelection, make_projector, period, projected_shape, side_of
from dpreg_grape.updates import GaLoreAdam, ProjectedAdam


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


class FixedData:
    """A minimal objective over fixed tensors (for estimator-level tests without a recipe)."""

    def __init__(self, model, x, y, loss=F.cross_entropy):
        self.model, self.x, self.y, self.loss = model, x, y, loss

    @property
    def n_train(self):
        return 0 if self.x is None else len(self.x)

    def module(self):
        return self.model

    def losses(self, idx):
        return self.loss(self.model(self.x[idx]), self.y[idx], reduction="none")


def estimator(model, data, *, rank=4, refresh=100, projector="gaussian", project=None, micro=None, seed=0, passes=1):
    """The projected estimator set up on ``model`` with ``data`` as its objective, and the context
    of step 0 (a detached one: the stage alone, as a run would drive it)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    cfg = ProjectedPerExampleGrad.Params(rank=rank, refresh_every=refresh, projector=projector,
                                         project=project or LayerSelection(), passes=passes)
    est = ProjectedPerExampleGrad(cfg)
    ctx = Context.detached(params, seed=seed, n_train=data.n_train, micro_batch_size=micro,
                           provides={Objective: data})
    est.setup(ctx)
    return est, ctx


def per_example_reference(model, losses):
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = {n: [] for n in names}
    for i in range(losses.shape[0]):
        for n, g in zip(names, torch.autograd.grad(losses[i], params, retain_graph=True)):
            out[n].append(g)
    return {n: torch.stack(v) for n, v in out.items()}


def digits(algorithm="dp_grape", steps=1, **sections):
    r = {"algorithm": algorithm, "seed": 3,
         "objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [96], "activation": "tanh"},
                       "data": {"dataset": "digits"}},
         "sampler": {"name": "poisson", "batch_size": 48},
         "privatizer": {"clip": 0.5, "noise_multiplier": 1.3},
         "privacy": {"epsilon": 1000.0, "delta": 1e-5, "noise": "reproducible"},
         "train": {"steps": steps, "log_every": 1000}}
    for k, v in sections.items():
        if v is None:
            r.pop(k)
            continue
        r[k] = v if not isinstance(v, dict) or not isinstance(r.get(k), dict) else {**r[k], **v}
    return r


def params_after(recipe, tmp_path):
    run = make_run(recipe, tmp_path)
    run.train()
    return {k: v.detach().clone() for k, v in run.params.items()}, run


def spy_releases(monkeypatch, cls):
    seen = []
    orig = cls.apply

    def apply(self, params, release, ctx):
        seen.append((ctx.step, release.value.clone(), {k: v.clone() for k, v in params.items()}))
        return orig(self, params, release, ctx)

    monkeypatch.setattr(cls, "apply", apply)
    return seen


# ------------------------------------------------------------------------------------------
# §7.1 projectors, §7.2 seed schedule, §7.3 orientation
# ------------------------------------------------------------------------------------------


def test_projector_is_reproducible_bit_for_bit_and_n01r():
    """§7.1: the same seed gives the same P bit for bit; entries have mean 0 and variance 1/r."""
    rng = RunRNG(11)
    s = rng.step_seed("grape_projector", 0, "layer.a")
    P1 = make_projector("gaussian", s, (4096, 8192), 64).matrix()
    P2 = make_projector("gaussian", RunRNG(11).step_seed("grape_projector", 0, "layer.a"), (4096, 8192), 64).matrix()
    assert P1.shape == (4096, 64) and torch.equal(P1, P2)
    assert rng.step_seed("grape_projector", 0, "layer.b") != s  # layers get different seeds
    x = P1.double()
    assert abs(float(x.mean())) < 0.005
    assert abs(float(x.var()) * 64 - 1) < 0.02


def test_seed_schedule_changes_exactly_every_F_steps():
    """§7.2: with F = 100 and t = 1..350 seeds change at t ∈ {100, 200, 300}; initial seeds exist before t = 1."""
    model = nn.Sequential(nn.Linear(12, 10))
    est, ctx = estimator(model, FixedData(model, None, None), rank=4, refresh=100)
    seeds = [est.projectors(t - 1)["0.weight"].seed for t in range(1, 351)]  # engine step = t − 1
    changes = [t for t in range(2, 351) if seeds[t - 1] != seeds[t - 2]]
    assert changes == [100, 200, 300]
    assert [period(t - 1, 100) for t in (1, 99, 100, 199, 200)] == [0, 0, 1, 1, 2]


def test_orientation_and_projected_shapes():
    """§7.3: out=1024,in=4096 → R (B, r, 4096), M and V (r, 4096); out=4096,in=1024 → R (B, 4096, r); square: left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 1024), nn.Tanh(), nn.Linear(1024, 4096), nn.Tanh(), nn.Linear(4096, 3))
    x, y = torch.randn(2, 4096), torch.tensor([0, 2])
    data = FixedData(model, x, y)
    est, ctx = estimator(model, data, rank=8)
    c = next(est.contributions(data, torch.arange(2), ctx))
    pe = {name: v for h, local, uses in c.records for k, v in h.per_example(uses[0]).items()
          for name in [local[k]]}
    assert pe["0.weight"].shape == (2, 8, 4096)
    assert pe["2.weight"].shape == (2, 4096, 8)
    assert pe["4.weight"].shape == (2, 3, 4096)  # min(3, 4096) ≤ r: the head stays dense
    assert side_of((64, 64)) == "left" and side_of((64, 65)) == "left" and side_of((65, 64)) == "right"
    agg = c.weighted_sum(torch.ones(2))
    upd = ProjectedAdam(ProjectedAdam.Params(lr=1e-3))
    upd.setup(ctx)
    upd.apply(ctx.params, Release(agg, []), ctx)
    assert upd.state.m["0.weight"].shape == (8, 4096) and upd.state.v["0.weight"].shape == (8, 4096)
    assert upd.state.m["2.weight"].shape == (4096, 8)


@pytest.mark.parametrize("shape", [(40, 56), (56, 40)], ids=["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_back_projection_updates_the_weight_in_blocks_without_a_weight_sized_transient(shape, dtype, monkeypatch):
    """W − α·back(X) lands in W a block of rows at a time: the one-shot lift's numbers, and no
    allocation as large as W (an embedding table's lifted step was hundreds of MiB)."""
    from torch.profiler import ProfilerActivity, profile

    pr = make_projector("gaussian", 5, shape, 4)
    X = torch.randn(projected_shape(shape, pr.side, 4), generator=torch.Generator().manual_seed(0))
    W = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expect = W - (pr.back(X) * 0.3).to(dtype)
    monkeypatch.setattr(moments, "BLOCK", 3 * shape[1])  # blocks of 3 rows, the last one short
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pr.sub_back_(W, X, 0.3)
    torch.testing.assert_close(W, expect, rtol=1e-6, atol=1e-6)  # up to the GEMM's summation order
    largest = max(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert largest <= max(3 * shape[1], pr.rows * 4) * 4 < W.numel() * 4  # a block of rows, or P itself


# ------------------------------------------------------------------------------------------
# §7.4 the fast path equals materialise-then-project; §7.6 flat clipping in the projected space
# ------------------------------------------------------------------------------------------


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 24, padding_idx=0)
        self.ln = nn.LayerNorm(24)
        self.up = nn.Linear(24, 40)     # right projection
        self.down = nn.Linear(40, 24)   # left projection
        self.head = nn.Linear(24, 3)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(h.mean(1))


@pytest.mark.parametrize("T", [2, 9])  # T=2: factors and ghost norms; T=9: R materialised
def test_projected_per_example_gradients_equal_projected_full_gradients(T):
    """§7.4 and §7.6: R_i = Pᵀ·G_i (or G_i·P) from the factors; norms are over R ∪ U, not G."""
    torch.manual_seed(T)
    model = Seq()
    ids = torch.randint(1, 20, (5, T))
    ids[0, -1] = 0
    y = torch.randint(0, 3, (5,))
    data = FixedData(model, ids, y)
    est, ctx = estimator(model, data, rank=6)
    assert set(est.shapes) == {"up.weight", "down.weight"}
    c = next(est.contributions(data, torch.arange(5), ctx))
    ref = per_example_reference(model, data.losses(torch.arange(5)))
    expect = {}
    for k, G in ref.items():
        pr = est.current.get(k)
        if pr is None:
            expect[k] = G
        else:
            P = pr.matrix(dtype=torch.float64)
            expect[k] = (P.T @ G.double() if pr.side == "left" else G.double() @ P).float()
    got = {local[k]: v for h, local, uses in c.records for k, v in h.per_example(uses[0]).items()}
    for k in expect:
        scale = float(expect[k].abs().max())
        assert float((got[k] - expect[k]).abs().max()) <= 1e-5 * scale, k
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in expect.values()))
    torch.testing.assert_close(c.norms(), norms, rtol=1e-5, atol=0)
    full = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
    assert not torch.allclose(norms, full, rtol=1e-3)  # the projected norm is not the full one
    C = float(norms.median())
    total = clip_and_sum(c, C)
    w = (C / norms).clamp(max=1)
    for k, v in expect.items():
        torch.testing.assert_close(total.aggregate.tensors[k], (v * w.view(-1, *[1] * (v.dim() - 1))).sum(0),
                                   rtol=1e-5, atol=1e-6)
    assert torch.all(norms * w <= C * (1 + 1e-6))
    c = next(est.contributions(data, torch.arange(5), ctx))  # a sum is taken once: the same batch again
    big = clip_and_sum(c, float(norms.max()) * 2)  # every norm below C: nothing changes
    for k, v in expect.items():
        torch.testing.assert_close(big.aggregate.tensors[k], v.sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("passes", [1, 2])
def test_a_backprop_in_the_projections_null_space_is_released_as_measured(passes):
    """Regression ½‖lin(x) − y‖² with the target y = −s·v, v in the null space of Pᵀ: the projected
    backprop (lin(x) + s·v)·P is mostly the rounding of s·v·P, and its norm measures that rounding.
    The second of two backward passes projected the reweighted backprop anew, fl(fl(w·g)·P), which
    rounds otherwise: 22·C released at a clip of C (a review). The first pass's projected pieces are
    now kept and summed with the weights (``second_pass_replays``)."""
    torch.manual_seed(0)
    OUT, IN, C = 16, 32, 1.0
    model = nn.Linear(IN, OUT, bias=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, IN, generator=g)
    y = torch.randn(40, OUT, generator=g)
    data = FixedData(model, x, y, loss=lambda out, y, reduction: 0.5 * (out - y).pow(2).sum(1))
    est, ctx = estimator(model, data, rank=4, passes=passes)
    pr = est.current["weight"]
    assert pr.side == "left"
    null = torch.linalg.svd(pr.matrix(dtype=torch.float64).T, full_matrices=True).Vh[4:]  # Pᵀv = 0
    for i in range(3, 40):  # examples 3.. are crafted, each alone beside the ordinary 0, 1, 2
        s = 10.0 ** (4 + 8 * torch.rand(1, generator=g).item())
        y[i] = (-s * torch.randn(len(null), generator=g, dtype=torch.float64) @ null).float()

    def released(idx):
        c = next(est.contributions(data, torch.tensor(idx), ctx))
        return {k: v.double() for k, v in clip_and_sum(c, C).aggregate.tensors.items()}

    without = released([0, 1, 2])
    worst = max(math.sqrt(sum(float((w[k] - without[k]).pow(2).sum()) for k in w))
                for w in (released([0, 1, 2, i]) for i in range(3, 40)))
    assert worst <= C * (1 + 1e-5)


def test_two_passes_refuse_a_model_below_float32():
    """The second backward of a bf16 model rounds its backprops in bf16, which the first's norms do
    not bound (a review: 1.10·C; its linearity check refused most ordinary steps too)."""
    from dpregistry import UserError

    model = Seq().to(torch.bfloat16)
    data = FixedData(model, torch.randint(1, 20, (5, 3)), torch.randint(0, 3, (5,)))
    with pytest.raises(UserError, match="passes: 2 needs a float32 model: this one differentiates bfloat16"):
        estimator(model, data, passes=2)
    estimator(model, data, passes=1)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_model_projects_and_clips_in_fp32(dtype, tol):
    """fp16/bf16 parameters (spec §5 "Precision": norms and noise in fp32): R_i = Pᵀ·G_i of the
    half model's own per-example gradients, every tensor the privatizer sees is fp32, and each
    clipped example's norm (over R ∪ U, from the per-example tensors) stays within C."""
    torch.manual_seed(4)
    model = Seq().to(dtype)
    ids, y = torch.randint(1, 20, (5, 9)), torch.randint(0, 3, (5,))
    data = FixedData(model, ids, y, loss=lambda o, t, reduction: F.cross_entropy(o.float(), t, reduction=reduction))
    est, ctx = estimator(model, data, rank=6)
    c = next(est.contributions(data, torch.arange(5), ctx))
    ref = per_example_reference(model, data.losses(torch.arange(5)))
    got = {local[k]: v for h, local, uses in c.records for k, v in h.per_example(uses[0]).items()}
    assert set(est.current) == {"up.weight", "down.weight"}
    for k, G in ref.items():
        G = G.float()
        pr = est.current.get(k)
        if pr is not None:
            P = pr.matrix(dtype=torch.float32)
            G = P.T @ G if pr.side == "left" else G @ P
        assert got[k].dtype == torch.float32
        assert float((got[k] - G).abs().max()) <= tol * float(G.abs().max()), k
    norms = c.norms()
    assert norms.dtype == torch.float32
    C = float(norms.median())
    total = clip_and_sum(c, C)
    assert all(t.dtype == torch.float32 for t in total.aggregate.tensors.values())
    w = (C / norms).clamp(max=1)
    clipped = torch.sqrt(sum((v * w.view(-1, *[1] * (v.dim() - 1))).flatten(1).pow(2).sum(1) for v in got.values()))
    assert torch.all(clipped <= C * (1 + 1e-5))


# ------------------------------------------------------------------------------------------
# §7.5 projection statistics
# ------------------------------------------------------------------------------------------


def test_projection_statistics_monte_carlo():
    """§7.5: E[PPᵀ] = I, E‖PᵀG‖² = ‖G‖², E‖PPᵀG‖² = (m+r+1)/r·‖G‖², E‖PZ‖² = s²mn (m=64, n=96, r=8)."""
    m, n, r, N = 64, 96, 8, 20000
    rng = RunRNG(5)
    P = torch.stack([make_projector("gaussian", rng.step_seed("grape_projector", k, "w"), (m, n), r).matrix()
                     for k in range(N)]).double()                                    # [N, m, r]
    PPt = torch.einsum("kir,kjr->ij", P, P) / N
    assert float((PPt - torch.eye(m, dtype=torch.float64)).abs().max()) < 0.02
    g = torch.Generator().manual_seed(0)
    G = torch.randn(m, n, generator=g, dtype=torch.float64)
    Y = torch.einsum("kir,in->krn", P, G)                                             # PᵀG
    assert abs(float(Y.pow(2).sum((1, 2)).mean() / G.pow(2).sum()) - 1) < 0.01
    PtP = torch.einsum("kir,kis->krs", P, P)
    ppg = torch.einsum("krs,krn,ksn->k", PtP, Y, Y)                                 # ‖P PᵀG‖²
    assert abs(float(ppg.mean() / G.pow(2).sum()) / ((m + r + 1) / r) - 1) < 0.01
    Z = torch.randn(N, r, n, generator=g, dtype=torch.float64) * 0.7
    pz = torch.einsum("krs,krn,ksn->k", PtP, Z, Z)                                  # ‖PZ‖²
    assert abs(float(pz.mean()) / (0.49 * m * n) - 1) < 0.01


# ------------------------------------------------------------------------------------------
# §7.7 noise in the projected space
# ------------------------------------------------------------------------------------------


def test_noise_is_added_to_every_projected_coordinate_with_std_C_sigma_over_B(tmp_path, monkeypatch):
    """§7.7: rΣn_ℓ + |U| noised coordinates; with a zero clipped sum the std is Cσ/B (±2%)."""
    seen = spy_releases(monkeypatch, ProjectedAdam)
    recipe = digits(estimator={"rank": 8}, privatizer={"clip": 0.5, "noise_multiplier": 1.3})
    run = make_run(recipe, tmp_path)
    run.train()
    agg = seen[0][1]
    shapes = {k: tuple(p.shape) for k, p in run.params.items()}
    assert shapes["0.weight"] == (96, 64) and shapes["2.weight"] == (10, 96)
    # 0.weight 96×64 → right, 96×8; 2.weight 10×96 → left, 8×96; biases (|U|) dense
    assert {k: tuple(v.shape) for k, v in agg.tensors.items()} == {
        "0.weight": (96, 8), "0.bias": (96,), "2.weight": (8, 96), "2.bias": (10,)}
    assert agg.numel == 96 * 8 + 8 * 96 + 96 + 10
    zero = ProjectedAggregate({"a": torch.zeros(1000, 1000)}, {})
    ctx = run.begin_step()  # after the last step: a release outside the run's steps, charged nowhere
    rel = run.privatizer.release(ClippedSum(zero, count=0), ctx)
    B = ctx.expected_batch_size()
    std = float(rel.value.tensors["a"].std())
    assert abs(std / (0.5 * 1.3 / B) - 1) < 0.02


# ------------------------------------------------------------------------------------------
# §7.8 identity projector == DP-Adam, bit for bit; §7.9 orthogonal P + SGD == DP-SGD
# ------------------------------------------------------------------------------------------


IDENTITY = {"name": "projected_per_example_grad", "projector": "identity",
            "project": {"exclude": [], "min_dim_gt_rank": False}}


@pytest.mark.parametrize("steps", [1, 10])
def test_identity_projector_step_equals_dp_adam_bitwise(tmp_path, steps):
    """§7.8: P = I (r = m): DP-GRAPE (Alg. 1+2) equals DP-Adam (Alg. 3) bit for bit, 1 and 10 steps."""
    a, _ = params_after(digits("dp_adam", steps, update={"lr": 3e-3}), tmp_path)
    b, run = params_after(digits("dp_grape", steps, estimator=IDENTITY, update={"lr": 3e-3}), tmp_path)
    assert set(run.estimator.shapes) == {"0.weight", "2.weight"}
    for k in a:
        assert torch.equal(a[k], b[k]), k
    moved = sum(float((a[k] - run.objective.model.state_dict()[k]).abs().sum()) for k in a)
    assert moved == 0.0


def test_identity_projector_contribution_equals_dense_on_sequences():
    """§7.8 at the contribution level, on sequences (ghost norms, factors, embeddings, LayerNorm)."""
    from dpregistry.persample import GradSampler

    torch.manual_seed(2)
    model = Seq()
    ids = torch.randint(1, 20, (6, 11))
    y = torch.randint(0, 3, (6,))
    data = FixedData(model, ids, y)
    est, ctx = estimator(model, data, projector="identity", project=LayerSelection(exclude=[], min_dim_gt_rank=False))
    c = next(est.contributions(data, torch.arange(6), ctx))
    gs = GradSampler(model, ctx.params)
    with torch.enable_grad(), gs.capture(6):
        losses = data.losses(torch.arange(6))
    d = gs.contribution(losses)
    assert torch.equal(c.norms(), d.norms())
    w = torch.linspace(0.1, 1.0, 6)
    ca, da = c.weighted_sum(w), d.weighted_sum(w)
    for k in da.tensors:
        assert torch.equal(ca.tensors[k], da.tensors[k]), k


def test_orthogonal_square_projector_with_sgd_is_dp_sgd_with_rotated_noise(tmp_path, monkeypatch):
    """§7.9: with square orthogonal P the update is (S + P·z)/B, where DP-SGD's is (S + z)/B."""
    sel = {"name": "projected_per_example_grad", "projector": "orthogonal", "rank": 64,
           "project": {"include": ["^0\\."], "min_dim_gt_rank": False}}
    obj = {"name": "tabular", "model": {"kind": "mlp", "hidden": [64], "activation": "tanh"}, "data": {"dataset": "digits"}}
    a, _ = params_after(digits("dp_sgd", 1, objective=obj, update={"lr": 0.1}), tmp_path)
    b, run = params_after(digits("dp_grape", 1, objective=obj, estimator=sel,
                                 update={"name": "projected_sgd", "lr": 0.1}), tmp_path)
    x0 = {k: v.detach() for k, v in make_run(digits("dp_sgd", 1, objective=obj), tmp_path).params.items()}
    P = run.estimator.projectors(0)["0.weight"].matrix(dtype=torch.float64)
    assert torch.allclose(P.T @ P, torch.eye(64, dtype=torch.float64), atol=1e-6)
    # Both runs draw the same z: the step's secret noise source, tensors in sorted order.
    src = RunRNG(3, "reproducible").noise(0, 0)
    z = {k: src.randn(tuple(x0[k].shape)) for k in sorted(x0)}["0.weight"].double()
    B, lr, sc = run.ctx.expected_batch_size(), 0.1, 1.3 * 0.5
    D_sgd = (x0["0.weight"] - a["0.weight"]).double() * B / lr       # S + σC·z
    D_grape = (x0["0.weight"] - b["0.weight"]).double() * B / lr     # P(PᵀS + σC·z) = S + σC·Pz
    S = D_sgd - sc * z
    torch.testing.assert_close(D_grape, S + sc * (P @ z), rtol=0, atol=2e-4 * float(D_sgd.abs().max()))
    assert abs(float((P @ z).norm() / z.norm()) - 1) < 1e-6         # Pz ~ N(0, σ²C²I) like z
    for k in ("0.bias", "2.weight", "2.bias"):  # unprojected tensors: the same DP-SGD update
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------
# §7.10 σ = 0, C = ∞; §7.11 moments across a refresh; §7.12 Alg. 2 arithmetic
# ------------------------------------------------------------------------------------------


def test_no_noise_no_clip_release_is_projected_mean_gradient(tmp_path):
    """§7.10: σ = 0, C = ∞ → R̃ = Pᵀ·(mean batch gradient), by linearity."""
    recipe = digits(sampler={"name": "shuffle", "batch_size": 40}, privatizer={"clip": math.inf, "noise_multiplier": 0},
                    estimator={"rank": 8}, privacy=None)
    run = make_run(recipe, tmp_path)
    ctx = run.begin_step()
    idx = run.sampler.indices(ctx)
    loss = run.objective.losses(idx).mean()
    grads = dict(zip(run.params, torch.autograd.grad(loss, list(run.params.values()))))
    release = run.privatizer.release(run.privatize_batch(idx), ctx)  # the step without the ledger
    agg = release.value
    assert set(agg.projectors) == {"0.weight", "2.weight"}
    for k, g in grads.items():
        pr = agg.projectors.get(k)
        expect = pr.project(g) if pr is not None else g
        torch.testing.assert_close(agg.tensors[k], expect, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("policy", ["keep", "reset"])
def test_moments_across_a_refresh(tmp_path, monkeypatch, policy):
    """§7.11: at t = F the new R̃ enters M^F = β1·M^{F−1} + (1−β1)·R̃^F; `keep` neither resets nor rotates M."""
    F_ = 3
    moments = []
    orig = ProjectedAdam.apply

    def apply(self, params, release, ctx):
        before = {k: v.clone() for k, v in self.state.m.items()}
        orig(self, params, release, ctx)
        moments.append((before, release.value.clone(), {k: v.clone() for k, v in self.state.m.items()}))

    monkeypatch.setattr(ProjectedAdam, "apply", apply)
    recipe = digits(steps=F_, estimator={"rank": 8, "refresh_every": F_}, update={"lr": 1e-3, "moment_policy": policy})
    run = make_run(recipe, tmp_path)
    run.train()
    before, rel, after = moments[F_ - 1]     # the step with t = F
    prev_seed = moments[F_ - 2][1].projectors["0.weight"].seed
    assert rel.projectors["0.weight"].seed != prev_seed  # the projector changed at t = F
    assert moments[F_ - 3][1].projectors["0.weight"].seed == prev_seed
    for k in ("0.weight", "2.weight"):
        M_prev = before[k] if policy == "keep" else torch.zeros_like(before[k])
        torch.testing.assert_close(after[k], 0.9 * M_prev + 0.1 * rel.tensors[k], rtol=1e-6, atol=1e-9)
    # unprojected tensors never reset
    torch.testing.assert_close(after["0.bias"], 0.9 * before["0.bias"] + 0.1 * rel.tensors["0.bias"])


class FixedProjector(Projector):
    def matrix(self, device=None, dtype=torch.float32):
        return torch.tensor([[0.5], [-1.0]], dtype=dtype)


def test_algorithm_2_arithmetic_by_hand():
    """§7.12: a 2×3 toy with fixed R̃ and P, β = (0.9, 0.999), φ = 1e-8, η = 1e-3."""
    W0 = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    R = [0.3, -0.2, 0.05]
    P = [0.5, -1.0]
    W = torch.tensor(W0, dtype=torch.float64)
    pr = FixedProjector(seed=1, rows=2, rank=1, side="left")
    agg = ProjectedAggregate({"w": torch.tensor([R], dtype=torch.float64)}, {"w": pr})
    upd = ProjectedAdam(ProjectedAdam.Params(lr=1e-3, betas=(0.9, 0.999), eps=1e-8))
    ctx = Context.detached({"w": W})
    upd.setup(ctx)
    upd.apply(ctx.params, Release(agg, []), ctx)
    alpha = 1e-3 * math.sqrt(1 - 0.999) / (1 - 0.9)
    assert abs(alpha - 3.16228e-4) < 1e-9
    for i in range(2):
        for j in range(3):
            m, v = 0.1 * R[j], 0.001 * R[j] ** 2
            expect = W0[i][j] - alpha * P[i] * m / (math.sqrt(v) + 1e-8)
            assert abs(float(W[i, j]) - expect) < 1e-12


# ------------------------------------------------------------------------------------------
# §7.13 naive DP-GaLore
# ------------------------------------------------------------------------------------------


def test_naive_galore_projects_the_noisy_dense_gradient(tmp_path, monkeypatch):
    """§7.13: P = U[:, :r] of the noisy G̃ (left) or V[:, :r] (right), PᵀP = I_r; noise is d-dimensional."""
    seen = spy_releases(monkeypatch, GaLoreAdam)
    P_at = []
    orig = GaLoreAdam.apply

    def apply(self, params, release, ctx):
        orig(self, params, release, ctx)
        P_at.append({k: v.clone() for k, v in self.state.P.items()})

    monkeypatch.setattr(GaLoreAdam, "apply", apply)
    recipe = digits("dp_galore_naive", 3, update={"rank": 8, "refresh_every": 2, "lr": 1e-3})
    run = make_run(recipe, tmp_path)
    run.train()
    d = sum(p.numel() for p in run.params.values())
    assert seen[0][1].numel == d  # privatized in full space
    assert set(P_at[0]) == {"0.weight", "2.weight"}
    for t in (0, 1):  # t = 1 (first step) and t = 2 (t mod F == 0): an SVD of that step's noisy gradient
        G = seen[t][1].tensors
        for k, P in P_at[t].items():
            assert torch.allclose(P.T @ P, torch.eye(8), atol=1e-5)
            U, S, Vh = torch.linalg.svd(G[k].double(), full_matrices=False)
            basis = U[:, :8] if side_of(tuple(G[k].shape)) == "left" else Vh[:8].T
            torch.testing.assert_close(P.double() @ P.double().T, basis @ basis.T, atol=1e-4, rtol=0)
    for k in P_at[1]:  # t = 3: neither 1 nor a multiple of F: the subspace is kept
        assert torch.equal(P_at[1][k], P_at[2][k])


# ------------------------------------------------------------------------------------------
# §7.15 privacy independent of r; gradient accumulation; resume
# ------------------------------------------------------------------------------------------


def test_privacy_is_independent_of_rank(tmp_path):
    """§7.15: the planned events and ε are identical for r ∈ {4, 16, 64} at fixed (σ, q, T, δ)."""
    obj = {"name": "tabular", "model": {"kind": "mlp", "hidden": [128], "activation": "tanh"}, "data": {"dataset": "digits"}}
    eps, plans = [], []
    for r in (4, 16, 64):
        est = {"rank": r, "project": {"min_dim_gt_rank": False}}
        run = make_run(digits(steps=200, objective=obj, estimator=est, privacy={"epsilon": 50, "delta": 1e-5}), tmp_path)
        assert set(run.estimator.shapes) == {"0.weight", "2.weight"}
        plan = run.algorithm.plan(run.ctx, run.privatizer.noise_multiplier)
        plans.append(plan)
        eps.append(run.accountant.epsilon(extra=plan))
    assert plans[0] == plans[1] == plans[2]
    assert eps[0] == eps[1] == eps[2] and math.isfinite(eps[0])


def test_gradient_accumulation_does_not_change_the_result(tmp_path, monkeypatch):
    """Micro-batches of one step share P (the estimator's and the update's), and the step is the same."""
    from conftest import setup_probes
    from dpreg_grape.estimators import ProjectedLinearHandler

    used, probing, orig = [], setup_probes(monkeypatch), ProjectedLinearHandler.weight_product

    def weight_product(self, use, a, g):
        if not probing:  # the setup's probes are no step's micro-batches
            used.append((self.name, self.estimator.current[self.name]))
        return orig(self, use, a, g)

    monkeypatch.setattr(ProjectedLinearHandler, "weight_product", weight_product)
    seen = spy_releases(monkeypatch, ProjectedAdam)
    recipe = digits(steps=3, estimator={"rank": 8, "refresh_every": 2}, update={"lr": 3e-3})
    a, run_a = params_after(recipe, tmp_path)
    n_full = len(used)
    b, run_b = params_after({**recipe, "train": {**recipe["train"], "micro_batch_size": 7}}, tmp_path)
    assert len(used) - n_full > 3 * n_full  # several micro-batches per step
    for step, rel, _ in seen[3:]:
        for name, pr in rel.projectors.items():
            assert pr == run_b.estimator.projectors(step)[name]
    micro = used[n_full:]
    for name, pr in micro:  # every micro-batch projected with one of the steps' (update) projectors
        assert any(pr == rel.projectors[name] for _, rel, _ in seen[3:])
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


RESUMED = {
    "dp_grape": digits(steps=6, estimator={"rank": 8, "refresh_every": 2},
                       update={"lr": 3e-3, "moment_policy": "reset"}),
    # t = 4 after the resume takes no SVD (F = 5): it needs the restored basis P and step count
    "dp_galore_naive": digits("dp_galore_naive", 6, update={"rank": 8, "refresh_every": 5, "lr": 3e-3,
                                                            "moment_policy": "reset"}),
}


@pytest.mark.parametrize("algorithm", list(RESUMED))
def test_resume_is_bit_identical(tmp_path, algorithm):
    """Projected Adam's moments (and the step-derived seeds), and naive GaLore's moments, basis and
    step count, survive a checkpoint and resume."""
    from dpregistry.folder import resume_run, start_run
    from dpregistry.run import Run
    from dpregistry.recipe import load
    from conftest import write_recipe

    recipe = RESUMED[algorithm]
    full, _ = params_after(recipe, tmp_path)
    path = write_recipe(tmp_path, recipe, "r.yaml")
    (tmp_path / "out").mkdir()
    run = start_run(Run(load(path)).prepare(), tmp_path / "out")

    def stop_at_3(r, metrics):
        if r.step == 3:
            r.stop_reason = "test stop"

    run.train(progress=stop_at_3)
    assert run.step == 3
    resumed = resume_run(tmp_path / "out")
    assert resumed.step == 3
    resumed.train()
    for k in full:
        assert torch.equal(full[k], resumed.params[k]), k


# ------------------------------------------------------------------------------------------
# §7.16 analytic memory counts on the shipped configurations (meta device, no weights)
# ------------------------------------------------------------------------------------------


def grape_elements(config, r):
    model = build_from_config(config, device="meta")
    params = dict(model.named_parameters())
    proj = set(select_layers(model, params, LayerSelection(), r).values())
    pe = sum(math.prod(projected_shape(tuple(p.shape), side_of(tuple(p.shape)), r)) if n in proj else p.numel()
             for n, p in params.items())
    return sum(p.numel() for p in params.values()), pe, proj


@pytest.mark.parametrize("config,r,d,elements", [
    ("roberta-large", 16, 355_412_057, 58_140_761),
    ("vit-base-p4-32", 64, 85_152_010, 7_295_242),
    ("opt-6.7b", 64, 6_658_473_984, 316_686_336),
])
def test_per_sample_element_counts_match_spec(config, r, d, elements):
    """§7.16: per-sample elements under the default layer split (embeddings, heads, LN, biases dense)."""
    full, pe, proj = grape_elements(config, r)
    assert (full, pe) == (d, elements)
    assert not any("embed" in n or "head" in n or "classifier" in n for n in proj)


def test_roberta_large_ratio_against_rank():
    """§7.16: RoBERTa-large per-sample ratio for r ∈ {4, 8, 32, 64, 128}."""
    for r, ratio in [(4, .1536), (8, .1569), (32, .1769), (64, .2034), (128, .2565)]:
        full, pe, _ = grape_elements("roberta-large", r)
        assert abs(pe / full - ratio) < 5e-5, r
