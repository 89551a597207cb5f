"""Helpers for objectives built on a torch module (plugins subclass :class:`TorchObjective`)."""

from __future__ import annotations

import os
import re
import types
from contextlib import contextmanager

import torch
from pydantic import BaseModel, ConfigDict, Field

from .errors import UserError
from .persample import check_forward_is_pure
from .stages import Objective

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def physical_memory() -> int | None:
    """Bytes of memory this machine has (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def require_memory(nbytes: float, what: str, key: str) -> None:
    """Refuse, before allocating it, what needs more memory than the machine has: a size of 10^11
    from a recipe would otherwise fail deep inside torch, or be granted lazily and thrash."""
    total = physical_memory()
    if total and nbytes > total:
        raise UserError(f"{what} would need {nbytes / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB of "
                        f"memory this machine has", key=key)


class Trainable(BaseModel):
    """Which parameters train: regexes on parameter names (``include`` empty means all)."""

    model_config = ConfigDict(extra="forbid")
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)

    def selects(self, name: str) -> bool:
        if self.include and not any(re.search(p, name) for p in self.include):
            return False
        return not any(re.search(p, name) for p in self.exclude)


class Lora(BaseModel):
    """LoRA adapters injected with ``peft`` (``model.lora``): the base weights stay frozen."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(default=8, gt=0)
    alpha: float = Field(default=16.0, gt=0)
    target_modules: list[str] | None = Field(default=None, description="default: peft's choice for the model type")


def inject_lora(model: torch.nn.Module, lora: Lora, seed: int, device, dtype) -> torch.nn.Module:
    """``model`` with LoRA adapters (B = 0, so the model computes what it did; A from ``seed``), in
    the model's dtype and on its device."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise UserError("model.lora needs the package peft (pip install peft)", key="model.lora") from None
    conf = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=lora.target_modules)
    with seeded(seed):
        model = inject_adapter_in_model(conf, model)
    return model.to(device, dtype)  # adapters are created in fp32


def activation_checkpointing_option():
    """The ``model.activation_checkpointing`` setting of the Hugging Face objectives."""
    return Field(default=False, description="recompute each transformer block's activations in the backward "
                                            "instead of keeping them: less memory for about one more forward")


def checkpoint_blocks(model: torch.nn.Module, key: str = "model.activation_checkpointing") -> int:
    """Wrap each transformer block of a Hugging Face model (its ``GradientCheckpointingLayer``s) in
    non-reentrant activation checkpointing, whatever the module's training mode: a block's
    activations are freed after the forward and recomputed in the backward, one block at a time.
    (Hugging Face's own switch checkpoints only in training mode, and objectives run in eval mode.)
    The per-example hooks keep their layer inputs as saved tensors, so those are freed too; the
    reentrant variant is refused by them. Returns the number of blocks."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        raise UserError("activation checkpointing needs transformers >= 4.53 (GradientCheckpointingLayer)",
                        key=key) from None
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise UserError(f"activation checkpointing: {type(model).__name__} has no transformer block "
                        "(GradientCheckpointingLayer) to checkpoint", key=key)
    for m in blocks:
        if "_forward_unchecked" not in vars(m):  # once: a second call would nest the checkpoints
            m._forward_unchecked = m.forward
            m.forward = types.MethodType(_checkpointed_forward, m)
    return len(blocks)


#: a block's key-value cache arguments: the recomputation would write the cache a second time
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed_forward(block, *args, **kwargs):
    """A block's forward under checkpointing. A method bound to the block, not a closure over it:
    a copy of the model (``copy.deepcopy``) then runs its own blocks, not the original's."""
    from torch.utils.checkpoint import checkpoint

    forward = block._forward_unchecked
    # No backward to recompute for; or inside torch.func, which has no saved-tensor hooks (the vmap
    # fallback's per-example gradients of a block that owns parameters, BEiT's layer scales).
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return forward(*args, **kwargs)
    if kwargs.get("use_cache"):  # as Hugging Face's own checkpointing does
        kwargs["use_cache"] = False
    kwargs.update({k: None for k in _CACHE_ARGUMENTS if kwargs.get(k) is not None})
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextmanager
def seeded(seed: int):
    """Run initialisation under a fixed torch seed without touching the global stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class TorchObjective(Objective):
    """An objective whose parameters belong to ``self.model``.

    Subclasses build ``self.model`` in ``build(ctx)`` and implement ``batch_losses(indices)``
    (per-example losses of training records) and ``evaluate()``. The model runs in eval mode (no
    dropout), so a forward pass is a deterministic function of the parameters: two zeroth-order
    evaluations see the same network, and a resume is bit-exact.
    """

    model: torch.nn.Module

    def build(self, ctx) -> None:
        raise NotImplementedError

    def batch_losses(self, indices: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.build(ctx)  # resolves model and data paths before it places anything on ctx.device
        check_forward_is_pure(self.model)  # every estimator runs forward passes on private data
        self.model.eval()
        self.select_trainable()
        self._params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if not self._params:
            raise UserError("no parameter matches objective.trainable; the model has no trainable parameters",
                            key="objective.trainable")

    def select_trainable(self) -> None:
        """Mark which parameters train (``requires_grad``): the recipe's ``trainable`` regexes."""
        trainable: Trainable = getattr(self.cfg, "trainable", None) or Trainable()
        names = [name for name, _ in self.model.named_parameters()]
        for pattern in trainable.include:  # a pattern that names nothing is a typo or another model's name
            if not any(re.search(pattern, n) for n in names):
                raise UserError(f"pattern {pattern!r} matches no parameter of this model (its parameters "
                                f"include {', '.join(names[:3])} ... {', '.join(names[-3:])})",
                                key="objective.trainable.include")
        for name, p in self.model.named_parameters():
            p.requires_grad_(trainable.selects(name))

    @property
    def device(self):
        return self.ctx.device

    def params(self):
        return self._params

    def module(self):
        return self.model

    def losses(self, indices: torch.Tensor) -> torch.Tensor:
        mb = self.ctx.micro_batch_size
        if torch.is_grad_enabled() or not mb or len(indices) <= mb:
            return self.batch_losses(indices)
        return torch.cat([self.batch_losses(indices[i:i + mb]) for i in range(0, len(indices), mb)])
