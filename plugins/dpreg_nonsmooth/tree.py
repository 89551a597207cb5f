"""The binary tree mechanism (continual counting) over one period of a stream.

Spec 001 §1.5 and spec 002 §1.2. Step t of a period releases Σ_{i≤t} inc_i + TREE(t), where
TREE(t) sums one independent Gaussian per dyadic block of NODE(t). Every block that is ever
released ends at some b ≤ T and is (b − lowbit(b) + 1, b), so "one fresh Gaussian per step, kept
for the block that ends there" is exactly one noise draw per released node (:class:`TreeStack`).

Errata this module corrects (each has a regression test):

* node count: a record (leaf) lies in at most ⌊log2 T⌋ + 1 released nodes; the paper's 2·ln T
  bound is smaller at T ∈ {1, 2, 4} and under-noises there (spec 001 §2.4 erratum);
* indexing: the position inside a period is p = ((t − 1) mod Σ) + 1; the printed "t mod Σ" is 0
  at the last step of every period, where TREE(0) is an empty sum: a release with no noise
  (spec 002 [AMBIG-3]);
* the node set: KLT's printed 𝒯 stops at width Σ/2 and cannot cover [1, Σ]; the complete tree
  with its root can (spec 002 [AMBIG-4]).

What accounting needs of the tree, the nodes a record lies in, is dpregistry's
(:func:`dpregistry.privacy.events.tree_nodes_per_record`, used by the ``TreeAggregation`` event);
the rest is the mechanism's own arithmetic, public for the paper plugins (see the package's
``__all__``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from dpregistry.privacy.events import tree_nodes_per_record


def lowbit(b: int) -> int:
    """The largest power of two dividing b (b & −b)."""
    return b & -b


def node_set(t: int) -> list[tuple[int, int]]:
    """NODE(t): the dyadic blocks covering [1, t], largest first (spec 001 §1.5).

    NODE(7) = [(1, 4), (5, 6), (7, 7)], NODE(8) = [(1, 8)]; |NODE(t)| = popcount(t).
    """
    if t < 1:
        raise ValueError(f"tree positions start at 1, got {t}")
    out, k = [], 0
    for i in range(t.bit_length() - 1, -1, -1):
        w = 1 << i
        if k + w <= t:
            out.append((k + 1, k + w))
            k += w
    return out


def released_nodes(T: int) -> set[tuple[int, int]]:
    """Every node some step of a period of length T releases: (b − lowbit(b) + 1, b), b ≤ T."""
    return {(b - lowbit(b) + 1, b) for b in range(1, T + 1)}


#: exact worst-case number of released nodes containing one leaf: ⌊log2 T⌋ + 1 (spec 001 §2.4
#: [ERRATUM]: the paper's 2·ln T is smaller at T ∈ {1, 2, 4})
nodes_per_record = tree_nodes_per_record


def max_nodes_per_leaf(T: int) -> int:
    """Brute force: max over leaves q of #{released nodes (a, b) with a ≤ q ≤ b} (for tests)."""
    nodes = released_nodes(T)
    return max(sum(1 for a, b in nodes if a <= q <= b) for q in range(1, T + 1))


def paper_node_bound(T: int) -> float:
    """The printed bound 2·ln T on the nodes per leaf (ZTC Cor. 4.4); wrong at T ∈ {1, 2, 4}."""
    return 2.0 * math.log(T)


def period_position(t: int, period: int) -> int:
    """Position p ∈ {1..Σ} of global step t ≥ 1 in its period: ((t − 1) mod Σ) + 1.

    Spec 002 [AMBIG-3]: the paper prints ``t mod Σ``, which is 0 at p = Σ (no noise there).
    """
    return ((t - 1) % period) + 1


def paper_period_position(t: int, period: int) -> int:
    """The printed index ``t mod Σ`` (for the regression test only)."""
    return t % period


def complete_tree_nodes(sigma: int) -> set[tuple[int, int]]:
    """KLT's corrected tree (spec 002 §1.2): all dyadic blocks of a 2^h-leaf tree, root included."""
    h = max(sigma - 1, 0).bit_length()  # ceil(log2 Σ), 0 for Σ = 1
    return {(j * (1 << l) + 1, (j + 1) * (1 << l)) for l in range(h + 1) for j in range(1 << (h - l))}


def klt_paper_nodes(sigma: int) -> set[tuple[int, int]]:
    """KLT's printed 𝒯: widths 2^{ℓ−1} for ℓ = 1..log Σ only (no root; [AMBIG-4])."""
    top = sigma.bit_length() - 1  # ℓ ≤ log2 Σ (real), so widths stop at 2^{⌊log2 Σ⌋−1}
    return {(j * (1 << (l - 1)) + 1, (j + 1) * (1 << (l - 1)))
            for l in range(1, top + 1) for j in range(sigma // (1 << (l - 1)))}


def klt_paper_node_set(p: int, sigma: int) -> list[tuple[int, int]]:
    """KLT's printed NODE(p): greedy widths 2^{⌈log Σ⌉−i}, i = 1..⌈log Σ⌉ (never the full width)."""
    h = max(sigma - 1, 0).bit_length()
    out, k = [], 0
    for i in range(1, h + 1):
        w = 1 << (h - i)
        if k + w <= p:
            out.append((k + 1, k + w))
            k += w
    return out


@dataclass
class TreeStack:
    """O(log T) state of the binary mechanism (spec 001 §1.5, "equivalent O(d log T) form").

    Each entry is (length, raw block sum, raw + its node's noise). ``push`` merges the blocks
    that the new step completes, draws ONE fresh Gaussian for the new node, and returns
    Σ_stack noisy = Σ_{i≤t} inc_i + Σ_{NODE(t)} ξ_b. At most ⌊log2 T⌋ + 1 entries are live.
    Its fields are plain values, so it is the tree privatizer's checkpointed ``State`` as it is.
    """

    t: int = 0
    lengths: list[int] = field(default_factory=list)
    raw: list[torch.Tensor] = field(default_factory=list)
    noisy: list[torch.Tensor] = field(default_factory=list)

    def reset(self) -> None:
        self.t, self.lengths, self.raw, self.noisy = 0, [], [], []

    def push(self, inc: torch.Tensor, noise: Callable[[torch.Size], torch.Tensor]) -> torch.Tensor:
        """Add increment ``inc``; ``noise(shape)`` returns the new node's Gaussian (std applied)."""
        self.t += 1
        target = lowbit(self.t)
        raw, length = inc.clone(), 1
        while length < target:
            length += self.lengths.pop()
            raw.add_(self.raw.pop())
            self.noisy.pop()
        self.lengths.append(target)
        self.raw.append(raw)
        self.noisy.append(raw + noise(raw.shape))
        out = self.noisy[0].clone()
        for v in self.noisy[1:]:
            out.add_(v)
        return out

    def prefix_sum(self) -> torch.Tensor | None:
        """Σ_{i≤t} inc_i (noiseless; never released)."""
        if not self.raw:
            return None
        out = self.raw[0].clone()
        for v in self.raw[1:]:
            out.add_(v)
        return out
