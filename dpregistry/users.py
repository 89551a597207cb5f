"""User-level privacy (``privacy.unit: user``): the privacy unit is a person, not a row.

Two mechanisms (Charles et al. 2024, "Fine-Tuning Large Language Models with User-Level
Differential Privacy"), chosen by the sampler:

* **ULS**, user-level sampling (``sampler: user_poisson``): a Poisson sample of users; each
  sampled user's contribution is the mean of the contributions of their (at most k) examples,
  clipped to C as one vector, summed and noised. The record of the analysis is the user, so the
  sensitivity is 2C under replace-one of a user's whole data and the sample rate is users sampled
  ÷ users: the events and accountants are the example-level ones, read at the user level.
* **ELS**, example-level sampling with contribution bounding (any example-level sampler): at most
  k examples per user are kept, chosen with public randomness before training; the run is
  example-level DP, and group privacy of size k converts it to the user level. With the group
  privacy lemma, (ε₀, δ₀)-DP for one example is (kε₀, k·e^{(k−1)ε₀}·δ₀)-DP for k examples, so
  a user-level target (ε, δ) is met by the example-level target ε₀ = ε/k,
  δ₀ = δ / (k·e^{(k−1)ε/k}); a zCDP target ρ by ρ₀ = ρ/k² (ρ-zCDP is k²ρ-zCDP for groups of k).

Both keep the same public selection of at most k examples per user (:func:`bound_contributions`):
a function of the run's seed and the user ids only, never of the labels or texts.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import UserError
from .privacy.accountant import Budget


@dataclass(frozen=True)
class UserIds:
    """The user of each training record (an objective provides it for ``privacy.unit: user``)."""

    ids: torch.Tensor  # [n_train] int64


@dataclass(frozen=True)
class UserGroups:
    """The users of a user-level run and the (at most k) records each contributes: the records of
    user u are ``members[offsets[u]:offsets[u + 1]]`` (objective indices)."""

    members: torch.Tensor  # [kept] int64, grouped by user
    offsets: torch.Tensor  # [users + 1] int64
    k: int

    @property
    def n_users(self) -> int:
        return len(self.offsets) - 1

    def records_of(self, users: torch.Tensor) -> torch.Tensor:
        """The records of ``users``, user after user."""
        if len(users) == 0:
            return self.members[:0]
        starts, ends = self.offsets[users], self.offsets[users + 1]
        return torch.cat([self.members[s:e] for s, e in zip(starts.tolist(), ends.tolist())])

    def digest(self) -> str:
        """Identifies the selection (recorded in the run's summary)."""
        h = hashlib.sha256(self.members.numpy().tobytes() + self.offsets.numpy().tobytes())
        return h.hexdigest()[:16]


def bound_contributions(user_ids: torch.Tensor, k: int, seed: int) -> UserGroups:
    """At most ``k`` records per user, chosen with public randomness: a function of the seed and
    the user ids alone (never of the labels or texts). Which of a user's records are kept depends
    on the seed and on that user's own records alone (how many, in which order), so adding,
    removing or replacing one user changes no other user's selection: the sensitivity argument
    needs that (one random order of all records made every user's selection depend on n, and a
    neighbouring data set changed them all). Over seeds each user's kept records are a uniformly
    random k of theirs; within one seed, users with as many records keep the same positions."""
    ids = torch.as_tensor(user_ids, dtype=torch.int64)
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)  # users in sorted order
    records = torch.argsort(inverse, stable=True)              # grouped by user, in file order within each
    starts = torch.cumsum(counts, 0) - counts
    count = torch.repeat_interleave(counts, counts)            # each record's user's number of records
    position = torch.arange(len(ids)) - torch.repeat_interleave(starts, counts)  # its place among them
    rank = position.clone()
    by_count = torch.argsort(count, stable=True)               # the records of users of c records together
    sizes, seen = torch.unique_consecutive(count[by_count], return_counts=True)
    for c, at in zip(sizes.tolist(), torch.split(by_count, seen.tolist())):
        if c > k:                                              # one random order of c records per count
            key = hashlib.sha256(f"{seed}/{c}".encode()).digest()[:8]
            order_of = torch.argsort(torch.randperm(c, generator=torch.Generator().manual_seed(
                int.from_bytes(key, "big"))))
            rank[at] = order_of[position[at]]
    members = records[rank < k]
    kept = counts.clamp(max=k)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kept, 0)])
    return UserGroups(members, offsets, k)


def example_budget(user: Budget, k: int) -> Budget:
    """The example-level budget whose guarantee, by group privacy of size k, is the user-level one."""
    if k == 1:
        return user
    eps = None if user.epsilon is None else user.epsilon / k
    delta = None
    if user.delta is not None and user.epsilon is not None:  # δ/(k·e^{(k−1)ε/k}), in logs
        delta = math.exp(math.log(user.delta) - math.log(k) - (k - 1) * user.epsilon / k)
        if delta == 0.0:
            raise UserError(f"privacy.epsilon = {user.epsilon:g} with at most {k} examples per user: group privacy "
                            f"needs an example-level δ of δ/(k·e^((k−1)ε/k)), below the smallest float; lower the "
                            f"ε or privacy.max_examples_per_user", key="privacy.epsilon")
    elif user.delta is not None:
        delta = user.delta / k
    rho = None if user.rho is None else user.rho / (k * k)
    return Budget(eps, delta, rho, user.relation)


_LOG_TINY = math.log(1e-300)


def user_epsilon(epsilon_at: Callable[[float], float], k: int, delta: float, delta0: float | None = None) -> float:
    """The user-level ε at the user-level δ of an example-level accountant, by group privacy of
    size k: k·ε₀ with ε₀ = ``epsilon_at(δ₀)`` for an example-level δ₀ such that
    k·e^{(k−1)ε₀}·δ₀ ≤ δ (:func:`user_delta`).

    ``delta0`` (the budget's δ₀) is tried first: it holds whenever the ledger is within an ε
    target. Otherwise (no ε target, a ρ target, an over-budget plan) the largest valid δ₀ is
    searched for on a log scale; every candidate is checked, so the ε returned is valid whatever
    the shape of ``epsilon_at``, and inf when no δ₀ is (reading ε₀ at δ/k and reporting k·ε₀ at
    δ understated ε: its δ was e^{(k−1)ε₀}·δ)."""
    if k == 1:
        return epsilon_at(delta)

    def check(d0: float) -> tuple[float, bool]:  # ε₀ at δ₀, and whether k·e^{(k−1)ε₀}·δ₀ ≤ δ (in logs)
        e0 = epsilon_at(d0)
        return e0, math.log(k) + (k - 1) * e0 + math.log(d0) <= math.log(delta)

    def at(x: float) -> tuple[float, bool]:  # at δ₀ = e^x
        return check(math.exp(x))

    if delta0 is not None and (found := check(delta0))[1]:
        return k * found[0]
    # Smaller δ₀ lowers k·e^{(k−1)ε₀}·δ₀ (ε₀ grows far slower than ln 1/δ₀) until the accountant's
    # ε₀ turns inf (PLD's truncated tails): look below δ/k at e^{-1}, e^{-2}, e^{-4}, ... for a valid δ₀,
    # and where ε₀ turns inf first, at the smallest δ₀ whose ε₀ is finite.
    hi = math.log(delta / k)
    e0, ok = at(hi)
    if ok:
        return k * e0
    lo, best, step = None, None, 1.0
    while lo is None and hi - step > _LOG_TINY:
        x = hi - step
        e0, ok = at(x)
        if ok:
            lo, best = x, e0
        elif math.isinf(e0):  # ε₀ turns inf in (x, hi]: a valid δ₀, if any, lies just above that boundary
            finite = hi
            while lo is None and finite - x > 1e-3:
                mid = (x + finite) / 2
                e_mid, ok = at(mid)
                if ok:
                    lo, best = mid, e_mid
                elif math.isfinite(e_mid):
                    finite = mid
                else:
                    x = mid
            break
        else:
            hi, step = x, 2 * step
    if lo is None:
        return math.inf
    while hi - lo > 1e-3:  # the largest valid δ₀, to 0.1 % (ε₀ moves far less)
        mid = (lo + hi) / 2
        e0, ok = at(mid)
        if ok:
            lo, best = mid, e0
        else:
            hi = mid
    return k * best


def group_epsilon(accountant, k: int, delta: float, delta0: float | None = None, extra=()) -> float:
    """The user-level ε at δ of an example-level accountant's ledger (plus ``extra`` charges), by
    group privacy of size k: :func:`user_epsilon`, and for a zCDP accountant the smaller of that and
    the ε of k²ρ₀ (group privacy of ρ-zCDP is k²ρ-zCDP, Bun & Steinke 2016, Prop. 1.9; ρ is a sum
    of counts, so k² times every count is k²ρ₀)."""
    eps = user_epsilon(lambda d: accountant.epsilon(d, extra=extra), k, delta, delta0)
    if k > 1 and accountant.notion == "zcdp":
        groups = accountant.ledger.grouped(list(extra))
        eps = min(eps, accountant._epsilon({p: Counter({e: n * k * k for e, n in c.items()})
                                            for p, c in groups.items()}, delta))
    return eps


def user_delta(example_epsilon: float, example_delta: float, k: int) -> float:
    """The user-level δ of an example-level (ε₀, δ₀), for groups of k: k·e^{(k−1)ε₀}·δ₀ (inf past
    the floats)."""
    try:
        return k * math.exp((k - 1) * example_epsilon) * example_delta
    except OverflowError:
        return math.inf


def unit_statement(summary: dict) -> str:
    """What the guarantee protects, in words (the run summary, reports, the model card), under the
    neighbouring relation it was accounted for: an ε for replacing one example does not cover
    adding or removing one (the uniform and shuffle samplers' analyses need a fixed n), and an
    add/remove ε covers a replacement only at twice its ε."""
    change = {"replace_one": "replacing", "add_remove": "adding or removing"}.get(summary.get("relation"))
    change = change or "changing (the neighbouring relation was not recorded)"
    holds = "would hold, were every release private with secret noise," if summary.get("guarantee") is False \
        else "holds"
    if summary.get("unit") != "user":
        return f"one example: the guarantee {holds} for {change} one training example"
    k, users = summary.get("max_examples_per_user"), summary.get("users")
    whom = "all the data of one user"
    if summary.get("user_mechanism") == "els":
        if summary.get("relation") == "replace_one":  # a user's number of kept examples is public
            whom += " by as many kept examples of another"
        ex = summary.get("example_level") or {}
        of = (f"ρ = {ex['rho']:.4g} (zCDP: k²ρ for a user)" if isinstance(ex.get("rho"), (int, float))
              else f"ε = {ex.get('epsilon', float('nan')):.4g}")
        how = (f"example-level sampling with at most {k} examples per user; group privacy of size {k} of the "
               f"example-level {of}")
    else:
        how = f"user-level sampling, each user's mean contribution over at most {k} examples clipped as one"
    return f"one user ({users} users): the guarantee {holds} for {change} {whom}; {how}"


def user_mechanism(recipe: dict) -> str | None:
    """How a resolved recipe protects users: "uls" (its sampler samples users), "els" (an
    example-level sampler: the ledger is example-level, read through group privacy), or None (an
    example-level run). Decided by the sampler, never by k (ELS with k = 1 is still ELS)."""
    from .registry import get_registry

    if (recipe.get("privacy") or {}).get("unit") != "user":
        return None
    sampler = get_registry().get("sampler", recipe["sampler"]["name"]).cls
    return "uls" if sampler.samples == "users" else "els"


def els_group(recipe: dict) -> int:
    """The size k of the group privacy that converts an ELS run's example-level ledger, else 1."""
    return int(recipe["privacy"]["max_examples_per_user"]) if user_mechanism(recipe) == "els" else 1


def unit_terms(recipe: dict) -> dict:
    """The privacy unit and relation as the resolved recipe (hash-checked) states them, for what
    reads a run folder: summary.json has no checksum, and an edited one must not widen the stated
    guarantee (an example-level replace-one run stated as one user under add/remove)."""
    privacy = recipe.get("privacy") or {}
    user = privacy.get("unit") == "user"
    return {"unit": "user" if user else "example", "relation": privacy.get("relation"),
            "max_examples_per_user": privacy.get("max_examples_per_user") if user else None,
            "user_mechanism": user_mechanism(recipe)}
