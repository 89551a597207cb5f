"""Single-pass sampling over disjoint batches with a per-period batch schedule.

Spec 001 §1.4 / spec 002 §1.4: a public permutation of the records is cut into consecutive
batches, B1 records at the first step of every period and B2 at the others; no record is ever
read twice. Each period's batches are disjoint from every other period's, so a period's charges
go into the period's own partition and the accountant composes periods in parallel (spec 001
§2.6, spec 002 §2.4). There is no sampling amplification. The period clock and the resolved
batch sizes are the O2NC algorithm's (:class:`~dpreg_nonsmooth.exchange.O2NCSchedule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from dpregistry import Charge, Sampler, StageParams, UserError

from .exchange import O2NCSchedule


def consumption(steps: int, period: int, b1: int, b2: int) -> int:
    """Records a single pass of ``steps`` steps reads: B1⌈T/Σ⌉ + B2(T − ⌈T/Σ⌉) (spec 002 §7.12)."""
    starts = -(-steps // period)
    return b1 * starts + b2 * (steps - starts)


def _count_below(steps: range, x: int) -> int:
    """How many t in ``steps`` are below x."""
    return len(range(steps.start, max(steps.start, min(steps.stop, x)), steps.step))


class SinglePassParams(StageParams):
    batch_first: int | Literal["auto"] = Field(default="auto", description="B1 at each period start (auto: the theorem's)")
    batch_rest: int | Literal["auto"] = Field(default="auto", description="B2 at the other steps (auto: the theorem's)")
    order: Literal["shuffled", "sequential"] = Field(default="shuffled", description="a public permutation, or file order")


class SinglePass(Sampler):
    """Single pass over disjoint batches: B1 records at each period start, B2 otherwise; none reused."""

    name = "single_pass"
    Params = SinglePassParams
    needs = (O2NCSchedule,)

    @dataclass
    class State:
        consumed: int = 0  # high-water mark: records [0, consumed) of the order are spent

    def batch_sizes(self, b1_auto: int, b2_auto: int) -> tuple[int, int]:
        """(B1, B2): the recipe's, or the algorithm's theorem values where it says auto."""
        b1, b2 = self.cfg.batch_first, self.cfg.batch_rest
        return (b1_auto if b1 == "auto" else int(b1)), (b2_auto if b2 == "auto" else int(b2))

    def setup(self, ctx):
        self.n = ctx.n_train
        self.schedule = ctx.need(O2NCSchedule)
        if self.cfg.order == "shuffled":
            self.order = torch.randperm(self.n, generator=ctx.rng.generator("single_pass_order", 0))
        else:
            self.order = torch.arange(self.n)

    def validate(self, ctx):
        s = self.schedule
        for key, v in (("batch_first", s.batch_first), ("batch_rest", s.batch_rest)):
            if v < 1:
                raise UserError(f"{key} must be at least 1, got {v}", key=f"sampler.{key}")
        need = consumption(s.total_steps, s.period, s.batch_first, s.batch_rest)
        if need > self.n:  # cannot happen when the algorithm caps the steps; kept as a guard
            raise UserError(f"{s.total_steps} single-pass steps need {need} records, the data has {self.n}",
                            key="train.steps")

    def _schedule(self, step):
        s = self.schedule
        k, p = s.position(step)
        per = s.batch_first + (s.period - 1) * s.batch_rest
        offset = k * per + (0 if p == 1 else s.batch_first + (p - 2) * s.batch_rest)
        size = s.batch_first if p == 1 else s.batch_rest
        return k, offset, size

    def indices(self, ctx):
        step = ctx.step
        _, offset, size = self._schedule(step)
        if offset < self.state.consumed:
            raise RuntimeError(f"single_pass: step {step} would reuse records {offset}..{self.state.consumed - 1}")
        if offset + size > self.n:
            raise RuntimeError(f"single_pass: step {step} needs records up to {offset + size}, the data has {self.n}")
        self.state.consumed = offset + size
        return self.order[offset:offset + size]

    def expected_batch_size(self, ctx):
        return float(self._schedule(ctx.step)[2])

    def account(self, step, events, ctx):
        k, _, _ = self._schedule(step)
        return [Charge(e, partition=f"period{k}") for e in events]

    def account_steps(self, steps, events, ctx):
        """Per period: the steps of ``steps`` in it, charged to its partition. A single pass takes
        at most one step per record, so there are at most n periods to visit."""
        if not steps or not events:
            return []
        P = self.schedule.period
        out = []
        for k in range(steps[0] // P, steps[-1] // P + 1):
            n = _count_below(steps, (k + 1) * P) - _count_below(steps, k * P)
            out += [Charge(e, partition=f"period{k}", count=n) for e in events] if n else []
        return out


SAMPLERS = (SinglePass,)
