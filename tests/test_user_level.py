"""User-level differential privacy (issue 19): the privacy unit is a person, not a row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import dpregistry
from dpregistry import Objective, UserError
from dpregistry.audit import epsilon_lower_bound, projections, trial_sums
from dpregistry.clipping import clip_and_sum
from dpregistry.context import Context
from dpregistry.own import OwnObjects
from dpregistry.privacy.accountant import Budget, make_accountant
from dpregistry.privacy.events import Gaussian
from dpregistry.recipe import resolve
from dpregistry.registry import get_registry
from dpregistry.run import Run
from dpregistry.stages import Charge
from dpregistry.users import bound_contributions, example_budget, user_delta, user_epsilon
from dpreg_baseline.estimators import PerExampleGrad
from dpreg_grape.estimators import ProjectedPerExampleGrad
from dpreg_grape.projection import LayerSelection

DELTA = 1e-5


def per_example(out, t):
    return F.cross_entropy(out, t, reduction="none")


# -- the public selection of at most k examples per user ---------------------------------------


def test_the_selection_is_public_bounded_and_blind_to_the_data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (1000,), generator=g)
    a, b = bound_contributions(ids, 5, seed=7), bound_contributions(ids, 5, seed=7)
    assert torch.equal(a.members, b.members) and torch.equal(a.offsets, b.offsets)  # a function of (ids, seed)
    assert not torch.equal(a.members, bound_contributions(ids, 5, seed=8).members)
    counts = torch.bincount(ids, minlength=40)
    assert a.n_users == len(ids.unique())
    for u in range(a.n_users):
        members = a.members[a.offsets[u]:a.offsets[u + 1]]
        user = ids.unique()[u]
        assert len(members) == min(5, int(counts[user])) and bool((ids[members] == user).all())
    # its signature takes user ids and a seed only: labels and texts cannot reach it; and every
    # record of a user is equally likely to be kept
    hits = torch.zeros(1000)
    for s in range(300):
        hits[bound_contributions(ids, 5, seed=s).members] += 1
    p = (5 / counts[ids].double()).clamp(max=1.0)
    z = (hits.double() - 300 * p) / (300 * p * (1 - p)).clamp(min=1e-12).sqrt()
    assert bool((z[p < 1].abs() < 5).all())  # every record kept at its rate, to 5 standard deviations
    assert bool((hits[p == 1] == 300).all())


def test_a_neighbouring_data_set_changes_no_other_users_selection():
    """The selection was one random order of all n records, so a data set with one user added,
    removed or replaced (n changes) kept other records for every other user (a review: 49 of 49)
    and the released sum moved by far more than one user's contribution. Each user's kept records
    are now a function of the seed and that user's own records."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (500,), generator=g)

    def kept(ids: torch.Tensor, names: list[str]) -> dict[str, set[str]]:  # user -> its kept records, by name
        sel = bound_contributions(ids, 3, seed=11)
        users = ids.unique().tolist()
        return {f"user {users[u]}": {names[i] for i in sel.members[sel.offsets[u]:sel.offsets[u + 1]].tolist()}
                for u in range(sel.n_users)}

    names = [f"record {i}" for i in range(len(ids))]
    base = kept(ids, names)
    mine = ids == 0
    neighbours = {  # user 0 removed; given one more record (first in the file); replaced by a user of 4 records
        "removed": (ids[~mine], [n for n, m in zip(names, mine.tolist()) if not m]),
        "added a record": (torch.cat([torch.tensor([0]), ids]), ["new"] + names),
        "replaced": (torch.cat([ids[~mine], torch.zeros(4, dtype=torch.int64)]),
                     [n for n, m in zip(names, mine.tolist()) if not m] + [f"new {i}" for i in range(4)]),
    }
    for what, (other_ids, other_names) in neighbours.items():
        other = kept(other_ids, other_names)
        changed = [u for u in base if u != "user 0" and base[u] != other[u]]
        assert changed == [], (what, changed)


# -- group norms equal autograd, and a user moves the clipped sum by at most C ---------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 8)
        self.lin = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 3)

    def forward(self, ids):
        return self.out(self.norm(torch.tanh(self.lin(self.emb(ids))))).mean(1)


class Tokens(Objective):
    def __init__(self, n=24, scale=1.0):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.model = Net().double()
        self.ids = torch.randint(0, 30, (n, 5), generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.scale = torch.ones(n, dtype=torch.float64)
        self.n_train = n

    def module(self):
        return self.model

    def losses(self, idx):
        return per_example(self.model(self.ids[idx]), self.y[idx]) * self.scale[idx]


def _estimator(kind):
    if kind == "dense":
        return PerExampleGrad(PerExampleGrad.Params(backend="hooks"))
    return ProjectedPerExampleGrad(ProjectedPerExampleGrad.Params(rank=2, projector="gaussian",
                                                                  project=LayerSelection(exclude=[])))


def _set_up(kind):
    """The Tokens objective, its parameters, a context and a set-up estimator of ``kind``."""
    obj = Tokens()
    params = dict(obj.model.named_parameters())
    ctx = Context.detached(params, n_train=obj.n_train, provides={Objective: obj})
    est = _estimator(kind)
    est.setup(ctx)
    return obj, params, ctx, est


@pytest.mark.parametrize("kind", ["dense", "projected"])
def test_the_norm_of_a_users_sum_is_computed_from_the_factors_as_autograd_gives_it(kind):
    obj, params, ctx, est = _set_up(kind)
    idx = torch.arange(obj.n_train)
    users = torch.tensor([0] * 7 + [1] * 1 + [2] * 9 + [3] * 7)  # uneven groups
    contrib = next(est.contributions(obj, idx, ctx))
    got = contrib.group_norms(users, 4)
    # the same per-example vectors, summed per user (in the contribution's own space: dense or projected);
    # a weighted sum is taken once, so each row comes from a fresh contribution of the same batch
    rows = [next(est.contributions(obj, idx, ctx)).weighted_sum(F.one_hot(torch.tensor(i), obj.n_train).double())
            for i in range(obj.n_train)]
    flat = torch.stack([torch.cat([t.reshape(-1) for _, t in sorted(r.tensors.items())]) for r in rows])
    want = torch.zeros(4, flat.shape[1], dtype=flat.dtype).index_add_(0, users, flat).norm(dim=1)
    assert torch.allclose(got, want, rtol=1e-9)
    if kind == "dense":  # and in the dense space, against one-example-at-a-time autograd
        losses = obj.losses(idx)
        ref = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], list(params.values()),
                                                                                   retain_graph=True)])
                           for i in range(obj.n_train)])
        sums = torch.zeros(4, ref.shape[1], dtype=ref.dtype).index_add_(0, users, ref)
        assert torch.allclose(got, sums.norm(dim=1), rtol=1e-9)


@pytest.mark.parametrize("kind", ["dense", "projected"])
def test_a_user_with_a_huge_gradient_moves_the_clipped_sum_by_at_most_c(kind):
    C = 0.5
    obj, params, ctx, est = _set_up(kind)
    idx = torch.arange(obj.n_train)
    users = torch.arange(obj.n_train) // 4  # six users of four examples

    def clipped(scale, keep):
        obj.scale = torch.ones(obj.n_train, dtype=torch.float64)
        obj.scale[:4] = scale  # user 0's examples
        rows = idx[keep]
        contrib = next(est.contributions(obj, rows, ctx))
        contrib.groups = users[rows]
        total = clip_and_sum(contrib, C)
        return torch.cat([t.reshape(-1) for _, t in sorted(total.aggregate.tensors.items())])

    everyone = torch.ones(obj.n_train, dtype=torch.bool)
    without = everyone.clone()
    without[:4] = False
    huge = clipped(1e6, everyone)
    gone = clipped(1.0, without)
    other = clipped(-3.0, everyone)  # the same user with other data
    assert (huge - gone).norm() <= C * (1 + 1e-9)           # add/remove a user: at most C
    assert (huge - other).norm() <= 2 * C * (1 + 1e-9)      # replace a user's whole data: at most 2C
    # example-level clipping of the same batch lets that user move it by more than C (up to 4C)
    obj.scale[:4] = 1e6
    ex = clip_and_sum(next(est.contributions(obj, idx, ctx)), C)
    ex_gone = clip_and_sum(next(est.contributions(obj, idx[4:], ctx)), C)
    keys = sorted(ex.aggregate.tensors)
    diff = torch.cat([(ex.aggregate.tensors[k] - ex_gone.aggregate.tensors[k]).reshape(-1) for k in keys])
    assert C < diff.norm() <= 4 * C * (1 + 1e-9)


def test_a_dpzero_user_moves_the_clipped_scalar_by_at_most_c():
    """DPZero's contributions are scalars on one shared direction: a user's mean scalar is clipped
    to C as one, so a user with huge finite differences moves the sum's coefficient by at most C."""
    from dpregistry.directions import Direction
    from dpregistry.spaces import DirectionContribution

    C = 0.5
    u = Direction(seed=1)
    users = torch.arange(24) // 4

    def coeff(values, rows):
        contrib = DirectionContribution(values=values[rows], direction=u, names=("w",), indices=rows)
        contrib.groups = users[rows]
        return float(clip_and_sum(contrib, C).aggregate.tensors["coeff"])

    g = torch.Generator().manual_seed(0)
    values = torch.randn(24, generator=g, dtype=torch.float64) * 0.1
    everyone, without = torch.arange(24), torch.arange(4, 24)
    huge = values.clone()
    huge[:4] = 1e9
    other = values.clone()
    other[:4] = -1e9
    assert abs(coeff(huge, everyone) - coeff(values, without)) <= C * (1 + 1e-12)
    assert abs(coeff(huge, everyone) - coeff(other, everyone)) <= 2 * C * (1 + 1e-12)
    # the small users' means are inside the clip: their sum is untouched
    assert coeff(values, without) == pytest.approx(sum(float(values[4 * k:4 * k + 4].mean()) for k in range(1, 6)))


# -- accounting ---------------------------------------------------------------------------------


def test_the_group_privacy_conversion_is_valid_against_the_exact_gaussian():
    """For a Gaussian mechanism, k examples of one user move the sum by at most k·Δ, so its exact
    user-level ε is the Gaussian's at sensitivity kΔ: the conversion used by ELS may be looser,
    never tighter."""
    pld = make_accountant("pld", Budget(delta=DELTA))
    for k in (2, 5, 20):
        for std in (3.0 * k, 8.0 * k, 20.0 * k):
            b = example_budget(Budget(epsilon=6.0, delta=DELTA), k)
            assert b.epsilon == pytest.approx(6.0 / k)
            assert user_delta(b.epsilon, b.delta, k) == pytest.approx(DELTA)
            ex = pld.epsilon(b.delta, extra=[Charge(Gaussian(std=std, sensitivity=2.0))])
            exact = pld.epsilon(DELTA, extra=[Charge(Gaussian(std=std, sensitivity=2.0 * k))])
            at = lambda d: pld.epsilon(d, extra=[Charge(Gaussian(std=std, sensitivity=2.0))])  # noqa: E731
            assert user_epsilon(at, k, DELTA, b.delta) == k * ex >= exact * (1 - 1e-6)
    rho = example_budget(Budget(rho=0.5), 4).rho
    assert rho == 0.5 / 16  # ρ-zCDP is k²ρ-zCDP for groups of k


@pytest.mark.parametrize("k", [2, 4])
def test_the_group_conversion_without_a_valid_budget_delta_searches_and_stays_valid(k):
    """Where the budget's δ₀ does not hold (no ε target, an over-budget plan), user_epsilon
    searches for a δ₀ with k·e^{(k−1)ε₀}·δ₀ ≤ δ. Against the mechanism's exact user-level ε
    (T full-batch Gaussian steps: a user's k rows move the sum by k·C; dp_accounting's PLD, add/remove)
    it is never smaller. Reading ε₀ at δ/k and reporting k·ε₀ at δ, as ELS did without an ε
    target, was below it: its δ was e^{(k−1)ε₀}·δ."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    z, steps = 2.0, 10

    def composed(accountant, noise_multiplier):
        acc = accountant()
        acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier), steps)
        return acc

    example = composed(rdp_privacy_accountant.RdpAccountant, z)
    exact = composed(pld_privacy_accountant.PLDAccountant, z / k).get_epsilon(DELTA)
    eps = user_epsilon(example.get_epsilon, k, DELTA)
    assert exact <= eps < math.inf
    assert k * example.get_epsilon(DELTA / k) < exact  # the old reading
    # a budget δ₀ that does not hold is not used
    assert user_epsilon(example.get_epsilon, k, DELTA, DELTA / k) == eps


def test_els_without_a_target_is_refused():
    """ELS places δ₀ from the user-level ε target (or ρ₀ = ρ/k² from a ρ one); without either ε₀ is
    unbounded, and group privacy of an ε₀ of 8 at k = 4 needs δ₀ below e^{-24}·δ: refused before
    the run, with the way out. A ρ target alone is held exactly (ρ-zCDP is k²ρ for groups of k)."""
    recipe = {"algorithm": "dp_sgd", "sampler": {"name": "poisson", "batch_size": 30},
              "privatizer": {"noise_multiplier": 2.0}, "privacy": {"delta": 1e-3, "unit": "user",
                                                                    "max_examples_per_user": 4}, "train": {"steps": 4}}
    with pytest.raises(UserError, match="privacy.epsilon") as e:
        _own_run(recipe, torch.arange(240) // 12)
    assert "user_poisson" in str(e.value)
    run = _own_run(dict(recipe, accountant="zcdp", privatizer={"noise_multiplier": "auto"},
                        privacy={"rho": 2.0, "unit": "user", "max_examples_per_user": 4}), torch.arange(240) // 12)
    assert run.budget.rho == 2.0 / 16 and run.train()["rho"] <= 2.0


def test_els_under_zcdp_reads_the_users_epsilon_from_k_squared_rho():
    """Group privacy of ρ-zCDP is k²ρ-zCDP. The user's ε was read only through the (ε₀, δ₀) group
    conversion, 14.23 where k²ρ₀ = 2 alone gives 11.60 at δ = 1e-5 (review 22), and the statement
    named an example-level ε that did not multiply to it."""
    from dpregistry.users import unit_statement

    recipe = {"algorithm": "dp_sgd", "train": {"steps": 10, "progress": False}, "accountant": "zcdp",
              "sampler": {"name": "poisson", "batch_size": 60}, "privatizer": {"noise_multiplier": "auto"},
              "privacy": {"rho": 2.0, "delta": 1e-5, "unit": "user", "max_examples_per_user": 4}}
    run = _own_run(recipe, torch.arange(240) // 12)
    s = run.train()
    rho = s["rho"]
    assert rho == pytest.approx(16 * s["example_level"]["rho"]) and rho <= 2.0
    assert s["epsilon"] <= rho + 2 * math.sqrt(rho * math.log(1e5)) * (1 + 1e-12)
    assert s["epsilon"] < user_epsilon(run.accountant.epsilon, 4, 1e-5, run.budget.delta)  # the (ε, δ) route
    assert f"group privacy of size 4 of the example-level ρ = {s['example_level']['rho']:.4g}" in unit_statement(s)


def _own_run(recipe, users, n=240, dim=4, seed=0):
    torch.manual_seed(seed)
    x, y = torch.randn(n, dim), torch.randint(0, 2, (n,))
    model = nn.Linear(dim, 2)
    objects = OwnObjects(model, per_example, list(zip(x, y)), users=users)
    data = {"objective": "python", "seed": seed, **recipe}
    return Run(resolve(data, {}, get_registry()), provides={OwnObjects: objects}).prepare()


def test_uls_accounts_users_and_els_accounts_examples_with_group_privacy():
    users = torch.arange(240) // 12  # 20 users
    base = {"algorithm": "dp_sgd", "update": {"lr": 0.1}, "train": {"steps": 10, "progress": False}}
    priv = {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 6, "noise": "reproducible"}
    uls = _own_run({**base, "sampler": {"name": "user_poisson", "users_per_step": 5}, "privacy": priv}, users)
    assert uls.group == 1 and uls.users.n_users == 20 and uls.sampler.q == 5 / 20
    assert uls.budget.epsilon == 4.0  # the accountant's budget is the user-level one
    s = uls.train()
    event = uls.accountant.ledger.to_json()[0]["event"]
    assert event["q"] == 0.25 and s["unit"] == "user" and s["users"] == 20 and s["user_mechanism"] == "uls"
    assert s["epsilon"] <= 4.0 and s["max_examples_per_user"] == 6

    els = _own_run({**base, "sampler": {"name": "poisson", "batch_size": 30}, "privacy": priv}, users)
    assert els.group == 6 and els.n_train == 120  # 6 kept of each user's 12
    assert els.budget.epsilon == pytest.approx(4.0 / 6)
    s = els.train()
    assert s["user_mechanism"] == "els" and s["epsilon"] == pytest.approx(6 * s["example_level"]["epsilon"])
    assert s["epsilon"] <= 4.0 * (1 + 1e-9) and s["delta"] == 1e-3
    assert els.accountant.ledger.to_json()[0]["event"]["q"] == pytest.approx(30 / 120)


def test_els_with_one_example_per_user_trains_on_one_kept_example_of_each_user():
    """ELS was told from ULS by k > 1: with k = 1 an example-level sampler's draws among the kept
    records were used as file rows (the first rows, whoever owned them) and clipped per "user"
    through ids of uninitialised memory; a user with 50 rows moved the sum by 26 C (review 22). The
    mechanism is now the sampler's: each step reads kept records only, one per user, per example."""
    users = torch.arange(240) // 12  # 20 users of 12 rows each, in order: rows 0..19 are users 0 and 1
    recipe = {"algorithm": "dp_sgd", "update": {"lr": 0.1}, "train": {"steps": 2, "progress": False},
              "sampler": {"name": "full_batch"}, "accountant": "pld",
              "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 1}}
    run = _own_run(recipe, users)
    read = []
    contributions = run.estimator.contributions

    def recorded(objective, indices, ctx):
        for c in contributions(objective, indices, ctx):
            assert c.groups is None  # clipped per example, not per "user"
            read.append(c.indices.clone())
            yield c

    run.estimator.contributions = recorded
    s = run.train()
    rows = torch.cat(read)
    assert len(rows) == 2 * 20 and set(rows.tolist()) == set(run.users.members.tolist())
    assert sorted(users[rows[:20]].tolist()) == list(range(20))  # one kept example of each user a step
    assert s["user_mechanism"] == "els" and s["example_level"]["epsilon"] == s["epsilon"] <= 4.0


def _flat(total):
    return torch.cat([t.reshape(-1) for _, t in sorted(total.aggregate.tensors.items())])


def test_a_user_whose_records_a_sampler_interleaves_is_clipped_once_as_one():
    """``ctx.micro_batches`` cuts between users where the batch changes user; a ULS batch whose
    users' records were interleaved (a sampler of one's own) split each user across micro-batches,
    clipped to C in each: a user of 4 examples moved the clipped sum by 4·C (review of 2026-11-28).
    The run now puts each user's records side by side first."""
    C = 1.0
    users = torch.arange(240) // 12
    recipe = {"algorithm": "dp_sgd", "train": {"steps": 1, "progress": False, "micro_batch_size": 4},
              "sampler": {"name": "user_poisson", "users_per_step": 5}, "privatizer": {"clip": C},
              "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 4}}
    torch.manual_seed(0)
    x, y = torch.randn(240, 4), torch.randint(0, 2, (240,))
    x[users == 0], y[users == 0] = 1e4, 1  # user 0: a huge gradient, all one way
    objects = OwnObjects(nn.Linear(4, 2), per_example, list(zip(x, y)), users=users)
    run = Run(resolve({"objective": "python", "seed": 0, **recipe}, {}, get_registry()),
              provides={OwnObjects: objects}).prepare()
    drawn = run.users.records_of(torch.arange(6))
    interleaved = drawn.reshape(6, 4).T.reshape(-1)  # record j of every user, then record j + 1
    everyone = _flat(run.privatize_batch(interleaved))
    without = _flat(run.privatize_batch(interleaved[run._user_of[interleaved] != 0]))
    assert 0.9 * C < (everyone - without).norm() <= C * (1 + 1e-6)


def test_an_estimator_that_splits_a_user_across_contributions_is_refused():
    users = torch.arange(240) // 12
    recipe = {"algorithm": "dp_sgd", "train": {"steps": 1, "progress": False},
              "sampler": {"name": "user_poisson", "users_per_step": 5},
              "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 4}}
    run = _own_run(recipe, users)
    contributions = run.estimator.contributions

    def one_record_at_a_time(objective, indices, ctx):
        for i in indices:
            yield from contributions(objective, i.reshape(1), ctx)

    run.estimator.contributions = one_record_at_a_time
    with pytest.raises(RuntimeError, match="a user's records came apart"):
        run.privatize_batch(run.users.records_of(torch.arange(3)))

    def reversed_within(objective, indices, ctx):  # one contribution, users' rows interleaved
        yield from contributions(objective, indices.reshape(-1, 2).T.reshape(-1), ctx)

    run.estimator.contributions = reversed_within
    with pytest.raises(RuntimeError, match="a user's records came apart"):
        run.privatize_batch(run.users.records_of(torch.arange(3)))


def test_a_uls_batch_with_a_record_outside_the_selection_is_refused():
    """The user of a record the public selection did not keep was uninitialised memory; it is -1,
    and a ULS batch that holds such a record stops the run (its rows would be clipped as nobody's)."""
    from dpregistry import StagePlugin
    from dpregistry.registry import Registry

    class Stray(get_registry().get("sampler", "user_poisson").cls):
        name = "stray"

        row = None  # a row the selection did not keep

        def indices(self, ctx):
            return torch.cat([super().indices(ctx), torch.tensor([self.row])])

    registry = Registry().load_entry_points()
    registry.add_plugin(StagePlugin(Stray), origin="test", name="test")
    torch.manual_seed(0)
    x, y = torch.randn(240, 4), torch.randint(0, 2, (240,))
    objects = OwnObjects(nn.Linear(4, 2), per_example, list(zip(x, y)), users=torch.arange(240) // 12)
    recipe = {"objective": "python", "seed": 0, "algorithm": "dp_sgd", "train": {"steps": 2, "progress": False},
              "sampler": {"name": "stray", "users_per_step": 5}, "privatizer": {"noise_multiplier": 1.0},
              "privacy": {"epsilon": 50.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 4}}
    run = Run(resolve(recipe, {}, registry), provides={OwnObjects: objects}).prepare()
    Stray.row = next(r for r in range(12) if r not in run.users.members.tolist())  # one of user 0's
    with pytest.raises(RuntimeError, match="records outside the public selection of at most 4 per user"):
        run.train()


def test_els_with_one_example_per_user_needs_no_target():
    """Group privacy of size 1 changes nothing, so ELS with k = 1 runs at a fixed noise multiplier
    like an example-level run (review 23: it was refused for want of an ε target)."""
    recipe = {"algorithm": "dp_sgd", "train": {"steps": 3, "progress": False}, "accountant": "rdp",
              "sampler": {"name": "poisson", "batch_size": 10}, "privatizer": {"noise_multiplier": 2.0},
              "privacy": {"delta": 1e-3, "unit": "user", "max_examples_per_user": 1}}
    s = _own_run(recipe, torch.arange(240) // 12).train()
    assert s["user_mechanism"] == "els" and s["epsilon"] == s["example_level"]["epsilon"] > 0
    with pytest.raises(UserError, match="needs a user-level target"):
        _own_run(dict(recipe, privacy={"delta": 1e-3, "unit": "user", "max_examples_per_user": 2}),
                 torch.arange(240) // 12)


def test_an_els_target_beyond_the_floats_is_one_line_and_refusals_name_the_per_example_budget(tmp_path):
    """Group privacy of size k needs δ₀ = δ/(k·e^{(k−1)ε/k}): at ε = 1000 and k = 5 its float
    overflowed into a traceback. An over-budget ELS plan quoted the example-level numbers as if
    they were the budget the user set."""
    users = torch.arange(240) // 12
    base = {"algorithm": "dp_sgd", "train": {"steps": 50, "progress": False}, "sampler": {"name": "poisson", "batch_size": 60}}
    with pytest.raises(UserError, match="below the smallest float"):
        _own_run({**base, "privacy": {"epsilon": 1000.0, "delta": 1e-5, "unit": "user", "max_examples_per_user": 5}},
                 users)
    with pytest.raises(UserError, match=r"per example: group privacy of size 3 turns the user-level budget "
                                        r"ε = 6, δ = 0.0001 into ε = 2, δ = 6.\d+e-07 for each example"):
        _own_run({**base, "privatizer": {"noise_multiplier": 0.5},
                  "privacy": {"epsilon": 6.0, "delta": 1e-4, "unit": "user", "max_examples_per_user": 3}}, users)


@pytest.mark.parametrize("recipe, says", [
    ({"privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user"}}, "max_examples_per_user"),
    ({"sampler": {"name": "user_poisson", "users_per_step": 4}, "privacy": {"epsilon": 4.0, "delta": 1e-3}},
     "set privacy.unit: user"),
])
def test_user_level_recipes_that_cannot_hold_are_refused(recipe, says):
    base = {"algorithm": "dp_sgd", "objective": {"name": "tabular", "data": {"dataset": "iris"}},
            "train": {"steps": 4}}
    with pytest.raises(UserError, match=says):
        Run(resolve({**base, **recipe}, {}, get_registry())).prepare()


def test_user_ids_without_the_user_unit_are_refused():
    """users= without privacy.unit: user trained at the example level, whose printed unit was right
    but easy to miss (a review): refused, saying how to ask for the user level."""
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    with pytest.raises(UserError, match="privacy.unit is example") as e:
        dpregistry.train({"algorithm": "dp_sgd", "privacy": {"epsilon": 4.0, "delta": 1e-3}, "train": {"steps": 2}},
                         model=nn.Linear(4, 2), loss=per_example, train_data=list(zip(x, y)),
                         users=torch.arange(40) // 4, verbose=False)
    assert e.value.key == "users"


def test_a_user_level_run_needs_user_ids():
    recipe = {"algorithm": "dp_sgd", "objective": {"name": "tabular", "data": {"dataset": "iris"}},
              "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 3},
              "train": {"steps": 4}}
    with pytest.raises(UserError, match="data.user") as e:
        Run(resolve(recipe, {}, get_registry())).prepare()
    assert e.value.key == "privacy.unit"
    with pytest.raises(UserError, match="users="):
        _own_run({"algorithm": "dp_sgd", "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user",
                                                     "max_examples_per_user": 3}, "train": {"steps": 4}}, None)


# -- the audit: one canary user holding many examples ----------------------------------------------


CANARY_ROWS = 50


def _audit_run(sampler, unit_privacy, epsilon):
    """A full-batch (or every-user) release around a linear model at 0, where a canary user holds
    CANARY_ROWS examples that all push the same coordinate; D' replaces the user's data."""
    n_users, per_user = 40, CANARY_ROWS
    n = n_users * per_user
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g) * 0.01
    x[:, 2] = 0.0
    x[:per_user, 2] = 10.0  # the canary user: user 0
    y = torch.randn(n, 1, generator=g) * 0.01
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    held = {"which": 0}

    def loss(out, t):
        # a linear loss: the gradient is the input, times 10, and in D' the canary's rows push the
        # other way (replacing the user's whole data)
        flip = (t == 7.0) & bool(held["which"])
        return -(out * torch.where(flip, -10.0, 10.0)).sum(-1)

    y[:per_user] = 7.0  # marks the canary's rows in the targets
    users = torch.arange(n) // per_user if unit_privacy.get("unit") == "user" else None  # else refused: unused
    objects = OwnObjects(model, loss, list(zip(x, y)), users=users)
    recipe = {"algorithm": "dp_sgd", "objective": "python", "seed": 0, "sampler": sampler,
              "privatizer": {"clip": 1.0, "noise_multiplier": "auto"}, "accountant": "pld",
              "privacy": {"epsilon": epsilon, "delta": DELTA, "noise": "reproducible", **unit_privacy},
              "train": {"steps": 1, "progress": False}}
    run = Run(resolve(recipe, {}, get_registry()), provides={OwnObjects: objects}).prepare()
    return run, held


def _audit(run, held, trials=30_000):
    parts = []
    run.begin_step()
    idx = run.sampler.indices(run.ctx)
    for which in (0, 1):
        held["which"] = which
        parts.append(run.privatize_batch(idx))
        run.ctx.undo_displacement()
    diff = parts[1].aggregate.clone()
    for k, t in diff.tensors.items():
        t.sub_(parts[0].aggregate.tensors[k])
    masks = torch.zeros(2 * trials, 2)
    masks[:trials, 0] = masks[trials:, 1] = 1
    release = run.privatizer.release(trial_sums(parts, masks), run.begin_step())
    stats = projections(release.value, diff)
    claimed = run.planned_epsilon()
    return claimed, epsilon_lower_bound(stats[:trials], stats[trials:], DELTA).epsilon_lower


def test_example_level_dp_leaks_a_user_with_many_examples_and_user_level_dp_does_not():
    # example-level DP-SGD: a user's 50 examples move the sum by up to 100C
    run, held = _audit_run({"name": "full_batch"}, {}, epsilon=2.0)
    claimed, audited = _audit(run, held)
    print(f"\nexample-level: claimed ε = {claimed:.3f} per example, the user's audited ε >= {audited:.3f}")
    assert audited > 3 * claimed  # the user's ε far exceeds the example-level claim
    # ULS: each user's mean clipped as one: the claim holds for the user
    run, held = _audit_run({"name": "user_poisson", "users_per_step": 40}, {"unit": "user", "max_examples_per_user": 50},
                           epsilon=2.0)
    claimed, audited = _audit(run, held)
    print(f"ULS: claimed user ε = {claimed:.3f}, audited >= {audited:.3f}")
    assert run.sampler.q == 1.0 and audited <= claimed and audited > 0.3 * claimed
    # ELS with k = 5: at most 5 of the user's examples; group privacy of size 5
    run, held = _audit_run({"name": "full_batch"}, {"unit": "user", "max_examples_per_user": 5}, epsilon=4.0)
    claimed, audited = _audit(run, held)
    print(f"ELS (k = 5): claimed user ε = {claimed:.3f}, audited >= {audited:.3f}")
    assert run.group == 5 and audited <= claimed


def test_uls_trains_a_model_of_ones_own_data_with_users():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    recipe = {"algorithm": "dp_adam", "sampler": {"name": "user_poisson", "users_per_step": 20},
              "update": {"lr": 0.02}, "train": {"steps": 60},
              "privacy": {"epsilon": 6.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 8}}
    r = dpregistry.train(recipe, model=model, loss=per_example, train_data=list(zip(x[:1400], y[:1400])),
                         eval_data=list(zip(x[1400:], y[1400:])), users=torch.arange(1400) // 20, verbose=False)
    assert r.epsilon <= 6.0 and r.summary["users"] == 70 and r.metrics["accuracy"] > 0.3  # chance: 0.1
    assert math.isfinite(r.metrics["loss"])


def test_the_two_pass_mode_is_refused_where_users_are_clipped_as_one():
    """A user's norm needs each layer's pieces, which the two-pass mode drops after its first
    backward: a ULS run refuses ``passes: 2`` before it starts, and a two-pass contribution
    refuses group norms rather than reading the emptied pieces (as zero norms, i.e. unclipped)."""
    users = torch.arange(240) // 12
    with pytest.raises(UserError, match="passes: 2") as e:
        _own_run({"algorithm": "dp_sgd", "update": {"lr": 0.1}, "train": {"steps": 2, "progress": False},
                  "estimator": {"backend": "hooks", "passes": 2},
                  "sampler": {"name": "user_poisson", "users_per_step": 5},
                  "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 6}}, users)
    assert e.value.key == "estimator.passes"
    obj = Tokens()
    ctx = Context.detached(dict(obj.model.named_parameters()), n_train=obj.n_train, provides={Objective: obj})
    est = PerExampleGrad(PerExampleGrad.Params(backend="hooks", passes=2))
    est.setup(ctx)
    contrib = next(est.contributions(obj, torch.arange(obj.n_train), ctx))
    with pytest.raises(RuntimeError, match="groups"):
        contrib.group_norms(torch.arange(obj.n_train) // 6, 4)


# -- the shipped recipes at the user level ----------------------------------------------------------

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SST2 = Path(__file__).resolve().parent / "data" / "sst2"


ULS = {"name": "user_poisson", "users_per_step": 4}
ELS = {"name": "poisson", "batch_size": 8}


@pytest.mark.parametrize("recipe, sampler", [("minilm_sst2_user_dp_adam", ULS), ("minilm_sst2_dpgrape", ULS),
                                             ("minilm_sst2_dpzero", ULS), ("minilm_sst2_dp_adam", ELS)])
def test_dp_adam_dp_grape_and_dpzero_recipes_run_at_the_user_level(recipe, sampler, tmp_path):
    """The first- and zeroth-order MiniLM recipes take privacy.unit: user with ULS (users drawn at
    rate users_per_step ÷ users, charged at the user level) and ELS (group privacy of size k)."""
    user = {"privacy": {"epsilon": 6.0, "delta": 1e-5, "unit": "user", "max_examples_per_user": 3,
                        "noise": "reproducible"},
            "data": {"path": str(SST2), "k_per_class": None, "rows_per_user": 25, "max_test": 16},
            "objective": {"cache_features": False},  # one step: encode its batch, not all 1,024 rows
            "train": {"steps": 1, "eval_every": None, "checkpoint_every": None, "progress": False}}
    path = tmp_path / "user.yaml"
    path.write_text(yaml.safe_dump({"extends": str(RECIPES / f"{recipe}.yaml"), "sampler": sampler, **user}))
    r = dpregistry.train(path, verbose=False)
    n_rows = sum(1 for _ in open(SST2 / "train.tsv")) - 1
    users = math.ceil(n_rows / 25)
    s, event = r.summary, r.ledger[0]["event"]
    assert s["unit"] == "user" and s["users"] == users and s["max_examples_per_user"] == 3
    assert s["epsilon"] <= 6.0 * (1 + 1e-9) and s["delta"] <= 1e-5
    if sampler is ULS:
        assert s["user_mechanism"] == "uls" and event["q"] == pytest.approx(4 / users)
    else:  # ELS: example-level sampling among the 3 kept rows of each user, group privacy of size 3
        assert s["user_mechanism"] == "els" and event["q"] == pytest.approx(8 / (3 * users))
        assert s["epsilon"] == pytest.approx(3 * s["example_level"]["epsilon"])


def test_a_resume_with_other_users_is_refused(tmp_path):
    """The data record of a checkpoint held the records but not their users: a user-level run
    resumed with another user column would continue its ledger on another partition."""
    from conftest import rewind
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = list(zip(torch.tensor(x[:400] / 16, dtype=torch.float32), torch.tensor(y[:400])))
    recipe = {"algorithm": "dp_sgd", "sampler": {"name": "user_poisson", "users_per_step": 5},
              "update": {"lr": 0.1}, "train": {"steps": 4, "checkpoint_every": 2},
              "privacy": {"epsilon": 6.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 4,
                          "noise": "reproducible"}}

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 10))

    dpregistry.train(recipe, model=model(), loss=per_example, train_data=data, users=torch.arange(400) // 10,
                     verbose=False, out=tmp_path / "r")
    rewind(tmp_path / "r", 2)
    with pytest.raises(UserError, match=r"training data is not the data of the checkpoint's run \(now 400 records, "
                                        r"digest \w+, users \w+; then 400 records, digest \w+, users \w+\)"):
        dpregistry.resume(tmp_path / "r", model=model(), loss=per_example, train_data=data,
                          users=torch.arange(400) // 8, verbose=False)
    assert dpregistry.resume(tmp_path / "r", model=model(), loss=per_example, train_data=data,
                             users=torch.arange(400) // 10, verbose=False).summary["step"] == 4


@pytest.mark.parametrize("space", ["dense", "direction"])
def test_a_user_whose_rows_cancel_moves_the_clipped_sum_by_at_most_c(space):
    """Rows ±10³⁰ of one user cancel in the user's sum, whose norm is then 0: the user is not
    clipped. Summed anew among the other users' rows, the two rows drowned those users' rows
    (1e30 absorbs them), and the sum moved by all of them, not by at most C (a review). The users'
    sums are now formed once, and the weights multiply those."""
    from dpregistry.clipping import clip_and_sum
    from dpregistry.spaces import DenseContribution, DirectionContribution

    C = 1.0
    rows = torch.full((6, 3), 0.9)  # six users of one row each, inside the clip
    crafted = torch.tensor([[1e30, 1e30, 1e30], [-1e30, -1e30, -1e30]])

    def released(values, groups):
        if space == "dense":
            c = DenseContribution(per_example={"w": values}, losses=torch.zeros(len(values)), groups=groups)
            return clip_and_sum(c, C).aggregate.tensors["w"].double()
        c = DirectionContribution(values=values[:, 0], direction=None, losses=torch.zeros(len(values)), groups=groups)
        return clip_and_sum(c, C).aggregate.tensors["coeff"].double()

    without = released(rows, torch.arange(6))
    with_it = released(torch.cat([rows[:3], crafted, rows[3:]]), torch.tensor([0, 1, 2, 9, 9, 3, 4, 5]))
    assert float((with_it - without).norm()) <= C


def test_a_user_whose_examples_cancel_in_a_hooked_layer_moves_the_sum_by_at_most_c():
    """Two examples of one user, tokens s·v and −s·v (s from 10² to 10⁸), through a token-wise
    Linear: the user's gradient is 0 and its norm 0, the user unclipped; the sum of the
    examples' products among the others' rows then released their fp32 rounding: 3.5·C (a
    review). The user's formed sums (and, for factors, the float64 shares) are released instead."""
    from dpregistry.clipping import clip_and_sum
    from dpregistry.persample import GradSampler

    torch.manual_seed(0)
    d, T, C = 260, 128, 1.0

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(d, d, bias=False), nn.Linear(d, 1)
            self.head.requires_grad_(False)

        def forward(self, x):
            return self.head(self.lin(x).mean(1)).squeeze(1)

    model = Bag().eval()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(3)
    others = torch.randn(3, T, d, generator=g)

    def released(x, groups):
        sampler = GradSampler(model, params)
        with torch.enable_grad(), sampler.capture(x.shape[0]):
            losses = model(x)
        c = sampler.contribution(losses)
        c.groups = groups
        return clip_and_sum(c, C).aggregate.tensors["lin.weight"].double()

    without = released(others, torch.arange(3))
    worst = 0.0
    for _ in range(6):
        a = (torch.randn(d, generator=g) * 10 ** (2 + 6 * torch.rand(1, generator=g).item())).repeat(T, 1)
        with_it = released(torch.cat([others, a[None], -a[None]]), torch.tensor([0, 1, 2, 7, 7]))
        worst = max(worst, float((with_it - without).norm()))
    assert worst <= C
