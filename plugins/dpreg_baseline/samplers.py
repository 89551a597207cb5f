"""Samplers: Poisson and uniform fixed-size (amplified), shuffled fixed-size batches, the full batch."""

from __future__ import annotations

import math
from collections import Counter
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from dpregistry import Charge, Sampler, StageParams, UserError
from dpregistry.stages import repeat
from dpregistry.users import UserGroups
from dpregistry.privacy.events import Composed, NonPrivate, PoissonSampled, PrivacyEvent, SampledWithoutReplacement


def sampled_together(events: list[PrivacyEvent], wrap) -> list[Charge]:
    """Charges of one step's releases of one batch: a record is in all of them or in none, so their
    composition is sampled once (wrapping each alone would assume independent batches: too little ε)."""
    private = [e for e in events if not isinstance(e, NonPrivate)]
    out = [Charge(e) for e in events if isinstance(e, NonPrivate)]
    if private:
        out.append(Charge(wrap(private[0] if len(private) == 1 else Composed(tuple(private)))))
    return out


def _every_step_alike(sampler, steps: range, events, ctx) -> list[Charge]:
    """account_steps of a sampler whose charges do not depend on the step: one step's, times |steps|."""
    return repeat(sampler.account(steps.start, events, ctx), len(steps)) if steps else []


def multiples_in(steps: range, m: int) -> int:
    """How many t in ``steps`` are multiples of m (a linear congruence: closed form in any range)."""
    if not steps:
        return 0
    a, s = steps.start, steps.step
    # a + k·s ≡ 0 (mod m)  <=>  k·(s/g) ≡ −a/g (mod m/g), solvable when g = gcd(s, m) divides a
    g = math.gcd(s, m)
    if a % g:
        return 0
    mg = m // g
    k0 = (-a // g) * pow(s // g, -1, mg) % mg if mg > 1 else 0
    return max(0, -(-(len(steps) - k0) // mg))


class PoissonParams(StageParams):
    batch_size: float | None = Field(default=None, gt=0, description="expected batch size q·n")
    sample_rate: float | None = Field(default=None, gt=0, le=1, description="q (instead of batch_size)")

    @model_validator(mode="after")
    def _one(self):
        if (self.batch_size is None) == (self.sample_rate is None):
            raise ValueError("give exactly one of batch_size and sample_rate")
        return self


class PoissonSampler(Sampler):
    """Poisson sampling: each record joins each step's batch independently with probability q."""

    name = "poisson"
    Params = PoissonParams

    def setup(self, ctx):
        n = ctx.n_train
        self.n = n
        self.q = self.cfg.sample_rate if self.cfg.sample_rate is not None else self.cfg.batch_size / n
        if self.q > 1:
            raise UserError(f"{self.cfg.batch_size:g} exceeds the data set size {n}",
                            key="sampler.batch_size")

    def indices(self, ctx):
        # Sampling is global (every rank draws the same mask), so q is the true rate; the mask is
        # as secret as the noise, since the amplification by sampling assumes it is hidden.
        return (ctx.rng.secret("poisson", ctx.step).uniform(self.n) <= self.q).nonzero().squeeze(1)

    def expected_batch_size(self, ctx):
        return self.q * self.n

    amplifies = True

    def account(self, step, events, ctx):
        return sampled_together(events, lambda e: PoissonSampled(self.q, e))

    def account_steps(self, steps, events, ctx):
        return _every_step_alike(self, steps, events, ctx)


class ShuffleParams(StageParams):
    batch_size: int = Field(gt=0)
    accounting: Literal["exact"] = Field(default="exact", description="one unamplified release per epoch")

    @field_validator("accounting", mode="before")
    @classmethod
    def _no_heuristic(cls, v):
        if v == "poisson_heuristic":
            # Audited: ε 15.04 reported where the exact analysis of the same run gives 52.77.
            raise ValueError("poisson_heuristic was removed: the shuffled order derives from the public seed, so "
                             "a batch is no secret and Poisson amplification does not hold; use sampler: poisson "
                             "for amplified accounting, or accounting: exact")
        return v


class ShuffleSampler(Sampler):
    """Shuffled fixed-size batches, a fresh permutation each epoch (the last partial batch is dropped).

    ``accounting: exact`` uses parallel composition inside an epoch (every record is in exactly one
    batch), so each epoch costs one unamplified release, charged at the epoch's first step; a later
    step whose release that charge does not cover (another mechanism) is charged as well.
    """

    name = "shuffle"
    Params = ShuffleParams

    def setup(self, ctx):
        self.n = ctx.n_train
        self.B = self.cfg.batch_size
        if self.B > self.n:
            raise UserError(f"{self.B} exceeds the data set size {self.n}", key="sampler.batch_size")
        self.per_epoch = self.n // self.B
        self._perm_epoch, self._perm = -1, None

    def validate(self, ctx):
        if ctx.adaptive:
            raise UserError("shuffle sampling with exact accounting needs the same mechanism at every step; "
                            "use the poisson sampler for adaptive algorithms", key="sampler")
        if ctx.relation != "replace_one":
            # A neighbour must change one batch of the epoch; adding a record re-cuts every batch.
            raise UserError("shuffle sampling with exact accounting is analysed under replace-one neighbours "
                            "(privacy.relation: replace_one); use the poisson sampler for add/remove", key="sampler")

    def indices(self, ctx):
        epoch, j = divmod(ctx.step, self.per_epoch)
        if epoch != self._perm_epoch:
            self._perm = torch.randperm(self.n, generator=ctx.rng.generator("shuffle", epoch))
            self._perm_epoch = epoch
        return self._perm[j * self.B:(j + 1) * self.B]

    def expected_batch_size(self, ctx):
        return float(self.B)

    def account(self, step, events, ctx):
        start = step - step % self.per_epoch
        if step == start:
            return [Charge(e) for e in events]
        if step != ctx.step:
            return []  # a later step of a plan: assumed to release what the epoch's first step did
        # A record of this batch suffers this step's release: parallel composition covers it only
        # if the epoch's first step charged it; charge the rest (sequential composition, valid).
        missing = Counter(events) - self._charged_at(start, ctx.ledger)
        return [Charge(e, count=n) for e, n in missing.items()]

    def account_steps(self, steps, events, ctx):
        # each epoch start in the range, and the current step if it is not one
        out = repeat([Charge(e) for e in events], multiples_in(steps, self.per_epoch))
        if ctx.step in steps and ctx.step % self.per_epoch:
            out += self.account(ctx.step, events, ctx)
        return out

    @staticmethod
    def _charged_at(step, ledger) -> Counter:
        """Unpartitioned events the ledger charged at ``step`` (an entry spanning several steps
        counts its per-step share, rounded down)."""
        out: Counter = Counter()
        for e in ledger.entries:
            if e["partition"] is None and e["first_step"] <= step <= e["last_step"]:
                share = e["count"] // (e["last_step"] - e["first_step"] + 1)
                if share:
                    out[PrivacyEvent.from_dict(e["event"])] += share
        return out


class UniformParams(StageParams):
    batch_size: int = Field(gt=0, description="B: every batch has exactly B records")


class UniformSampler(Sampler):
    """A fresh uniformly random batch of exactly B of the n records at every step (sampling
    without replacement), amplified by Wang–Balle–Kasiviswanathan 2019 (replace-one; rdp, zcdp)."""

    name = "uniform"
    Params = UniformParams

    def setup(self, ctx):
        self.n = ctx.n_train
        self.B = self.cfg.batch_size
        if self.B > self.n:
            raise UserError(f"{self.B} exceeds the data set size {self.n}", key="sampler.batch_size")

    def validate(self, ctx):
        if ctx.relation != "replace_one":
            raise UserError("the uniform sampler's amplification is analysed under replace-one neighbours "
                            "(privacy.relation: replace_one); use the poisson sampler for add/remove", key="sampler")

    def indices(self, ctx):
        return ctx.rng.secret("uniform", ctx.step).uniform(self.n).argsort()[:self.B]

    def expected_batch_size(self, ctx):
        return float(self.B)

    amplifies = True

    def account(self, step, events, ctx):
        return sampled_together(events, lambda e: SampledWithoutReplacement(self.n, self.B, e))

    def account_steps(self, steps, events, ctx):
        return _every_step_alike(self, steps, events, ctx)


class FullBatch(Sampler):
    """Every record at every step (no amplification)."""

    name = "full_batch"

    def setup(self, ctx):
        self.n = ctx.n_train

    def indices(self, ctx):
        return torch.arange(self.n)

    def expected_batch_size(self, ctx):
        return float(self.n)

    def account(self, step, events, ctx):
        return [Charge(e) for e in events]

    def account_steps(self, steps, events, ctx):
        return _every_step_alike(self, steps, events, ctx)


class UserPoissonParams(StageParams):
    users_per_step: float = Field(gt=0, description="expected number of users in a step's batch (q × users)")


class UserPoisson(Sampler):
    """User-level sampling (ULS): each user joins each step independently with probability q, with
    their (at most k) records; the run clips each user's mean contribution as one (privacy.unit: user)."""

    name = "user_poisson"
    Params = UserPoissonParams
    needs = (UserGroups,)
    samples = "users"
    amplifies = True

    def setup(self, ctx):
        self.users = ctx.need(UserGroups)
        n = self.users.n_users
        self.q = self.cfg.users_per_step / n
        if self.q > 1:
            raise UserError(f"{self.cfg.users_per_step:g} exceeds the {n} users",
                            key="sampler.users_per_step")

    def indices(self, ctx):
        # As secret as the noise: amplification by sampling assumes nobody knows which users were drawn.
        drawn = (ctx.rng.secret("user_poisson", ctx.step).uniform(self.users.n_users) <= self.q).nonzero().squeeze(1)
        return self.users.records_of(drawn)

    def expected_batch_size(self, ctx):
        return self.q * self.users.n_users  # users: a user is one unit of the privatized mean

    def account(self, step, events, ctx):
        return sampled_together(events, lambda e: PoissonSampled(self.q, e))

    def account_steps(self, steps, events, ctx):
        return _every_step_alike(self, steps, events, ctx)


SAMPLERS = (PoissonSampler, UniformSampler, ShuffleSampler, FullBatch, UserPoisson)
