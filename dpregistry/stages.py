"""Stage contracts.

One private step, for every algorithm (DESIGN.md)::

    idx      = sampler.indices(ctx)                             # public or private sampling
    for contrib in estimator.contributions(objective, idx, ctx):  # per-example, in a SPACE
        total += privatizer.clip_sum(contrib)                   # local: clip each example, sum
    total    = ctx.comm.all_reduce(total)                       # ranks add up clipped sums
    release  = privatizer.release(total, ctx)                   # noise once -> Release + events
    run.charge(release.events)                                  # accountant (or filter) may refuse
    update_rule.apply(ctx.params, release, ctx)                 # lift the space to parameters

Every stage method receives a :class:`~dpregistry.context.Context` (the step, the parameters, the
device, the randomness it may use, the neighbouring relation, the communicator), never the run
or another stage. What a stage needs from another is declared: ``needs`` lists the types it reads
with ``ctx.need(T)``, ``provides`` the types it returns from ``provide(T)``. Only the
:class:`Algorithm` sees the run, in ``step``: it owns the loop above, so algorithms with rounds,
episodes, proximal calls, adaptive noise or private output selection change the control flow
without engine special cases:

* stateful privatizers (tree mechanism, prefix sums) keep their ``State`` and are ``reset()`` by
  the algorithm at period boundaries;
* noise that depends on earlier releases is set per call (``release(..., std=...)``); the
  accountant is then a privacy filter whose ``can_afford`` the algorithm asks, and a refused
  charge raises :class:`~dpregistry.errors.BudgetExhausted`, which stops the run cleanly;
* update rules keep state in whatever space they accept (projected Adam moments, O2NC's
  displacement); ``output()`` picks the final parameters (a random iterate, an episode average);
* selection that touches data (the exponential mechanism) is charged like any other release.

Every stage is a class with a pydantic ``Params`` model (its recipe schema, validated before any
work starts), ``setup(ctx)`` to bind to a run, and, if it keeps state across steps, a ``State``
dataclass whose fields (tensors and JSON-able values) the run saves in checkpoints and restores.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from .errors import UserError
from .space_names import DENSE, GRADIENT
from .privacy.events import PrivacyEvent

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import torch

    from .context import Context
    from .export import ModelExport
    from .run import Run
    from .spaces import Aggregate, Contribution

_ABSENT = object()


def _booleans_read_as_numbers(given: Any, dumps: tuple, loc: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(location, value) of every boolean in ``given`` that validation turned into a number;
    ``dumps`` are the validated values (by alias and by field name: the input may use either)."""
    if isinstance(given, bool):
        value = next((d for d in dumps if d is not _ABSENT), _ABSENT)
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            yield loc, value
    elif isinstance(given, dict):
        for k, v in given.items():
            sub = tuple(d.get(k, _ABSENT) if isinstance(d, dict) else _ABSENT for d in dumps)
            yield from _booleans_read_as_numbers(v, sub, loc + (k,))
    elif isinstance(given, (list, tuple)):
        for i, v in enumerate(given):
            sub = tuple(d[i] if isinstance(d, (list, tuple)) and i < len(d) else _ABSENT for d in dumps)
            yield from _booleans_read_as_numbers(v, sub, loc + (i,))


class NoBooleanNumbers(BaseModel):
    """A schema that refuses a boolean where a number is meant: pydantic reads ``epsilon: true``
    as 1 and ``clip: false`` as 0. (Strict mode would refuse them too, and also the lists a tuple
    field is given in YAML and JSON.)"""

    @model_validator(mode="wrap")
    @classmethod
    def _no_booleans_as_numbers(cls, data, handler):
        model = handler(data)
        if isinstance(data, dict):
            dumps = (model.model_dump(by_alias=True), model.model_dump())
            bad = [InitErrorDetails(type="float_type" if isinstance(v, float) else "int_type", loc=loc, input=True)
                   for loc, v in _booleans_read_as_numbers(data, dumps)]
            if bad:
                raise ValidationError.from_exception_data(cls.__name__, bad)
        return model


class StageParams(NoBooleanNumbers):
    """Base of every stage's recipe schema: unknown keys are errors, and so are NaN and ±inf
    (a field that means something by inf, like a clip of inf, says so with allow_inf_nan=True),
    and booleans where numbers are meant."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False,
                              populate_by_name=True)


class Stage:
    """Base of every stage: a recipe schema, optional declared state, and declared exchanges."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""
    Params: ClassVar[type[StageParams]] = StageParams
    #: a dataclass of what the stage keeps across steps (tensors and JSON-able values); the run
    #: saves its fields in every checkpoint and restores them on resume (None: stateless)
    State: ClassVar[type | None] = None
    #: types this stage reads with ``ctx.need(T)`` (checked before step 1: each has one provider; an
    #: instance may add to them from its settings)
    needs: ClassVar[tuple[type, ...]] = ()
    #: types this stage returns from ``provide(T)``
    provides: ClassVar[tuple[type, ...]] = ()

    def __init__(self, params: StageParams | None = None):
        self.cfg = params if params is not None else self.Params()
        self.state = self.State() if self.State is not None else None

    @classmethod
    def description(cls) -> str:
        """The docstring's first paragraph, on one line (a first line alone may stop mid-sentence),
        without its reST markup (``x`` reads `x`, :mod:`a.b` reads a.b)."""
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        return re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc).replace("``", "`")

    def setup(self, ctx: "Context") -> None:
        """Bind to a run: the objective and the parameters exist by now (``ctx.params``)."""

    def validate(self, ctx: "Context") -> None:
        """Checks against the other stages' declared values; raise UserError with a helpful message."""

    def provide(self, kind: type) -> Any:
        """The value of a type listed in ``provides``."""
        raise NotImplementedError(f"{type(self).__name__} lists {kind.__name__} in provides but does not provide it")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the fields of ``State``. Override only for custom serialisation."""
        if self.state is None:
            return {}
        return {f.name: getattr(self.state, f.name) for f in dataclasses.fields(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.State is None:
            return
        known = {f.name for f in dataclasses.fields(self.State)}
        self.state = dataclasses.replace(self.state, **{k: v for k, v in state.items() if k in known})


# --------------------------------------------------------------------------------------------
# Objective: model + loss + data
# --------------------------------------------------------------------------------------------


class Objective(Stage):
    """Model, per-example loss and data. Parameters are the trainable tensors, in a fixed order."""

    kind = "objective"

    #: number of training records (the n of every sampling rate and sensitivity)
    n_train: int = 0

    def params(self) -> dict[str, torch.Tensor]:
        """Trainable tensors by name, modified in place by update rules."""
        raise NotImplementedError

    def module(self) -> torch.nn.Module | None:
        """The torch module, when there is one (hook-based per-example gradients need it)."""
        return None

    def losses(self, indices: torch.Tensor) -> torch.Tensor:
        """Per-example losses [B] at the current parameters, for training records ``indices``.

        Examples never interact: padding or batching never changes another example's loss.
        """
        raise NotImplementedError

    def functional_losses(self, params: dict[str, torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
        """Per-example losses as a pure function of ``params`` (for torch.func); optional."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (the test split is not the private training data)."""
        return {}

    def fingerprint(self) -> str | None:
        """A digest of the training records (:func:`dpregistry.digest.data_digest`), or None: a
        resume and every rank of a distributed run must see the same one (and the same n_train)."""
        return None

    def export(self, folder: Path, *, merge: bool = False) -> "ModelExport":
        """Write the trained model into the empty ``folder`` as a Hugging Face model that computes
        exactly what this objective's model computes, and describe it (``dpreg export``; ``merge``:
        LoRA adapters merged into the base weights). Raise UserError saying why when it cannot."""
        raise UserError(f"objective {self.name!r} has no transformers model to export (`dpreg export` writes "
                        f"Hugging Face models: hf_text_classification, the prompt LMs, your own transformers model)")


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Charge:
    """An event to charge ``count`` times, and the partition of the data it touches (None: every
    record; see dpregistry.privacy.accountant on parallel composition)."""

    event: PrivacyEvent
    partition: str | None = None
    count: int = 1

    def __post_init__(self):
        # a negative count would un-charge, and a count of 0 charge nothing for a step that released
        if not (isinstance(self.count, numbers.Integral) and self.count >= 1):
            raise ValueError(f"a charge count must be an integer >= 1, got {self.count}")


class Sampler(Stage):
    """Picks the records of each step, and says how the sampling amplifies (or partitions) privacy."""

    kind = "sampler"
    #: True when ``account`` amplifies by the secrecy of the batch: every release from one batch
    #: must then be charged together (one ``Run.charge`` per step), or each would be amplified alone.
    amplifies: ClassVar[bool] = False
    #: "examples", or "users": a user-level sampler draws users and returns their records, each
    #: user's contributions clipped as one (dpregistry.users)
    samples: ClassVar[str] = "examples"

    def indices(self, ctx: "Context") -> torch.Tensor:
        """The training records of step ``ctx.step``."""
        raise NotImplementedError

    def expected_batch_size(self, ctx: "Context") -> float:
        """The denominator of the privatized mean at step ``ctx.step`` (Poisson: q·n, fixed batches: B)."""
        raise NotImplementedError

    def account(self, step: int, events: list[PrivacyEvent], ctx: "Context") -> list[Charge]:
        """Wrap the mechanism events of step ``step`` in this sampler's sampling/partition structure
        (``ctx.step`` is the step in progress; ``ctx.ledger`` what was charged so far)."""
        raise NotImplementedError

    def account_steps(self, steps: range, events: list[PrivacyEvent], ctx: "Context") -> list[Charge]:
        """The charges of every step in ``steps``, each releasing ``events``: the sum of
        ``account(t, events, ctx)`` over t, merged into counts. Plans use it, so a sampler should
        compute it in closed form (the default calls ``account`` once per step: 10^9 steps would
        take hours)."""
        return compress(c for t in steps for c in self.account(t, events, ctx))


# --------------------------------------------------------------------------------------------
# Estimator
# --------------------------------------------------------------------------------------------


class Estimator(Stage):
    """Turns a batch into per-example contributions in a coordinate space."""

    kind = "estimator"
    #: the space of the contributions it yields
    space: ClassVar[str] = DENSE
    #: GRADIENT (an estimate) or INCREMENT (a change to a running estimate, for stream privatizers)
    contribution_kind: ClassVar[str] = GRADIENT
    #: its contributions name their records (``Contribution.indices``) and its micro-batches come
    #: from ``ctx.micro_batches``, so a user's rows can be clipped as one (user-level sampling)
    user_level: ClassVar[bool] = False

    def contributions(self, objective: Objective, indices: torch.Tensor, ctx: "Context") -> Iterator[Contribution]:
        """Yield the contributions of the batch (one per micro-batch for first-order estimators)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget history (variance reduction restarts at a period boundary)."""


# --------------------------------------------------------------------------------------------
# Privatizer
# --------------------------------------------------------------------------------------------


@dataclass
class ClippedSum:
    """The clipped sum of some examples, before noise; sums across micro-batches and ranks."""

    aggregate: Aggregate
    count: int = 0          # examples seen
    clipped: int = 0        # examples whose norm exceeded the clip
    nonfinite: int = 0      # examples zeroed because a loss or gradient was NaN/inf
    loss_sum: float = 0.0   # diagnostics only (finite losses)
    kind: str = GRADIENT
    #: the privacy units (records, or users at the user level) the run clipped into it
    #: (``Run.privatize_batch``; None: none, as in a sum made by hand or one already released): two
    #: sums that share one cannot be added, since the unit would move their sum by twice the clip (an
    #: algorithm's own accumulation cut a user in two: 4·C at k = 4)
    units: torch.Tensor | None = field(default=None, repr=False)

    def add_(self, other: "ClippedSum") -> "ClippedSum":
        if self.units is None or other.units is None:
            self.units = other.units if self.units is None else self.units
        else:
            import torch

            if bool(torch.isin(other.units, self.units).any()):
                raise RuntimeError("two clipped sums that hold the same record (or user) cannot be added: the sum "
                                   "would hold it twice, beyond the clip its release is charged for; privatize "
                                   "each record once per release (the run cuts a batch into micro-batches itself)")
            self.units = torch.cat([self.units, other.units])
        self.aggregate.add_(other.aggregate)
        self.count += other.count
        self.clipped += other.clipped
        self.nonfinite += other.nonfinite
        self.loss_sum += other.loss_sum
        return self


@dataclass
class Release:
    """A privatized aggregate (already divided by the expected batch size) and what it cost."""

    value: Aggregate
    events: list[PrivacyEvent]
    kind: str = GRADIENT
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NoiseStd:
    """A privatizer's word that each of its releases states ``stats["noise_std"]``: the std of the
    Gaussian noise on every coordinate of the released value (σ·C/E[B] for a privatized mean).
    An update rule that corrects for the noise (Adam's ``noise_correction``) needs it."""


class Privatizer(Stage):
    """Clips per-example contributions in their space, sums, and adds noise once per step."""

    kind = "privatizer"
    #: spaces it can work in (None: every space)
    accepts: ClassVar[frozenset[str] | None] = None
    #: contribution kinds it accepts (stream privatizers take increments)
    accepts_kinds: ClassVar[frozenset[str]] = frozenset({GRADIENT})
    #: its ``clip_sum`` clips a user-level contribution's rows of each user as one
    #: (``contribution.groups``, as ``dpregistry.clipping.clip_and_sum`` does), so it may run with
    #: user-level sampling
    user_level: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "clip_sum" in cls.__dict__ and "user_level" not in cls.__dict__:
            cls.user_level = False  # a clip_sum of its own says for itself whether it clips users as one

    #: noise std ÷ the clip (None until set by the recipe or by calibration)
    noise_multiplier: float | None = None

    @property
    def calibrates(self) -> bool:
        """Whether the recipe leaves the noise multiplier to calibration against the budget
        (``noise_multiplier: auto``); the run then calls ``set_noise_multiplier`` before step 1."""
        return False

    def set_noise_multiplier(self, z: float) -> None:
        self.noise_multiplier = float(z)

    def clip_sum(self, contribution: Contribution) -> ClippedSum:
        raise NotImplementedError

    def release(self, total: ClippedSum, ctx: "Context", *, std: float | None = None) -> Release:
        """Add noise from ``ctx.noise()`` (std overrides the configured scale for per-call
        schedules) and divide by ``ctx.expected_batch_size()``."""
        raise NotImplementedError

    def planned_events(self, noise_multiplier: float, ctx: "Context") -> list[PrivacyEvent]:
        """The events one release would cost at ``noise_multiplier`` (for planning/calibration)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Start a new stream/period (stateful privatizers)."""

    def prepaid(self, ctx: "Context") -> bool:
        """Whether the release of step ``ctx.step`` was paid for by an earlier charge, so that its
        events are none (a tree aggregation charges its whole period at the period's first step).
        The run refuses any other step that privatizes or draws noise and charges nothing."""
        return False


# --------------------------------------------------------------------------------------------
# Update rule
# --------------------------------------------------------------------------------------------


class UpdateRule(Stage):
    """Maps a release back to parameters, in place."""

    kind = "update_rule"
    #: release spaces it accepts; dense rules lift any space (not memory-free, see ``lifts``)
    accepts: ClassVar[frozenset[str]] = frozenset({DENSE})
    #: spaces accepted only by lifting to dense coordinates (costs d memory per step)
    lifts: ClassVar[frozenset[str]] = frozenset()

    def apply(self, params: dict[str, torch.Tensor], release: Release, ctx: "Context") -> None:
        raise NotImplementedError

    def output(self, params: dict[str, torch.Tensor], ctx: "Context") -> dict[str, torch.Tensor] | None:
        """Final parameters if they are not the current ones (for example an episode average)."""
        return None


# --------------------------------------------------------------------------------------------
# Accountant (the base with ledger lives in dpregistry.privacy.accountant)
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# Algorithm
# --------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """What one call of ``Algorithm.step`` did (for logging)."""

    metrics: dict[str, float] = field(default_factory=dict)
    done: bool = False


class Algorithm(Stage):
    """A named preset: default stages and the control flow of a step.

    ``defaults`` gives the stage configurations a recipe starts from (``{kind: {name: ..., ...}}``);
    a recipe's own sections override them key by key. An algorithm composes its stages: the run
    hands them over as ``self.stages`` before ``setup``, and ``step(run)`` (the only method that
    sees the run) drives them. The base class runs the standard step; an algorithm with outer
    loops overrides ``step`` and keeps its loop counters in its ``State``.
    """

    kind = "algorithm"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    #: needs a privacy filter (noise that depends on earlier releases)
    adaptive: ClassVar[bool] = False
    #: its step metrics are functions of the step's releases (a noisy norm, a test on one): with
    #: secret noise each logged row then follows a checkpoint of its step, so that a resume never
    #: draws again the noise of a step whose release a row has shown
    logs_releases: ClassVar[bool] = False
    #: the run's stages, set before setup
    stages: "Stages"

    def total_steps(self, ctx: "Context") -> int:
        """Steps the run takes (the recipe's ``train.steps`` unless the algorithm's schedule ends sooner)."""
        return ctx.max_steps

    def done(self, ctx: "Context") -> bool:
        return ctx.step >= self.total_steps(ctx)

    def plan(self, ctx: "Context", noise_multiplier: float) -> list[Charge]:
        """Every charge from step ``ctx.step`` to the end at ``noise_multiplier``: checked against
        the budget before the first step, and inverted for calibration. Return [] for adaptive
        algorithms (the filter then guards the budget)."""
        per_step = self.stages.privatizer.planned_events(noise_multiplier, ctx)
        return compress(self.stages.sampler.account_steps(range(ctx.step, self.total_steps(ctx)), per_step, ctx))

    def step(self, run: "Run") -> StepResult:
        ctx = run.ctx
        idx = run.sampler.indices(ctx)
        total = run.privatize_batch(idx)
        release = run.privatizer.release(total, ctx)
        run.charge(release.events)
        run.update_rule.apply(ctx.params, release, ctx)
        return StepResult(run.step_metrics(total, release))


@dataclass
class Stages:
    """The stages an algorithm composes."""

    objective: Objective
    sampler: Sampler
    estimator: Estimator
    privatizer: Privatizer
    update_rule: UpdateRule
    accountant: Any  # dpregistry.privacy.accountant.Accountant


def compress(charges) -> list[Charge]:
    """Merge identical charges into counts (a plan of 20,000 equal steps is one Charge)."""
    counts: dict[tuple, int] = {}
    for c in charges:
        key = (c.event, c.partition)
        counts[key] = counts.get(key, 0) + c.count
    return [Charge(e, p, n) for (e, p), n in counts.items()]


def repeat(charges: list[Charge], times: int) -> list[Charge]:
    """The charges of ``times`` steps that each charge ``charges``."""
    return [Charge(c.event, c.partition, c.count * times) for c in charges] if times > 0 else []
