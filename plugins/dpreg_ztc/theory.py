"""Closed forms of Zhang–Tran–Cutkosky (ICLR 2024), with the errata of spec 001 applied.

ρ below is the paper's privacy parameter: (α, αρ²/2)-RDP for every α > 1, i.e. ρ²/2-zCDP
(spec 001 §0); a recipe's ``privacy.rho`` is the zCDP parameter ρ²/2.
"""

from __future__ import annotations

import math

from dpregistry.privacy.events import tree_nodes_per_record as nodes_per_record

from dpreg_nonsmooth import node_set, paper_node_bound


def theory_T(dim: int, lipschitz: float, smooth_radius: float, n: int, init_gap: float, rho: float,
             rule: str = "max") -> int:
    """Episode length T of Theorem 4.9 (spec 001 §1.6) for M = n records.

    T1 = (√d·L·δ·M/(F* + Lδ))^{2/3} balances the non-private terms and
    T2 = (d^{3/2}·L·δ·M/((F* + Lδ)ρ))^{1/2} the privacy term. [ERRATUM] the paper prints min;
    max bounds every term by its balanced value (with min, T2 → 0 as ρ → ∞ and the non-private
    rate is lost). ``rule="min"`` is kept for the ablation only. Clamped to [1, M // 2].
    """
    d, L, delta = dim, lipschitz, smooth_radius
    scale = L * delta * n / (init_gap + L * delta)
    t1 = (math.sqrt(d) * scale) ** (2 / 3)
    t2 = math.sqrt(d ** 1.5 * scale / rho) if rho > 0 and math.isfinite(rho) else 0.0
    if rule == "max":
        t = max(t1, t2)
    elif rule == "min":
        t = min(t1, t2) if t2 > 0 else t1
    else:
        raise ValueError(f"unknown T rule {rule!r}")
    return int(min(max(round(t), 1), max(n // 2, 1)))


def naive_T(dim: int, lipschitz: float, smooth_radius: float, n: int, init_gap: float, rho: float,
            batch: int = 1) -> int:
    """T for App. E's naive oracle: both of its terms scale as 1/√T, so T balances A·T against
    (√d·L + 2d^{3/2}L/(Bρ))/√T (corrected σ = 2dL/(Bρ), spec 001 §1.7; max, not the printed min)."""
    d, L, delta = dim, lipschitz, smooth_radius
    scale = L * delta * (n / batch) / (init_gap + L * delta)
    b = math.sqrt(d / batch) + (2 * d ** 1.5 / (batch * rho) if rho > 0 and math.isfinite(rho) else 0.0)
    return int(min(max(round((b * scale) ** (2 / 3)), 1), max(n // (2 * batch), 1)))


def error_bound(T: float, A: float, B: float, C: float) -> float:
    """The shape A·T + B/√T + C/T of the §3.4 bound (for the min-versus-max regression)."""
    return A * T + B / math.sqrt(T) + C / T


def node_count(T: int, rule: str = "exact") -> float:
    """Nodes per record c_T: exact ⌊log2 T⌋+1; ``paper`` 2 ln T (under-counts at T ∈ {1, 2, 4});
    ``conservative`` the larger of the two (spec 001 §2.4)."""
    if rule == "exact":
        return nodes_per_record(T)
    if rule == "paper":
        return paper_node_bound(T)
    if rule == "conservative":
        return max(paper_node_bound(T), nodes_per_record(T))
    raise ValueError(f"unknown node count rule {rule!r}")


def element_sensitivity(dim: int, lipschitz: float, smooth_radius: float, radius: float, b1: int, b2: int) -> float:
    """s = max(2dL/B1, 4dLD/(B2·δ)): GRAD (Lemma 3.1) and DIFF at ‖w_t − w_{t−1}‖ ≤ 2D (Lemma 3.2)."""
    d, L = dim, lipschitz
    return max(2 * d * L / b1, 4 * d * L * radius / (b2 * smooth_radius))


def calibrate(rho: float, T: int, dim: int, lipschitz: float, smooth_radius: float, radius: float,
              b1: int, b2: int, count_rule: str = "exact") -> float:
    """σ of every tree node for (α, αρ²/2)-RDP per episode (spec 001 §2.8): σ = s·sqrt(c_T)/ρ."""
    s = element_sensitivity(dim, lipschitz, smooth_radius, radius, b1, b2)
    return s * math.sqrt(node_count(T, count_rule)) / rho


def report(sigmas: list[float], sens: list[float], T: int) -> float:
    """ρ_eff of one episode from per-node σ_b and per-element s_i, by the exact max over leaves
    (spec 001 §2.3): ρ_eff² = max_q Σ_{released (a,b) ∋ q} (max_{i∈[a,b]} s_i)² / σ_b²."""
    released = {blk for t in range(1, T + 1) for blk in node_set(t)}
    worst = 0.0
    for q in range(1, T + 1):
        tot = 0.0
        for a, b in released:
            if a <= q <= b:
                s = max(sens[i - 1] for i in range(a, b + 1))
                tot += math.inf if sigmas[b - 1] == 0 else s * s / sigmas[b - 1] ** 2
        worst = max(worst, tot)
    return math.sqrt(worst)


def naive_sigma(dim: int, lipschitz: float, batch: int, rho: float, printed: bool = False) -> float:
    """App. E: σ = 2dL/(Bρ) for the replace-one sensitivity 2dL/B ([ERRATUM]: printed dL/(Bρ))."""
    return (1 if printed else 2) * dim * lipschitz / (batch * rho)
