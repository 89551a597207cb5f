"""scikit-learn's bundled data sets (shipped inside the package: nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError

BUNDLED = {
    "iris": ("load_iris", "classification"),
    "digits": ("load_digits", "classification"),
    "wine": ("load_wine", "classification"),
    "breast_cancer": ("load_breast_cancer", "classification"),
    "diabetes": ("load_diabetes", "regression"),
}


@dataclass
class Tabular:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    task: str
    n_classes: int


def load_tabular(name: str, *, test_fraction: float = 0.2, seed: int = 0, dtype=torch.float32) -> Tabular:
    """Split ``name`` into train/test with ``seed`` and standardise the features.

    The scaling statistics come from the held-out split, which is treated as public; the private
    training split never influences them (a non-private statistic of it would leak).
    """
    if name not in BUNDLED:
        raise UserError(f"unknown bundled data set {name!r} (choose from {', '.join(BUNDLED)})", key="data.dataset")
    import sklearn.datasets as skd

    loader, task = BUNDLED[name]
    x, y = getattr(skd, loader)(return_X_y=True)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(x))
    n_test = max(1, int(round(test_fraction * len(x))))
    te, tr = perm[:n_test], perm[n_test:]
    mu, sd = x[te].mean(0), x[te].std(0)
    sd[sd == 0] = 1.0
    x = (x - mu) / sd
    yt = torch.as_tensor(y, dtype=torch.long if task == "classification" else dtype)
    if task == "regression":
        ymu, ysd = y[te].mean(), y[te].std() or 1.0
        yt = torch.as_tensor((y - ymu) / ysd, dtype=dtype)
    xt = torch.as_tensor(x, dtype=dtype)
    n_classes = int(yt.max()) + 1 if task == "classification" else 0
    return Tabular(xt[tr], yt[tr], xt[te], yt[te], task, n_classes)
