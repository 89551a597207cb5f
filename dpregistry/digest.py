"""A digest of the training records, to tell whether a resume or another rank trains on the same
data, in the same order: every record of tensors, lists and text tables; for other data sets the
number of records and 16 spread over them (each read under fixed seeds, so that a random
augmentation reads alike), a heuristic that a changed file or another shard is caught by."""

from __future__ import annotations

import hashlib
import numbers
import random
from typing import Any, Callable

import numpy as np
import torch


def spread(n: int, m: int = 16) -> list[int]:
    """Up to ``m`` indices spread over ``range(n)``, the first and the last included."""
    return sorted({round(i * (n - 1) / (m - 1)) for i in range(m)}) if n > 1 else list(range(n))


def _update(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        h.update(f"tensor {value.dtype} {tuple(value.shape)}".encode())
        h.update(memoryview(value.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(value, np.ndarray):
        h.update(f"array {value.dtype} {value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (str, bytes, bool, numbers.Number)) or value is None:
        h.update(f"{type(value).__name__} {value!r}".encode())
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(f"key {k!r}".encode())
            _update(h, value[k])
    elif isinstance(value, (tuple, list)):
        h.update(f"seq {len(value)}".encode())
        for v in value:
            _update(h, v)
    else:  # an object whose repr may hold its address: its type only
        h.update(f"object {type(value).__qualname__}".encode())


def data_digest(n: int, record: Callable[[int], Any], every: bool = False) -> str:
    """The digest of ``n`` records, ``record(i)`` being the i-th (tensors, arrays, numbers, text,
    and tuples, lists and dicts of them): of every record, or of 16 spread over them; each read
    with torch's, numpy's and Python's generators seeded alike and restored after."""
    h = hashlib.sha256(f"{n} records".encode())
    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            for i in range(n) if every else spread(n):
                torch.default_generator.manual_seed(i)  # (torch.manual_seed would seed CUDA's too)
                np.random.seed(i)
                random.seed(i)
                _update(h, record(i))
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    return h.hexdigest()[:16]


def rows_of(data: Any) -> tuple[Any, list[int] | None]:
    """(the data set under ``data``'s Subsets, the indices of it that ``data`` holds, or None for
    all of it)."""
    from torch.utils.data import Subset

    if isinstance(data, Subset):
        base, inner = rows_of(data.dataset)
        idx = [int(i) for i in data.indices]
        return base, idx if inner is None else [inner[i] for i in idx]
    return data, None


def dataset_digest(data: Any) -> str:
    """:func:`data_digest` of a torch data set or a list: a TensorDataset's tensors (or the rows of
    them a Subset holds) in bulk, a list's every record, another data set's 16 spread records."""
    from torch.utils.data import TensorDataset

    base, rows = rows_of(data)
    if isinstance(base, TensorDataset):
        h = hashlib.sha256(f"{len(data)} records".encode())
        for t in base.tensors:
            _update(h, t if rows is None else t[torch.as_tensor(rows, dtype=torch.long)])
        return h.hexdigest()[:16]
    return data_digest(len(data), data.__getitem__, every=isinstance(base, (list, tuple)))
