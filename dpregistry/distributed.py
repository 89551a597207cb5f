"""Data-parallel private training on torch.distributed (gloo on CPU, NCCL on GPU).

Every rank holds the model, the same public seeds and the same secret key (a secure run's key is
drawn by rank 0 and sent to the others once, when the run starts), so it regenerates the same
sampled batch, the same direction or projector, and the same noise. A step's batch is cut into
micro-batch-sized chunks dealt round-robin to the ranks; each rank evaluates its chunks and:

* zeroth-order estimators send only their per-example scalars (all-gather, O(B) bytes): every
  rank then clips, sums and noises the full vector in the single-process order, so 1 and N
  processes give bit-identical runs;
* first-order estimators clip locally and all-reduce the clipped sums (in the projected space for
  DP-GRAPE), equal to the single-process run up to floating-point reduction order.

Noise is added once (the same draw on every rank) and every rank applies the same update; a
parameter checksum every ``train.sync_check_every`` steps proves the replicas did not drift.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import os

import torch
import torch.distributed as dist

from .stages import ClippedSum


class LocalComm:
    """Single-process communication: the whole batch is local and every collective is the identity."""

    rank = 0
    world_size = 1
    bytes_sent = 0
    micro_batch = None
    positions = None  # the whole batch is local

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        return indices

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def all_reduce(self, total: ClippedSum) -> ClippedSum:
        return total

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def check_replicas(self, params, step) -> None:
        pass

    def any_flag(self, flag: bool) -> bool:
        return flag


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(timeout_s: float = 120.0) -> "TorchComm":
    """Join the process group that torchrun describes in the environment, once per process: later
    runs reuse it (a group joined again after it was destroyed reads its peers' stale addresses
    from torchrun's store). A group we joined is left at exit, before interpreter shutdown: with
    its threads alive then, gloo can abort the process ("terminate called without an active
    exception"). A group the caller joined stays the caller's."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("DPREG_BACKEND") != "gloo" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_leave_at_exit)
    return TorchComm()


def _leave_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TorchComm:
    def __init__(self):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # NCCL collectives take GPU tensors; gloo takes CPU tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        self.bytes_sent = 0  # payload bytes this rank contributed to collectives
        self.micro_batch: int | None = None
        self._chunks: list[tuple[int, int]] = []

    # -- batch sharding ----------------------------------------------------------------------

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of the global batch (chunk j goes to rank j mod world size)."""
        n = len(indices)
        m = self.micro_batch or max(1, -(-n // self.world_size))
        self._chunks = [(s, min(s + m, n)) for s in range(0, n, m)]
        mine = [(s, e) for j, (s, e) in enumerate(self._chunks) if j % self.world_size == self.rank]
        #: where this rank's examples sit in the global batch (for per-slot public randomness)
        self.batch_size = n
        self.positions = torch.cat([torch.arange(s, e) for s, e in mine]) if mine else torch.zeros(0, dtype=torch.long)
        return torch.cat([indices[s:e] for s, e in mine]) if mine else indices[:0]

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """The per-example rows of every rank, back in the global order of the last ``shard``."""
        W = self.world_size
        sizes = [sum(e - s for j, (s, e) in enumerate(self._chunks) if j % W == r) for r in range(W)]
        pad = max(sizes) if sizes else 0
        buf = torch.zeros((pad,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
        buf[:len(local)] = local
        parts = [torch.empty_like(buf) for _ in range(W)]
        dist.all_gather(parts, buf)
        self.bytes_sent += buf.numel() * buf.element_size()
        cursor = [0] * W
        rows = []
        for j, (s, e) in enumerate(self._chunks):
            r = j % W
            rows.append(parts[r][cursor[r]:cursor[r] + (e - s)])
            cursor[r] += e - s
        return torch.cat(rows) if rows else local[:0]

    # -- reductions ----------------------------------------------------------------------------

    def all_reduce(self, total: ClippedSum) -> ClippedSum:
        """Sum the clipped sums (and their counts) over ranks, in place."""
        tensors = [total.aggregate.tensors[k] for k in sorted(total.aggregate.tensors)]
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, device=self.device)
        dist.all_reduce(flat)
        self.bytes_sent += flat.numel() * flat.element_size()
        start = 0
        for t in tensors:
            t.copy_(flat[start:start + t.numel()].view_as(t))
            start += t.numel()
        stats = torch.tensor([total.count, total.clipped, total.nonfinite, total.loss_sum], dtype=torch.float64,
                             device=flat.device)
        dist.all_reduce(stats)
        total.count, total.clipped, total.nonfinite = (int(x) for x in stats[:3].tolist())
        total.loss_sum = float(stats[3])
        return total

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(t, src)
        return t

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def any_flag(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (so that all ranks stop after the same step)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def check_replicas(self, params: dict[str, torch.Tensor], step: int) -> None:
        """Raise if the parameters differ between ranks (they must be bit-identical)."""
        h = hashlib.sha256()
        for k in sorted(params):
            t = params[k].detach().contiguous().cpu()
            h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
        digests = [None] * self.world_size
        dist.all_gather_object(digests, h.hexdigest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"replicas drifted at step {step}: parameter checksums differ across ranks")

