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
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
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


def _user_ids(users: Any, n: int) -> np.ndarray:
    """``users=``: one id per training example, a text or an integer, numbered as a text file's
    ``data.user`` column is (:func:`dpregistry.data.text.user_numbers`)."""
    import pyarrow as pa

    from .data.text import user_numbers

    def refuse(message: str, row: int | None = None) -> UserError:
        return UserError(message + (f" (example {row})" if row is not None else ""), key="users")

    if isinstance(users, (str, bytes, dict, set, frozenset)) or not hasattr(users, "__len__"):
        # a dict would give its keys, a text its characters, a set no order
        raise refuse(f"users must be a sequence of user ids in the order of train_data (a list, an array or a "
                     f"tensor), got {type(users).__name__}")
    not_floats = "users must be integers or texts, not floats (a feature column passed by mistake?)"
    values = users if isinstance(users, (np.ndarray, torch.Tensor)) else np.asarray(list(users), dtype=object)
    if values.ndim != 1 or len(values) != n:
        raise refuse(f"users must hold one user id per training example ({n}), got shape {tuple(values.shape)}")
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex():  # bfloat16 has no NumPy form
            raise refuse(not_floats)
        values = values.detach().cpu().numpy()
    if values.dtype == object:  # missing ids as None (pandas gives NA, or NaN in a column of texts)
        values = np.array([None if _missing(v) else v for v in values], dtype=object)
        for row, v in enumerate(values):  # NumPy's and Decimal's floats too: each kind is an id or a refusal
            if not (v is None or isinstance(v, str) or (isinstance(v, numbers.Integral) and not isinstance(v, bool))):
                raise refuse(not_floats if isinstance(v, (numbers.Number, np.floating)) and not isinstance(v, bool)
                             else f"users must be integers or texts, got {type(v).__name__}", row)
    elif values.dtype.kind in "fc":
        raise refuse(not_floats)
    try:
        return user_numbers(pa.array(values.tolist() if values.dtype == object else values), "users", refuse)
    except OverflowError:
        raise refuse("users must be integers of at most 64 bits, or texts: pass larger ids as texts") from None
    except pa.ArrowException as e:
        raise refuse(f"users must be integers or texts, one kind for all ({str(e).splitlines()[0][:120]})") from None


def _missing(v: Any) -> bool:
    return v is None or type(v).__name__ == "NAType" or (isinstance(v, float) and v != v)


def _indexable(data: Any, what: str) -> Any:
    from torch.utils.data import IterableDataset

    if data is None:
        return None
    if isinstance(data, IterableDataset) or isinstance(data, dict) or type(data).__module__.startswith("pandas"):
        kind = ("a stream (IterableDataset)" if isinstance(data, IterableDataset) else
                "a dict (of splits or columns?)" if isinstance(data, dict) else f"a pandas {type(data).__name__}")
        raise UserError(f"{what} is {kind}: sampling draws examples by index from a set of known size; pass a map-"
                        f"style Dataset, a list of examples, or one split of a datasets.Dataset "
                        f"(datasets.Dataset.from_pandas for a DataFrame)", key=what)
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
    tensor overlaps the other's rows in one storage, lists holding the same example objects, or
    datasets.Datasets that read the same Arrow rows. Rows copied into other objects are not
    detected."""
    from torch.utils.data import TensorDataset

    (a, ia), (b, ib) = rows_of(train), rows_of(held_out)
    if a is b:
        return ia is None or ib is None or not set(ia).isdisjoint(ib)
    if isinstance(a, TensorDataset) and isinstance(b, TensorDataset):
        return len(a.tensors) == len(b.tensors) and all(_same_rows(x, y) for x, y in zip(a.tensors, b.tensors))
    if isinstance(a, list) and isinstance(b, list):
        ids = {id(r) for r in a if isinstance(r, (tuple, list, dict, torch.Tensor))}
        return any(id(r) in ids for r in b)
    ra, rb = _arrow_rows(a, ia), _arrow_rows(b, ib)
    if ra is not None and rb is not None:
        for buffer in set(ra) & set(rb):
            if np.intersect1d(ra[buffer], rb[buffer]).size:
                return True
    return False


def _arrow_rows(data: Any, rows: list[int] | None) -> dict[int, np.ndarray] | None:
    """The Arrow rows a datasets.Dataset (``rows`` of it, or all) reads, by the memory they are
    in: {address of a buffer of one of its columns: the rows' positions in that column's chunk}.
    ``select``, ``shuffle``, ``train_test_split``, ``with_format`` and ``remove_columns`` make new
    Datasets over the same memory, so a held-out set made from the training set is seen whatever
    object it is, and whichever of its columns it kept (a struct column, an image, holds its
    values in its children's buffers: every buffer counts). Two memory maps of one cache file are
    other memory, and are not seen."""
    import sys

    datasets = sys.modules.get("datasets")
    if datasets is None or not isinstance(data, datasets.Dataset):
        return None
    table = data.data.table
    picked = data._indices.column(0).to_numpy() if data._indices is not None else None
    keep = picked if rows is None else (np.asarray(rows) if picked is None else picked[rows])
    out: dict[int, list[np.ndarray]] = {}
    for column in table.columns:
        start = 0
        for chunk in column.chunks:
            mine = np.arange(start, start + len(chunk))
            start += len(chunk)
            held = mine if keep is None else np.intersect1d(mine, keep)
            for buffer in chunk.buffers():
                if buffer is not None and buffer.size:
                    out.setdefault(buffer.address, []).append(held - mine[0] + chunk.offset if len(mine) else held)
    return {b: np.concatenate(p) for b, p in out.items()}


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
        return UserIds(torch.from_numpy(_user_ids(self.own.users, self.n_train)))

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
        if peft is not None and any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in self.model.modules()):
            # save_pretrained would write base_layer/lora_A keys that from_pretrained drops, loading the
            # adapted layers at random
            raise UserError("your model holds peft adapters outside a PeftModel (inject_adapter_in_model), which "
                            "save_pretrained cannot write as a loadable model; wrap it with peft.get_peft_model, or "
                            "merge the adapters into the weights first")
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
