"""Your own model, loss and data: the ``python`` objective behind ``dpregistry.train(..., model=...)``.

No plugin is needed to train your own module privately. The conventions are PyTorch's:

* the data (a torch ``Dataset``, a sequence of examples, or a Hugging Face ``datasets.Dataset``) is
  read by index, a batch at a time, never loaded whole; examples are collated with
  ``torch.utils.data.default_collate``;
* an example is an ``(inputs, target)`` pair: the model is called on the batched inputs and
  ``loss(outputs, targets)`` returns one loss per example (as with ``reduction='none'``);
* a loss whose first parameter is named ``model`` is called as ``loss(model, batch)`` instead, for
  any other shape of example (dicts of a ``datasets.Dataset``, several inputs);
* ``metrics`` maps names to ``fn(outputs, targets)`` (or ``fn(model, batch)``) giving one value per
  example or one per batch; held-out metrics are their means over ``eval_data``, with the loss and,
  for class scores and integer targets, the accuracy by default.

Per-example clipping goes through the same hooks as the shipped objectives, so a model with a
layer they cannot serve is refused before step 1, naming the layer. The model runs in eval mode
(no dropout: a zeroth-order estimator's two forward passes must see the same network).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .digest import dataset_digest, rows_of
from .errors import UserError
from .objectives import TorchObjective
from .progress import track
from .stages import StageParams
from .users import UserIds


@dataclass(frozen=True)
class OwnObjects:
    """What ``dpregistry.train`` was given; the run provides it to the ``python`` objective."""

    model: torch.nn.Module
    loss: Callable
    train_data: Any
    eval_data: Any = None
    metrics: dict[str, Callable] = field(default_factory=dict)
    users: Any = None  # the user of each training example (privacy.unit: user)


class OwnParams(StageParams):
    eval_batch_size: int = 256


def _calls_model(fn: Callable) -> bool:
    """Whether ``fn`` is called as fn(model, batch): its first parameter is named ``model``."""
    try:
        first = next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return False
    return first == "model"


def _indexable(data: Any, what: str) -> Any:
    if data is None:
        return None
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise UserError(f"{what} must be indexable with a length (a torch Dataset, a list of examples or a "
                        f"datasets.Dataset); got {type(data).__name__}", key=what)
    if len(data) == 0:
        raise UserError(f"{what} is empty", key=what)
    return data


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' rows overlap in one storage (views of one tensor's rows); a row stride
    of 0 (a broadcast constant) holds no rows."""
    if a.dim() == 0 or b.dim() == 0 or a.stride(0) == 0 or b.stride(0) == 0 or \
            a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size = a.element_size()

    def span(t):  # the bytes from its first row's first element to its last row's
        ends = (t.storage_offset() * size, (t.storage_offset() + (t.shape[0] - 1) * t.stride(0)) * size)
        return min(ends), max(ends) + size

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _shares_rows(train: Any, held_out: Any) -> bool:
    """Whether the held-out data visibly holds training rows: the same data set (Subsets of one data
    set, random_split's, whose indices meet, or one and the whole), TensorDatasets whose every
    tensor overlaps the other's rows in one storage, or lists holding the same example objects.
    Rows copied into other objects are not detected."""
    from torch.utils.data import TensorDataset

    (a, ia), (b, ib) = rows_of(train), rows_of(held_out)
    if a is b:
        return ia is None or ib is None or not set(ia).isdisjoint(ib)
    if isinstance(a, TensorDataset) and isinstance(b, TensorDataset):
        return len(a.tensors) == len(b.tensors) and all(_same_rows(x, y) for x, y in zip(a.tensors, b.tensors))
    if isinstance(a, list) and isinstance(b, list):
        ids = {id(r) for r in a if isinstance(r, (tuple, list, dict, torch.Tensor))}
        return any(id(r) in ids for r in b)
    return False


class OwnObjective(TorchObjective):
    """Your own model, per-example loss and data, given to dpregistry.train (no plugin needed)."""

    name = "python"
    Params = OwnParams
    needs = (OwnObjects,)
    provides = (UserIds,)

    def provide(self, kind):
        if self.own.users is None:
            raise UserError("user needs the user of each training example: pass users=[...] to "
                            "dpregistry.train", key="privacy.unit")
        ids = torch.as_tensor(self.own.users).reshape(-1)
        if len(ids) != self.n_train or ids.is_floating_point():
            raise UserError(f"users must hold one integer user id per training example ({self.n_train}), got "
                            f"{tuple(ids.shape)} {ids.dtype}", key="users")
        return UserIds(ids.to(torch.int64))

    def build(self, ctx):
        from torch.utils.data import default_collate

        o = ctx.need(OwnObjects)
        if not isinstance(o.model, torch.nn.Module):
            raise UserError(f"model must be a torch.nn.Module, got {type(o.model).__name__}", key="model")
        if not callable(o.loss):
            raise UserError("loss must be a function: loss(outputs, targets) or loss(model, batch)", key="loss")
        self.own = o
        self.train_data = _indexable(o.train_data, "train_data")
        self.eval_data = _indexable(o.eval_data, "eval_data")
        if self.eval_data is not None and _shares_rows(self.train_data, self.eval_data):
            raise UserError("eval_data holds training examples: held-out metrics computed on them measure the "
                            "training examples themselves, which the guarantee does not cover; pass data the model "
                            "does not train on", key="eval_data")
        self.n_train = len(self.train_data)
        self._fingerprint = dataset_digest(self.train_data)
        self.collate = default_collate
        self.model = o.model.to(ctx.device)

    def select_trainable(self) -> None:
        """Keep the model's own choice (``requires_grad``) of what trains."""

    def _batch(self, data, indices) -> Any:
        rows = [data[int(i)] for i in indices]
        return _to(self.collate(rows), self.device)

    @staticmethod
    def _pair(batch: Any) -> tuple[Any, Any]:
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            raise UserError("an example must be an (inputs, target) pair for loss(outputs, targets); name the "
                            "loss's first parameter `model` to be called as loss(model, batch)", key="loss")
        return batch[0], batch[1]

    def _apply(self, fn: Callable, batch: Any) -> torch.Tensor:
        if _calls_model(fn):
            return fn(self.model, batch)
        inputs, targets = self._pair(batch)
        return fn(self.model(inputs), targets)

    def batch_losses(self, indices):
        losses = self._apply(self.own.loss, self._batch(self.train_data, indices.tolist()))
        if not (isinstance(losses, torch.Tensor) and losses.shape == (len(indices),)):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise UserError(f"the loss must return one loss per example ({len(indices)} here, as with "
                            f"reduction='none'); it returned {shape}", key="loss")
        return losses

    def fingerprint(self) -> str:
        return self._fingerprint

    @torch.no_grad()
    def evaluate(self):
        if self.eval_data is None:
            return {}
        fns = {"loss": self.own.loss, **self.own.metrics}
        sums: dict[str, float] = {}
        n, size = len(self.eval_data), self.cfg.eval_batch_size
        starts = range(0, n, size)
        for s in track(starts, len(starts), "held-out evaluation"):
            count = min(n, s + size) - s
            batch = self._batch(self.eval_data, range(s, s + count))
            values = {}
            if all(_calls_model(fn) for fn in fns.values()):
                values = {name: fn(self.model, batch) for name, fn in fns.items()}
            else:
                inputs, targets = self._pair(batch)
                outputs = self.model(inputs)
                values = {name: fn(self.model, batch) if _calls_model(fn) else fn(outputs, targets)
                          for name, fn in fns.items()}
                if "accuracy" not in fns and outputs.dim() == 2 and not torch.is_floating_point(targets):
                    values["accuracy"] = (outputs.argmax(-1) == targets).double()
            for name, v in values.items():
                v = torch.as_tensor(v, dtype=torch.float64)
                total = float(v.sum()) if v.dim() and v.numel() == count else float(v.mean()) * count
                sums[name] = sums.get(name, 0.0) + total
        return {k: v / n for k, v in sums.items()}

    def export(self, folder, *, merge: bool = False):
        """Your model as it is, when it is a transformers model (``save_pretrained``), or a peft
        model's adapter: the same module, so the same function of its inputs. A plain torch module
        is no architecture that transformers knows how to load."""
        import sys

        from .export import MODEL_DIR, ModelExport

        transformers, peft = sys.modules.get("transformers"), sys.modules.get("peft")  # imported by such a model
        if merge:
            raise UserError("--merge: dpregistry merges only the LoRA adapters of its own objectives; merge yours "
                            "(result.model.merge_and_unload()) and save that")
        if peft is not None and isinstance(self.model, peft.PeftModel):
            self.model.save_pretrained(folder)
            base = type(self.model.get_base_model()).__name__
            return ModelExport(what=f"a peft adapter of {base} (your own model and loss)", library="peft",
                               usage=f"""from peft import PeftModel
from transformers import {base}

base = {base}.from_pretrained("YOUR BASE MODEL")  # the model you wrapped with peft
model = PeftModel.from_pretrained(base, "{MODEL_DIR}").eval()""")
        if transformers is None or not isinstance(self.model, transformers.PreTrainedModel):
            raise UserError(f"your model is a plain torch module ({type(self.model).__name__}), which transformers "
                            f"cannot load; save result.model's state_dict with safetensors instead")
        self.model.save_pretrained(folder)
        arch = type(self.model).__name__
        return ModelExport(what=f"{arch} (your own model and loss)", usage=f"""from transformers import {arch}

model = {arch}.from_pretrained("{MODEL_DIR}").eval()  # preprocess its inputs as your training data was""")


def _to(batch: Any, device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch
