"""Safetensors checkpoints: atomic, checksummed, and never unpickled.

A checkpoint holds tensors (trainable parameters, stage state, RNG state) and one metadata entry,
``dpregistry``, with JSON: the step, the resolved recipe and its hash, the non-tensor stage state
(the privacy ledger among it), the library version and a SHA-256 of all tensor bytes and of the
metadata itself (a flipped bit in the ledger would otherwise under-charge a resumed run). A file
whose checksum does not match (a torn write, a flipped bit) is refused, and the run falls back
to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from . import files
from .errors import UserError

META_KEY = "dpregistry"
NAME = re.compile(r"^step-(\d+)\.safetensors$")
#: safetensors readers refuse a header (the JSON before the tensor bytes) larger than this
HEADER_LIMIT = 100_000_000


class CorruptCheckpoint(Exception):
    pass


def tensor_digest(tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> str:
    """SHA-256 of every tensor (name, dtype, shape, bytes) and of the metadata without its checksum."""
    h = hashlib.sha256()
    if meta is not None:
        h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        if t.numel():
            h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# -- nested state <-> (json, tensors) -----------------------------------------------------


def state_digest(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """What a keyed replay must reproduce at a step: the tensors and the stages' state (not the
    ledger, the counters or the wall time). Recorded in ledger.jsonl (:mod:`dpregistry.ledger_file`)."""
    return tensor_digest(tensors, {"state": meta["state"]})


def split_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace tensors in a nested state by {"__tensor__": key}, collecting them in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().contiguous().cpu()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {str(k): split_state(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    return obj


def join_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: join_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_state(v, tensors) for v in obj]
    return obj


# -- files -------------------------------------------------------------------------------------


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Stream ``tensors`` to the open binary file ``f`` in the safetensors format, one tensor at a
    time (no second copy of the model in memory). I/O errors surface as the OSError of the write
    (ENOSPC, EROFS, ...), which safetensors' own writer hides behind its own error type and
    temporary file. Format: u64 header length, JSON header padded to 8 bytes, tensor bytes."""
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("safetensors files are little-endian")
    items = sorted(tensors.items())
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for k, t in items:
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{k}: dtype {t.dtype} cannot be stored in safetensors")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for _, t in items:
        if t.numel():
            f.write(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write a checksummed safetensors file atomically (see :func:`dpregistry.files.write_atomic`)."""
    meta = json.loads(json.dumps(meta))  # exactly what a reader will see (tuples become lists)
    meta["checksum"] = tensor_digest(tensors, meta)
    files.write_atomic(Path(path), lambda f: write_safetensors(f, tensors, {META_KEY: json.dumps(meta, sort_keys=True)}))


def read(path: Path, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a checkpoint written by :func:`write_atomic` (safetensors only: no pickle)."""
    try:
        files.require_regular(path, "checkpoint")  # opening a FIFO would block
    except UserError as e:
        raise CorruptCheckpoint(f"{path}: {e.message}") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # truncated header, not a safetensors file, ...
        raise CorruptCheckpoint(f"{path}: unreadable ({e})") from None
    if raw is None:
        raise CorruptCheckpoint(f"{path}: not a dpregistry checkpoint (no metadata)")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        raise CorruptCheckpoint(f"{path}: unreadable metadata") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(f"{path}: unreadable metadata")
    if verify and meta.get("checksum") != tensor_digest(tensors, meta):
        raise CorruptCheckpoint(f"{path}: checksum mismatch")
    return tensors, meta


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}.safetensors"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return sorted(out)


def latest_valid(folder: Path, warn=print) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path] | None:
    """The newest checkpoint that loads and verifies; corrupted ones are skipped with a warning."""
    for _, path in reversed(list_checkpoints(folder)):
        try:
            tensors, meta = read(path)
            return tensors, meta, path
        except CorruptCheckpoint as e:
            warn(f"warning: skipping corrupted checkpoint {e}")
    return None


def prune(folder: Path, keep: int) -> None:
    for _, path in list_checkpoints(folder)[:-keep]:
        path.unlink(missing_ok=True)


def require_safetensors(path: Path) -> None:
    """Refuse anything that is not a safetensors file (pickles run code on load)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise UserError(f"{path}: not a safetensors file")
    n = int.from_bytes(head, "little")
    if n <= 0 or n > HEADER_LIMIT or head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK"):
        raise UserError(f"{path}: not a safetensors file (pickle and zip archives are refused)")
