"""A digest of the training records, to tell whether a resume or another rank trains on the same
data: the number of records and the content of up to 16 spread over them (a heuristic that a
changed file, another shard or another order is caught by, not a hash of every record)."""

from __future__ import annotations

import hashlib
import numbers
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


def data_digest(n: int, record: Callable[[int], Any]) -> str:
    """The digest of ``n`` records, ``record(i)`` being the i-th (tensors, arrays, numbers, text,
    and tuples, lists and dicts of them)."""
    h = hashlib.sha256(f"{n} records".encode())
    for i in spread(n):
        _update(h, record(i))
    return h.hexdigest()[:16]
