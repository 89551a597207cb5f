"""The tree mechanism: node sets, exact node counts, variances, and the errata of specs 001/002."""

from __future__ import annotations

import math

import pytest
import torch

from dpreg_nonsmooth.tree import (TreeStack, complete_tree_nodes, klt_paper_node_set, klt_paper_nodes,
                                  lowbit, max_nodes_per_leaf, node_set, nodes_per_record, paper_node_bound,
                                  paper_period_position, period_position, released_nodes)
from dpreg_ztc import theory as ztc
from dpreg_klt import theory as klt


def popcount(t: int) -> int:
    return bin(t).count("1")


def test_node_sets_match_spec_examples_and_popcount():
    assert node_set(7) == [(1, 4), (5, 6), (7, 7)]
    assert node_set(8) == [(1, 8)]
    for t in range(1, 2001):
        blocks = node_set(t)
        assert len(blocks) == popcount(t)
        assert blocks[0][0] == 1 and blocks[-1][1] == t  # contiguous, disjoint cover of [1, t]
        assert all(b[1] + 1 == c[0] for b, c in zip(blocks, blocks[1:]))
        assert all(a == b - lowbit(b) + 1 for a, b in blocks)  # identified by the right end


def test_exact_node_count_is_floor_log2_plus_one_up_to_2000():
    # max over leaves of released nodes containing it, built incrementally (node T adds [a, T])
    counts = [0] * 2001
    worst = 0
    for T in range(1, 2001):
        a = T - lowbit(T) + 1
        for q in range(a, T + 1):
            counts[q] += 1
            worst = max(worst, counts[q])
        assert worst == nodes_per_record(T) == math.floor(math.log2(T)) + 1
    for T in (1, 2, 3, 7, 12, 64):  # the brute-force helper agrees
        assert max_nodes_per_leaf(T) == nodes_per_record(T)


def test_paper_2lnT_count_undercounts_exactly_at_1_2_4():
    """Spec 001 §2.4 [ERRATUM]: c_T ≤ 2 ln T fails for T ∈ {1, 2, 4} and nowhere else up to 2000."""
    bad = [T for T in range(1, 2001) if nodes_per_record(T) > paper_node_bound(T)]
    assert bad == [1, 2, 4]
    # the spec's table
    for T, c, two_ln in [(1, 1, 0), (2, 2, 1.39), (3, 2, 2.20), (4, 3, 2.77), (5, 3, 3.22), (8, 4, 4.16),
                         (16, 5, 5.55), (64, 7, 8.32), (1000, 10, 13.8)]:
        assert nodes_per_record(T) == c and paper_node_bound(T) == pytest.approx(two_ln, abs=0.02)


def test_paper_sigma_undernoises_at_1_2_4_and_exact_never_does():
    """Regression: σ = s·sqrt(2 ln T)/ρ (printed) gives ρ_eff > ρ at T ∈ {1, 2, 4}; σ = s·sqrt(c_T)/ρ never."""
    rho, s = 1.0, 0.7
    for T in range(1, 65):
        sens = [s] * T
        exact = ztc.calibrate(rho, T, dim=1, lipschitz=s / 2, smooth_radius=1.0, radius=0.0, b1=1, b2=1)
        assert exact == pytest.approx(s * math.sqrt(nodes_per_record(T)) / rho)  # s = 2dL/B1
        assert ztc.report([exact] * T, sens, T) <= rho * (1 + 1e-12)
        paper = s * math.sqrt(2 * math.log(T)) / rho
        eff = ztc.report([paper] * T, sens, T)
        if T in (1, 2, 4):
            assert eff > rho
        else:
            assert eff <= rho * (1 + 1e-12)


def test_stack_returns_prefix_plus_exactly_the_node_noises():
    """Spec 001 §5.9: out_t = Σ_{i≤t} inc_i + Σ_{(a,b)∈NODE(t)} ξ_b, with ξ_b drawn at step b."""
    tree = TreeStack()
    incs = [torch.tensor([float(i), 2.0 * i, -1.0]) for i in range(1, 14)]
    xis = {}
    for t, inc in enumerate(incs, start=1):
        xis[t] = torch.tensor([1000.0 * t, -7.0 * t, 0.5 * t])
        out = tree.push(inc, lambda shape, t=t: xis[t].clone())
        expect = sum(incs[:t]) + sum(xis[b] for _, b in node_set(t))
        assert torch.equal(out, expect)
        assert len(tree.raw) <= nodes_per_record(13)
        assert torch.equal(tree.prefix_sum(), sum(incs[:t]))


def test_stack_variance_is_popcount_times_d_sigma2_and_resets_independently():
    """Spec 001 §5.9–10 / spec 002 §7.2: E‖out − prefix‖² = d·σ²·popcount(t); covariances are the
    shared node counts; after reset TREE(1) is independent of the previous period."""
    trials, d = 20_000, 3
    g = torch.Generator().manual_seed(1)
    tree = TreeStack()
    outs = []
    for t in range(1, 14):
        outs.append(tree.push(torch.zeros(trials, d, dtype=torch.float64),
                              lambda shape: torch.randn(shape, generator=g, dtype=torch.float64)))
        msq = float(outs[-1].pow(2).sum(1).mean())
        assert msq == pytest.approx(d * popcount(t), rel=0.04)
        assert float(outs[-1].mean()) == pytest.approx(0.0, abs=0.03)
    for p in (3, 6, 7, 12):
        for q in (5, 7, 8, 13):
            cov = float((outs[p - 1][:, 0] * outs[q - 1][:, 0]).mean())
            shared = len(set(node_set(p)) & set(node_set(q)))
            assert cov == pytest.approx(shared, abs=0.06)
    tree.reset()
    fresh = tree.push(torch.zeros(trials, d, dtype=torch.float64),
                      lambda shape: torch.randn(shape, generator=g, dtype=torch.float64))
    assert tree.t == 1 and len(tree.raw) == 1
    corr = float((fresh[:, 0] * outs[-1][:, 0]).mean()) / math.sqrt(popcount(13))
    assert abs(corr) < 0.03


def test_gaussian_audit_every_leaf_within_budget():
    """Spec 001 §5.12: moving increment q by a vector of norm s moves exactly the released nodes
    containing q, so D_α = α·Σ_nodes s²/(2σ²) must be ≤ αρ²/2 for every q (σ from the exact rule)."""
    rho, s, T = 0.8, 0.3, 23
    sigma = s * math.sqrt(nodes_per_record(T)) / rho
    nodes = sorted(released_nodes(T), key=lambda ab: ab[1])
    for q in range(1, T + 1):
        shift = [(a <= q <= b) * s for a, b in nodes]  # each node's sum shifts by s iff it contains q
        d_alpha_over_alpha = sum(v * v for v in shift) / (2 * sigma ** 2)
        assert d_alpha_over_alpha <= rho ** 2 / 2 * (1 + 1e-12)


def test_klt_complete_tree_covers_and_paper_tree_does_not():
    """Spec 002 §7.1: the corrected tree covers [1, p] for every p ≤ Σ with popcount(p) nodes, every leaf
    lies in ⌈log2 Σ⌉+1 of its nodes; the printed 𝒯/NODE fails for Σ = 8, 12, 16."""
    for sigma in (1, 2, 3, 8, 12, 16, 100):
        nodes = complete_tree_nodes(sigma)
        h = math.ceil(math.log2(sigma)) if sigma > 1 else 0
        leaves = 1 << h
        for q in range(1, leaves + 1):
            assert sum(1 for a, b in nodes if a <= q <= b) == h + 1
        for p in range(1, sigma + 1):
            blocks = node_set(p)
            assert set(blocks) <= nodes and len(blocks) == popcount(p)
    for sigma in (8, 16):  # NODE(Σ) stops at Σ − 1: the last step of a period is not covered
        cover = klt_paper_node_set(sigma, sigma)
        assert cover[-1][1] < sigma
    assert (1, 8) in klt_paper_node_set(12, 12) and (1, 8) not in klt_paper_nodes(12)


def test_period_index_never_releases_without_noise():
    """Spec 002 [AMBIG-3]: t mod Σ is 0 at the period's last step (TREE(0) is an empty sum, no noise);
    p = ((t − 1) mod Σ) + 1 stays in {1..Σ}; with Σ = 1 every step is a fresh period."""
    for sigma in (1, 2, 5, 16):
        ps = [period_position(t, sigma) for t in range(1, 4 * sigma + 1)]
        assert min(ps) == 1 and max(ps) == sigma and ps.count(1) == 4
        assert all(len(node_set(p)) >= 1 for p in ps)  # at least one noise node per release
        printed = [paper_period_position(t, sigma) for t in range(1, 4 * sigma + 1)]
        assert 0 in printed  # the printed index: some release has no noise node
    assert [paper_period_position(t, 1) for t in range(1, 5)] == [0, 0, 0, 0]  # "t mod Σ = 1" never true


def test_klt_prop25_and_exact_calibration_numbers():
    """Spec 002 §7.13: σ(s=1, Σ=16, ε=1, δ=1e-5) = 27.14 (log2) / 22.60 (ln); exact zCDP 10.96 ≤ both."""
    assert klt.prop25_sigma(1, 16, 1, 1e-5) == pytest.approx(27.14, abs=0.01)
    assert klt.prop25_sigma(1, 16, 1, 1e-5, log="ln") == pytest.approx(22.60, abs=0.01)
    exact = klt.exact_tree_sigma(1, 16, 1, 1e-5)
    assert exact == pytest.approx(10.96, abs=0.01)
    assert exact <= klt.prop25_sigma(1, 16, 1, 1e-5, log="ln")
