"""Model configurations shipped as JSON, and an image-classification objective (ViT on CIFAR-10).

The paper's models are built from these configurations (``configs/*.json``): ViT-B/4 at 32 px is
trained from scratch, so it needs no weights at all; RoBERTa-large and OPT-6.7B load weights from
a local folder, and their configurations let tests check the layer split (spec 003 §7.16) on the
meta device without them.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from dpregistry import StageParams, UserError
from dpregistry.files import read_regular, require_regular
from dpregistry.hf import quiet
from dpregistry.objectives import DTYPES, TorchObjective, Trainable, seeded

CONFIGS = Path(__file__).parent / "configs"
MAX_CONFIG_BYTES = 10_000_000  # a model configuration is a few kB of JSON


def config_dict(name_or_path: str) -> dict:
    """A shipped configuration by name (``vit-base-p4-32``), or a config.json / model folder path."""
    shipped = CONFIGS / f"{name_or_path}.json"
    try:
        p = shipped if shipped.is_file() else Path(name_or_path).expanduser()
        if p.is_dir():
            p = p / "config.json"
        found = p.exists()
    except OSError:  # a name too long for the file system, ...
        found = False
    if not found:
        names = ", ".join(sorted(f.stem for f in CONFIGS.glob("*.json")))
        raise UserError(f"model configuration {name_or_path!r} not found (shipped: {names})", key="model.config")
    try:
        config = json.loads(read_regular(p, "model configuration", limit=MAX_CONFIG_BYTES))
    except (ValueError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise UserError(f"{p} is not a JSON model configuration (an object)", key="model.config")
    return config


def build_from_config(name_or_path: str, *, device=None, dtype=torch.float32, **overrides):
    """The Hugging Face model of a configuration (its first ``architectures`` entry), randomly
    initialised; ``device="meta"`` builds the shapes only (no memory, no time)."""
    import transformers

    cfg_dict = dict(config_dict(name_or_path), **overrides)
    try:
        config = transformers.AutoConfig.for_model(**cfg_dict)
        arch = getattr(transformers, cfg_dict.get("architectures", ["AutoModel"])[0])
        with torch.device(device or "cpu"):
            model = arch(config)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        # the configuration is input: a wrong type or an unknown model type is bad input, not a bug
        raise UserError(f"cannot build a model from configuration {name_or_path!r} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})", key="model.config") from None
    return model.to(dtype) if device != "meta" else model


# ------------------------------------------------------------------------------------------
# image classification
# ------------------------------------------------------------------------------------------


class _Sub(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageModel(_Sub):
    config: str = Field(default="vit-base-p4-32", description="a shipped configuration, or a config.json/folder")
    init: Literal["random", "pretrained"] = Field(default="random", description="pretrained: weights from `config`'s folder")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class ImageData(_Sub):
    path: str = Field(description="folder with the CIFAR-10 binary batches, or train.npz/test.npz")
    format: Literal["cifar10_binary", "npz"] = "cifar10_binary"
    mean: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
    std: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)
    max_train: int | None = Field(default=None, gt=0)
    max_test: int | None = Field(default=None, gt=0)


class ImageParams(StageParams):
    model: ImageModel = Field(default_factory=ImageModel)
    data: ImageData
    trainable: Trainable = Field(default_factory=Trainable)


def _cifar10_binary(folder: Path, files: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10's binary version: records of 1 label byte + 3·32·32 pixel bytes (channel-major)."""
    xs, ys = [], []
    for name in files:
        p = folder / name
        if not p.exists():
            raise UserError(f"{p} not found (CIFAR-10 binary version: data_batch_1..5.bin, test_batch.bin)",
                            key="data.path")
        require_regular(p, "data file")  # a FIFO would block, a device never end
        raw = np.fromfile(p, dtype=np.uint8)
        if raw.size % 3073:
            raise UserError(f"{p} is not a CIFAR-10 binary batch (size {raw.size} is not a multiple of 3073)",
                            key="data.path")
        raw = raw.reshape(-1, 3073)
        ys.append(raw[:, 0].astype(np.int64))
        xs.append(raw[:, 1:].reshape(-1, 3, 32, 32))
    return np.concatenate(xs), np.concatenate(ys)


def _npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.exists():
        raise UserError(f"{path} not found", key="data.path")
    require_regular(path, "data file")
    try:
        with np.load(path, allow_pickle=False) as z:
            x, y = z["x"], z["y"].astype(np.int64)
    except (ValueError, OSError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise UserError(f"{path} is not an .npz file with arrays x and y ({type(e).__name__})",
                        key="data.path") from None
    if x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)  # NHWC -> NCHW
    return np.ascontiguousarray(x), y


class ImageClassification(TorchObjective):
    """A Hugging Face image classifier (default: ViT-B/4 at 32 px from config) on CIFAR-10-style data."""

    name = "image_classification"
    Params = ImageParams

    def build(self, ctx):
        d = self.cfg.data
        folder = Path(d.path).expanduser()
        if not folder.is_dir():
            raise UserError(f"data folder {d.path!r} not found", key="data.path")
        if d.format == "cifar10_binary":
            xtr, ytr = _cifar10_binary(folder, [f"data_batch_{i}.bin" for i in range(1, 6)])
            xte, yte = _cifar10_binary(folder, ["test_batch.bin"])
        else:
            (xtr, ytr), (xte, yte) = _npz(folder / "train.npz"), _npz(folder / "test.npz")
        # The number of classes is public (CIFAR-10's ten, or the whole held-out split's): never read off
        # the private training labels (one row's label of 999 would widen the head, and the model shows it)
        n_labels = 10 if d.format == "cifar10_binary" else int(yte.max(initial=0)) + 1
        labels = np.concatenate([ytr, yte])
        if labels.min(initial=0) < 0 or labels.max(initial=0) >= n_labels:
            source = "CIFAR-10's" if d.format == "cifar10_binary" else "the held-out split's"
            raise UserError(f"a label lies outside the classes 0..{n_labels - 1} ({source}; the private training "
                            f"labels never set them)", key="data.path")
        if d.max_train:
            xtr, ytr = xtr[:d.max_train], ytr[:d.max_train]
        if d.max_test:
            xte, yte = xte[:d.max_test], yte[:d.max_test]
        if not len(yte):  # held-out accuracy 0 and loss 0 would read as measured
            raise UserError("the test data set is empty", key="data.path")
        self.n_train = len(ytr)
        self.x_train, self.y_train = torch.from_numpy(xtr), torch.from_numpy(ytr).to(ctx.device)
        self.x_test, self.y_test = torch.from_numpy(xte), torch.from_numpy(yte).to(ctx.device)
        self.mean = torch.tensor(d.mean).view(1, -1, 1, 1)
        self.std = torch.tensor(d.std).view(1, -1, 1, 1)
        m = self.cfg.model
        self.dtype = DTYPES[m.dtype]
        with seeded(ctx.rng.seed("init", 0)), quiet():
            if m.init == "pretrained":
                import transformers

                from dpregistry.hf import resolve_model_dir

                folder = resolve_model_dir(m.config)  # a local folder with safetensors weights, never a pickle
                arch = getattr(transformers, config_dict(folder).get("architectures", ["AutoModel"])[0])
                self.model = arch.from_pretrained(folder, num_labels=n_labels, ignore_mismatched_sizes=True,
                                                  use_safetensors=True)
            else:
                self.model = build_from_config(m.config, num_labels=n_labels)
        self.model = self.model.to(ctx.device, self.dtype)

    def _pixels(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() / 255.0 - self.mean) / self.std
        return x.to(self.device, self.dtype)

    def batch_losses(self, indices):
        logits = self.model(pixel_values=self._pixels(self.x_train[indices.cpu()])).logits
        return F.cross_entropy(logits.float(), self.y_train[indices], reduction="none")

    @torch.no_grad()
    def evaluate(self, batch_size: int = 256):
        correct, loss = 0, 0.0
        for s in range(0, len(self.y_test), batch_size):
            logits = self.model(pixel_values=self._pixels(self.x_test[s:s + batch_size])).logits.float()
            y = self.y_test[s:s + batch_size]
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        n = max(len(self.y_test), 1)
        return {"accuracy": correct / n, "loss": loss / n}


OBJECTIVES = (ImageClassification,)
