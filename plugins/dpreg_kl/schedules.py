"""The data-independent constants of the KL algorithms (spec 004 §1), computed before any data access.

Units: every σ here is the std of the noise on a *mean* over the n records (the paper's units);
privatizers noise the clipped *sum*, so the algorithms pass ``std = σ·n``. Sensitivities are the
true L2 distances between neighbouring means under the run's relation (``clipped_sum_sensitivity``:
2C/n for replace-one), never the paper's L0/n convention (spec §0.1, [AMBIG-3]).

Integer rounding: K, T_k, T and T_A are rounded up once and the same integer is used everywhere
(spec §0, [REC]). ``ln`` is the natural log ([AMBIG-1]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dpregistry import UserError
from dpregistry.privacy.events import clipped_sum_sensitivity

CALIBRATIONS = ("paper", "exact")

#: Exact mode sizes its noise for ρ·(1 − 1e-9): the accountants decide budgets exactly, and a sum
#: of T equal shares ρ/T can exceed ρ by one float rounding; this margin absorbs it (1e-9 more noise).
SIZING_MARGIN = 1.0 - 1e-9


def gaussian_cost(sensitivity: float, std: float) -> float:
    """zCDP cost Δ²/(2σ²) of one Gaussian query (Bun–Steinke)."""
    if std == 0:
        return math.inf
    ratio = sensitivity / std  # first: Δ² or σ² alone overflows for a clip of 1e300, their ratio does not
    return ratio * ratio / 2.0


# --------------------------------------------------------------------------------------------
# Algorithm 1: KL-Spider (spec §1.1)
# --------------------------------------------------------------------------------------------


@dataclass
class SpiderSchedule:
    """Every constant of Alg. 1 for known (γ, κ), κ ∈ [1, 2].

    ``calibration = "paper"`` uses the printed σ formulas and C_f = 32; the true replace-one cost
    of that run is up to 2.125ρ (spec §1.1 "Exact replace-one costs", [AMBIG-5]).
    ``calibration = "exact"`` splits ρ between the anchors (share θ) and the difference queries,
    sets each σ from its true sensitivity, and sets C_f = 16(a + b), a and b the σ's relative to the
    paper's, so that Lemma 2 still holds (spec §1.1 "calibration: exact"); the planned total is ≤ ρ.
    The spec splits (1 − θ)ρ/K over T_k queries per round; only T_k − 1 are ever issued (below), so
    each gets (1 − θ)ρ/(K(T_k − 1)), which only lowers b. At κ = 2 no round issues a difference
    query and θ = 1: all of ρ goes to the anchors.

    Round k issues one anchor and at most T_k − 1 difference queries: the last difference query
    of a round that runs its T_k steps is never used, so it is not issued (spec §1.1 [REC]).
    """

    n: int
    rho: float
    d: int
    beta: float
    f0: float
    gamma: float
    kappa: float
    lipschitz: float          # L0: per-sample gradient bound (the anchor clip)
    smoothness: float         # L1: per-sample smoothness (difference clip = L1·r_k)
    calibration: str = "exact"
    anchor_share: float | None = None   # θ; None: 1 at κ = 2 (no difference queries), else 1/2
    relation: str = "replace_one"

    # derived (filled by __post_init__)
    e: float = field(init=False)
    c: float = field(init=False)
    K_raw: float = field(init=False)
    K: int = field(init=False)
    beta_prime: float = field(init=False)
    c_floor: float = field(init=False)       # C_f
    phi_floor: float = field(init=False)
    sigma_hat: float = field(init=False)     # anchor noise std (on the mean)
    phi: np.ndarray = field(init=False)      # Φ̂_k, k = 1..K (index k-1)
    T: np.ndarray = field(init=False)        # T_k
    sigma: np.ndarray = field(init=False)    # σ_k, difference-query noise std (on the mean)
    r: np.ndarray = field(init=False)        # r_k, step length
    theta: np.ndarray = field(init=False)    # θ_k, round-end threshold on ‖v‖

    def __post_init__(self):
        if not 1.0 <= self.kappa <= 2.0:
            raise ValueError(f"KL-Spider needs κ in [1, 2], got {self.kappa}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}")
        n, rho, d, kap, g, L0, L1, F0 = (self.n, self.rho, self.d, self.kappa, self.gamma,
                                         self.lipschitz, self.smoothness, self.f0)
        nsr = n * math.sqrt(rho)
        self.e = (2.0 - kap) / kap
        self.c = 1.0 + F0 ** self.e / (64.0 * g * g * L1)
        self.K_raw = (1.0 + 64.0 * F0 ** (-self.e) * g * g * L1) * (
            math.log(F0) + kap * math.log(nsr / (g * L0 * math.sqrt(d))))
        self.K = max(0, math.ceil(self.K_raw))
        K = max(self.K, 1)
        # β′ = β / (a bound on the number of steps); a run takes at least K steps, so β′ ≤ β/K (the
        # formula exceeds that only where the theory is vacuous, and ln(1/β′) would turn negative).
        ratio = g * L0 * math.sqrt(K * d) / (nsr * F0 ** (1.0 / kap))
        self.beta_prime = (self.beta / K) * min(1.0, ratio ** (2.0 - kap))
        self.c_floor = 32.0 if self.calibration == "paper" else self._exact_c_floor()
        noise = g * L0 * math.sqrt(K * d * math.log(1.0 / self.beta_prime)) / nsr
        self.phi_floor = min((self.c_floor * noise) ** kap, F0)
        k = np.arange(1, self.K + 1, dtype=np.float64)
        self.phi = np.maximum(F0 * self.c ** (-k), self.phi_floor)
        # κ = 2 gives e = 0 and (F0/Φ̂)^0 = 1.0 exactly, so T_k = 1 without any fudge.
        self.T = np.maximum(np.ceil((F0 / self.phi) ** self.e), 1).astype(np.int64)
        self.r = self.phi ** (1.0 / kap) / (4.0 * g * L1)
        self.theta = (7.0 / (8.0 * g)) * self.phi ** (1.0 / kap)
        if self.calibration == "paper":
            self.sigma_hat = L0 * math.sqrt(K) / nsr
            self.sigma = self.phi ** (1.0 / kap) * np.sqrt(self.T * K) / (g * nsr)
        else:
            share = self.share
            rho = rho * SIZING_MARGIN
            self.sigma_hat = self.anchor_sensitivity / math.sqrt(2.0 * share * rho / K)
            if share >= 1.0:  # no budget for differences: only valid when no round issues one
                self.sigma = np.full(self.K, math.inf)
            else:
                m = np.maximum(self.T - 1, 1)  # queries issued (rounds with none never use σ_k)
                rho_diff = (1.0 - share) * rho / (K * m)
                self.sigma = self.difference_sensitivity(self.r) / np.sqrt(2.0 * rho_diff)

    # -- helpers --------------------------------------------------------------------------------

    def _exact_c_floor(self) -> float:
        """C_f = 16(a + b), a and b the σ's relative to the paper's (spec §1.1, "calibration: exact").

        a = σ̂·n√ρ/(L0√K) with σ̂ = Δ0/√(2θρ/K). b_k = σ_k γn√ρ/(Φ̂_k^{1/κ}√(T_k K)) with
        σ_k = Δ_k/√(2ρ_diff,k), Δ_k = s(L1 r_k)/n and r_k = Φ̂_k^{1/κ}/(4γL1): the Φ̂ factors cancel
        and b_k = (s(1)/4)·√(m_k/T_k)/√(2(1−θ)) with m_k = T_k − 1 < T_k, so b = (s(1)/4)/√(2(1−θ))
        bounds every round. Replace-one, θ = 1/2: a = 2, b = 1/2, C_f = 40 (as the spec states).
        """
        share, K = self.share, max(self.K, 1)
        nsr = self.n * math.sqrt(self.rho)
        a = (self.anchor_sensitivity / math.sqrt(2.0 * share * self.rho / K)) * nsr / (self.lipschitz * math.sqrt(K))
        if share >= 1.0:
            return 16.0 * a
        b = (clipped_sum_sensitivity(1.0, self.relation) / 4.0) / math.sqrt(2.0 * (1.0 - share))
        return 16.0 * (a + b)

    @property
    def share(self) -> float:
        """θ, the anchors' share of ρ: all of it at κ = 2 (T_k ≡ 1, no difference queries), else 1/2."""
        if self.anchor_share is not None:
            return self.anchor_share
        return 1.0 if self.kappa == 2.0 else 0.5

    @property
    def anchor_sensitivity(self) -> float:
        """L2 distance between neighbouring clipped mean gradients (2L0/n under replace-one)."""
        return clipped_sum_sensitivity(self.lipschitz, self.relation) / self.n

    def difference_sensitivity(self, step_length):
        return clipped_sum_sensitivity(1.0, self.relation) * self.smoothness * step_length / self.n

    @cached_property
    def max_differences(self) -> np.ndarray:
        """Difference queries round k can issue: T_k − 1 (the last one would be unused)."""
        return self.T - 1

    @cached_property
    def worst_case_releases(self) -> int:
        return int(self.K + int(self.max_differences.sum()))

    def planned_costs(self) -> tuple[float, float]:
        """(anchors, differences): the true zCDP cost of the worst-case run."""
        anchors = self.K * gaussian_cost(self.anchor_sensitivity, self.sigma_hat)
        diffs = float(sum(int(m) * gaussian_cost(self.difference_sensitivity(r), s)
                          for m, r, s in zip(self.max_differences, self.r, self.sigma) if m))
        return anchors, diffs


# --------------------------------------------------------------------------------------------
# Algorithm 2: private proximal point with Algorithm 4 as the inner solver (spec §1.2)
# --------------------------------------------------------------------------------------------


@dataclass
class ProximalSchedule:
    """Constants of Alg. 2 (outer T calls at ρ/T each) and Alg. 4 (projected noisy GD).

    Alg. 4 takes T_A − 1 noisy gradient steps (u_1 = c, loop j = 1..T_A − 1, [AMBIG-7]).
    ``calibration = "paper"``: σ_A² = 4L0²T_A/(n²ρ_A), which under replace-one spends ρ_A/2 per
    call (safe, half wasted). ``"exact"``: σ_A from ρ_A split over the T_A − 1 queries at the true
    sensitivity, which spends exactly ρ_A. ``max_inner_steps`` caps T_A: privacy is unchanged
    (σ_A is computed from the capped count, so each call still costs ≤ ρ_A) but Lemma 3's utility
    bound, which needs the uncapped T_A, no longer applies (spec §1.2, "Cost").
    """

    n: int
    rho: float
    d: int
    beta: float
    f0: float
    gamma: float
    kappa: float
    lipschitz: float          # L0 (clip)
    weak_convexity: float     # L̃1
    calibration: str = "exact"
    max_inner_steps: int | None = None
    relation: str = "replace_one"

    T_raw: float = field(init=False)
    T: int = field(init=False)
    rho_call: float = field(init=False)
    beta_call: float = field(init=False)
    T_A_uncapped: int = field(init=False)
    T_A: int = field(init=False)
    sigma: float = field(init=False)
    radius: float = field(init=False)

    def __post_init__(self):
        if self.kappa < 2.0:
            raise ValueError(f"the proximal point method needs κ >= 2, got {self.kappa}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}")
        g, kap, L0, Lt, F0 = self.gamma, self.kappa, self.lipschitz, self.weak_convexity, self.f0
        nsr = self.n * math.sqrt(self.rho)
        self.T_raw = (1.0 + 32.0 * F0 ** ((kap - 2.0) / kap) * g * g * Lt) * (
            math.log(F0) + kap * math.log(nsr / (g * L0 * math.sqrt(self.d))))
        self.T = max(0, math.ceil(self.T_raw))
        T = max(self.T, 1)
        self.rho_call = self.rho / T
        self.beta_call = self.beta / T
        log_term = math.log(2.0 / self.beta_call) ** 2
        self.T_A_uncapped = max(1, math.ceil(self.n ** 2 * self.rho_call * log_term / self.d))
        self.T_A = min(self.T_A_uncapped, self.max_inner_steps) if self.max_inner_steps else self.T_A_uncapped
        self.radius = L0 / (2.0 * Lt)
        queries = self.T_A - 1
        if self.calibration == "paper":
            self.sigma = math.sqrt(4.0 * L0 ** 2 * self.T_A / (self.n ** 2 * self.rho_call))
        else:
            self.sigma = self.sensitivity / math.sqrt(2.0 * self.rho_call * SIZING_MARGIN / max(queries, 1))

    @property
    def sensitivity(self) -> float:
        return clipped_sum_sensitivity(self.lipschitz, self.relation) / self.n

    @property
    def capped(self) -> bool:
        return self.T_A < self.T_A_uncapped

    def lr(self, j: int) -> float:
        """η_j = 1/(L̃1·j)."""
        return 1.0 / (self.weak_convexity * j)

    @property
    def worst_case_releases(self) -> int:
        return self.T * (self.T_A - 1)

    def planned_cost(self) -> float:
        return self.worst_case_releases * gaussian_cost(self.sensitivity, self.sigma)


# --------------------------------------------------------------------------------------------
# Algorithm 3: adaptive noisy GD (spec §1.3)
# --------------------------------------------------------------------------------------------


@dataclass
class AdaptiveConstants:
    """Constants of Alg. 3 at budget ρ (the share of the budget the descent may spend).

    The paper's σ̂ = L0/(√n ρ^{1/4}) and σ_min = 2L0/(n√ρ) assume Δ = 2L0/n (replace-one); under
    another relation they are scaled by Δ/(2L0/n), so every query costs what it costs under
    replace-one: the norm query 2√ρ/n, a gradient query Δ²/(2σ_t²) ≤ ρ/2. The filter charges
    those true costs (never the paper's closed-form ρ_t, which under-charges; spec §1.3).
    """

    n: int
    rho: float
    beta: float
    lipschitz: float
    relation: str = "replace_one"

    def __post_init__(self):
        scales = {"sensitivity": self.sensitivity, "σ̂": self.sigma_norm, "σ_min": self.sigma_min}
        if not all(math.isfinite(v) and v > 0 for v in scales.values()):
            shown = ", ".join(f"{k} = {v:g}" for k, v in scales.items())
            raise UserError(f"{self.lipschitz:g} puts the noise scales out of range ({shown})", key="privatizer.clip")

    @property
    def sensitivity(self) -> float:
        return clipped_sum_sensitivity(self.lipschitz, self.relation) / self.n

    @property
    def unit(self) -> float:
        return self.sensitivity / (2.0 * self.lipschitz / self.n)

    @property
    def ell(self) -> float:
        """ℓ = ln(n√ρ/β)."""
        return math.log(self.n * math.sqrt(self.rho) / self.beta)

    @property
    def sigma_norm(self) -> float:
        """σ̂, the std of the scalar norm query."""
        return self.unit * self.lipschitz / (math.sqrt(self.n) * self.rho ** 0.25)

    @property
    def sigma_min(self) -> float:
        return self.unit * 2.0 * self.lipschitz / (self.n * math.sqrt(self.rho))

    def sigma_t(self, noisy_norm: float, dim: int) -> float:
        """σ_t = max{N_t/√(dℓ), σ_min}, from the *noisy* norm N_t only (N_t ≤ 0 gives σ_min)."""
        if not math.isfinite(noisy_norm) or noisy_norm <= 0:
            return self.sigma_min
        return max(self.unit * noisy_norm / math.sqrt(dim * self.ell), self.sigma_min)

    def step_cost(self, sigma_t: float) -> float:
        """True zCDP cost of one step: the norm query plus the gradient query at σ_t."""
        return gaussian_cost(self.sensitivity, self.sigma_norm) + gaussian_cost(self.sensitivity, sigma_t)

    def paper_ledger_entry(self, noisy_norm: float, dim: int) -> float:
        """The paper's closed-form ρ_t = min{L0²dℓ/(n²N_t²), ρ/2} + √ρ/n (for comparison only:
        it halves every cost, and for N_t ≤ 0 it can be tiny while σ_t = σ_min costs ρ/2)."""
        n, L0 = self.n, self.lipschitz
        head = math.inf if noisy_norm == 0 else L0 ** 2 * dim * self.ell / (n ** 2 * noisy_norm ** 2)
        return min(head, self.rho / 2.0) + math.sqrt(self.rho) / n

    @property
    def max_steps(self) -> int:
        """Each step's norm query costs 2√ρ/n, so a filter at ρ allows at most n√ρ/2 steps."""
        return math.floor(self.rho / gaussian_cost(self.sensitivity, self.sigma_norm) * (1 + 1e-12))


def selection_epsilon(rho_select: float) -> float:
    """ε of the exponential mechanism whose bounded-range zCDP cost ε²/8 is ``rho_select``."""
    return math.sqrt(8.0 * rho_select)


def exponential_log_weights(grad_norms, epsilon: float, score_sensitivity: float) -> np.ndarray:
    """log P(t) of the exponential mechanism on the score −‖∇F(w_t)‖ (Thm 5), normalised.

    P(t) ∝ exp(−ε‖∇F(w_t)‖/(2Δu)); with Δu = 2L0/n and ε = 2√ρ this is the paper's
    exp(−(n√ρ/(2L0))‖∇F(w_t)‖).
    """
    s = -np.asarray(grad_norms, dtype=np.float64) * epsilon / (2.0 * score_sensitivity)
    s = s - s.max()
    return s - math.log(np.exp(s).sum())
