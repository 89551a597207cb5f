"""What a stage sees: a small typed context instead of the whole run.

Every stage method but the algorithm's ``step`` receives a :class:`Context`: the step, the
trainable parameters and their device, the run's public and secret randomness, the neighbouring
relation, the communicator, and the services of the step in progress (the next release's noise,
a zeroth-order displacement of the parameters). Whatever a stage needs from another stage is a
declared, typed exchange:

* a stage lists the types it needs in ``needs`` and reads them with ``ctx.need(T)``;
* a stage lists the types it offers in ``provides`` and returns them from ``provide(T)``.

The run checks before step 1 that every declared need has exactly one provider, so the contract of
a stage is what its class says. The run itself provides the
:class:`~dpregistry.stages.Objective` (estimators that set up on its module declare it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .directions import Direction
    from .privacy.secret import SecretStream
    from .rng import RunRNG

T = TypeVar("T")


class Randomness:
    """The run's randomness as a stage may use it.

    ``seed``/``generator`` are public: a pure function of the recipe's seed, a purpose and the
    step, so replicas and resumed runs regenerate them and logs may name them. ``secret`` is not:
    it derives from the run's secret key (see :mod:`dpregistry.rng`), for randomness whose secrecy
    a privacy guarantee rests on (amplifying batches, directions behind a high-probability bound).
    The key itself is out of reach."""

    __slots__ = ("_rng",)

    def __init__(self, rng: "RunRNG"):
        self._rng = rng

    def seed(self, purpose: str, step: int, *extra: object) -> int:
        return self._rng.step_seed(purpose, step, *extra)

    def generator(self, purpose: str, step: int, *extra: object, device="cpu") -> torch.Generator:
        return self._rng.generator(purpose, step, *extra, device=device)

    def secret(self, purpose: str, step: int, *extra: object) -> "SecretStream":
        """Stages share one namespace of purposes: name yours after your stage. ``noise`` is the
        run's (``ctx.noise()``): a stage drawing it would hold the releases' noise."""
        if purpose == "noise":
            raise ValueError("the secret purpose 'noise' is the privacy noise's own; draw it with ctx.noise(), "
                             "or name your stream after your stage")
        self._rng.stage_secrets += 1
        return self._rng.secret(purpose, step, *extra)


@dataclass
class Displacement:
    """The parameters sit at x + scale·u(direction); whoever consumes it must undo it."""

    direction: "Direction"
    names: tuple[str, ...]
    scale: float


class _StepServices:
    """What the step in progress shares among its stages (one per step)."""

    def __init__(self, noise: Callable[[int], "SecretStream"] | None = None):
        self._noise = noise
        self.calls = 0
        self.displacement: Displacement | None = None


@dataclass
class Context:
    """What a stage sees. The run makes one per step (and one for setup and planning)."""

    step: int
    params: dict[str, torch.Tensor]
    _device: Callable[[], torch.device] = field(repr=False)
    relation: str                      # "replace_one" or "add_remove": the neighbouring relation
    n_train: int                       # records in the private training data
    rng: Randomness
    comm: Any                          # dpregistry.distributed's communicator, or a local one
    micro_batch_size: int | None       # the physical batch (gradient accumulation)
    max_steps: int                     # the recipe's train.steps (a cap: a schedule may end sooner)
    ledger: Any                        # the privacy ledger so far (a LedgerView: copies)
    adaptive: bool = False             # the algorithm chooses its noise adaptively (a filter guards it)
    _batch_size: Callable[["Context"], float] | None = field(default=None, repr=False)
    _units: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)  # user of each index
    _services: _StepServices = field(default_factory=_StepServices, repr=False)
    _provider: Callable[[type], Any] | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        """Where the parameters live (checked when first asked for: a run on a machine without the
        recipe's device still reports a missing model path first)."""
        return self._device()

    @property
    def clips_groups(self) -> bool:
        """Whether contributions are clipped per user (``privacy.unit: user`` with user-level
        sampling): the privatizer then asks for the norms of groups of rows, not of rows."""
        return self._units is not None

    # -- the step's services -------------------------------------------------------------------

    def noise(self) -> "SecretStream":
        """The secret noise of the next release in this step (the same on every rank)."""
        s = self._services
        if s._noise is None:
            raise RuntimeError("noise is drawn only inside a step")
        stream = s._noise(s.calls)
        s.calls += 1
        return stream

    def micro_batches(self, indices: torch.Tensor):
        """``indices`` in chunks of at most ``micro_batch_size`` (the physical batch), never cutting
        a unit apart: in a user-level run a user's records stay in one chunk (clipped as one)."""
        size = self.micro_batch_size or max(len(indices), 1)
        if self._units is None:
            for i in range(0, len(indices), size):
                yield indices[i:i + size]
            return
        units = self._units(indices)
        cuts = (torch.nonzero(units[1:] != units[:-1]).squeeze(1) + 1).tolist() + [len(indices)]
        start = prev = 0
        for cut in cuts:  # whole units, until the next one would overflow the chunk
            if cut - start > size and prev > start:
                yield indices[start:prev]
                start = prev
            prev = cut
        if start < len(indices):
            yield indices[start:]

    def expected_batch_size(self) -> float:
        """The sampler's expected batch size at this step: the denominator of a privatized mean."""
        return self._batch_size(self)

    def displace(self, direction: "Direction", names: tuple[str, ...], scale: float) -> None:
        """Record that the parameters were moved to x + scale·u (a zeroth-order estimator), so the
        update rule, or the run if the step stops early, moves them back."""
        self._services.displacement = Displacement(direction, names, scale)

    def take_displacement(self) -> Displacement | None:
        s = self._services
        d, s.displacement = s.displacement, None
        return d

    def undo_displacement(self) -> None:
        d = self.take_displacement()
        if d is not None:
            d.direction.add_([self.params[n] for n in d.names], -d.scale)

    # -- typed exchange --------------------------------------------------------------------------

    def need(self, kind: type[T]) -> T:
        """The value of type ``kind`` that another stage (or the run) provides; the run checked before
        step 1 that a stage which declares ``kind`` in ``needs`` has exactly one provider."""
        return self._provider(kind)

    @classmethod
    def detached(cls, params: dict[str, torch.Tensor], *, step: int = 0, seed: int = 0, n_train: int = 0,
                 relation: str = "replace_one", micro_batch_size: int | None = None, max_steps: int = 1,
                 device: str | torch.device = "cpu", provides: dict[type, Any] | None = None,
                 noise: str = "reproducible", expected_batch_size: float | None = None) -> "Context":
        """A context outside any run, to drive one stage in a unit test: ``provides`` maps the types
        stages ``need`` to values. Secret randomness is reproducible from ``seed`` by default."""
        from .distributed import LocalComm
        from .privacy.accountant import Ledger, LedgerView
        from .rng import RunRNG

        rng = RunRNG(seed, noise)
        given = dict(provides or {})

        def provide(kind):
            if kind not in given:
                raise RuntimeError(f"this detached context provides no {kind.__name__}")
            return given[kind]

        dev = torch.device(device)
        return cls(step=step, params=params, _device=lambda: dev, relation=relation, n_train=n_train,
                   rng=Randomness(rng), comm=LocalComm(), micro_batch_size=micro_batch_size, max_steps=max_steps,
                   ledger=LedgerView(Ledger()), _batch_size=lambda c: expected_batch_size,
                   _services=_StepServices(lambda call: rng.noise(step, call)), _provider=provide)

    def at(self, step: int) -> "Context":
        """The same run at another step, outside it (for plans and for sampling at other steps)."""
        return replace(self, step=step, _services=_StepServices())
