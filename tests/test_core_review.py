"""Regression tests for defects found in the adversarial review of the core (privacy first).

Each test states the property it checks and computes the expectation independently of the code
under test (a budget that must be enforced, the charge a record actually suffers, a batch that
must not be derivable from public information)."""

from __future__ import annotations

import pytest

from conftest import make_run
from dpregistry.errors import UserError

TABULAR = {"name": "tabular", "model": {"kind": "mlp", "hidden": [8]}, "data": {"dataset": "wine"}}


def dp_sgd(**over):
    recipe = {"seed": 3, "algorithm": "dp_sgd", "objective": TABULAR,
              "sampler": {"name": "poisson", "batch_size": 16},
              "privatizer": {"clip": 1.0, "noise_multiplier": 1.0},
              "privacy": {"epsilon": 8.0, "delta": 1e-3},
              "train": {"steps": 4, "progress": False}}
    recipe.update(over)
    return recipe


# -- a stated budget is enforced, or the recipe is refused ------------------------------------


KEY_A, KEY_B = "3f1c9a7be2d54c6a8b0e1f2a3c4d5e6f", "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d"


def two_ranks():
    """Comm classes for two ranks run one after the other in this process (rank 0 first): the k-th
    broadcast of a rank 1 receives the k-th broadcast of the latest rank 0; no other collective is
    needed."""
    from dpregistry.distributed import LocalComm

    sent = []

    class TwoRanks(LocalComm):
        world_size = 2

        def __init__(self, rank):
            self.rank = rank
            self.broadcasts = 0
            if rank == 0:
                sent.clear()

        def broadcast_object(self, obj, src=0):
            self.broadcasts += 1
            if self.rank == src:
                sent.append(obj)
                return obj
            return sent[self.broadcasts - 1]

    return TwoRanks


def test_an_epsilon_without_delta_is_refused_not_ignored(tmp_path):
    """privacy.epsilon alone is no (ε, δ) budget: it used to be silently dropped, so 200 steps at
    z = 0.5 (ε in the hundreds at any δ) ran under "epsilon: 0.01" with no check at all."""
    recipe = dp_sgd(privatizer={"clip": 1.0, "noise_multiplier": 0.5}, privacy={"epsilon": 0.01},
                    train={"steps": 200, "progress": False})
    with pytest.raises(UserError, match="privacy.delta") as e:
        make_run(recipe, tmp_path)
    assert e.value.key.startswith("privacy")


@pytest.mark.parametrize("accountant", ["rdp", "rdp_filter", "pld", "kov_advanced_composition"])
def test_a_rho_budget_is_refused_by_accountants_that_cannot_enforce_it(accountant, tmp_path):
    """privacy.rho is a zCDP budget. The (ε, δ)/RDP accountants ignored it: 50 steps of
    z = 0.8 (ρ = (2C/σ)²/2 per unamplified step, 50 · 3.125 = 156 in total) ran under rho: 1e-4."""
    recipe = dp_sgd(privatizer={"clip": 1.0, "noise_multiplier": 0.8}, accountant=accountant,
                    privacy={"epsilon": 50.0, "delta": 1e-3, "rho": 1e-4}, train={"steps": 50, "progress": False})
    with pytest.raises(UserError, match="privacy.rho is a zCDP budget") as e:
        make_run(recipe, tmp_path)
    assert e.value.key.startswith("privacy")
    # the zcdp accountant enforces ρ: the same recipe is refused for overspending it
    with pytest.raises(UserError, match="ρ = 156.25, more than the budget ρ = 0.0001"):
        make_run(dict(recipe, accountant="zcdp"), tmp_path)


def test_an_accountant_that_does_not_declare_a_rho_budget_has_it_refused(tmp_path):
    """The refusal is the run's, not each accountant's: kov_advanced_composition (dpgd_0th's default)
    had no refusal of its own and ran a review's recipe to 45 × its privacy.rho. A third-party
    accountant is held to the same rule unless it says it budgets ρ (``budgets_rho``)."""
    from dpregistry import StagePlugin
    from dpregistry.privacy.accountant import Accountant
    from dpregistry.registry import get_registry

    rdp = get_registry().get("accountant", "rdp").cls

    class Mine(Accountant):
        name = "mine_eps_delta"
        supports, _epsilon, _delta = rdp.supports, rdp._epsilon, rdp._delta

    get_registry().add_plugin(StagePlugin(Mine), origin="tests")
    recipe = dp_sgd(privatizer={"clip": 1.0, "noise_multiplier": 0.8}, accountant="mine_eps_delta",
                    privacy={"epsilon": 50.0, "delta": 1e-3, "rho": 1e-4}, train={"steps": 50, "progress": False})
    with pytest.raises(UserError, match="mine_eps_delta accountant cannot enforce"):
        make_run(recipe, tmp_path)


def test_zcdp_fail_holds_one_budget(tmp_path):
    """zcdp_fail checked ε and δ and skipped privacy.rho when both were given (a review's KLT recipe
    spent 68 × its ρ): both together are refused; ρ alone is held (no failure probability)."""
    both = {"epsilon": 50.0, "delta": 1e-3, "rho": 1e-4}
    with pytest.raises(UserError, match="holds one budget"):
        make_run(dp_sgd(accountant="zcdp_fail", privatizer={"clip": 1.0, "noise_multiplier": 0.8}, privacy=both,
                        train={"steps": 50, "progress": False}), tmp_path)
    with pytest.raises(UserError, match="more than the budget"):
        make_run(dp_sgd(accountant="zcdp_fail", privatizer={"clip": 1.0, "noise_multiplier": 0.8},
                        sampler={"name": "full_batch"}, privacy={"rho": 1e-4}, train={"steps": 50, "progress": False}),
                 tmp_path)


def test_a_privatizer_whose_noise_the_algorithm_sets_is_refused_with_one_that_sets_none(tmp_path):
    """KL's scheduled and SPIDER privatizers take σ from their algorithm at each release; with an
    algorithm that sets none the run stopped in planning with a TypeError."""
    recipe = dp_sgd(privatizer={"name": "scheduled_gaussian", "clip": 1.0}, train={"steps": 5, "progress": False})
    with pytest.raises(UserError, match="takes its noise from the algorithm at each release") as e:
        make_run(recipe, tmp_path)
    assert e.value.key.startswith("privatizer")


# -- shuffled batches: parallel composition inside an epoch --------------------------------------


def shuffle_recipe(**sampler):
    return dp_sgd(algorithm="standard", estimator={"name": "per_example_grad"},
                  sampler={"name": "shuffle", "batch_size": 16, **sampler},
                  privatizer={"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0},
                  update={"name": "sgd", "lr": 0.1}, accountant="rdp", privacy={"epsilon": 50.0, "delta": 1e-3})


def test_exact_shuffle_accounting_is_refused_under_add_remove(tmp_path):
    """Exact shuffle accounting charges one release of sensitivity C per epoch, which assumes that
    a neighbour changes one batch. Under add/remove the data size changes, and the seeded
    permutation of n + 1 records cuts entirely different batches than that of n records."""
    import torch

    run = make_run(shuffle_recipe(), tmp_path)  # replace-one: accepted
    n, B = run.n_train, run.sampler.B
    first = set(torch.randperm(n, generator=run.rng.generator("shuffle", 0))[:B].tolist())
    first_plus = set(torch.randperm(n + 1, generator=run.rng.generator("shuffle", 0))[:B].tolist())
    assert len(first ^ first_plus) > 2  # more than the one added record moved
    with pytest.raises(UserError, match="replace.one") as e:
        make_run(dict(shuffle_recipe(), privacy={"epsilon": 50.0, "delta": 1e-3, "relation": "add_remove"}), tmp_path)
    assert e.value.key.startswith("sampler") or e.value.key.startswith("privacy")



def test_shuffle_sampling_has_no_poisson_amplification(tmp_path):
    """The shuffled order derives from the public seed: whoever has the recipe knows every batch,
    so accounting a shuffled run as Poisson-sampled under-reports ε (audited: 15.04 against 52.77)."""
    with pytest.raises(UserError, match="public seed") as e:
        make_run(shuffle_recipe(accounting="poisson_heuristic"), tmp_path)
    assert e.value.key == "sampler.accounting" and e.value.line


def test_exact_shuffle_accounting_charges_a_step_whose_mechanism_differs_from_the_epoch_start(tmp_path):
    """A record of batch j suffers the release of step j. The sampler charged only the epoch's
    first step and dropped every later one, which is right only when all steps release the same
    mechanism; a step with less noise (a schedule, a third-party privatizer) went uncharged."""
    from dpregistry.privacy.accountant import Budget, make_accountant
    from dpregistry.privacy.events import Gaussian
    from dpregistry.stages import Charge

    run = make_run(dict(shuffle_recipe(), privacy={"delta": 1e-3}), tmp_path)
    assert run.sampler.per_epoch >= 3
    planned, weak = Gaussian(std=1.0, sensitivity=2.0), Gaussian(std=0.25, sensitivity=2.0)
    run.step = 0
    run.charge([planned])
    run.step = 1
    assert run.charge([planned]) == []  # the same mechanism: covered by parallel composition
    run.step = 2
    run.charge([weak])                  # records of batch 2 suffer this release
    alone = make_accountant("rdp", Budget(delta=1e-3)).epsilon(extra=[Charge(weak)])
    assert run.accountant.epsilon() >= alone
    assert run.accountant.ledger.n_charges == 2


# -- amplification by sampling needs batches as secret as the noise ------------------------------


def public_batch(recipe, n, step):
    """The batch anyone can compute from the recipe: its seed and the sampler's public purpose."""
    import torch

    from dpregistry.rng import RunRNG

    g = RunRNG(recipe["seed"], "reproducible").generator(recipe["sampler"]["name"], step)
    if recipe["sampler"]["name"] == "poisson":
        return (torch.rand(n, generator=g) < recipe["sampler"]["batch_size"] / n).nonzero().squeeze(1)
    return torch.randperm(n, generator=g)[:recipe["sampler"]["batch_size"]]


SAMPLED = [dp_sgd(), dp_sgd(sampler={"name": "uniform", "batch_size": 16}, privacy={"epsilon": 20.0, "delta": 1e-3})]


@pytest.mark.parametrize("recipe", SAMPLED, ids=["poisson", "uniform"])
def test_keyed_and_secure_modes_sample_batches_nobody_can_regenerate_from_the_recipe(recipe, tmp_path, monkeypatch):
    """The accountant charges amplified events (PoissonSampled, SampledWithoutReplacement), which
    hold only if the batch is hidden: in keyed and secure modes the batches come from the secret key,
    never from the public recipe seed."""
    import torch

    from dpregistry.rng import NOISE_KEY_ENV

    def batches(run):
        return [run.sampler.indices(run.ctx.at(t)) for t in range(4)]

    def mode(name):
        return dict(recipe, privacy=dict(recipe["privacy"], noise=name))

    n = make_run(mode("reproducible"), tmp_path).n_train
    public = [public_batch(recipe, n, t) for t in range(4)]
    assert all(abs(len(b) - recipe["sampler"]["batch_size"]) < 12 for b in public)

    monkeypatch.setenv(NOISE_KEY_ENV, KEY_A)
    keyed = batches(make_run(mode("keyed"), tmp_path))
    assert not any(torch.equal(a, b) for a, b in zip(keyed, public))
    assert all(torch.equal(a, b) for a, b in zip(keyed, batches(make_run(mode("keyed"), tmp_path))))  # reproducible
    monkeypatch.setenv(NOISE_KEY_ENV, KEY_B)
    assert not any(torch.equal(a, b) for a, b in zip(keyed, batches(make_run(mode("keyed"), tmp_path))))
    monkeypatch.delenv(NOISE_KEY_ENV)

    one, two = batches(make_run(mode("secure"), tmp_path)), batches(make_run(mode("secure"), tmp_path))
    assert not any(torch.equal(a, b) for a, b in zip(one, public))
    assert not any(torch.equal(a, b) for a, b in zip(one, two))


def test_secure_mode_ranks_share_the_key_once_and_draw_the_same_batches_and_noise(tmp_path):
    """In secure mode each process has its own OS entropy, but every rank must cut its shard from
    the same global batch and add the same noise: rank 0 draws the key and sends it once, when the
    run starts; no noise or seed crosses the network afterwards. (A replica checksum cannot catch a
    disagreement in batches: ranks all-reduce one sum either way.)"""
    import torch

    from dpregistry.run import Run
    from dpregistry.recipe import load
    from conftest import write_recipe

    TwoRanks = two_ranks()

    recipe = load(write_recipe(tmp_path, dp_sgd()))
    assert recipe.privacy.noise == "secure"
    comms = [TwoRanks(r) for r in (0, 1)]
    ranks = [Run(recipe, comm=c).prepare() for c in comms]
    assert ranks[0].rng.key == ranks[1].rng.key
    sent = [c.broadcasts for c in comms]
    for t in range(3):
        a, b = (run.sampler.indices(run.ctx.at(t)) for run in ranks)
        assert torch.equal(a, b)
        x, y = (run.rng.noise(t, 0).randn((50,)) for run in ranks)
        assert torch.equal(x, y)
    assert [c.broadcasts for c in comms] == sent  # nothing more was sent
    alone = Run(recipe).prepare()
    assert alone.rng.key != ranks[0].rng.key


# -- a forward pass must not change parameters from private data ----------------------------------


def test_an_embedding_that_renormalises_its_rows_in_the_forward_pass_is_refused():
    """nn.Embedding(max_norm=...) rescales, in place and without noise, the rows of the ids a
    forward pass sees: after one private step the released weights show which tokens the batch
    held. Neither the hooks nor any other estimator can make that private."""
    import torch
    from torch import nn

    from dpregistry.persample import GradSampler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.mul_(10)  # every row longer than max_norm
    before = model[0].weight.detach().clone()
    private_ids = torch.tensor([[2, 7]])
    model(private_ids)
    changed = (model[0].weight != before).any(1).nonzero().squeeze(1).tolist()
    assert changed == [2, 7]  # the leak: exactly the private batch's tokens
    with pytest.raises(UserError, match="max_norm"):
        GradSampler(model, dict(model.named_parameters()))
    frozen = dict(model[2].named_parameters(prefix="2"))  # a frozen renormalising embedding leaks too
    model[0].weight.requires_grad_(False)
    with pytest.raises(UserError, match="max_norm"):
        GradSampler(model, frozen)
    # zeroth-order estimators only run forward passes: the objective itself refuses the model
    from dpregistry.objectives import TorchObjective

    class Renorm(TorchObjective):
        def build(self, ctx):
            self.model = model

    with pytest.raises(UserError, match="max_norm"):
        Renorm().setup(None)


# -- per-example gradients: a layer's rows must each belong to one example ------------------------


def _per_example_reference(model, params, losses):
    """One backward per example (shares nothing with the hooks)."""
    import torch

    rows = []
    for i in range(losses.shape[0]):
        gs = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True)
        rows.append(torch.sqrt(sum(g.pow(2).sum() for g in gs)))
    return torch.stack(rows)


@pytest.mark.parametrize("layout", ["two_views", "sequence_first"])
def test_a_layer_whose_rows_mix_examples_is_refused_not_misattributed(layout):
    """The hooks read dimension 0 of a layer's output as the example (or batch-major blocks of it).
    A batch concatenated with a second view of itself ([2B, F]: rows i and B + i are example i) or
    a sequence-first tensor ([T, B, F] with T a multiple of B) fit that shape, and each clipped
    "example" mixed several records: a record then moved several clipped rows, beyond 2C."""
    import torch
    from torch import nn

    from dpregistry.persample import GradSampler

    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            B = x.shape[0]
            h = self.lin(torch.cat([x, 2 * x]))
            return (h[:B] * h[B:]).sum(-1)

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):                          # x: [B, T, 3]
            return self.lin(x.transpose(0, 1)).pow(2).sum((0, 2))  # the layer sees [T, B, 3]

    torch.manual_seed(0)
    model, x = (TwoViews(), torch.randn(4, 3)) if layout == "two_views" else (SequenceFirst(), torch.randn(4, 8, 3))
    params = dict(model.named_parameters())
    truth = _per_example_reference(model, params, model(x))
    gs = GradSampler(model, params)
    with pytest.raises(UserError, match="one example"):
        with torch.enable_grad(), gs.capture(4):
            losses = model(x)
        norms = gs.contribution(losses).norms()
        # what the hooks reported instead of refusing: norms of mixtures, not of the examples
        assert torch.allclose(norms, truth, rtol=1e-4), (norms, truth)


# -- error paths: one line, exit 2 -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["{not json", "[]", '{"recipe": 5, "recipe_hash": "x"}', '{"recipe": {}}'],
                         ids=["not_json", "a_list", "recipe_not_a_mapping", "no_hash"])
def test_resume_of_a_damaged_recipe_json_is_one_line(text, tmp_path):
    from test_core_cli import dpreg

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.json").write_text(text)
    res = dpreg("resume", tmp_path / "run")
    assert res.returncode == 2 and "recipe.json" in res.stderr


def test_ranks_with_different_noise_keys_are_refused(tmp_path, monkeypatch):
    """Keyed batches and noise derive from DPREG_NOISE_KEY on every rank: a rank with another key
    (or none) would cut its shard from another batch (a record could be summed on two ranks, twice
    the sensitivity) and add other noise."""
    from dpregistry.run import Run
    from dpregistry.recipe import load
    from dpregistry.rng import NOISE_KEY_ENV
    from conftest import write_recipe

    TwoRanks = two_ranks()

    recipe = load(write_recipe(tmp_path, dict(dp_sgd(), privacy={"epsilon": 8.0, "delta": 1e-3, "noise": "keyed"})))
    monkeypatch.setenv(NOISE_KEY_ENV, KEY_A)
    Run(recipe, comm=TwoRanks(0)).prepare()
    Run(recipe, comm=TwoRanks(1)).prepare()  # the same key: fine
    Run(recipe, comm=TwoRanks(0)).prepare()
    monkeypatch.setenv(NOISE_KEY_ENV, KEY_B)
    with pytest.raises(UserError, match="DPREG_NOISE_KEY"):
        Run(recipe, comm=TwoRanks(1)).prepare()
    monkeypatch.delenv(NOISE_KEY_ENV)
    with pytest.raises(UserError, match="DPREG_NOISE_KEY"):
        Run(recipe, comm=TwoRanks(1)).prepare()


def test_the_layout_check_keeps_a_sketch_of_each_backprop_not_a_copy(monkeypatch):
    """The check runs in a run's first step, which sets its peak memory: it keeps k = 4 numbers
    per output row (a copy of every backprop made DP-GRAPE's first step 20% larger than its others)."""
    import torch
    from torch import nn

    from dpregistry.persample import GradSampler

    model = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(4, 8, 3)
    gs = GradSampler(model, dict(model.named_parameters()))
    kept, check = [], GradSampler._check_layout

    def spy(self, use, g):
        kept.append((self._probes[id(use)].numel(), g.numel()))
        return check(self, use, g)

    monkeypatch.setattr(GradSampler, "_check_layout", spy)
    with torch.enable_grad(), gs.capture(4):
        losses = model(x).pow(2).sum((1, 2))
    gs.contribution(losses).backward()  # (a contribution runs its backward when first read)
    assert len(kept) == 2 and all(sketch == 4 * 8 * 4 and backprop == 4 * 8 * 64 for sketch, backprop in kept)


def test_ranks_with_different_recipes_are_refused(tmp_path):
    """Every rank loads the recipe itself (on several nodes, from its own file): a rank with a larger
    clip would add a larger clipped sum to the all-reduce, unaccounted for, and since every rank
    applies the same reduced update, the parameter checksums would never show it."""
    from dpregistry.run import Run
    from dpregistry.recipe import load
    from conftest import write_recipe

    TwoRanks = two_ranks()

    recipe = load(write_recipe(tmp_path, dp_sgd()))
    Run(recipe, comm=TwoRanks(0)).prepare()
    Run(recipe, comm=TwoRanks(1)).prepare()  # the same recipe: fine
    other = load(write_recipe(tmp_path, dp_sgd(), name="other.yaml"), ["privatizer.clip=100"])
    with pytest.raises(UserError, match="recipe"):
        Run(other, comm=TwoRanks(1)).prepare()
