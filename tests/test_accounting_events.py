"""Privacy events as data: JSON round trips, validation, sensitivities checked on data, the tree
mechanism's node counts against brute force (spec 001 §2.4, spec 002 §2.3), and the ledger."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dpregistry.clipping import clip_and_sum
from dpregistry.privacy.accountant import Budget, Ledger, make_accountant
from dpregistry.privacy.events import (ZCDP, Composed, Exponential, Gaussian, NonPrivate,
                                       PoissonSampled, PrivacyEvent, SampledWithoutReplacement,
                                       SelfComposed, TreeAggregation, clipped_sum_sensitivity, leaves,
                                       tree_nodes_per_record)
from dpregistry.spaces import DenseContribution, DirectionContribution
from dpregistry.directions import Direction
from dpregistry.stages import Charge

ALL_EVENTS = [
    Gaussian(std=1.5, sensitivity=2.0),
    PoissonSampled(0.01, Gaussian(std=3.0, sensitivity=2.0)),
    SampledWithoutReplacement(1000, 32, Gaussian(std=3.0, sensitivity=2.0)),
    Composed((Gaussian(1.0, 2.0), ZCDP(0.1), Exponential(0.5, bounded_range=False))),
    SelfComposed(PoissonSampled(0.5, TreeAggregation(2.0, 1.0, 4)), 7),
    ZCDP(0.25),
    TreeAggregation.for_period(std=2.0, sensitivity=1.0, period=100),
    Exponential(1.0),
    NonPrivate(),
]


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: e.type)
def test_events_round_trip_through_json(event):
    d = json.loads(json.dumps(event.to_dict()))
    back = PrivacyEvent.from_dict(d)
    assert back == event and hash(back) == hash(event) and type(back) is type(event)
    assert back.describe() == event.describe()


def test_ledger_round_trips_and_run_length_encodes():
    led = Ledger()
    g = PoissonSampled(0.1, Gaussian(2.0, 2.0))
    for step in range(5):
        led.add(Charge(g), step)
    led.add(Charge(ZCDP(0.1), "p1"), 5)
    led.add(Charge(ZCDP(0.1), "p1"), 6)
    led.add(Charge(g), 9)  # not consecutive: a new entry
    assert [(e["count"], e["first_step"], e["last_step"]) for e in led.entries] == [(5, 0, 4), (2, 5, 6), (1, 9, 9)]
    back = Ledger.from_json(json.loads(json.dumps(led.to_json())))
    assert back.to_json() == led.to_json() and back.grouped() == led.grouped()
    assert back.n_charges == 8 and back.last_step == 9
    assert [e["count"] for e in back.until(2).entries] == [3]
    assert back.until(5).n_charges == 6 and back.until(100).to_json() == led.to_json()


def test_leaves_expand_compositions_and_unwrap_what_is_asked():
    """The one event-tree walker (accountants share it): (leaf, times charged) in order, counts
    multiplied through self-compositions, wrappers kept unless listed in ``unwrap``."""
    g, h, z = Gaussian(1.0, 2.0), Gaussian(3.0, 2.0), ZCDP(0.1)
    sampled = PoissonSampled(0.1, h)
    tree = Composed((SelfComposed(Composed((g, sampled)), 3), z, SelfComposed(SelfComposed(g, 2), 5)))
    assert list(leaves(tree, 2)) == [(g, 6), (sampled, 6), (z, 2), (g, 20)]
    assert list(leaves(tree, 2, unwrap=(PoissonSampled,))) == [(g, 6), (h, 6), (z, 2), (g, 20)]
    # the total count of each leaf is what composing the tree count times charges (by hand: 3·2 + 5·2·2)
    assert sum(n for ev, n in leaves(tree, 2) if ev == g) == 26
    assert list(leaves(g)) == [(g, 1)] and list(leaves(Composed(()), 4)) == []


@pytest.mark.parametrize("bad", [
    lambda: PoissonSampled(0.0, Gaussian(1, 1)), lambda: PoissonSampled(1.5, Gaussian(1, 1)),
    lambda: SampledWithoutReplacement(10, 11, Gaussian(1, 1)), lambda: Gaussian(1.0, 0.0),
    lambda: Gaussian(-1.0, 1.0), lambda: Gaussian(1.0, math.inf), lambda: ZCDP(-0.1), lambda: ZCDP(math.nan),
    lambda: TreeAggregation(1.0, 1.0, 0), lambda: Exponential(-1.0), lambda: tree_nodes_per_record(0),
])
def test_invalid_events_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def _released_nodes(T: int) -> list[tuple[int, int]]:
    """The dyadic intervals [k·2^j+1, (k+1)·2^j] of the binary tree that are complete by T."""
    nodes, size = [], 1
    while size <= T:
        nodes += [(k * size + 1, (k + 1) * size) for k in range(T // size)]
        size *= 2
    return nodes


def test_tree_nodes_per_record_matches_brute_force():
    for T in [*range(1, 100), 127, 128, 129, 255, 256, 257]:
        nodes = _released_nodes(T)
        worst = max(sum(a <= leaf <= b for a, b in nodes) for leaf in range(1, T + 1))
        assert worst == tree_nodes_per_record(T) == math.floor(math.log2(T)) + 1, T
    # spec 001 §2.4 table (T, c_T), and the erratum: c_T <= 2 ln T fails exactly for T in {1, 2, 4}
    for T, c in [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (8, 4), (16, 5), (64, 7), (1000, 10)]:
        assert tree_nodes_per_record(T) == c
    assert [T for T in range(1, 2001) if tree_nodes_per_record(T) > 2 * math.log(T)] == [1, 2, 4]
    assert tree_nodes_per_record(2 ** 40) == 41 and tree_nodes_per_record(2 ** 40 - 1) == 40


def test_tree_event_is_a_gaussian_of_sensitivity_s_sqrt_c():
    """spec 001 Cor. 4.4: σ = s·sqrt(c_T)/ρ' makes a period ρ'²/2-zCDP; spec 002 §2.3: s = 1,
    Σ = 16, (ε, δ) = (1, 1e-5) needs σ = 10.96 with the standard zCDP conversion."""
    from dpreg_accounting.accountants import zcdp_rho

    s, T, rp = 0.3, 1000, 0.8
    ev = TreeAggregation.for_period(std=s * math.sqrt(10) / rp, sensitivity=s, period=T)
    assert ev.nodes_per_record == 10
    assert zcdp_rho(ev) == pytest.approx(rp ** 2 / 2, rel=1e-12)
    assert ev.as_gaussian().noise_multiplier == pytest.approx(1 / rp)
    acc = make_accountant("zcdp", Budget(epsilon=1.0, delta=1e-5))
    sigma = acc.calibrate(lambda z: [Charge(TreeAggregation.for_period(z, 1.0, 16))], rtol=1e-6)
    assert sigma == pytest.approx(10.96, abs=0.005)
    assert sigma == pytest.approx(math.sqrt(5 / (2 * 0.0208199)), rel=1e-5)


@pytest.mark.parametrize("relation", ["replace_one", "add_remove"])
def test_clipped_sum_sensitivity_holds_on_data(relation):
    """The largest distance between clipped sums of neighbouring batches is the declared one:
    replace-one moves one record anywhere (2C), add/remove adds or drops one (C)."""
    C = 0.7
    sens = clipped_sum_sensitivity(C, relation)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(200):
        base = torch.randn(8, 5, generator=g, dtype=torch.float64) * 3
        other = base.clone()
        if relation == "replace_one":
            other[-1] = torch.randn(5, generator=g, dtype=torch.float64) * 3
        else:
            other = base[:-1]
        a = clip_and_sum(DenseContribution(per_example={"w": base}), C).aggregate.tensors["w"]
        b = clip_and_sum(DenseContribution(per_example={"w": other}), C).aggregate.tensors["w"]
        worst = max(worst, float((a - b).norm()))
    assert worst <= sens + 1e-12
    assert worst > 0.9 * sens  # attained nearly: the declared sensitivity is not loose
    # scalar (seeded-direction) contributions: ±big clip to ±C, a distance of exactly 2C
    u = Direction(1)
    vals = torch.tensor([0.1, -0.2, 1e9], dtype=torch.float64)
    flipped = vals.clone()
    flipped[-1] = -1e9
    a = clip_and_sum(DirectionContribution(values=vals, direction=u), C).aggregate.coeff
    b = clip_and_sum(DirectionContribution(values=flipped, direction=u), C).aggregate.coeff
    assert abs(a - b) == pytest.approx(clipped_sum_sensitivity(C, "replace_one"))


def test_non_finite_examples_never_leak_through_clipping():
    C = 1.0
    vals = torch.tensor([0.5, math.nan, math.inf, -math.inf], dtype=torch.float64)
    total = clip_and_sum(DirectionContribution(values=vals, direction=Direction(3)), C)
    assert total.aggregate.coeff == 0.5 and total.nonfinite == 3


@pytest.mark.parametrize("make", [lambda: SelfComposed(Gaussian(1.0, 1.0), -3),
                                  lambda: SelfComposed(Gaussian(1.0, 1.0), 2.5),
                                  lambda: Charge(Gaussian(1.0, 1.0), count=-1)])
def test_negative_or_fractional_counts_are_refused(make):
    """A negative count would subtract from the ledger: ε reported below the truth."""
    with pytest.raises(ValueError, match="count"):
        make()


def test_a_negative_count_cannot_lower_the_charged_total():
    acc = make_accountant("zcdp", Budget(rho=1.0))
    acc.charge([Charge(Gaussian(1.0, 1.0))], 0)
    with pytest.raises(ValueError):
        acc.charge([Charge(SelfComposed(Gaussian(1.0, 1.0), -1))], 1)
    assert acc.rho() == 0.5


@pytest.mark.parametrize("name", ["rdp", "rdp_filter", "pld", "zcdp"])
def test_a_zero_count_charge_is_refused_and_a_zero_count_entry_hides_nothing(name):
    """A charge counts at least once: a sampler's count that rounded to 0 charged nothing for steps
    that released (review 17: ε = 0 after ten private steps). A ledger entry of count 0 read back
    from a file costs nothing and hides nothing: 0·∞ is NaN, and dp-accounting turns a NaN RDP
    curve into ε = 0, which once made the RDP accountant report ε = 0 for the whole ledger."""
    acc = make_accountant(name, Budget(epsilon=50.0, delta=1e-5))
    acc.charge([Charge(Gaussian(1.0, 2.0), count=5)], 0)
    before = acc.epsilon()
    for ev in (NonPrivate(), PoissonSampled(0.5, Gaussian(3.0, 2.0))):
        with pytest.raises(ValueError, match="a charge count must be an integer >= 1"):
            Charge(ev, count=0)
        entries = acc.ledger.to_json() + [{"event": ev.to_dict(), "count": 0, "partition": None,
                                           "first_step": 1, "last_step": 1}]
        read_back = make_accountant(name, Budget(epsilon=50.0, delta=1e-5))
        read_back.ledger = Ledger.from_json(entries)
        assert read_back.epsilon() == before
        assert not read_back.fits([Charge(Gaussian(0.5, 2.0), count=100)])
    with pytest.raises(ValueError, match="count"):
        SelfComposed(Gaussian(1.0, 1.0), 0)
