"""Building and checking a run: its stages, their context, and the plan against the budget.

A :class:`Run` is made from a validated recipe. ``prepare()`` sets the objective up, binds the
other stages to its parameters through a :class:`~dpregistry.context.Context`, checks that every
stage's declared needs have a provider, calibrates the noise and refuses a plan that exceeds the
budget, before anything is written. The run then serves the algorithm's step (a context per step,
privatizing a batch across micro-batches and ranks, charging the accountant) and is what a
checkpoint saves. :mod:`dpregistry.loop` takes the steps and :mod:`dpregistry.folder` writes
them down.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any, Callable

import torch

from . import __version__, heap
from . import checkpoint as ckpt
from .context import Context, Randomness, _StepServices
from .distributed import LocalComm
from .errors import BudgetExhausted, UserError
from .persample import StateWatch, probe_indices
from .privacy.accountant import Budget, LedgerView
from .privacy.events import EventError, PrivacyEvent, any_nonprivate, held, nodes
from .recipe import SECTIONS, Recipe, stopped_at_private_count
from .record_use import AMPLIFIED, RecordUse
from .rng import RunRNG
from .spaces import Contribution
from .stages import Charge, ClippedSum, Objective, Release, Stages
from .users import UserGroups, UserIds, bound_contributions, example_budget, group_epsilon

#: stage kind -> its recipe section
SECTION_OF = {kind: section for section, kind in SECTIONS.items()} | {"algorithm": "algorithm"}


class Run:
    """One training run: its stages, parameters, randomness and privacy ledger."""

    def __init__(self, recipe: Recipe, *, comm=None, provides: dict[type, Any] | None = None):
        """``provides``: typed values for stages that ``need`` them (``dpregistry.train``'s own
        model, loss and data, for the ``python`` objective)."""
        self.recipe = recipe
        self.comm = comm or LocalComm()
        self.comm.micro_batch = recipe.train.micro_batch_size
        p = recipe.privacy
        self.relation = p.relation
        self.unit = p.unit
        self.target = Budget(p.epsilon, p.delta, p.rho, p.relation)  # what the recipe asked, in its unit
        try:
            self.rng = RunRNG(recipe.seed, p.noise, run=recipe.hash)
        except UserError as e:
            raise recipe.error(e.message, "privacy", "noise") from None
        try:
            self._device = torch.device(recipe.train.device)
        except RuntimeError as e:
            raise recipe.error(f"not a torch device ({str(e).splitlines()[0]})", "train", "device") from None
        self._device_checked = False
        self.folder = None                      # the run folder (dpregistry.folder), if any
        self.step = 0
        self.stop_reason: str | None = None
        self.stop_signal: int | None = None     # the signal that stopped the run (the CLI exits 128 + it)
        self.nonfinite_steps = 0
        self.iterate_snapshot: dict[str, torch.Tensor] | None = None
        self.log_window: list[dict[str, Any]] = []  # step metrics since the last logged row
        self.history: list[dict[str, Any]] = []     # logged rows
        self.bytes_logged = 0                       # payload bytes sent by the last logged row
        self._sampled_charge_step: int | None = None  # see charge()
        self._read_batch_step: int | None = None       # see check_charged()
        self._checked_batch: torch.Tensor | None = None  # see privatize_batch()
        self._batch_digest = ""                           # (compared across ranks)
        self._ever: tuple[int, set] | None = None        # see _ever_charged()

        def make(kind):
            entry, params = recipe.stages[kind]
            return entry.cls(params)

        self.algorithm = make("algorithm")
        self.objective = make("objective")
        self.sampler = make("sampler")
        self.estimator = make("estimator")
        self.privatizer = make("privatizer")
        self.update_rule = make("update_rule")
        self.accountant = make("accountant")
        self.algorithm.stages = Stages(self.objective, self.sampler, self.estimator, self.privatizer,
                                       self.update_rule, self.accountant)
        # What each step releases, against what it charges (check_charged): the algorithm calls the
        # privatizer's release itself, so the run listens on it.
        self._released: Counter = Counter()
        self._charged: Counter = Counter()
        self._step_charges: list[Charge] = []  # what the sampler made of them
        self._step_held: Counter = Counter()   # each event those charges hold, counted (events.held)
        self.records = RecordUse(self.sampler.name)  # parallel composition, checked against the batches
        release = self.privatizer.release

        def recorded(total: ClippedSum, *args, **kwargs) -> Release:
            out = release(total, *args, **kwargs)
            self._released.update(out.events)
            total.units = None  # released: what is added to it now is post-processing
            return out

        self.privatizer.release = recorded
        # Whether the step's batch was drawn from the secret stream: a batch amplified by sampling
        # must be (anyone with the recipe regenerates one drawn from ctx.rng.generator)
        self._secret_batch: bool | None = None
        self._state_watch: StateWatch | None = None  # the model's state, fixed from setup on
        indices = self.sampler.indices

        def drawn(ctx) -> torch.Tensor:
            before = self.rng.stage_secrets
            out = indices(ctx)
            self._secret_batch = self.rng.stage_secrets > before
            return out

        self.sampler.indices = drawn
        # User-level runs (dpregistry.users): user-level sampling (ULS) reads the users a sampler
        # draws; any other sampler draws examples among the kept ones (ELS), and group privacy of
        # size k turns the accountant's example-level budget into the user-level one.
        self.users: UserGroups | None = None    # the public selection of at most k records per user
        self.els = self.unit == "user" and self.sampler.samples == "examples"  # else ULS (when user-level)
        self.group = 1                          # ELS: k (the accountant's budget is example-level)
        if self.unit == "user":
            if self.comm.world_size > 1:
                raise recipe.error("privacy.unit: user runs on one process for now", "privacy", "unit")
            if self.els:
                self.group = p.max_examples_per_user
                if self.group > 1 and self.target.epsilon is None and self.target.rho is None:  # (example_budget)
                    raise recipe.error(
                        f"privacy.unit: user with an example-level sampler reads the example-level ledger through "
                        f"group privacy of size {self.group}, which needs a user-level target, privacy.epsilon (or "
                        f"privacy.rho): without one the example-level ε is unbounded and the group conversion gives "
                        f"no useful ε. Set it, or sample users (sampler: user_poisson) for a fixed noise "
                        f"multiplier", "privacy", "epsilon")
            elif not self.estimator.user_level:
                raise recipe.error(f"estimator {self.estimator.name!r} cannot clip a user's examples as one, so "
                                   f"user-level sampling does not apply; use an example-level sampler (contribution "
                                   f"bounding and group privacy) or per_example_grad, zo_two_point, "
                                   f"projected_per_example_grad", "estimator")
            elif not self.privatizer.user_level:
                raise recipe.error(f"privatizer {self.privatizer.name!r} does not say that it clips a user's examples "
                                   f"as one (Privatizer.user_level), so user-level sampling does not apply: clipping "
                                   f"each row lets a user of k examples move the sum by k·C. Use privatizer gaussian, "
                                   f"or an example-level sampler (contribution bounding and group privacy)",
                                   "privatizer")
        elif self.sampler.samples == "users":
            raise recipe.error(f"sampler {self.sampler.name!r} samples users: set privacy.unit: user and "
                               f"privacy.max_examples_per_user", "sampler", "name")
        self.budget = example_budget(self.target, self.group)  # what the accountant enforces
        self._given: dict[type, Any] = {Budget: self.budget, **(provides or {})}
        if self.unit == "user":
            self._given[UserGroups] = None  # set once the objective has said who each record's user is
        self.params: dict[str, torch.Tensor] = {}
        self._ctx = self.context()

    # ------------------------------------------------------------------ stages and context

    @property
    def stages(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "objective": self.objective, "sampler": self.sampler,
                "estimator": self.estimator, "privatizer": self.privatizer,
                "update_rule": self.update_rule, "accountant": self.accountant}

    @property
    def n_train(self) -> int:
        """The records a sampler draws from: the kept ones of a user-level run."""
        return self.objective.n_train if self.users is None else len(self.users.members)

    @property
    def n_units(self) -> int:
        """The records the guarantee counts: examples, or users."""
        return self.n_train if self.users is None else self.users.n_users

    @property
    def device(self) -> torch.device:
        """The run's device, checked on first use: objectives resolve their model and data paths
        before they place anything, so a missing model is reported even on a machine without the
        device the recipe asks for."""
        if not self._device_checked:
            _check_device(self._device, self.recipe)
            self._device_checked = True
        return self._device

    @property
    def total_steps(self) -> int:
        return self.algorithm.total_steps(self.ctx)

    def context(self, step: int | None = None) -> Context:
        """A context at ``step`` (default: the run's step) with fresh step services."""
        step = self.step if step is None else step
        return Context(step=step, params=self.params, _device=lambda: self.device, relation=self.relation,
                       n_train=self.n_train, rng=Randomness(self.rng), comm=self.comm,
                       micro_batch_size=self.recipe.train.micro_batch_size, max_steps=self.recipe.train.steps,
                       ledger=LedgerView(self.accountant.ledger), adaptive=self.algorithm.adaptive,
                       _batch_size=lambda c: self.sampler.expected_batch_size(c),
                       _units=(lambda idx: self._user_of[idx]) if self.users is not None and not self.els else None,
                       _services=_StepServices(lambda call: self.rng.noise(step, call)), _provider=self._provide)

    @property
    def ctx(self) -> Context:
        """The context of the step in progress (``self.step``)."""
        if self._ctx.step != self.step or self._ctx.params is not self.params:
            self._ctx = self.context()
        return self._ctx

    def begin_step(self) -> Context:
        """The context of the step about to be taken (its noise calls and displacement start afresh)."""
        self._ctx = self.context()
        self._released, self._charged, self._step_charges, self._step_held = Counter(), Counter(), [], Counter()
        self._secret_batch = None
        return self._ctx

    def _providers(self) -> dict[type, Any]:
        out: dict[type, Any] = {Objective: self, **{t: self for t in self._given}}
        for kind, stage in self.stages.items():
            for t in type(stage).provides:
                if t in out:
                    other = out[t].name if out[t] is not self else "the run"
                    raise UserError(f"{t.__name__} is provided by both {other!r} and {kind} {stage.name!r}",
                                    key=SECTION_OF[kind])
                out[t] = stage
        return out

    def _provide(self, kind: type) -> Any:
        provider = self._provider_map.get(kind)
        if provider is None:
            raise RuntimeError(f"no stage provides {kind.__name__}")
        if provider is self:
            return self.objective if kind is Objective else self._given[kind]
        return provider.provide(kind)

    def _check_needs(self) -> None:
        """Every type a stage declares in ``needs`` has a provider (checked before any setup)."""
        self._provider_map = self._providers()
        for kind, stage in self.stages.items():
            for t in stage.needs:
                if t not in self._provider_map:
                    raise UserError(f"{kind} {stage.name!r} needs {t.__name__}, which no stage of this recipe "
                                    f"provides{_providers_of(t)}", key=SECTION_OF[kind])

    # ------------------------------------------------------------------ preparing

    def prepare(self) -> "Run":
        """Load data and model, bind stages, calibrate noise and check the plan against the budget.

        A UserError that a stage raises without a file is located in the recipe (file, line, key)."""
        self._section: str | None = None
        self._check_ranks_share_the_noise_key()
        try:
            self._check_needs()
            self._prepare_stages()
            if self.device.type == "cpu":  # the device is checked here even if no tensor was placed
                heap.keep_freed_memory()  # each step reuses what the last one freed (heap.py)
        except UserError as e:
            raise self.recipe.locate(e, self._section)
        except (MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            # a model or data set sized by the recipe that does not fit: bad input, not a bug
            raise self.recipe.locate(UserError(f"out of memory while building the run "
                                               f"({str(e).splitlines()[0][:200]})"), self._section) from None
        except OSError as e:  # preparing only reads: a data or model path the recipe names (too long, ...)
            name = f" {e.filename}" if e.filename else ""
            raise self.recipe.locate(UserError(f"cannot read{name} ({e.strerror or e})"), self._section) from None
        except (ArithmeticError, ValueError) as e:
            if not isinstance(e, (ArithmeticError, EventError)) and str(e) != "math domain error":
                raise
            # a stage's theory constants from absurd recipe numbers (stat_tol: 1e300 overflowed β³)
            raise self.recipe.locate(UserError(f"a number of the recipe is out of range: computing with it failed "
                                               f"({type(e).__name__}: {e})"), self._section) from None
        return self

    def _check_ranks_share_the_noise_key(self) -> None:
        """Ranks resolve one recipe (checked first) and share the noise key: a rank with another key
        would add other noise and cut its shard from another batch (a record summed twice). A secure
        run's key is drawn by rank 0 and sent to the others once, here; keyed runs derive it from
        DPREG_NOISE_KEY on every rank, which must agree."""
        if self.comm.world_size == 1:
            return
        # Each rank loads the recipe itself (on several nodes, from its own copy): a rank with another
        # clip would add an unaccounted-for sum to the all-reduce, and the ranks would not even drift.
        mine = (self.recipe.hash, self.rng.noise_mode, self.rng.noise_fingerprint)
        first = self.comm.broadcast_object(mine + (self.recipe.data,))
        if self.comm.any_flag(first[0] != mine[0]):
            key = _first_difference(first[3], self.recipe.data)
            where = {"file": self.recipe.source, **(self.recipe.where(*key.split(".")) if key else {})}
            what = f"{key} differs from rank 0's" if key else "another recipe" if first[0] != mine[0] else "as rank 0"
            raise UserError(f"the ranks resolved different recipes (rank {self.comm.rank}: {what}); give every "
                            f"rank the same recipe file and --set options", **where)
        first = first[:3]
        differs = first != mine
        if self.comm.any_flag(differs):
            raise UserError(f"the ranks do not share one DPREG_NOISE_KEY (rank {self.comm.rank}: "
                            f"{'a different key' if differs else 'as rank 0'}); give every rank the same key")
        if self.rng.noise_mode == "secure":
            self.rng = RunRNG(self.recipe.seed, "secure", key=self.comm.broadcast_object(self.rng.key))

    def _check_ranks_share_the_data(self) -> None:
        """Every rank loads the whole training set: the ranks draw one batch and each computes its
        share of it by index, so a rank with its own shard (the usual habit of data-parallel
        training) would sum other records at a sampling rate the ledger never saw."""
        if (found := self._unlike_rank_0(self.data_record)) is not None:
            first, differs = found
            mine = f"rank {self.comm.rank}: {_describe_data(self.data_record)}; " if differs else ""
            raise UserError(f"the ranks hold different training data ({mine}rank 0: {_describe_data(first)}"
                            f"{'' if differs else '; another rank differs'}); give every rank the whole training "
                            f"set, in the same order: the run samples and shares out each batch", key="data")

    def _unlike_rank_0(self, mine: Any) -> tuple[Any, bool] | None:
        """None when every rank holds what rank 0 holds; else (rank 0's, whether this rank differs).
        Every rank must call it (a broadcast and an all-reduce)."""
        if self.comm.world_size == 1:
            return None
        first = self.comm.broadcast_object(mine)
        differs = first != mine
        return (first, differs) if self.comm.any_flag(differs) else None

    def _prepare_stages(self) -> None:
        self._section = "objective"
        self.objective.setup(self.context())
        model = getattr(self.objective, "model", None)
        watch = StateWatch(model) if isinstance(model, torch.nn.Module) else None
        self._section = None
        if self.objective.n_train <= 0:
            raise UserError("the training data set is empty", file=self.recipe.source, key="data")
        self.data_record = {"n_train": self.objective.n_train, "digest": self.objective.fingerprint()}
        self._check_ranks_share_the_data()
        if self.unit == "user":
            self._bind_users()
        elif self._names_users():
            raise self.recipe.error("the data names each example's user (data.user, data.rows_per_user), but "
                                    "privacy.unit is example: the guarantee would protect one example, not one user; "
                                    "set privacy: {unit: user, max_examples_per_user: k}, or leave the users out",
                                    "privacy", "unit")
        n, d = self.n_units, self.target.delta
        if d is not None and d >= 1.0 / n:
            unit = "user" if self.unit == "user" else "record"
            raise self.recipe.error(f"δ = {d:g} is not below 1/n = {1.0 / n:.3g}; such a δ allows publishing a "
                                    f"{unit}", "privacy", "delta")
        self.params = self.objective.params()
        if not self.params:
            raise UserError("the model has no trainable parameters", file=self.recipe.source, key="objective")
        self._ctx = self.context()
        for kind, stage in self.stages.items():
            if stage is not self.objective:
                self._section = SECTION_OF[kind]
                stage.setup(self.ctx)
        for kind, stage in self.stages.items():
            self._section = SECTION_OF[kind]
            stage.validate(self.ctx)
        self._section = None
        if watch is not None:
            probe = probe_indices(self.objective.n_train, self.recipe.train.micro_batch_size)
            watch.check(lambda: self.objective.losses(probe), self.device)
            watch.keep_watching(self.params)
        self._state_watch = watch
        if self.budget.rho is not None and not self.accountant.budgets_rho:
            raise self.recipe.error(f"privacy.rho is a zCDP budget, which the {self.accountant.name} accountant "
                                    f"cannot enforce; use accountant zcdp, or give the budget as privacy.epsilon "
                                    f"and privacy.delta", "privacy", "rho")
        self._calibrate_and_check()

    def _names_users(self) -> bool:
        """Whether the objective was told each record's user (read only by a user-level run)."""
        if UserIds not in type(self.objective).provides:
            return False
        try:
            self.objective.provide(UserIds)
        except UserError:
            return False
        return True

    def _bind_users(self) -> None:
        """The public selection of at most k records per user (from the objective's user ids)."""
        if UserIds not in type(self.objective).provides:
            raise self.recipe.error(f"user needs the user of each record, and objective {self.objective.name!r} "
                                    f"has none (data files and hub data sets name them with data.user or "
                                    f"data.rows_per_user; your own data with dpregistry.train(..., users=...))",
                                    "privacy", "unit")
        self._section = "objective"  # the objective's refusal names its own keys (data.user)
        ids = self.objective.provide(UserIds).ids
        self._section = None
        # who holds each record is part of the data a resume must train on again
        self.data_record["users"] = hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]
        self.users = bound_contributions(ids, self.recipe.privacy.max_examples_per_user,
                                         self.rng.step_seed("user_contributions", 0))
        self._given[UserGroups] = self.users
        if not self.els:
            self.records.unit = "user"
        self._user_of = torch.full((self.objective.n_train,), -1, dtype=torch.int64)  # -1: not kept
        self._user_of[self.users.members] = torch.repeat_interleave(
            torch.arange(self.users.n_users), self.users.offsets.diff())

    def _calibrate_and_check(self) -> None:
        if self.privatizer.calibrates:
            if not (self.budget.epsilon and self.budget.delta) and self.budget.rho is None:
                raise self.recipe.error("noise_multiplier: auto needs a privacy budget (privacy.epsilon and "
                                        "privacy.delta, or rho)", "privatizer", "noise_multiplier")
            ctx = self.context()
            try:
                z = self.accountant.calibrate(lambda z: self.algorithm.plan(ctx, z))
            except UserError as e:  # no noise meets the budget: the budget is the key to change
                if e.file is not None or e.key is not None:
                    raise
                raise self.recipe.error(e.message + self._per_example(), "privacy",
                                        "rho" if self.budget.rho is not None else "epsilon") from None
            self.privatizer.set_noise_multiplier(z)
        self.check_plan()

    def plan(self) -> list[Charge]:
        """The charges of the rest of the run at the privatizer's noise multiplier."""
        z = self.privatizer.noise_multiplier
        return self.algorithm.plan(self.context(), z) if z is not None or not self.algorithm.adaptive else []

    def check_plan(self) -> None:
        """Refuse a run whose planned charges (on top of the ledger) exceed the budget."""
        if self.algorithm.adaptive and not self.budget.is_set:
            # A filter's guarantee holds for a budget fixed in advance; the sum of adaptively chosen
            # costs is none (Rogers et al. 2016), so without one the filter would admit every charge.
            raise self.recipe.error(f"algorithm {self.algorithm.name!r} chooses its noise adaptively: its privacy "
                                    f"filter needs a budget set in advance (privacy.rho, or privacy.epsilon and "
                                    f"privacy.delta)", "privacy")
        plan = self.plan()
        self.accountant.check_events(c.event for c in plan)
        if plan and not self.budget.is_set:
            # what the first logged ε would refuse (pld's size bound) is refused before the folder is made
            self.epsilon(extra=plan)
        if self.budget.is_set and plan:
            try:
                self.accountant.approve(plan)
            except BudgetExhausted:
                spent = "the ledger so far and the rest of the plan" if self.accountant.ledger.entries else "the planned run"
                raise self.recipe.error(f"{spent} spends {self.accountant.overspend(plan)}{self._per_example()}; raise "
                                        f"the noise, lower the steps or the sampling rate, or set "
                                        f"privatizer.noise_multiplier: auto", "privacy") from None

    def _per_example(self) -> str:
        """What an ELS refusal's numbers are: the example-level budget the user-level one became."""
        if self.group == 1:
            return ""

        def said(b: Budget) -> str:
            return ", ".join(f"{name} = {v:g}" for name, v in zip("εδρ", (b.epsilon, b.delta, b.rho)) if v is not None)

        return (f" (per example: group privacy of size {self.group} turns the user-level budget "
                f"{said(self.target)} into {said(self.budget)} for each example)")

    # ------------------------------------------------------------------ step services

    def charge(self, events) -> list[Charge]:
        """Charge the accountant for this step's releases (it may refuse: BudgetExhausted)."""
        events = list(events)
        if not all(isinstance(e, PrivacyEvent) for e in events):
            raise TypeError(f"algorithm {self.algorithm.name!r} (privatizer {self.privatizer.name!r}) charged "
                            f"{events!r}: a release's events are dpregistry.privacy.events.PrivacyEvents")
        charges = self.sampler.account(self.step, events, self.ctx)
        if not all(isinstance(c, Charge) for c in charges):
            raise TypeError(f"sampler {self.sampler.name!r}: account() returns Charges, got {charges!r}")
        # A second release from the same secret batch, amplified on its own, would under-count: the
        # releases of one batch are one sampled mechanism (Release.events holds them all), wrapped
        # once. Decided by the charges themselves, not only by the sampler's word (``amplifies``).
        holds = sum((held(c.event, c.count) for c in charges), Counter())
        amplified = sum(n for e, n in holds.items() if isinstance(e, AMPLIFIED))
        if amplified > 1:
            raise RuntimeError(f"sampler {self.sampler.name!r}: step {self.step}'s charges amplify one batch {amplified} "
                               f"times, each as if its batch were drawn alone; the releases of one sampled batch are "
                               f"one sampled mechanism: wrap their composition once")
        if amplified and not self._secret_batch:
            how = "its indices() drew nothing from" if self._secret_batch is False else "no batch was drawn from"
            raise RuntimeError(f"sampler {self.sampler.name!r}: step {self.step}'s charges are amplified by sampling, "
                               f"but {how} ctx.rng.secret: amplification assumes each batch is a fresh secret draw "
                               f"(one from ctx.rng.generator is public: anyone with the recipe regenerates it). Draw "
                               f"each sampled batch from ctx.rng.secret when indices() is called")
        if self.sampler.amplifies or amplified:
            if self._sampled_charge_step == self.step:
                raise RuntimeError(f"algorithm {self.algorithm.name!r} charged step {self.step} twice on a "
                                   f"{self.sampler.name!r} batch; charge every release of a sampled batch in one "
                                   f"Run.charge call")
            self._sampled_charge_step = self.step
        self.accountant.charge(charges, self.step)
        self._charged.update(events)
        self._step_charges += charges
        self._step_held += holds
        return charges

    def check_charged(self, ctx: Context) -> None:
        """After each step: one that read its batch or drew noise released something about the
        data, and must have charged events for it (an empty ``Release.events``, or an algorithm
        that never calls ``charge``, would leave ε at 0), among them every event its releases
        stated (a noisy norm released and left uncharged beside a charged gradient). The sampler
        may still charge nothing for them (a shuffled epoch's later steps, covered by parallel
        composition at its first), but not before anything was charged, and the events it charges
        wrap the released ones: a released event no charge ever held was never paid for."""
        who = f"algorithm {self.algorithm.name!r} (privatizer {self.privatizer.name!r})"
        if uncharged := self._released - self._charged:
            raise RuntimeError(f"{who} released {', '.join(e.describe() for e in uncharged.elements())} at step "
                               f"{self.step} without charging it: charge every release's events")
        read = self._read_batch_step == self.step
        released = read or ctx._services.calls > 0
        if released and not self._charged and not self.privatizer.prepaid(ctx):
            raise RuntimeError(f"{who} {'privatized a batch' if read else 'drew noise'} at step {self.step} but "
                               f"charged nothing: every release pays with privacy events (NonPrivate for a "
                               f"non-private one)")
        if (released or self._charged) and not self.accountant.ledger.entries:
            # parallel composition (or a prepaid period) lets a step charge nothing when an earlier
            # step of its epoch or period charged it, never when nothing was charged yet
            raise RuntimeError(f"{who}, sampler {self.sampler.name!r}: step {self.step} released, and the ledger "
                               f"holds no charge (account() returned none, or the step was said to be prepaid)")
        if unmatched := [e for e in self._charged if e not in self._ever_charged()]:
            raise RuntimeError(f"sampler {self.sampler.name!r}: the charges of step {self.step} do not hold "
                               f"{', '.join(e.describe() for e in unmatched)}, which it released, and no earlier "
                               f"charge does: a sampler wraps the released events (sampling, partitions), never "
                               f"replaces them")
        self.records.end_step(self.step, self._step_charges, self._step_held, self._charged)

    def _ever_charged(self) -> set[PrivacyEvent]:
        """Every event the ledger holds, wrappers and what they wrap (cached by the ledger's number
        of entries: an entry holds one event, and a step charging it again only adds to its count)."""
        ledger = self.accountant.ledger
        if self._ever is None or self._ever[0] != len(ledger.entries):
            self._ever = (len(ledger.entries), {n for e in ledger.events for n in nodes(e)})
        return self._ever[1]

    def privatize_batch(self, indices: torch.Tensor) -> ClippedSum:
        """Clip-and-sum every contribution of this rank's shard, and combine across ranks.

        Contributions small enough to send (per-example scalars) are gathered first, so every rank
        clips the whole batch in the single-process order; others all-reduce their clipped sums."""
        total: ClippedSum | None = None
        gathered = False
        self._read_batch_step = self.step
        drawn_from = len(self.users.members) if self.els else self.objective.n_train  # ELS: the kept ones
        # a batch passed again unchanged (a KL algorithm's full batch, 10⁷ records) is checked once;
        # "unchanged" by its values (a write through .data or a NumPy view keeps the version counter)
        checked = self._checked_batch
        changed = checked is None or checked.shape != indices.shape or not torch.equal(checked, indices)
        if self.comm.world_size > 1:
            # each rank takes its share of one batch: a sampler drawing from the process's own
            # generator gives each rank another batch, and records are summed twice or never
            # (compared before anything a rank could refuse alone, which would leave the others waiting)
            if changed:
                self._batch_digest = hashlib.sha256(repr(tuple(indices.shape)).encode()
                                                    + indices.cpu().numpy().tobytes()).hexdigest()
            if self._unlike_rank_0(self._batch_digest) is not None:
                raise RuntimeError(f"sampler {self.sampler.name!r}: the ranks drew different batches at step "
                                   f"{self.step}; a batch is drawn once for all ranks, from the run's generators "
                                   f"(ctx.rng), not the process's")
        if indices.dim() != 1:
            raise RuntimeError(f"sampler {self.sampler.name!r}: a batch is a 1-D tensor of record indices, got "
                               f"shape {tuple(indices.shape)}")
        if changed:
            if len(indices) and not _each_once(indices, drawn_from):
                raise RuntimeError(f"sampler {self.sampler.name!r}: a batch holds a record twice or one outside "
                                   f"the {drawn_from} records; each record is in a batch at most once")
            self._checked_batch = indices.clone()
        uls = self.users is not None and not self.els
        if uls:  # parallel composition counts users, not records
            users, user = torch.unique(self._user_of[indices], return_inverse=True)
            if len(users) and int(users[0]) < 0:
                raise RuntimeError(f"sampler {self.sampler.name!r}: a user-level batch holds records outside the "
                                   f"public selection of at most {self.users.k} per user")
            self.records.read(users, self.users.n_users)
        else:
            self.records.read(self._checked_batch, drawn_from)
        if self.els:  # the sampler drew among the kept records
            indices = self.users.members[indices]
        elif uls:
            indices = _users_side_by_side(indices, user)
        shard = self.comm.shard(indices)
        # the rows are checked against a copy the estimator cannot write into (one process without
        # ELS is given the checked batch itself: no clone of a KL full batch of 10⁷ records)
        reference = shard.clone() if self.els or self.comm.world_size > 1 else self._checked_batch
        rows = _Rows(self.estimator.name, reference)
        clipped_users = torch.zeros(self.users.n_users if uls else 0, dtype=torch.bool)
        for contrib in self.estimator.contributions(self.objective, shard, self.ctx):
            rows.add(contrib)
            if uls:  # each user's examples are one unit
                if contrib.indices is None:
                    raise UserError(f"estimator {self.estimator.name!r} does not say which records its contributions "
                                    f"come from, so it cannot clip users as one (privacy.unit: user)", key="estimator")
                contrib.groups = self._user_of[contrib.indices]
                if bool((contrib.groups < 0).any()):
                    raise RuntimeError(f"estimator {self.estimator.name!r}: a contribution names records outside the "
                                       f"public selection of at most {self.users.k} per user")
                n_users = _each_user_together(contrib.groups, clipped_users, self.estimator.name)
            full = contrib.gather(self.comm) if self.comm.world_size > 1 else None
            gathered = full is not None
            part = self.privatizer.clip_sum(full if gathered else contrib)
            if uls and part.count != n_users:
                raise RuntimeError(f"privatizer {self.privatizer.name!r}: a user-level contribution of {n_users} users "
                                   f"came back as {part.count} clipped units; clip each user's rows as one "
                                   f"(dpregistry.clipping.clip_and_sum does)")
            total = part if total is None else total.add_(part)
            del contrib, full  # free activations before the next micro-batch
        if total is None:
            raise RuntimeError(f"estimator {self.estimator.name!r} yielded no contribution")
        rows.check()
        total = total if gathered else self.comm.all_reduce(total)
        total.units = users if uls else self._checked_batch.reshape(-1)  # (ClippedSum.add_)
        return total

    @staticmethod
    def step_metrics(total: ClippedSum, release: Release) -> dict[str, float]:
        m = {"batch_size": total.count,
             "loss": total.loss_sum / max(total.count - total.nonfinite, 1),
             "clipped_fraction": total.clipped / max(total.count, 1),
             "nonfinite": total.nonfinite}
        m.update(release.stats)
        return m

    def epsilon(self, extra: list[Charge] | tuple = ()) -> float | None:
        """ε spent (with ``extra`` charges), at the recipe's δ and in its unit (ELS: group privacy
        of the example-level accountant, :func:`dpregistry.users.group_epsilon`)."""
        if self.budget.delta is None:
            return None
        return group_epsilon(self.accountant, self.group, self.target.delta, self.budget.delta, extra)

    @property
    def guarantee(self) -> bool:
        """Whether the reported ε is a privacy guarantee: secret noise, no release charged as
        non-private (a ``none`` privatizer: ε is infinite), and no stop on a count of the private
        batch (the opt-in ``train.max_nonfinite_steps``)."""
        return (self.rng.guarantee and not any_nonprivate(self._ever_charged())
                and not self.stopped_at_private_count)

    @property
    def stopped_at_private_count(self) -> bool:
        return stopped_at_private_count(self.recipe.train.max_nonfinite_steps, self.nonfinite_steps)

    def planned_epsilon(self) -> float:
        """ε of the whole planned run (the ledger and the rest of the plan), in the recipe's unit."""
        return self.epsilon(extra=self.plan())

    def spent(self) -> dict[str, Any]:
        """What the ledger has spent, in the recipe's unit, with the budget it is held to."""
        s = dict(self.accountant.spent())
        if self.els:
            s["example_level"] = {"epsilon": s.get("epsilon"), "delta": s.get("delta"), "rho": s.get("rho")}
            if s.get("epsilon") is not None:
                s["epsilon"], s["delta"] = self.epsilon(), self.target.delta
            if s.get("rho") is not None:
                s["rho"] = s["rho"] * self.group ** 2
                s["target_rho"] = self.target.rho
            s["target_epsilon"] = self.target.epsilon
        if self.users is not None:
            s.update(unit="user", users=self.users.n_users, max_examples_per_user=self.users.k,
                     user_mechanism="els" if self.els else "uls", user_selection=self.users.digest())
        else:
            s["unit"] = "example"
        return s

    def output_params(self) -> dict[str, torch.Tensor]:
        """The parameters the run outputs: an update rule's choice, the random iterate, or the last."""
        out = self.update_rule.output(self.params, self.ctx)
        if out is not None:
            return out
        if self.iterate_snapshot is not None:
            return self.iterate_snapshot
        return self.params

    def check_state(self, values: bool = False) -> None:
        """Refuse a model whose forward wrote its buffers or untrained parameters during the steps
        (``StateWatch``; ``values``: by their values too, before the model leaves the run)."""
        if self._state_watch is not None:
            self._state_watch.unchanged(values)

    def train(self, progress: Callable | None = None) -> dict[str, Any]:
        """Take the remaining steps (:func:`dpregistry.loop.train`) and return the summary."""
        from .loop import train

        return train(self, progress)

    # ------------------------------------------------------------------ checkpoint content

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, metadata) of a checkpoint: parameters, stage states, the ledger, counters."""
        tensors: dict[str, torch.Tensor] = {f"params/{k}": v.detach().cpu() for k, v in self.params.items()}
        stage_state = {kind: ckpt.split_state(s.state_dict(), f"state/{kind}", tensors)
                       for kind, s in self.stages.items()}
        if self.iterate_snapshot is not None:
            for k, v in self.iterate_snapshot.items():
                tensors[f"iterate/{k}"] = v.cpu()
        meta = {"step": self.step, "recipe": self.recipe.data, "recipe_hash": self.recipe.hash,
                "version": __version__, "format": CHECKPOINT_FORMAT, "state": stage_state,
                "noise_multiplier": self.privatizer.noise_multiplier,
                "noise": {"mode": self.rng.noise_mode, "key_fingerprint": self.rng.noise_fingerprint},
                "nonfinite_steps": self.nonfinite_steps,
                "log_window": [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in self.log_window],
                "ledger": self.accountant.ledger.to_json(), "data": self.data_record,
                "records": self.records.state(tensors, "records")}
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if meta.get("format", 1) != CHECKPOINT_FORMAT:
            raise UserError(f"the checkpoint has format {meta.get('format', 1)}, this dpregistry reads format "
                            f"{CHECKPOINT_FORMAT}; resume it with the version that wrote it")
        if meta["recipe_hash"] != self.recipe.hash:
            raise UserError("the checkpoint was written by a different recipe; resuming would change the "
                            "results or the privacy guarantee", key="recipe")
        noise = meta.get("noise") or {}
        if noise.get("mode") != self.rng.noise_mode:
            raise UserError(f"the checkpoint's noise mode {noise.get('mode')!r} is not the recipe's "
                            f"{self.rng.noise_mode!r}; the checkpoint was not written by this run")
        if noise.get("key_fingerprint") != self.rng.noise_fingerprint:
            raise UserError("the run's privacy noise was keyed: set DPREG_NOISE_KEY to the same secret key to "
                            "resume it (a different key would change the noise of the remaining steps)")
        saved = meta.get("data")  # (older checkpoints hold none)
        if saved is not None and saved != self.data_record:
            raise UserError(f"the training data is not the data of the checkpoint's run (now "
                            f"{_describe_data(self.data_record)}; then {_describe_data(saved)}): the ledger charged "
                            f"its steps on that data, and a sampler that goes through the data in epochs or once "
                            f"would reuse records it counts as unused; resume with the same data", key="data")
        with torch.no_grad():
            for k, v in self.params.items():
                v.copy_(tensors[f"params/{k}"].to(v.device, v.dtype))
        state = ckpt.join_state(meta["state"], tensors)
        for kind, s in self.stages.items():
            s.load_state_dict(_to_device(state.get(kind, {}), self.device))
        self.step = int(meta["step"])
        self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        self.log_window[:] = meta.get("log_window", [])  # the next row averages the same steps
        if meta.get("noise_multiplier") is not None:
            self.privatizer.set_noise_multiplier(meta["noise_multiplier"])
        self.records.load_state(meta.get("records"), tensors, "records")
        it = {k[len("iterate/"):]: v for k, v in tensors.items() if k.startswith("iterate/")}
        self.iterate_snapshot = it or None
        self._ctx = self.context()
        self._check_ranks_resumed_alike()
        self.check_plan()  # the remaining plan must still fit on top of the restored ledger

    def _check_ranks_resumed_alike(self) -> None:
        """Ranks that restored different checkpoints (a stale copy of the run folder on one node)
        would sum the batches of different steps under one ledger entry."""
        mine = (self.step, hashlib.sha256(json.dumps(self.accountant.ledger.to_json(), sort_keys=True).encode())
                .hexdigest())
        if (found := self._unlike_rank_0(mine)) is not None:
            first, differs = found
            here = (f"rank {self.comm.rank}: step {mine[0]}{'' if first[0] != mine[0] else ', another ledger'}; "
                    if differs else "")
            raise UserError(f"the ranks resumed from different checkpoints ({here}rank 0: step {first[0]}"
                            f"{'' if differs else '; another rank differs'}); every rank must read the same run "
                            f"folder")


def _users_side_by_side(indices: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
    """A ULS batch with each user's records side by side (``user``: each record's user, numbered
    0, 1, ...), users in the order of their first record (``user_poisson`` draws them so; a
    sampler of one's own need not). ``ctx.micro_batches`` cuts between users only where they
    change, so a user whose records were apart was split across micro-batches and clipped to C in
    each (4·C with k = 4 in a review)."""
    if len(indices) < 2:
        return indices
    first = torch.full((int(user.max()) + 1,), len(user), dtype=torch.int64)
    first.scatter_reduce_(0, user, torch.arange(len(user)), "amin")
    return indices[torch.argsort(first[user], stable=True)]


def _each_user_together(groups: torch.Tensor, clipped: torch.Tensor, estimator: str) -> int:
    """Refuse a ULS contribution that holds a user already clipped in an earlier one, or a user's
    rows apart: a user is clipped once, as one, and the hooks' weighted sum, one GEMM over the rows,
    must not hold a user's running sum while other users' rows are added to it (a user whose
    examples cancel, ±X, would round theirs away). Marks the contribution's users in ``clipped``
    and returns how many they are."""
    groups = groups.cpu()
    if not len(groups):
        return 0
    starts = torch.ones(len(groups), dtype=torch.bool)
    starts[1:] = groups[1:] != groups[:-1]
    users = groups[starts]
    if len(torch.unique(users)) != len(users) or bool(clipped[users].any()):
        raise RuntimeError(f"estimator {estimator!r}: a user's records came apart (in two contributions, or apart "
                           f"within one); a user is clipped as one, so their records come side by side in one "
                           f"contribution (ctx.micro_batches keeps them so)")
    clipped[users] = True
    return len(users)


def _each_once(indices: torch.Tensor, n: int) -> bool:
    """Whether ``indices`` are distinct records among ``n``: a mask, not a sort (a KL full batch
    is 10⁷ records a step)."""
    if int(indices.min()) < 0 or int(indices.max()) >= n:
        return False
    seen = torch.zeros(n, dtype=torch.bool, device=indices.device)
    seen[indices] = True
    return int(seen.sum()) == indices.numel()


class _Rows:
    """The records an estimator's contributions cover, against the batch it was given: the
    sensitivity of a clipped sum holds for each sampled record contributing once and no other
    record contributing at all (a record yielded twice, or one from outside the batch, is used
    at a rate the accountant never saw)."""

    def __init__(self, estimator: str, batch: torch.Tensor):
        self.estimator, self.batch = estimator, batch
        self.named: list[torch.Tensor] = []
        self.rows = 0

    def add(self, contrib) -> None:
        if not isinstance(contrib, Contribution):
            raise TypeError(f"estimator {self.estimator!r}: contributions() yields Contributions "
                            f"(dpregistry.spaces), got {type(contrib).__name__}")
        self.rows += contrib.n_records
        if contrib.indices is None and contrib.batch_size and type(contrib).n_records is Contribution.n_records:
            raise RuntimeError(f"estimator {self.estimator!r}: a contribution of {contrib.batch_size} rows names no "
                               f"records; set its indices (the training record of each row) so that the run can "
                               f"check that each record of the batch contributes once")
        if contrib.indices is not None:
            if len(contrib.indices) != contrib.batch_size:
                raise RuntimeError(f"estimator {self.estimator!r}: a contribution of {contrib.batch_size} rows names "
                                   f"{len(contrib.indices)} records")
            self.named.append(contrib.indices.reshape(-1).cpu())

    def check(self) -> None:
        batch = self.batch.reshape(-1).cpu()
        named = torch.cat(self.named) if self.named else batch[:0]
        if self.named and len(named) == self.rows:  # every row names its record
            if _same_records(named, batch):
                return
            extra, missing = _excess(named, batch), _excess(batch, named)
            found = "; ".join([f"more rows than the batch holds for {_listed(extra)}"] * bool(extra)
                              + [f"no row for {_listed(missing)}"] * bool(missing)) or "records named twice"
        elif not _within(named, batch):  # rows that stand for several records name records of the batch, once
            found = "rows naming records outside the batch, or one twice"
        elif self.rows == len(batch):
            return
        else:
            found = f"{self.rows} rows"
        raise RuntimeError(f"estimator {self.estimator!r}: its contributions cover other records than the "
                           f"{len(batch)} of the batch it was given ({found}); each record of the "
                           f"batch contributes once and no other record at all")


def _same_records(named: torch.Tensor, batch: torch.Tensor) -> bool:
    """Whether ``named`` holds each record of ``batch`` (distinct records) once and nothing else."""
    return len(named) == len(batch) and _within(named, batch)


def _within(named: torch.Tensor, batch: torch.Tensor) -> bool:
    """Whether ``named`` holds records of ``batch`` only, each at most once: masks, not sorts (a KL
    full batch is 10⁷ records)."""
    if not len(named):
        return True
    if int(named.min()) < 0:
        return False
    n = max(int(named.max()), int(batch.max()) if len(batch) else 0) + 1
    in_batch = torch.zeros(n, dtype=torch.bool)
    in_batch[batch] = True
    return _each_once(named, n) and bool(in_batch[named].all())


def _excess(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """The records that ``a`` holds more often than ``b`` (counted with multiplicity)."""
    values, counts = torch.cat([a, b]).unique(return_counts=True)
    in_a = torch.zeros_like(counts)
    in_a.index_add_(0, torch.searchsorted(values, a), torch.ones_like(a, dtype=counts.dtype))
    return values[in_a > counts - in_a].tolist()


def _listed(records: list[int], most: int = 5) -> str:
    shown = ", ".join(map(str, records[:most])) + (", …" if len(records) > most else "")
    return f"record{'s' * (len(records) > 1)} {shown}"


def _describe_data(record: dict[str, Any]) -> str:
    return (f"{record['n_train']} records" + (f", digest {record['digest']}" if record.get("digest") else "")
            + (f", users {record['users']}" if record.get("users") else ""))


#: the layout of a checkpoint's metadata and stage state (format 2: stage states are the fields
#: of each stage's declared State)
CHECKPOINT_FORMAT = 2

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed (torch's CPU allocator raises a plain RuntimeError)."""
    return isinstance(e, (MemoryError, _OUT_OF_MEMORY)) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "not enough memory" in str(e)))


def _providers_of(kind: type) -> str:
    """"; stages that provide it: ..." from the registry (on a refusal only: it imports every stage)."""
    from .registry import get_registry

    found = []
    for e in get_registry().all():
        try:
            if kind in e.cls.provides:
                found.append(f"{e.kind.replace('_', ' ')} {e.name}")
        except Exception:  # a broken lazy stage: it provides nothing here
            continue
    return f"; stages that provide it: {', '.join(found)}" if found else ""


def _to_device(obj: Any, device: torch.device) -> Any:
    """Stage state tensors live on the run's device (a checkpoint holds them on the CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj


def _first_difference(a: Any, b: Any, path: tuple = ()) -> str | None:
    """The first key path (``privatizer.clip``) at which two resolved recipes differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return ".".join(path + (k,))
            found = _first_difference(a[k], b[k], path + (k,))
            if found:
                return found
        return None
    return None if a == b else ".".join(path) or None


def _check_device(device: torch.device, recipe: Recipe) -> None:
    if device.type == "cpu":
        return
    mod = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    available = getattr(mod, "is_available", None)
    if available is None or not available():
        raise recipe.error(f"device {str(device)!r} is not available on this machine; run where it is, or set "
                           f"train.device: cpu (--set train.device=cpu)", "train", "device")
    count = getattr(mod, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise recipe.error(f"device {str(device)!r} does not exist ({count} {device.type} device(s) here)",
                           "train", "device")
