"""Small helpers shared by the KL stages."""

from __future__ import annotations

from dpregistry import UserError


def user_error(run, message: str, key: str) -> UserError:
    """A UserError that names the recipe file, and the line of ``key`` when the recipe sets it."""
    where = run.recipe.where(*key.split(".")) if getattr(run, "recipe", None) else {"key": key}
    return UserError(message, **{"file": getattr(getattr(run, "recipe", None), "source", None), **where})


def declared(run, key: str, what: str) -> float:
    """A constant the objective declares (``kl_constants``), for ``auto`` settings."""
    consts = getattr(run.objective, "kl_constants", None)
    value = consts().get(key) if consts else None
    if value is None:
        raise user_error(run, f"auto needs an objective that declares its {key}; objective "
                              f"{run.objective.name!r} does not, so give a number", what)
    return float(value)
