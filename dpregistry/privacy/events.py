"""Privacy events as plain data.

A privatizer describes what each release cost with these events; an accountant consumes them.
They are deliberately close to Google's ``dp_accounting.DpEvent`` family, onto which the
accountants map them (see ``dpreg_accounting``).

Sensitivity convention (one place, used everywhere): ``Gaussian.sensitivity`` is the largest L2
distance between the mechanism's outputs on two neighbouring data sets, under the run's
neighbouring relation. For a clipped sum with per-example bound C that is 2C under replace-one
(all five papers) and C under add/remove (``clipped_sum_sensitivity``). The subsampled analyses
need the per-example bound: sensitivity/2 under replace-one, the sensitivity under add/remove.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Iterable, Iterator

RELATIONS = ("replace_one", "add_remove")


class EventError(ValueError):
    """An event's parameters are out of range (a recipe's clip of 1e308 makes an infinite
    sensitivity): the run reports it as bad input."""


def clipped_sum_sensitivity(clip: float, relation: str) -> float:
    """L2 sensitivity of a sum of per-example vectors each clipped to norm ``clip``."""
    if relation == "replace_one":
        return 2.0 * clip  # the differing example moves from x to x', |x - x'| <= 2C
    if relation == "add_remove":
        return clip
    raise EventError(f"unknown neighbouring relation {relation!r}")


class PrivacyEvent:
    """Base of all events. Subclasses are frozen dataclasses with a ``type`` tag."""

    type: ClassVar[str]
    _registry: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        PrivacyEvent._registry[cls.type] = cls

    def children(self) -> tuple["PrivacyEvent", ...]:
        """The events this one wraps or composes (none for a mechanism)."""
        inner = self.__dict__.get("event")
        return (inner,) if isinstance(inner, PrivacyEvent) else tuple(self.__dict__.get("events", ()))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for k, v in asdict(self).items():
            out[k] = v
        # nested events are serialised through their own to_dict
        if "event" in self.__dict__:
            out["event"] = self.event.to_dict()
        if "events" in self.__dict__:
            out["events"] = [e.to_dict() for e in self.events]
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "PrivacyEvent":
        d = dict(d)
        cls = PrivacyEvent._registry[d.pop("type")]
        if "event" in d:
            d["event"] = PrivacyEvent.from_dict(d["event"])
        if "events" in d:
            d["events"] = tuple(PrivacyEvent.from_dict(e) for e in d["events"])
        return cls(**d)

    def describe(self) -> str:
        return self.type


@dataclass(frozen=True)
class Gaussian(PrivacyEvent):
    """Adds N(0, std² I) to a statistic of L2 sensitivity ``sensitivity`` (see module doc)."""

    type: ClassVar[str] = "gaussian"
    std: float
    sensitivity: float

    def __post_init__(self):
        if not (self.sensitivity > 0 and math.isfinite(self.sensitivity)):
            raise EventError(f"Gaussian sensitivity must be positive and finite, got {self.sensitivity}")
        if not (self.std >= 0):
            raise EventError(f"Gaussian std must be >= 0, got {self.std}")

    @property
    def noise_multiplier(self) -> float:
        """std / sensitivity: the multiplier of the equivalent sensitivity-1 mechanism."""
        return self.std / self.sensitivity

    def describe(self) -> str:
        return f"gaussian(σ/Δ={self.noise_multiplier:.4g})"


@dataclass(frozen=True)
class PoissonSampled(PrivacyEvent):
    """Each record enters the batch independently with probability ``q``."""

    type: ClassVar[str] = "poisson_sampled"
    q: float
    event: PrivacyEvent

    def __post_init__(self):
        if not 0 < self.q <= 1:
            raise EventError(f"a sampling rate must be in (0, 1], got {self.q}")

    def describe(self) -> str:
        return f"poisson(q={self.q:.4g}, {self.event.describe()})"


@dataclass(frozen=True)
class SampledWithoutReplacement(PrivacyEvent):
    """A uniformly random subset of ``batch_size`` of the ``n`` records (fresh each step)."""

    type: ClassVar[str] = "sampled_without_replacement"
    n: int
    batch_size: int
    event: PrivacyEvent

    def __post_init__(self):
        if not 1 <= self.batch_size <= self.n:
            raise EventError(f"need 1 <= batch_size <= n, got {self.batch_size} of {self.n}")

    def describe(self) -> str:
        return f"wor({self.batch_size}/{self.n}, {self.event.describe()})"


@dataclass(frozen=True)
class Composed(PrivacyEvent):
    """Sequential (adaptive) composition of different events."""

    type: ClassVar[str] = "composed"
    events: tuple = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "events", tuple(self.events))

    def describe(self) -> str:
        return "+".join(e.describe() for e in self.events)


@dataclass(frozen=True)
class SelfComposed(PrivacyEvent):
    type: ClassVar[str] = "self_composed"
    event: PrivacyEvent
    count: int

    def __post_init__(self):
        # a negative count would un-charge; a zero one is no event (and 0·∞ is NaN in an RDP curve)
        if not (isinstance(self.count, numbers.Integral) and self.count >= 1):
            raise EventError(f"a self-composition count must be an integer >= 1, got {self.count}")

    def describe(self) -> str:
        return f"{self.count}×{self.event.describe()}"


@dataclass(frozen=True)
class ZCDP(PrivacyEvent):
    """A charge stated directly in ρ-zCDP (Bun–Steinke)."""

    type: ClassVar[str] = "zcdp"
    rho: float

    def __post_init__(self):
        if not self.rho >= 0:
            raise EventError(f"zCDP rho must be >= 0, got {self.rho}")

    def describe(self) -> str:
        return f"zcdp(ρ={self.rho:.4g})"


def nodes(event: PrivacyEvent) -> Iterator[PrivacyEvent]:
    """Every event of a tree, the wrappers and compositions included (depth first)."""
    yield event
    for child in event.children():
        yield from nodes(child)


def held(event: PrivacyEvent, count: int = 1) -> Counter:
    """How many times ``count`` charges of ``event`` hold each event of its tree: itself, its
    wrappers' contents, a composition's parts as often as they occur in it, a self-composition's
    part its count times over (what a charge pays for, counted)."""
    out = Counter({event: count})
    inner = event.count * count if isinstance(event, SelfComposed) else count
    for child in event.children():
        out += held(child, inner)
    return out


def leaves(event: PrivacyEvent, count: int = 1, *,
           unwrap: tuple[type[PrivacyEvent], ...] = ()) -> Iterator[tuple[PrivacyEvent, int]]:
    """The (base event, times charged) pairs of ``count`` charges of ``event``, in order:
    compositions are expanded (a self-composition multiplies the count), and events of a type in
    ``unwrap`` are replaced by the event they wrap (an accountant that charges Poisson sampling
    without amplification passes ``unwrap=(PoissonSampled,)``). Every other event is a leaf; an
    accountant checks the leaves it can compose."""
    if isinstance(event, Composed):
        for e in event.events:
            yield from leaves(e, count, unwrap=unwrap)
    elif isinstance(event, SelfComposed):
        yield from leaves(event.event, count * event.count, unwrap=unwrap)
    elif unwrap and isinstance(event, unwrap):
        yield from leaves(event.event, count, unwrap=unwrap)
    else:
        yield event, count


def tree_nodes_per_record(period: int) -> int:
    """⌊log₂T⌋+1: the most released nodes of a binary tree over T leaves that contain one leaf.

    The released nodes are the dyadic intervals [k·2^j+1, (k+1)·2^j] that end by T; a leaf lies in
    one per level j, for the levels with 2^j <= T (spec 001 §2.4 erratum: not 2 ln T, which is
    smaller for T in {1, 2, 4}).
    """
    if period < 1:
        raise EventError(f"a tree period has at least one step, got {period}")
    return int(period).bit_length()  # = ⌊log₂T⌋+1, exactly, in integers


@dataclass(frozen=True)
class TreeAggregation(PrivacyEvent):
    """Binary-tree (continual counting) release of prefix sums over one period.

    Each node carries N(0, std² I); a record enters ``nodes_per_record`` released nodes
    (⌊log2 T⌋+1 for a period of T steps, :func:`tree_nodes_per_record`), each with L2 sensitivity
    at most ``sensitivity``. The record's influence is therefore a Gaussian mechanism of
    sensitivity ``sensitivity·sqrt(nodes_per_record)`` (exact for equal node noise; adaptively
    chosen increments allowed: spec 001 §2.3, spec 002 §2.3).
    """

    type: ClassVar[str] = "tree_aggregation"
    std: float
    sensitivity: float
    nodes_per_record: int

    def __post_init__(self):
        if not (self.sensitivity > 0 and math.isfinite(self.sensitivity)):
            raise EventError(f"tree sensitivity must be positive and finite, got {self.sensitivity}")
        if not (self.std >= 0):
            raise EventError(f"tree std must be >= 0, got {self.std}")
        if not (isinstance(self.nodes_per_record, int) and self.nodes_per_record >= 1):
            raise EventError(f"nodes_per_record must be a positive integer, got {self.nodes_per_record}")

    @classmethod
    def for_period(cls, std: float, sensitivity: float, period: int) -> "TreeAggregation":
        """The event of one tree over ``period`` steps (each record in ⌊log₂T⌋+1 nodes)."""
        return cls(std=std, sensitivity=sensitivity, nodes_per_record=tree_nodes_per_record(period))

    def as_gaussian(self) -> Gaussian:
        return Gaussian(std=self.std, sensitivity=self.sensitivity * math.sqrt(self.nodes_per_record))

    def describe(self) -> str:
        return f"tree(σ/Δ={self.std / self.sensitivity:.4g}, nodes={self.nodes_per_record})"


@dataclass(frozen=True)
class Exponential(PrivacyEvent):
    """Exponential mechanism with pure ε-DP (for private selection).

    ``bounded_range`` charges ε²/8-zCDP (Cesar–Rogers); otherwise ε²/2 (Bun–Steinke Prop 1.4).
    """

    type: ClassVar[str] = "exponential"
    epsilon: float
    bounded_range: bool = True

    def __post_init__(self):
        if not (self.epsilon >= 0):
            raise EventError(f"exponential mechanism ε must be >= 0, got {self.epsilon}")

    def zcdp_rho(self) -> float:
        return self.epsilon ** 2 / (8.0 if self.bounded_range else 2.0)

    def describe(self) -> str:
        return f"exponential(ε={self.epsilon:.4g})"


@dataclass(frozen=True)
class NonPrivate(PrivacyEvent):
    """A release with no privacy guarantee (for example MeZO without noise)."""

    type: ClassVar[str] = "non_private"

    def describe(self) -> str:
        return "non-private"


def any_nonprivate(events: Iterable[PrivacyEvent]) -> bool:
    """Whether any of ``events``, or an event they compose, is a :class:`NonPrivate` release: a run
    that charged one has an infinite ε and states no guarantee."""
    return any(isinstance(node, NonPrivate) for event in events for node in nodes(event))
