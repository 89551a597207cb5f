"""The plugin registry: a pluggy ``PluginManager("dpregistry")`` fed from entry points."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from . import hookspecs
from .errors import UserError
from .stages import Algorithm, Estimator, Objective, Privatizer, Sampler, Stage, UpdateRule
from .privacy.accountant import Accountant

ENTRY_POINT_GROUP = "dpregistry"

#: kind -> (hook name, base class)
KINDS: dict[str, tuple[str, type]] = {
    "objective": ("dpreg_register_objectives", Objective),
    "sampler": ("dpreg_register_samplers", Sampler),
    "estimator": ("dpreg_register_estimators", Estimator),
    "privatizer": ("dpreg_register_privatizers", Privatizer),
    "update_rule": ("dpreg_register_update_rules", UpdateRule),
    "accountant": ("dpreg_register_accountants", Accountant),
    "algorithm": ("dpreg_register_algorithms", Algorithm),
}


class PluginConflict(UserError):
    pass


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    cls: type
    origin: str  # "distribution version (plugin)"

    @property
    def description(self) -> str:
        return self.cls.description()

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "origin": self.origin,
                "description": self.description}


class Registry:
    def __init__(self):
        self.pm = pluggy.PluginManager("dpregistry")
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}

    def load_entry_points(self) -> "Registry":
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if self.pm.has_plugin(ep.name):
                continue
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            self.add_plugin(ep.load(), origin=f"{dist} ({ep.name})", name=ep.name)
        return self

    def add_plugin(self, plugin: Any, origin: str, name: str | None = None) -> None:
        """Register a plugin object (a module or an instance with hookimpls) and its stages."""
        self.pm.register(plugin, name=name)
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        for kind, (hook, _) in KINDS.items():
            caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
            caller(register=self._registrar(kind, origin))

    def _registrar(self, kind: str, origin: str):
        base = KINDS[kind][1]

        def register(cls: type, name: str | None = None) -> None:
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(f"{origin}: a {kind} must subclass dpregistry.{base.__name__}, got {cls!r}")
            name = name or cls.name
            if not name:
                raise TypeError(f"{origin}: {cls.__name__} has no name")
            old = self.entries[kind].get(name)
            if old is not None:
                raise PluginConflict(f"{kind} {name!r} is registered twice: by {old.origin} and by {origin}")
            self.entries[kind][name] = Entry(kind, name, cls, origin)

        return register

    def get(self, kind: str, name: str) -> Entry:
        table = self.entries[kind]
        if name in table:
            return table[name]
        close = difflib.get_close_matches(name, table, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(table)) or "none"
        raise UserError(f"unknown {kind.replace('_', ' ')} {name!r}{hint} (registered: {known})")

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def all(self) -> list[Entry]:
        return [e for kind in KINDS for e in sorted(self.entries[kind].values(), key=lambda e: e.name)]


class StagePlugin:
    """A plugin object that registers stage classes under their kinds; all most plugins need.

    In your package: ``plugin = StagePlugin(MyPrivatizer, MyAlgorithm)``, and in pyproject.toml
    ``[project.entry-points.dpregistry] mine = "my_package:plugin"``. Each class is registered by
    the hook of the kind it subclasses.
    """

    def __init__(self, *classes: type):
        self.classes = classes

    def _register(self, kind: str, register) -> None:
        for cls in self.classes:
            if issubclass(cls, KINDS[kind][1]):
                register(cls)

    @hookspecs.hookimpl
    def dpreg_register_objectives(self, register):
        self._register("objective", register)

    @hookspecs.hookimpl
    def dpreg_register_samplers(self, register):
        self._register("sampler", register)

    @hookspecs.hookimpl
    def dpreg_register_estimators(self, register):
        self._register("estimator", register)

    @hookspecs.hookimpl
    def dpreg_register_privatizers(self, register):
        self._register("privatizer", register)

    @hookspecs.hookimpl
    def dpreg_register_update_rules(self, register):
        self._register("update_rule", register)

    @hookspecs.hookimpl
    def dpreg_register_accountants(self, register):
        self._register("accountant", register)

    @hookspecs.hookimpl
    def dpreg_register_algorithms(self, register):
        self._register("algorithm", register)


_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry
    if _registry is None:
        _registry = Registry().load_entry_points()
    return _registry


def reset_registry() -> None:
    global _registry
    _registry = None


__all__ = ["Registry", "Entry", "StagePlugin", "get_registry", "reset_registry", "KINDS", "PluginConflict", "Stage"]
