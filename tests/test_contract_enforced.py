"""The stage contract, enforced where a third-party stage's slip would print a wrong ε without a
word (review 13 wrote well-formed stages from the documented contract, each with one privacy bug;
every one ran to the end, and the printed ε was 0 or the honest run's while the true ε, from
dp-accounting, was 3 to 14.6).

The run cannot audit arbitrary code; it checks what the contract makes checkable: a step that
reads its batch or draws noise charges something, a sampled batch is charged once, each sampled
record contributes once and no other record does, the privacy noise's stream is the run's own,
and a stage is registered under its own name (tests/test_core_registry.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_run
from dpregistry import Algorithm, Charge, StagePlugin
from dpregistry.registry import Registry, get_registry
from dpregistry.stages import StepResult

TABULAR = {"name": "tabular", "model": {"kind": "mlp", "hidden": [8]}, "data": {"dataset": "wine"}}


def dp_sgd(**over):
    recipe = {"seed": 3, "algorithm": "dp_sgd", "objective": TABULAR, "sampler": {"name": "poisson", "batch_size": 16},
              "privatizer": {"clip": 1.0, "noise_multiplier": 1.0}, "privacy": {"epsilon": 8.0, "delta": 1e-3},
              "train": {"steps": 4, "progress": False}}
    recipe.update(over)
    return recipe


def shipped(kind: str, name: str) -> type:
    return get_registry().get(kind, name).cls


def with_stages(*classes) -> Registry:
    reg = Registry().load_entry_points()
    reg.add_plugin(StagePlugin(*classes), origin="third-party 0 (tp)", name="tp")
    return reg


class SilentGaussian(shipped("privatizer", "gaussian")):
    """The shipped Gaussian, but its releases state no events."""

    name = "silent_gaussian"

    def release(self, total, ctx, *, std=None):
        out = super().release(total, ctx, std=std)
        out.events = []
        return out


class NoCharge(Algorithm):
    """The standard step without ``run.charge``."""

    name = "no_charge"
    defaults = shipped("algorithm", "dp_sgd").defaults

    def step(self, run):
        ctx = run.ctx
        total = run.privatize_batch(run.sampler.indices(ctx))
        release = run.privatizer.release(total, ctx)
        run.update_rule.apply(ctx.params, release, ctx)
        return StepResult(run.step_metrics(total, release))


class ChargeTwice(NoCharge):
    """Two releases of one batch, each charged in a call of its own (each amplified alone)."""

    name = "charge_twice"

    def step(self, run):
        ctx = run.ctx
        idx = run.sampler.indices(ctx)
        for _ in range(2):
            release = run.privatizer.release(run.privatize_batch(idx), ctx)
            run.charge(release.events)
        run.update_rule.apply(ctx.params, release, ctx)
        return StepResult({})


class OneOfTwo(NoCharge):
    """Two releases of one batch (a noisy norm, then the gradient), only the second charged."""

    name = "one_of_two"

    def step(self, run):
        ctx = run.ctx
        total = run.privatize_batch(run.sampler.indices(ctx))
        run.privatizer.release(run.privatize_batch(run.sampler.indices(ctx)), ctx)
        release = run.privatizer.release(total, ctx)
        run.charge(release.events)
        run.update_rule.apply(ctx.params, release, ctx)
        return StepResult({})


class RecordTwice(shipped("sampler", "poisson")):
    """The shipped Poisson sampler, but its batch holds its first record twice."""

    name = "record_twice"

    def indices(self, ctx):
        drawn = super().indices(ctx)
        return torch.cat([drawn, drawn[:1]])


class Refilled(shipped("sampler", "poisson")):
    """One buffer refilled in place through ``.data`` (its version counter stays): from step 1 on,
    its first record twice."""

    name = "refilled"

    def indices(self, ctx):
        drawn = super().indices(ctx)
        if ctx.step == 0:
            self.buffer = drawn.clone()
        else:
            self.buffer.data[1:] = self.buffer.data[:1]
        return self.buffer


class ZeroCount(shipped("sampler", "poisson")):
    """Its charges counted as a whole number of epochs a step: 0."""

    name = "zero_count"

    def account(self, step, events, ctx):
        return [Charge(c.event, c.partition, int(ctx.step / 100)) for c in super().account(step, events, ctx)]

    def account_steps(self, steps, events, ctx):  # the plan, honestly
        return [Charge(c.event, c.partition, c.count * len(steps)) for c in super().account(steps[0], events, ctx)]


class ChargesNothing(shipped("sampler", "poisson")):
    """Says every step is covered by an earlier charge that never was."""

    name = "charges_nothing"

    def account(self, step, events, ctx):
        return []


class Unnamed(shipped("estimator", "per_example_grad")):
    """The shipped estimator's rows, without the records they come from."""

    name = "unnamed"

    def contributions(self, objective, indices, ctx):
        for c in super().contributions(objective, indices, ctx):
            c.indices = None
            yield c


class Rewrites(shipped("estimator", "per_example_grad")):
    """Writes the first records into the batch it is given, then estimates on it (review 20:
    records 0..B-1 took part in every step, charged at the Poisson rate)."""

    name = "rewrites"

    def contributions(self, objective, indices, ctx):
        indices[:] = torch.arange(len(indices))
        yield from super().contributions(objective, indices, ctx)


class TwoD(shipped("sampler", "poisson")):
    """A batch as a column: its length is 1 whatever it holds."""

    name = "two_d"

    def indices(self, ctx):
        drawn = super().indices(ctx)
        return torch.stack([drawn[:1], drawn[:1]], 1)


class PrepaidFromTheStart(SilentGaussian):
    """Releases that state no events, every step said to be paid for already."""

    name = "prepaid_from_the_start"

    def prepaid(self, ctx):
        return True


class ChargesAnother(shipped("sampler", "poisson")):
    """Charges a Gaussian of a million times the noise instead of the one released."""

    name = "charges_another"

    def account(self, step, events, ctx):
        from dpregistry.privacy.events import Gaussian, PoissonSampled

        return [Charge(PoissonSampled(self.q, Gaussian(std=1e6, sensitivity=2.0)))]

    def account_steps(self, steps, events, ctx):
        return [Charge(c.event, c.partition, c.count * len(steps)) for c in self.account(steps[0], events, ctx)]


class QuietPoisson(shipped("sampler", "poisson")):
    """The shipped Poisson sampler, without its word that the batch must stay secret."""

    name = "quiet_poisson"
    amplifies = False


class Twice(shipped("estimator", "per_example_grad")):
    """Every micro-batch yielded twice (a generator bug)."""

    name = "twice"

    def contributions(self, objective, indices, ctx):
        yield from super().contributions(objective, indices, ctx)
        yield from super().contributions(objective, indices, ctx)


class Outside(shipped("estimator", "per_example_grad")):
    """Record 0 added to every batch."""

    name = "outside"

    def contributions(self, objective, indices, ctx):
        yield from super().contributions(objective, torch.cat([indices, indices.new_zeros(1)]), ctx)


class Swapped(shipped("estimator", "per_example_grad")):
    """A batch's first record replaced by one from outside it (as many rows as the batch)."""

    name = "swapped"

    def contributions(self, objective, indices, ctx):
        outside = next(i for i in range(len(indices) + 1) if i not in indices.tolist())
        yield from super().contributions(objective, torch.cat([indices.new_tensor([outside]), indices[1:]]), ctx)


@pytest.mark.parametrize("over, stages, refusal", [
    ({"privatizer": {"name": "silent_gaussian", "clip": 1.0, "noise_multiplier": 1.0}}, [SilentGaussian],
     "privatized a batch at step 0 but charged nothing"),
    ({"algorithm": "no_charge"}, [NoCharge], r"released gaussian\(.*\) at step 0 without charging it"),
    ({"algorithm": "one_of_two"}, [OneOfTwo], r"released gaussian\(.*\) at step 0 without charging it"),
    ({"sampler": {"name": "record_twice", "batch_size": 16}}, [RecordTwice], "a batch holds a record twice"),
    ({"algorithm": "charge_twice"}, [ChargeTwice], "charged step 0 twice on a 'poisson' batch"),
    ({"algorithm": "charge_twice", "sampler": {"name": "quiet_poisson", "batch_size": 16}}, [ChargeTwice, QuietPoisson],
     "charged step 0 twice on a 'quiet_poisson' batch"),
    ({"estimator": {"name": "twice"}}, [Twice], "contributions cover other records than the"),
    ({"estimator": {"name": "outside"}}, [Outside], "contributions cover other records than the"),
    ({"sampler": {"name": "zero_count", "batch_size": 16}}, [ZeroCount], "a charge count must be an integer >= 1"),
    ({"sampler": {"name": "charges_nothing", "batch_size": 16}}, [ChargesNothing],
     "sampler 'charges_nothing': step 0 released, and the ledger holds no charge"),
    ({"estimator": {"name": "unnamed"}}, [Unnamed], "a contribution of \\d+ rows names no records"),
    ({"estimator": {"name": "rewrites"}}, [Rewrites], "more rows than the batch holds for record"),
    ({"sampler": {"name": "two_d", "batch_size": 16}}, [TwoD], r"a batch is a 1-D tensor of record indices, got shape \(1, 2\)"),
    ({"privatizer": {"name": "prepaid_from_the_start", "clip": 1.0, "noise_multiplier": 1.0}}, [PrepaidFromTheStart],
     "step 0 released, and the ledger holds no charge"),
    ({"sampler": {"name": "charges_another", "batch_size": 16}}, [ChargesAnother],
     r"the charges of step 0 do not hold gaussian\(.*\), which it released"),
    ({"estimator": {"name": "swapped"}}, [Swapped], r"more rows than the batch holds for record \d+; no row for record \d+\)"),
], ids=["empty events", "no charge", "one release of two charged", "a record twice in the batch", "charged twice", "charged twice, sampler silent", "rows twice",
        "a record outside the batch", "a charge of count 0", "no charge from the sampler",
        "rows that name no records", "a batch rewritten by its estimator", "a 2-D batch", "prepaid from the start",
        "another event charged", "a record swapped for one outside"])
def test_a_stage_that_breaks_the_contract_stops_the_run_before_its_step_counts(over, stages, refusal, tmp_path):
    """Each ran to the end before: ε printed 0 for the first two (true: 3 at z = 5.2), the honest
    run's for the others (true 13.96 against 12.41 printed for a batch charged twice with the
    sampler's ``amplifies`` unset; 6.64 against 3 for rows yielded twice). Now the first step is
    refused, and nothing it released is kept: the ledger holds only what was charged before."""
    run = make_run(dp_sgd(**over), tmp_path, registry=with_stages(*stages))
    with pytest.raises((RuntimeError, ValueError), match=refusal):
        run.train()
    assert run.step == 0


def test_a_batch_rewritten_in_place_is_checked_again(tmp_path):
    """Review 17: the each-record-once check ran again only for a new tensor or a new version
    counter, and a write through ``.data`` (or a NumPy view) keeps the counter: a sampler that
    refilled one buffer with a record four times was charged as a batch without one (ε 22.89)."""
    run = make_run(dp_sgd(sampler={"name": "refilled", "batch_size": 16}), tmp_path, registry=with_stages(Refilled))
    with pytest.raises(RuntimeError, match="a batch holds a record twice"):
        run.train()
    assert run.step == 1


def test_the_checks_pass_the_shipped_stages(tmp_path):
    """The same run with the shipped stages takes its steps and charges each once. (A tree
    aggregation charges its period whole at its first step, ``Privatizer.prepaid``: its runs are
    in tests/test_nonsmooth_e2e.py.)"""
    run = make_run(dp_sgd(), tmp_path)
    run.train()
    assert run.step == 4 and run.accountant.ledger.n_charges == 4


class OnceOnly(shipped("sampler", "poisson")):
    """Charges the first step and says the later ones are covered by it (an epoch's word)."""

    name = "once_only"

    def account(self, step, events, ctx):
        return super().account(step, events, ctx) if step == 0 else []


class PartitionPerStep(shipped("sampler", "poisson")):
    """Puts each step's charge in a partition of its own, though every batch is drawn from all
    records: the accountant reports the worst partition, one step (review 20: 4.94 printed, 13.6
    spent)."""

    name = "partition_per_step"

    def account(self, step, events, ctx):
        return [Charge(c.event, f"p{step}", c.count) for c in super().account(step, events, ctx)]

    def account_steps(self, steps, events, ctx):
        return [c for s in steps for c in self.account(s, events, ctx)]


class Reshuffled(shipped("sampler", "shuffle")):
    """Charged once an epoch, but a fresh permutation every step (batches overlap in an epoch)."""

    name = "reshuffled"

    def indices(self, ctx):
        return torch.randperm(self.n, generator=ctx.rng.generator("reshuffled", ctx.step))[:self.B]


class Forgetful(shipped("sampler", "shuffle")):
    """Draws an epoch's permutation from the process's generator: a resumed run reads a new one
    in the middle of the epoch, whose records overlap those the epoch read before."""

    name = "forgetful"

    def indices(self, ctx):
        epoch, j = divmod(ctx.step, self.per_epoch)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = torch.randperm(self.n), epoch
        return self._perm[j * self.B:(j + 1) * self.B]


SHUFFLED = {"privacy": {"epsilon": 100.0, "delta": 1e-3, "relation": "replace_one"},
            "train": {"steps": 20, "progress": False}}


@pytest.mark.parametrize("sampler, refusal, at", [
    (OnceOnly, r"step 1 read records and charged less than it released, relying on the charge at step 0; that "
               r"charge is amplified", 1),
    (PartitionPerStep, r"step \d+ charges partition 'p\d+', but record \d+ was read in partition 'p\d+'", None),
    (Reshuffled, r"step \d+ charged less than it released, relying on an earlier charge that pays for one use of each "
                 r"record, but records? [\d, ]+ (was|were) read since the charge at step 0 already", None),
], ids=["a sampled charge said to cover later steps", "a partition per step", "an epoch that reads a record twice"])
def test_parallel_composition_is_checked_against_the_records_read(sampler, refusal, at, tmp_path):
    """Charging nothing for a step, or charging it to a partition, claims a structure in the
    batches (an epoch, disjoint partitions) that the accountant takes on the sampler's word. Each of
    these ran to the end before, printing the ε of one step or one epoch; the run now checks the
    claim against the records it privatized, and refuses the first step that breaks it."""
    over = SHUFFLED if sampler is Reshuffled else {"privacy": {"epsilon": 100.0, "delta": 1e-3}}
    run = make_run(dp_sgd(sampler={"name": sampler.name, "batch_size": 16}, **over), tmp_path,
                   registry=with_stages(sampler))
    with pytest.raises(RuntimeError, match=refusal):
        run.train()
    assert 0 < run.step < 20 and (at is None or run.step == at)


def test_the_shipped_shuffle_passes_and_a_resume_remembers_what_its_epoch_read(tmp_path):
    """The shipped shuffle (each record once an epoch, charged at the epoch's first step) runs two
    epochs. A sampler whose epoch's permutation is not part of its state reads a new one after a
    resume; the records the epoch read before the checkpoint are in the checkpoint, so the resumed
    run refuses the step that reads one of them again."""
    recipe = dp_sgd(sampler={"name": "shuffle", "batch_size": 16, "accounting": "exact"}, **SHUFFLED)
    shipped_run = make_run(recipe, tmp_path)
    shipped_run.train()
    assert shipped_run.step == 20 > shipped_run.sampler.per_epoch

    recipe["sampler"]["name"] = "forgetful"
    registry = with_stages(Forgetful)
    torch.manual_seed(0)
    first = make_run(recipe, tmp_path, registry=registry)
    first.train(progress=lambda r, m: setattr(r, "stop_reason", "stop") if r.step == 4 else None)
    assert first.step == 4
    tensors, meta = first.state()
    resumed = make_run(recipe, tmp_path, registry=registry)
    resumed.load_state(tensors, meta)
    with pytest.raises(RuntimeError, match=r"step 4 charged less than it released.* read since the charge at step 0"):
        resumed.train()


class LazyShuffle(shipped("sampler", "shuffle")):
    """The shipped shuffle, but a later step of an epoch charges nothing, whatever it released."""

    name = "lazy_shuffle"

    def account(self, step, events, ctx):
        return [Charge(e) for e in events] if step % self.per_epoch == 0 else []


class LoudAtEpochStarts(shipped("privatizer", "gaussian")):
    """z = 50 at the first step of each epoch after the first (8 steps of 16 of wine's 142 records),
    the recipe's z at the others: from the second epoch on, the cover is cheap."""

    name = "loud_at_epoch_starts"

    def release(self, total, ctx, *, std=None):
        loud = ctx.step > 0 and ctx.step % 8 == 0
        return super().release(total, ctx, std=50.0 * self.cfg.clip if loud else std)


class TwoQueries(shipped("algorithm", "dp_sgd")):
    """Two releases of the same event on each batch, charged together."""

    name = "two_queries"

    def step(self, run):
        ctx = run.ctx
        idx = run.sampler.indices(ctx)
        first, second = (run.privatizer.release(run.privatize_batch(idx), ctx) for _ in range(2))
        run.charge(first.events + second.events)
        run.update_rule.apply(ctx.params, first, ctx)
        return StepResult({})

    def plan(self, ctx, z):
        return []


class OncePerEvent(shipped("sampler", "poisson")):
    """Wraps each distinct event once: two releases of one event are charged as one."""

    name = "once_per_event"

    def account(self, step, events, ctx):
        from dpregistry.privacy.events import PoissonSampled

        return [Charge(PoissonSampled(self.q, e)) for e in dict.fromkeys(events)]


class SplitPoisson(shipped("sampler", "poisson")):
    """Draws as the shipped sampler, but amplifies each release of the batch on its own."""

    name = "split_poisson"

    def account(self, step, events, ctx):
        from dpregistry.privacy.events import PoissonSampled

        return [Charge(PoissonSampled(self.q, e)) for e in events]


@pytest.mark.parametrize("recipe, stages, refusal", [
    (dp_sgd(sampler={"name": "lazy_shuffle", "batch_size": 16},
            privatizer={"name": "loud_at_epoch_starts", "clip": 1.0, "noise_multiplier": 1.0}, **SHUFFLED),
     [LazyShuffle, LoudAtEpochStarts], r"step 9 released gaussian\(σ/Δ=0.5\) beyond its own charges, relying on "
                                       r"the charge at step 8, which does not hold it"),
    (dp_sgd(algorithm="two_queries", sampler={"name": "once_per_event", "batch_size": 16},
            privacy={"epsilon": 1e4, "delta": 1e-5}),
     [TwoQueries, OncePerEvent], r"step 0 read records and charged less than it released "
                                 r"\(gaussian\(σ/Δ=0.5\) unpaid\), and no earlier step's charges held all"),
    (dp_sgd(algorithm="two_queries", sampler={"name": "split_poisson", "batch_size": 16},
            privacy={"epsilon": 1e4, "delta": 1e-5}),
     [TwoQueries, SplitPoisson], r"step 0's charges amplify one batch 2 times, each as if its batch were drawn alone"),
], ids=["a cover for a cheaper mechanism", "two releases charged as one", "two releases amplified apart"])
def test_a_cover_pays_for_the_mechanisms_it_holds_as_often_as_it_holds_them(recipe, stages, refusal, tmp_path):
    """Review 21: the check compared the records read, not what read them. A shuffle that charged
    each epoch's first step only, under a privatizer that used z = 50 there and z = 1 elsewhere,
    printed ε 10.75 where dp_accounting gives 48.80; two releases of one event on each Poisson batch,
    charged once each step, printed 25.59 against 73.36; amplified one by one (review 23), 68.73
    against 157.27. Each stops at its first such step now."""
    run = make_run(recipe, tmp_path, registry=with_stages(*stages))
    with pytest.raises(RuntimeError, match=refusal):
        run.train()


def test_the_records_each_charge_covers_survive_a_checkpoint():
    """What the steps read is part of the checkpoint (the mask packed 8 records a byte, 13 here):
    after a restore a record read under a covering charge, or in a partition, is still known."""
    from collections import Counter

    from dpregistry.privacy.events import Gaussian, held
    from dpregistry.record_use import RecordUse

    def holds(charges):
        return sum((held(c.event, c.count) for c in charges), Counter())

    g = Gaussian(std=1.0, sensitivity=1.0)
    use = RecordUse("s")
    use.read(torch.tensor([0, 3]), 13)
    use.end_step(0, [Charge(g, "a")], holds([Charge(g, "a")]), Counter([g]))
    use.read(torch.tensor([5, 12]), 13)
    use.end_step(1, [], Counter(), Counter())  # covered by step 0's charge, in its partition

    def restored():
        tensors = {}
        meta = use.state(tensors, "records")
        out = RecordUse("s")
        out.load_state(meta, tensors, "records")
        return out

    again = restored()
    again.read(torch.tensor([12]), 13)
    with pytest.raises(RuntimeError, match=r"step 2 .* record 12 was read since the charge at step 0"):
        again.end_step(2, [], Counter(), Counter())
    again = restored()
    again.read(torch.tensor([5]), 13)
    with pytest.raises(RuntimeError, match="step 2 charges partition 'b', but record 5 was read in partition 'a'"):
        again.end_step(2, [Charge(g, "b")], holds([Charge(g, "b")]), Counter([g]))
    again = restored()
    again.read(torch.tensor([7]), 13)
    again.end_step(2, [Charge(g, "b")], holds([Charge(g, "b")]), Counter([g]))  # a record no partition held: fine
    again.read(torch.tensor([1]), 13)
    with pytest.raises(RuntimeError, match="charges the partitions a, b for one batch"):
        both = [Charge(g, "a"), Charge(g, "b")]
        again.end_step(3, both, holds(both), Counter([g]))


class ProcessRandom(shipped("sampler", "uniform")):
    """Draws its batch from the process's generator, not the run's (each rank its own batch). Such a
    batch is not secret, so it charges each step in full, unamplified (an amplified charge on it
    is refused: test_contract_units.py)."""

    name = "process_random"
    amplifies = False

    def indices(self, ctx):
        return torch.randperm(self.n)[:self.B]

    def account(self, step, events, ctx):
        return [Charge(e) for e in events]


def test_ranks_that_draw_different_batches_are_refused(tmp_path):
    """Each rank takes its share of one batch by position. A sampler drawing from the process's
    generator gave each rank its own batch: a record in two ranks' shares was summed twice, one in
    none never, and each rank's own check saw a proper batch. The ranks now compare each batch
    (rank 1 is refused here; on real ranks every rank stops at the same collective)."""
    from conftest import write_recipe
    from dpregistry.recipe import load
    from dpregistry.run import Run
    from test_core_review import two_ranks

    TwoRanks = two_ranks()
    recipe = load(write_recipe(tmp_path, dp_sgd(sampler={"name": "process_random", "batch_size": 16},
                                                privacy={"epsilon": 50.0, "delta": 1e-3})),
                  registry=with_stages(ProcessRandom))
    runs = []
    for rank in (0, 1):
        torch.manual_seed(rank)
        runs.append(Run(recipe, comm=TwoRanks(rank)).prepare())
        if rank == 0:
            runs[0].train()
    with pytest.raises(RuntimeError, match="the ranks drew different batches at step 0"):
        runs[1].train()
    assert runs[0].step == 4 and runs[1].step == 0

    torch.manual_seed(0)  # the same draws on both ranks: the same batches, nothing refused
    alike = [Run(recipe, comm=TwoRanks(rank)).prepare() for rank in (0, 1)]
    for run in alike:
        torch.manual_seed(1)
        run.train()
    assert [r.step for r in alike] == [4, 4]


class Tidies(shipped("sampler", "poisson")):
    """Edits the ledger it reads through its context: each entry's count set to 1 (a "tidy-up")."""

    name = "tidies"

    def account(self, step, events, ctx):
        for entry in ctx.ledger.entries:
            entry["count"] = 1
        return super().account(step, events, ctx)


def test_a_stage_cannot_write_the_ledger_it_reads(tmp_path):
    """``ctx.ledger`` handed stages the run's own ledger: a sampler that set each entry's count to 1
    ran 20 steps under the ε of one step. Its entries now come as copies."""
    over = {"privacy": {"epsilon": 100.0, "delta": 1e-3}, "train": {"steps": 20, "progress": False}}
    honest = make_run(dp_sgd(**over), tmp_path)
    honest.train()
    run = make_run(dp_sgd(sampler={"name": "tidies", "batch_size": 16}, **over), tmp_path, registry=with_stages(Tidies))
    run.train()
    assert run.accountant.ledger.n_charges == 20
    assert run.epsilon() == honest.epsilon()


def test_the_privacy_noise_stream_is_the_runs_own():
    """``ctx.rng.secret`` is open to every stage; the purpose "noise" returned exactly the
    releases' noise (a stage drawing it for a projection would correlate with the noise)."""
    from dpregistry.context import Context

    ctx = Context.detached({}, noise="secure")
    with pytest.raises(ValueError, match="'noise' is the privacy noise's own"):
        ctx.rng.secret("noise", 0, 0)
    mine, noise = ctx.rng.secret("my_stage", 0, 0).randn((64,)), ctx.noise().randn((64,))
    assert not torch.equal(mine, noise)


@pytest.mark.parametrize("relation, says, never", [("replace_one", "replacing one training example", "adding"),
                                                   ("add_remove", "adding or removing one training example",
                                                    "replacing")])
def test_the_unit_statement_names_the_relation_that_was_accounted(relation, says, never, tmp_path):
    """Every run said its guarantee holds for "adding, removing or replacing" one example: an
    add/remove ε covers a replacement only at about twice the ε (3.69 against 2 in the review's
    run), and the uniform and shuffle samplers' replace-one analyses do not cover add/remove."""
    from dpregistry.users import unit_statement

    run = make_run(dp_sgd(privacy={"epsilon": 8.0, "delta": 1e-3, "relation": relation}), tmp_path)
    summary = run.train()
    stated = unit_statement(summary)
    assert says in stated and never not in stated and "the guarantee holds" in stated
    # reproducible noise: the ε is no guarantee, and the unit line does not say one holds (review 15)
    assert "the guarantee would hold, were every release private with secret noise," in unit_statement(
        {**summary, "guarantee": False})
    user = unit_statement({**summary, "unit": "user", "users": 10, "max_examples_per_user": 2})
    assert ("adding or removing all the data" if relation == "add_remove" else "replacing all the data") in user
    # ELS: a user's number of kept examples is public, so a replacement keeps it (review 22)
    els = unit_statement({**summary, "unit": "user", "users": 10, "max_examples_per_user": 2, "user_mechanism": "els"})
    assert ("by as many kept examples of another" in els) == (relation == "replace_one")


def test_a_run_without_a_budget_whose_epsilon_cannot_be_computed_is_refused_before_its_folder(tmp_path):
    """With δ alone (no ε budget), pld's size bound refused the plan in ``dpreg validate`` but ``dpreg
    run`` made the folder, trained 9 steps and stopped at the first logged ε (exit 2): bad input
    writes nothing."""
    from dpregistry.errors import UserError

    recipe = dp_sgd(privatizer={"clip": 1.0, "noise_multiplier": 0.15}, accountant="pld",
                    privacy={"delta": 1e-3}, train={"steps": 30, "progress": False})
    out = tmp_path / "out"
    with pytest.raises(UserError, match="privacy-loss array of"):
        make_run(recipe, tmp_path, out=out)
    assert not out.exists()


class HonestGaussian(shipped("privatizer", "gaussian")):
    """The shipped Gaussian under another name, from another package."""

    name = "honest_gaussian"


def test_the_epsilon_names_the_third_party_stages_it_rests_on(tmp_path):
    """What the run cannot check (noise calibrated to another clip than the one applied: the
    review's 2.998 printed against 55.9) rests on the stage's author; the summary, the printed
    table and the privacy report say which stages those are, and a run of shipped stages names none."""
    from dpregistry.report import write_report

    assert make_run(dp_sgd(), tmp_path).train()["third_party_stages"] == []
    out = tmp_path / "out"
    run = make_run(dp_sgd(privatizer={"name": "honest_gaussian", "clip": 1.0, "noise_multiplier": 1.0}), tmp_path,
                   out=out, registry=with_stages(HonestGaussian))
    summary = run.train()
    assert summary["third_party_stages"] == ["privatizer honest_gaussian (third-party 0 (tp))"]
    write_report(out)
    report = (out / "report" / "report.md").read_text()
    assert "| third-party stages | privatizer honest_gaussian (third-party 0 (tp)): the ε holds only if" in report


def test_a_run_with_a_non_private_release_is_no_guarantee(tmp_path):
    """Review 16: a run of the `none` privatizer (its ledger charges every step as non-private, ε is
    infinite) said "the guarantee holds", and its summary said guarantee: true."""
    from dpregistry.users import unit_statement

    summary = make_run(dp_sgd(privatizer={"name": "none"}, privacy={"delta": 1e-3}), tmp_path).train()
    assert summary["guarantee"] is False and summary["noise"] == "secure"
    assert "the guarantee would hold, were every release private with secret noise" in unit_statement(summary)


def test_a_non_private_release_is_named_under_the_plot_and_beside_the_progress_bars_epsilon(tmp_path, monkeypatch):
    """The privacy report's plot title and the progress bar's ε decided "no guarantee" from the noise
    mode alone, so a secret-noise run of the `none` privatizer drew and printed ε = inf unqualified."""
    from rich.console import Console

    from dpregistry import report
    from dpregistry.api import _train

    titles = []
    monkeypatch.setattr(report, "_save", lambda fig, path: titles.append(fig._suptitle.get_text()))
    out = tmp_path / "out"
    run = make_run(dp_sgd(privatizer={"name": "none"}, privacy={"delta": 1e-3},
                          train={"steps": 4, "progress": True}), tmp_path, out=out)
    console = Console(record=True, width=200)
    _train(run, verbose=True, console=console)
    assert "(no guarantee: a non-private release)" in console.export_text()
    report.privacy_report(out)
    assert report.NO_GUARANTEE in titles[-1]
    make_run(dp_sgd(), tmp_path, out=tmp_path / "private").train()
    report.privacy_report(tmp_path / "private")
    assert report.NO_GUARANTEE not in titles[-1]



@pytest.mark.parametrize("recipe, sets", [
    *((name, ()) for name in ("ztc_l1", "klt_sp_zo_ring", "klt_mp_zo_erm_ring", "kl_adaptive_gd_diabetes",
                              "kl_adaptive_gd_zo", "kl_spider_pl", "quadratic_dpgd0th", "quickstart")),
    ("kl_adaptive_gd_diabetes", ("objective={name: quadratic, dim: 3, n: 300}",  # per-record gradients by vmap
                                 "privatizer={name: scheduled_gaussian, clip: 1.0}"))])
def test_the_shipped_estimators_name_the_record_of_every_row(recipe, sets, tmp_path, monkeypatch):
    """The run checks which records a contribution covers where its rows name them; the KL,
    nonsmooth and DPGD-0th estimators named none, so a record swapped for another passed by count.
    A grouped KL row stands for several identical records and is checked by their number."""
    from conftest import RECIPES
    from dpregistry import run as run_module
    from dpreg_kl.estimators import GroupedDenseContribution

    seen = []
    add = run_module._Rows.add
    monkeypatch.setattr(run_module._Rows, "add", lambda rows, c: (seen.append(c), add(rows, c))[1])
    make_run(RECIPES / f"{recipe}.yaml", tmp_path, sets=["train.steps=2", *sets]).train()
    assert seen and all(c.indices is not None or isinstance(c, GroupedDenseContribution) for c in seen)
