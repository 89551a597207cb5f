"""The plugin registry: a pluggy ``PluginManager("dpregistry")`` fed from entry points.

Loading every plugin is cheap when plugins are: an entry point should be a small module whose
hooks name its stages. A stage may be registered as a class, or lazily as a ``"module:Class"``
string with its name, and is then imported only when a recipe or command uses it. So
``dpreg privacy calibrate`` imports the accountant it needs and nothing with torch in it, while
every name is still known up front, which is what lets the registry refuse two plugins that
claim one name.

A plugin that fails (its import or its hooks raise) is skipped with a one-line warning naming its
distribution; the other plugins keep working, ``dpreg plugins`` lists it as broken, and a recipe
that names a stage it might have provided is told so.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from dataclasses import dataclass
from functools import cached_property
from importlib.metadata import entry_points
from typing import Any

import pluggy

from . import hookspecs
from .errors import UserError

ENTRY_POINT_GROUP = "dpregistry"

#: kind -> the hook that registers it
KINDS: dict[str, str] = {
    "objective": "dpreg_register_objectives",
    "sampler": "dpreg_register_samplers",
    "estimator": "dpreg_register_estimators",
    "privatizer": "dpreg_register_privatizers",
    "update_rule": "dpreg_register_update_rules",
    "accountant": "dpreg_register_accountants",
    "algorithm": "dpreg_register_algorithms",
}

#: kind -> its base class, imported when first needed (the stage contracts import pydantic)
_BASES = {kind: ("dpregistry.stages", cls) for kind, cls in [
    ("objective", "Objective"), ("sampler", "Sampler"), ("estimator", "Estimator"),
    ("privatizer", "Privatizer"), ("update_rule", "UpdateRule"), ("algorithm", "Algorithm")]}
_BASES["accountant"] = ("dpregistry.privacy.accountant", "Accountant")

#: a lazily registered stage: "package.module:Class" (or "...:Outer.Inner")
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def base_class(kind: str) -> type:
    module, name = _BASES[kind]
    return getattr(importlib.import_module(module), name)


class PluginConflict(UserError):
    pass


class PluginBroken(UserError):
    """A plugin (or one of its lazily registered stages) failed to import."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters (a plugin's message may be long)."""
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _check_stage(cls: Any, kind: str, origin: str, name: str | None = None) -> None:
    """A stage class of ``kind`` whose schema forbids unknown keys (a pydantic model of its own
    would drop a misspelt setting and run with the default), registered under its own ``name``:
    stages and algorithms tell each other apart by name (O2NC's full batch), so a class named
    ``full_batch`` under another registered name would pass for one."""
    from .stages import StageParams

    base = base_class(kind)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{origin}: a {kind} must subclass dpregistry.{base.__name__}, got {cls!r}")
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, StageParams)):
        raise TypeError(f"{origin}: {cls.__name__}.Params must subclass dpregistry.stages.StageParams (it refuses "
                        f"unknown keys), got {cls.Params!r}")
    if name is not None and cls.name != name:
        raise TypeError(f"{origin}: the {kind} {cls.__name__} is registered as {name!r} but its name is "
                        f"{cls.name!r}; register it under its name")


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    target: type | str  # the class, or "module:Class" imported on first use
    origin: str  # "distribution version (plugin)"
    plugin: str = ""  # the plugin's name (its entry point), when it has one

    @cached_property
    def cls(self) -> type:
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (Exception, SystemExit) as e:  # a third-party plugin may raise anything on import
            raise PluginBroken(f"{self.kind} {self.name!r} of {self.origin} failed to load ({self.target}): "
                               f"{one_line(e)}") from None
        try:
            _check_stage(obj, self.kind, self.origin, self.name)
        except TypeError as e:
            raise PluginBroken(f"{self.kind} {self.name!r} of {self.origin} ({self.target}): {e}") from None
        return obj

    @property
    def distribution(self) -> str:
        """``name version`` of the distribution that provides it."""
        suffix = f" ({self.plugin})"
        return self.origin[:-len(suffix)] if self.plugin and self.origin.endswith(suffix) else self.origin

    @property
    def description(self) -> str:
        return self.cls.description()

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "origin": self.origin,
                "description": self.description}


@dataclass(frozen=True)
class Broken:
    """An entry point that could not be loaded, and why."""

    plugin: str        # the entry point's name
    distribution: str  # "name version"
    error: str         # one line

    @property
    def message(self) -> str:
        return (f"plugin {self.plugin!r} of {self.distribution} failed to load and is skipped: {self.error}")


class _Builtin:
    """What dpregistry itself registers, like a plugin: the ``python`` objective (your own model,
    loss and data, given to ``dpregistry.train``) and the per-example gradients of the built-in layers."""

    @hookspecs.hookimpl
    def dpreg_register_objectives(self, register):
        register("dpregistry.own:OwnObjective", name="python")

    @hookspecs.hookimpl
    def dpreg_register_grad_samplers(self, register):
        from .persample import register_builtin_layers

        register_builtin_layers(register)


class Registry:
    def __init__(self):
        self.pm = pluggy.PluginManager("dpregistry")
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
        self.broken: list[Broken] = []
        self._grad_samplers: dict[type, tuple[Any, str]] | None = None
        from . import __version__

        self.add_plugin(_Builtin(), origin=f"dpregistry {__version__} (builtin)", name="dpregistry")

    def grad_samplers(self) -> dict[type, Any]:
        """Layer type -> the handler of its per-example gradients, from every plugin's
        ``dpreg_register_grad_samplers`` (collected on first use: it imports torch). Two plugins
        claiming one layer type are an error that names both."""
        if self._grad_samplers is None:
            table: dict[type, tuple[Any, str]] = {}
            for impl in self.pm.hook.dpreg_register_grad_samplers.get_hookimpls():
                origin = impl.plugin_name

                def register(layer: type, handler: Any, origin=origin) -> None:
                    if not isinstance(layer, type):
                        raise TypeError(f"{origin}: register(LayerType, handler) got {layer!r}")
                    if layer in table:
                        raise PluginConflict(f"per-example gradients of {layer.__name__} are registered twice: by "
                                             f"{table[layer][1]} and by {origin}")
                    table[layer] = (handler, origin)

                impl.function(register=register)  # bound to its plugin: one origin per call
            self._grad_samplers = table
        return {layer: h for layer, (h, _) in self._grad_samplers.items()}

    def load_entry_points(self) -> "Registry":
        """Load every plugin of the entry-point group. A plugin that raises is recorded in
        ``broken`` and skipped; two plugins claiming one name stop everything (PluginConflict):
        which of them a recipe would get is not for the registry to guess."""
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if self.pm.has_plugin(ep.name):
                continue
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            try:
                self.add_plugin(ep.load(), origin=f"{dist} ({ep.name})", name=ep.name)
            except PluginConflict:
                raise
            except (Exception, SystemExit) as e:  # anything a third-party import may raise, but Ctrl-C
                self.broken.append(Broken(ep.name, dist, one_line(e)))
        return self

    def add_plugin(self, plugin: Any, origin: str, name: str | None = None) -> None:
        """Register a plugin object (a module or an instance with hookimpls) and its stages; all
        or nothing: a plugin whose hooks raise leaves the registry as it was."""
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()  # a misspelt hook (dpreg_register_privatizer) would never be called
            pending: list[Entry] = []
            others = [p for p in self.pm.get_plugins() if p is not plugin]
            for kind, hook in KINDS.items():
                caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
                caller(register=self._registrar(kind, origin, name or "", pending))
        except BaseException:
            self.pm.unregister(plugin)
            raise
        for e in pending:
            self.entries[e.kind][e.name] = e
        self._grad_samplers = None  # collected again, with this plugin's layers, when next needed

    def _registrar(self, kind: str, origin: str, plugin: str, pending: list[Entry]):
        def register(cls: type | str, name: str | None = None) -> None:
            if isinstance(cls, str):
                if not _TARGET.fullmatch(cls):
                    raise TypeError(f"{origin}: a lazily registered {kind} is 'package.module:Class', got {cls!r}")
                if not name:
                    raise TypeError(f"{origin}: the {kind} {cls!r} is registered lazily, so it needs name=")
            else:
                name = name or cls.name
                _check_stage(cls, kind, origin, name)
            if not isinstance(name, str) or not name:
                raise TypeError(f"{origin}: {getattr(cls, '__name__', cls)} has no name")
            entry = Entry(kind, name, cls, origin, plugin)
            self._refuse_clash(entry, pending)
            pending.append(entry)

        return register

    def _refuse_clash(self, new: Entry, pending: list[Entry]) -> None:
        """Names are unique within a kind, and so are their case-folded forms: `Gaussian` next
        to `gaussian` would let a typo, or a hostile plugin, pick another stage than meant."""
        taken = [*self.entries[new.kind].values(), *(e for e in pending if e.kind == new.kind)]
        for old in taken:
            if old.name == new.name:
                raise PluginConflict(f"{new.kind} {new.name!r} is registered twice: by {old.origin} and by {new.origin}")
            if old.name.casefold() == new.name.casefold():
                raise PluginConflict(f"{new.kind} {new.name!r} of {new.origin} differs only by case from "
                                     f"{old.name!r} of {old.origin}; stage names must differ by more than case")

    def get(self, kind: str, name: str) -> Entry:
        table = self.entries[kind]
        if name in table:
            return table[name]
        close = difflib.get_close_matches(name, table, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(table)) or "none"
        broken = "".join(f"; it may come from {b.plugin!r} of {b.distribution}, which failed to load ({b.error})"
                         for b in self.broken)
        raise UserError(f"unknown {kind.replace('_', ' ')} {name!r}{hint}{broken} (registered: {known})")

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def all(self) -> list[Entry]:
        return [e for kind in KINDS for e in sorted(self.entries[kind].values(), key=lambda e: e.name)]


class StagePlugin:
    """A plugin object that registers stage classes under their kinds; all most plugins need.

    In your package: ``plugin = StagePlugin(MyPrivatizer, MyAlgorithm)``, and in pyproject.toml
    ``[project.entry-points.dpregistry] mine = "my_package:plugin"``. Each class is registered by
    the hook of the kind it subclasses. To keep ``dpreg`` quick, name the stages instead and let
    them be imported on first use::

        plugin = StagePlugin(lazy={"privatizer": {"mine": "my_package.privatizers:MyPrivatizer"}})
    """

    def __init__(self, *classes: type, lazy: dict[str, dict[str, str]] | None = None):
        unknown = set(lazy or ()) - set(KINDS)
        if unknown:
            raise TypeError(f"unknown stage kinds {sorted(unknown)}; the kinds are {', '.join(KINDS)}")
        self.classes = classes
        self.lazy = lazy or {}

    def _register(self, kind: str, register) -> None:
        if kind == next(iter(KINDS)):  # once, before any kind registers: a class of no kind would be dropped
            bases = tuple(base_class(k) for k in KINDS)
            for cls in self.classes:
                if not (isinstance(cls, type) and issubclass(cls, bases)):
                    raise TypeError(f"StagePlugin got {cls!r}, which subclasses no stage kind "
                                    f"({', '.join(b.__name__ for b in bases)})")
        if self.classes:
            base = base_class(kind)
            for cls in self.classes:
                if issubclass(cls, base):
                    register(cls)
        for name, target in self.lazy.get(kind, {}).items():
            register(target, name=name)

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


def third_party(entries) -> list[str]:
    """``kind name (origin)`` of each stage that dpregistry does not ship."""
    from . import __version__

    return [f"{e.kind.replace('_', ' ')} {e.name} ({e.origin})" for e in entries
            if not e.origin.startswith(f"dpregistry {__version__} ")]


def trust_statement(stages: list[str]) -> str:
    """What a run's ε rests on beyond dpregistry's own stages, in words (summary, report, model card)."""
    return (f"{'; '.join(stages)}: the ε holds only if these stages keep the stage contract (their events "
            f"state what they release); dpregistry checks what it can (docs/contract.md)")


_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use; each broken plugin is
    reported once, in one line on stderr."""
    global _registry
    if _registry is None:
        _registry = Registry().load_entry_points()
        for b in _registry.broken:
            print(f"warning: {b.message}", file=sys.stderr)
    return _registry


def reset_registry() -> None:
    global _registry
    _registry = None


__all__ = ["Registry", "Entry", "Broken", "StagePlugin", "get_registry", "reset_registry", "KINDS",
           "PluginConflict", "PluginBroken", "base_class", "third_party", "trust_statement"]
