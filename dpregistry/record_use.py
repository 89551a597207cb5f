"""Which charge pays for each record's use: the run's check of parallel composition.

A sampler may charge nothing for a step, or charge a step to a named partition, on the strength of
a structure in its batches: a shuffled epoch charges its first step once for the whole epoch,
because each record is in one batch of it; a single pass charges each period to its own
partition, because no record is read in two periods (dpregistry.privacy.accountant). The
accountant takes that structure on the sampler's word. :class:`RecordUse` checks it against the
records the run actually privatized, so a sampler that claims it wrongly stops the run instead of
printing a smaller ε:

* A step whose charges hold every event it released, as many times as it released it, is
  *covered by its own charge*. A step that charges less (nothing, or a part: a shuffled epoch's
  later step, a tree's prepaid step) relies on the last such covering charge, which paid for one
  use of each record from that step on by the events it holds. So there must be such a charge;
  what the step does not pay for itself must be among what that charge holds (no costlier
  mechanism, no more releases); no record may be read twice between two covering charges; and a
  covering charge amplified by the secrecy of its batch (Poisson, without replacement) covers its
  own batch only.
* Each record lies in at most one named partition: a record read in a step charged to partition p
  is never read in a step charged to another (records of unpartitioned steps are in every
  partition's composition already). A step's batch lies in one partition.

Records are counted in the sampler's index space (the batch it returns); where users are sampled
(user-level sampling) the unit is the user, and each user counts as one record. The state travels in the
checkpoint, so a resume does not forget what the earlier steps read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from .privacy.events import PoissonSampled, PrivacyEvent, SampledWithoutReplacement
from .stages import Charge

AMPLIFIED = (PoissonSampled, SampledWithoutReplacement)  # events amplified by a secret batch


class RecordUse:
    """Records read since the last covering charge, and the partition each record was read in."""

    def __init__(self, sampler: str):
        self.sampler = sampler
        self.unit = "record"  # "user" where users are sampled (ULS): each user is then one of n
        self.n = 0
        self._step: list[torch.Tensor] = []       # the batches of the step in progress
        self._cover_step: int | None = None       # the step of the last covering charge
        self._cover_held: Counter | None = Counter()  # the events it holds, counted (None: not known)
        self._cover_amplified = False
        self._cover_partition: str | None = None
        self._cover: list[torch.Tensor] = []      # its batches; a mask once a step relies on it
        self._since: torch.Tensor | None = None   # bool[n]: read since the covering charge
        self._owner: torch.Tensor | None = None   # int32[n]: the partition a record was read in, or -1
        self._partitions: list[str] = []

    def read(self, batch: torch.Tensor, n: int) -> None:
        """A batch of records among ``n`` was privatized in the step in progress."""
        self.n = max(self.n, n)
        self._step.append(batch)

    def end_step(self, step: int, charges: list[Charge], holds: Counter, events: Counter) -> None:
        """Check the step's records against its ``charges`` (the sampler's), each event they hold
        (counted: :func:`~dpregistry.privacy.events.held`) and ``events`` (what the algorithm
        charged, counted), then record them. Raises RuntimeError: the sampler's slip."""
        batches, self._step = self._step, []
        unpaid = events - holds  # what this step released and its own charges do not hold
        covering = bool(charges) and not unpaid
        named = {c.partition for c in charges if c.partition is not None}
        if not covering and self._cover_partition is not None:
            named.add(self._cover_partition)
        if len(named) > 1:
            raise RuntimeError(f"sampler {self.sampler!r}: step {step} charges the partitions "
                               f"{', '.join(sorted(named))} for one batch; a record lies in one partition, so a "
                               f"step's batch does")
        if covering:
            self._cover_step, self._cover, self._since, self._cover_held = step, batches, None, holds
            self._cover_amplified = any(isinstance(e, AMPLIFIED) for e in holds)
            self._cover_partition = next(iter(named), None)
        if not batches or (covering and not named):
            return  # (the common step: nothing to look up)
        records = self._distinct(batches)
        if not covering:
            self._relies_on_cover(step, records, unpaid)
        if named:
            self._in_partition(step, records, named.pop())

    def _distinct(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """The records of a step's batches, each once (one batch holds each once: the run checked)."""
        if len(batches) == 1:
            return batches[0].reshape(-1).cpu()
        seen = torch.zeros(self.n, dtype=torch.bool)
        for b in batches:
            seen[b.reshape(-1).cpu()] = True
        return seen.nonzero().flatten()

    def _relies_on_cover(self, step: int, records: torch.Tensor, unpaid: Counter) -> None:
        since = f"since the charge at step {self._cover_step}" if self._cover_step is not None else "before"
        if self._cover_held is not None and self._cover_step is None:
            raise RuntimeError(f"sampler {self.sampler!r}: step {step} read records and charged less than it released "
                               f"({_listed(unpaid)} unpaid), and no earlier step's charges held all it released; "
                               f"charge every release's events (a composition of the same event counts each)")
        if self._cover_held is not None and (beyond := unpaid - self._cover_held):
            raise RuntimeError(f"sampler {self.sampler!r}: step {step} released {_listed(beyond)} beyond its own "
                               f"charges, relying on the charge at step {self._cover_step}, which does not hold "
                               f"{'it' if sum(beyond.values()) == 1 else 'them'}: a cover pays for the mechanisms it "
                               f"holds, once per record; charge the rest")
        if self._cover_amplified:
            raise RuntimeError(f"sampler {self.sampler!r}: step {step} read records and charged less than it released, "
                               f"relying on the charge at step {self._cover_step}; that charge is amplified by the "
                               f"secrecy of its own batch (sampling), so it pays for that batch only. Charge each "
                               f"sampled step")
        mask = self._mask()
        if (again := mask[records].nonzero().flatten()).numel():
            shown = ", ".join(str(int(r)) for r in records[again[:5]]) + (", …" if len(again) > 5 else "")
            raise RuntimeError(f"sampler {self.sampler!r}: step {step} charged less than it released, relying on an "
                               f"earlier charge that pays for one use of each {self.unit}, but {self.unit}"
                               f"{'s' * (len(again) > 1)} {shown} {'were' if len(again) > 1 else 'was'} read {since} "
                               f"already; charge the step, or read each {self.unit} once per charge (an epoch, a "
                               f"period)")
        mask[records] = True

    def _in_partition(self, step: int, records: torch.Tensor, partition: str) -> None:
        if partition not in self._partitions:
            self._partitions.append(partition)
        pid = self._partitions.index(partition)
        owner = self._grown(self._owner, -1, torch.int32)
        self._owner = owner
        other = (owner[records] >= 0) & (owner[records] != pid)
        if bool(other.any()):
            first = records[other][0]
            raise RuntimeError(f"sampler {self.sampler!r}: step {step} charges partition {partition!r}, but "
                               f"{self.unit} {int(first)} was read in partition {self._partitions[int(owner[first])]!r}; parallel "
                               f"composition holds for disjoint partitions only ({int(other.sum())} {self.unit}s of "
                               f"this batch lie in another)")
        owner[records] = pid

    def _mask(self) -> torch.Tensor:
        if self._since is None:
            self._since = self._grown(None, False, torch.bool)
            for b in self._cover:
                self._since[b.reshape(-1).cpu()] = True
            self._cover = []
        self._since = self._grown(self._since, False, torch.bool)
        return self._since

    def _grown(self, t: torch.Tensor | None, fill: Any, dtype: torch.dtype) -> torch.Tensor:
        """``t`` extended to ``n`` entries with ``fill`` (the index space can grow: ELS selections)."""
        if t is not None and len(t) >= self.n:
            return t
        out = torch.full((self.n,), fill, dtype=dtype)
        if t is not None:
            out[:len(t)] = t
        return out

    # ------------------------------------------------------------------ checkpoint

    def state(self, tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
        """Metadata of the state, its tensors added to ``tensors`` (the mask packed 8 records a byte,
        the partitions' numbers in one byte a record while there are fewer than 128)."""
        if self._cover_step is not None:
            tensors[f"{prefix}/since"] = torch.from_numpy(np.packbits(self._mask().numpy()))
        if self._owner is not None:  # in the narrowest integer that numbers the partitions (and -1)
            parts = len(self._partitions)
            tensors[f"{prefix}/owner"] = self._owner.to(
                torch.int8 if parts < 2 ** 7 else torch.int16 if parts < 2 ** 15 else torch.int32)
        return {"n": self.n, "cover_step": self._cover_step, "cover_amplified": self._cover_amplified,
                "cover_partition": self._cover_partition, "partitions": list(self._partitions),
                "cover_held": [[e.to_dict(), n] for e, n in (self._cover_held or {}).items()]}

    def load_state(self, meta: dict[str, Any] | None, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        if not meta:  # a checkpoint of an earlier version: what its steps read and charged is not known
            self._cover_held = None
            return
        self.n = int(meta["n"])
        self._cover_held = Counter({PrivacyEvent.from_dict(e): n for e, n in meta.get("cover_held", [])})
        self._cover_step, self._cover_amplified = meta["cover_step"], bool(meta["cover_amplified"])
        self._cover_partition, self._partitions = meta["cover_partition"], list(meta["partitions"])
        self._cover, self._since, self._owner = [], None, None
        if f"{prefix}/since" in tensors:
            bits = np.unpackbits(tensors[f"{prefix}/since"].numpy(), count=self.n)
            self._since = torch.from_numpy(bits.astype(bool))
        if f"{prefix}/owner" in tensors:
            self._owner = tensors[f"{prefix}/owner"].to(torch.int32).clone()


def _listed(events: Counter) -> str:
    return ", ".join(f"{n}×{e.describe()}" if n > 1 else e.describe() for e, n in events.items())
