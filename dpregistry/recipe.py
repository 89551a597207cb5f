"""YAML recipes: loading with line numbers, ``extends:``, ``--set`` overrides and validation.

A recipe names an algorithm (a preset of stages) and overrides any stage section::

    extends: base.yaml                  # optional, relative to this file
    algorithm: dp_adam
    objective: {name: tabular, dataset: digits, model: mlp}
    privatizer: {clip: 1.0}             # merged into the preset's privatizer section
    privacy: {epsilon: 3, delta: 1e-5}
    train: {steps: 300}

Every stage's parameters are validated against that stage's own pydantic schema before any work
starts; an error names the file, the line and the key, and suggests the closest known name.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import UserError
from .files import read_regular
from .limits import MAX_DEPTH, MAX_EXTENDS, MAX_RECIPE_BYTES, MAX_STEPS, MAX_VALUES
from .registry import Entry, Registry
from .spaces import DENSE, VECTOR_ZO
from .stages import NoBooleanNumbers

#: recipe section -> stage kind
SECTIONS = {"objective": "objective", "sampler": "sampler", "estimator": "estimator",
            "privatizer": "privatizer", "update": "update_rule", "accountant": "accountant"}
TOP_LEVEL = {"extends", "description", "seed", "algorithm", "model", "data", "privacy", "train",
             "output", *SECTIONS}
#: keys that change neither privacy nor results (excluded from the recipe hash)
COSMETIC = {("description",), ("train", "log_every"), ("train", "checkpoint_every"),
            ("train", "keep_checkpoints"), ("train", "eval_every"), ("train", "progress"),
            ("train", "sync_check_every"), ("train", "max_nonfinite_steps")}

Loc = tuple[str, int | None]  # (file, line)

# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

# YAML 1.1 (PyYAML) reads 1e-5 as a string; recipes mean a float.
_FLOAT = re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")


class _Loader(yaml.SafeLoader):
    """The recipe loader: PyYAML's safe loader, whose (recursive) composer refuses nesting beyond
    MAX_DEPTH."""

    def __init__(self, text: str, file: str):
        self.file = file
        self._depth = 0
        super().__init__(text)

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _too_deep(self.file, self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _too_deep(file: str, mark) -> UserError:
    return UserError(f"the recipe nests deeper than {MAX_DEPTH} levels", file=file,
                     line=mark.line + 1 if mark else None)


class _Expansion:
    """Counts the keys, values and characters of a recipe as aliases are expanded."""

    def __init__(self, file: str):
        self.file = file
        self.values = 0
        self.chars = 0

    def take(self, node, depth: int) -> None:
        self.values += 1
        if isinstance(node, yaml.ScalarNode):
            self.chars += len(node.value) + 1
        if depth > MAX_DEPTH:  # an alias inside an alias (or a recursive one) nests further
            raise _too_deep(self.file, node.start_mark)
        if self.values > MAX_VALUES or self.chars > MAX_RECIPE_BYTES:
            raise UserError(f"the recipe expands to more than {MAX_VALUES:,} keys and values or "
                            f"{MAX_RECIPE_BYTES:,} characters (aliases included)", file=self.file,
                            line=node.start_mark.line + 1)


#: the YAML tags whose values a recipe holds (JSON's: a run folder stores the recipe as JSON)
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "str", "int", "float", "bool", "null")}


def _convert(node, loader, file: str, path: tuple, locs: dict[tuple, Loc], budget: _Expansion):
    budget.take(node, len(path))
    if node.tag not in _PLAIN_TAGS:  # a date (2024-05-01), binary data, a set, or a custom tag
        where = {"file": file, "line": node.start_mark.line + 1, "key": ".".join(path) or None}
        value = node.value if isinstance(node, yaml.ScalarNode) else "..."
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        raise UserError(f"{value!r} reads as YAML's {tag}, which a recipe cannot hold (text, numbers, true/false, "
                        f"null, lists and mappings); quote it to make it text", **where)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k_node, v_node in node.value:
            budget.take(k_node, len(path) + 1)
            key = loader.construct_object(k_node, deep=True)
            if not isinstance(key, str):
                raise UserError(f"keys must be strings, got a {type(key).__name__}", file=file,
                                line=k_node.start_mark.line + 1)
            if key in out:
                raise UserError("duplicate key", file=file, line=k_node.start_mark.line + 1,
                                key=".".join(path + (key,)))
            locs[path + (key,)] = (file, k_node.start_mark.line + 1)
            out[key] = _convert(v_node, loader, file, path + (key,), locs, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, loader, file, path + (str(i),), locs, budget) for i, v in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def _count_values(text: str, file: str) -> None:
    """Refuse, before any node is built, a text of more than MAX_VALUES keys and values (a
    streaming pass of libyaml's parser: a million small values would take seconds and hundreds
    of MB to compose in Python). Syntax errors are left to the full parse, which words them."""
    parser = getattr(yaml, "CSafeLoader", None) if getattr(yaml, "__with_libyaml__", False) else None
    if parser is None:
        return  # the pure-Python parse is bounded by the file size and the expansion limits
    counted = (yaml.ScalarEvent, yaml.AliasEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)
    values = 0
    try:
        for event in yaml.parse(text, Loader=parser):
            if isinstance(event, counted):
                values += 1
                if values > MAX_VALUES:
                    raise UserError(f"the recipe holds more than {MAX_VALUES:,} keys and values", file=file,
                                    line=event.start_mark.line + 1)
    except yaml.YAMLError:
        return


def _read_recipe(path: Path, file: str) -> str:
    data = read_regular(path, "recipe file", limit=MAX_RECIPE_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"cannot read recipe (not UTF-8 text: byte {e.start})", file=file) from None


def _require_sections(node, file: str) -> None:
    """A file whose top level names no recipe section is not a recipe: say so without quoting it
    (``extends: /etc/shadow`` must not print the file's first line as an unknown section)."""
    if node is None:
        return
    if not isinstance(node, yaml.MappingNode):
        raise UserError("a recipe must be a mapping of sections", file=file, line=1)
    keys = {k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    if node.value and not keys & TOP_LEVEL:
        raise UserError(f"not a recipe: none of its top-level keys is a recipe section (such as algorithm, "
                        f"objective, privacy, train)", file=file)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's description of a syntax error, with quoted text of the file left out (it may not be a
    recipe); a quoted single character, like a tab, stays."""
    if isinstance(e, yaml.reader.ReaderError):  # an unprintable character: its code, not the text
        return str(e).splitlines()[0]
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    # PyYAML quotes its own tokens (',', '}', '<stream end>') and, at times, the file's text
    return re.sub(r"'(<[^'>]*>|[^']?)'|'[^']*'|\"[^\"]*\"",
                  lambda m: m.group(0) if m.group(1) is not None else "(text not shown)", str(problem))


def _compose(text: str, file: str, recipe: bool, budget: _Expansion | None = None) -> tuple[Any, dict[tuple, Loc]]:
    """The value of a YAML text with the location of every key, within the limits (raises
    yaml.YAMLError for a syntax error). ``budget`` counts the expansion (shared by --set values)."""
    _count_values(text, file)
    loader = None
    try:
        loader = _Loader(text, file)
        node = loader.get_single_node()
        if recipe:
            _require_sections(node, file)
        locs: dict[tuple, Loc] = {}
        if node is None:
            return ({} if recipe else None), locs
        return _convert(node, loader, file, (), locs, budget or _Expansion(file)), locs
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple, Loc]]:
    file = str(path)
    text = _read_recipe(Path(path), file)
    try:
        data, locs = _compose(text, file, recipe=True)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark else None
        if isinstance(e, yaml.reader.ReaderError):  # an unprintable character (NUL, ...)
            line = text.count("\n", 0, e.position) + 1
        raise UserError(f"YAML syntax error: {_yaml_problem(e)}", file=file, line=line) from None
    if not isinstance(data, dict):
        raise UserError("a recipe must be a mapping of sections", file=file, line=1)
    return data, locs


def _section_name(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("name")
    return None


def _merge(base: Any, over: Any, path: tuple = ()) -> Any:
    """Deep merge; a stage section that names a different stage replaces the parent's."""
    if isinstance(base, dict) and isinstance(over, dict):
        if len(path) == 1 and path[0] in SECTIONS | {"algorithm": "algorithm"}:
            if "name" in over and _section_name(base) not in (None, over["name"]):
                return copy.deepcopy(over)
        out = copy.deepcopy(base)
        for k, v in over.items():
            out[k] = _merge(base.get(k), v, path + (k,)) if k in base else copy.deepcopy(v)
        return out
    if isinstance(over, str) and isinstance(base, dict) and len(path) == 1 and path[0] in SECTIONS:
        # `privatizer: gaussian` over a dict section: keep the params only if the name matches
        return dict(base, name=over) if base.get("name") in (None, over) else {"name": over}
    return copy.deepcopy(over)


def load_raw(path: Path | str, sets: list[str] | tuple = (), _seen: tuple = ()) -> tuple[dict, dict]:
    """The merged recipe (``extends`` applied) and the location of every key."""
    path = Path(path).resolve() if _seen else Path(path)
    key = str(Path(path).resolve())
    if key in _seen:
        chain = " -> ".join(Path(p).name for p in _seen + (key,))
        raise UserError(f"extends cycle: {chain}", file=str(path))
    if len(_seen) >= MAX_EXTENDS:
        raise UserError(f"extends: a chain of more than {MAX_EXTENDS} recipes", file=str(path))
    data, locs = load_yaml(path)
    budget = _Expansion("--set")  # every --set value together
    # `--set extends=base.yaml` means what `extends: base.yaml` in the recipe means (so it is
    # applied before the parent is read, relative to the recipe's folder)
    for s in sets:
        if _set_path(s)[:1] == ("extends",):
            _apply_set(data, locs, s, budget)
    parent = data.pop("extends", None)
    if parent is not None:
        file, line = locs[("extends",)]
        if not isinstance(parent, str):
            raise UserError("extends must be a path", file=file, line=line, key="extends")
        ppath = (Path(path).parent / parent)
        try:
            found = ppath.exists()
        except OSError as e:  # a name too long for the file system, ...
            raise UserError(f"cannot read {parent} ({e.strerror or e})", file=file, line=line,
                            key="extends") from None
        if not found:
            raise UserError(f"{parent} not found", file=file, line=line, key="extends")
        pdata, plocs = load_raw(ppath, (), _seen + (key,))
        data = _merge(pdata, data)
        locs = {**plocs, **locs}
    for s in sets:
        if _set_path(s)[:1] != ("extends",):
            _apply_set(data, locs, s, budget)
    return data, locs


def _one_place(data: dict, parts: tuple[str, ...]) -> tuple[str, ...]:
    """``data.x`` and ``objective.data.x`` (and ``model.``) name one place, the one the recipe
    uses: --set data.dataset=wine on a recipe that nests data in its objective would otherwise
    give data twice."""
    obj = data.get("objective")
    nested = isinstance(obj, dict)
    if len(parts) > 1 and parts[0] in ("model", "data") and parts[0] not in data and nested and parts[0] in obj:
        return ("objective",) + parts
    if len(parts) > 2 and parts[0] == "objective" and parts[1] in ("model", "data") and parts[1] in data \
            and not (nested and parts[1] in obj):
        return parts[1:]
    return parts


def _set_path(assignment: str) -> tuple[str, ...]:
    return tuple(assignment.split("=", 1)[0].strip().split("."))


def _apply_set(data: dict, locs: dict, assignment: str, budget: _Expansion | None = None) -> None:
    if "=" not in assignment:
        raise UserError(f"expects key.path=value, got {assignment!r}", file="--set")
    key, value = assignment.split("=", 1)
    parts = tuple(p for p in key.strip().split("."))
    if not all(parts):
        raise UserError(f"malformed key {key!r}", file="--set")
    parts = _one_place(data, parts)
    if len(parts) > MAX_DEPTH:
        raise _too_deep("--set", None)
    try:
        val, _ = _compose(value, "--set", recipe=False, budget=budget)
    except yaml.YAMLError:
        raise UserError(f"--set: cannot parse value {value!r}", file="--set", key=key) from None
    except UserError as e:  # a limit: the line of a command-line value means nothing
        raise UserError(e.message, file="--set", key=key) from None
    node = data
    for i, p in enumerate(parts[:-1]):
        cur = node.get(p)
        if isinstance(cur, str) and i == 0 and (p in SECTIONS or p == "algorithm"):
            cur = node[p] = {"name": cur}
        elif cur is None:
            cur = node[p] = {}
        elif not isinstance(cur, dict):
            raise UserError(f"--set: {'.'.join(parts[:i + 1])} is not a section", file="--set", key=key)
        node = cur
    node[parts[-1]] = val
    for i in range(1, len(parts) + 1):
        locs[parts[:i]] = ("--set", None)


# --------------------------------------------------------------------------------------------
# top-level schema
# --------------------------------------------------------------------------------------------


class _Strict(NoBooleanNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite budget is no budget


class PrivacySection(_Strict):
    """The budget of the run and the neighbouring relation."""

    epsilon: float | None = Field(default=None, gt=0, description="target ε")
    delta: float | None = Field(default=None, gt=0, lt=1, description="target δ (must be < 1/n)")
    rho: float | None = Field(default=None, gt=0, description="target ρ (zCDP)")
    relation: Literal["replace_one", "add_remove"] = "replace_one"
    noise: Literal["secure", "keyed", "reproducible"] = Field(
        default="secure", description="secure: a key from OS entropy (default); keyed: DPREG_NOISE_KEY; "
                                      "reproducible: from the seed, no privacy guarantee")
    unit: Literal["example", "user"] = Field(
        default="example", description="what the guarantee protects: one example (row), or one user's data")
    max_examples_per_user: int | None = Field(
        default=None, gt=0, le=1_000_000, description="k: the most examples of one user a user-level run reads")

    @model_validator(mode="after")
    def _user_needs_k(self):
        if self.unit == "user" and self.max_examples_per_user is None:
            raise ValueError("privacy.unit: user needs privacy.max_examples_per_user (k, the most examples of one "
                             "user the run reads)")
        if self.unit == "example" and self.max_examples_per_user is not None:
            raise ValueError("privacy.max_examples_per_user applies to privacy.unit: user")
        return self

    @model_validator(mode="after")
    def _epsilon_needs_delta(self):
        # Without δ no accountant can enforce ε: the budget would be silently ignored.
        if self.epsilon is not None and self.delta is None:
            raise ValueError("privacy.epsilon needs privacy.delta (an (ε, δ) budget); without δ it would not be "
                             "enforced")
        return self


def stopped_at_private_count(limit: int | None, nonfinite_steps: int) -> bool:
    """Whether a run stands stopped at its opt-in non-finite limit (``train.max_nonfinite_steps``):
    when it stopped depends on a count of the private batch, without noise, so what it released
    then is no guarantee. A resume past the limit continues the mechanism, whose output is covered."""
    return limit is not None and nonfinite_steps > limit


class TrainSection(_Strict):
    steps: int = Field(gt=0, le=MAX_STEPS, description="number of private steps (releases)")
    log_every: int = Field(default=10, gt=0)
    eval_every: int | None = Field(default=None, gt=0)
    checkpoint_every: int | None = Field(default=None, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0, description="physical batch (gradient accumulation)")
    device: str = "cpu"
    max_nonfinite_steps: int | None = Field(
        default=None, ge=0, description="opt-in: stop after this many steps with NaN/inf examples (a count on the "
                                        "private batch: when the run stops is then not covered by the guarantee)")
    sync_check_every: int = Field(default=100, ge=0, description="multi-process: compare parameter checksums every K steps")
    progress: bool = True


# --------------------------------------------------------------------------------------------
# resolution
# --------------------------------------------------------------------------------------------


@dataclass
class Recipe:
    """A validated, fully resolved recipe."""

    data: dict[str, Any]                         # resolved, with every default filled in
    stages: dict[str, tuple[Entry, Any]]         # kind -> (registry entry, validated params)
    privacy: PrivacySection
    train: TrainSection
    seed: int
    output: str
    source: str = ""
    locs: dict[tuple, Loc] = field(default_factory=dict)

    @property
    def hash(self) -> str:
        return recipe_hash(self.data)

    def where(self, *path: str) -> dict[str, Any]:
        return _where(self.locs, path)

    def error(self, message: str, *path: str) -> UserError:
        """A UserError at the recipe's key ``path`` (its file and line when the recipe wrote it)."""
        w = self.where(*path) if path else {}
        return UserError(message, file=w.get("file", self.source), line=w.get("line"), key=w.get("key"))

    def locate(self, e: UserError, section: str | None) -> UserError:
        """Give a stage's UserError the recipe's file and the line of its key (stages know only keys,
        often relative to their own section: ``model.path`` of the objective)."""
        if e.file is not None:
            return e
        e.file = self.source
        parts = tuple(e.key.split(".")) if e.key else ()
        candidates = [parts] if parts else []
        absolute = {"privacy", "train", "seed", "output", "algorithm", *SECTIONS}  # `model`/`data` are the objective's
        if section and parts and parts[:1] != (section,) and parts[0] not in absolute:
            candidates.insert(0, (section,) + parts)  # `model.path` of the objective: objective.model.path
        for path in candidates:
            if path and path in self.locs:
                e.key, (e.file, e.line) = ".".join(path), self.locs[path]
                return e
        for path in candidates:  # the nearest enclosing key that the recipe wrote (or --set)
            w = self.where(*path)
            if "file" in w:
                e.key, e.file, e.line = ".".join(path), w["file"], w["line"]
                return e
        if not parts and section:
            e.key = section
            w = self.where(section)
            e.file, e.line = w.get("file", self.source), w.get("line")
        return e


def recipe_hash(data: dict[str, Any]) -> str:
    d = copy.deepcopy(data)
    for path in COSMETIC:
        node = d
        for p in path[:-1]:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def _where(locs: dict[tuple, Loc], path: tuple) -> dict[str, Any]:
    for i in range(len(path), 0, -1):
        if path[:i] in locs:
            f, line = locs[path[:i]]
            return {"file": f, "line": line, "key": ".".join(path)}
    return {"key": ".".join(path)}


def _data_loc(loc: tuple, data: Any, missing: bool) -> tuple:
    """The part of a pydantic error location that names keys of the data (a union adds the name of
    each member type, ``noise_multiplier.float``, which is no key of the recipe)."""
    out: list[str] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            if missing or not out:
                out.append(part)
            break
        out.append(part)
    return tuple(out)


def _pydantic_error(e: ValidationError, prefix: tuple, locs: dict, model: type[BaseModel], file: str,
                    data: Any = None) -> UserError:
    errors = e.errors()
    # a misspelled key is also a missing one: name the misspelling
    errors = sorted(errors, key=lambda x: x["type"] != "extra_forbidden")
    err = errors[0]
    loc = tuple(str(x) for x in err["loc"])
    if data is not None:
        loc = _data_loc(loc, data, err["type"] == "missing")
        same = [x["msg"] for x in errors if _data_loc(tuple(str(y) for y in x["loc"]), data,
                                                      x["type"] == "missing") == loc]
        msg = " or ".join(dict.fromkeys(same))  # every member of a union, once each
    else:
        msg = err["msg"]
    if err["type"] == "extra_forbidden":
        fields = list(model.model_fields)
        sub = model
        for part in loc[:-1]:  # nested models
            f = sub.model_fields.get(part)
            ann = getattr(f, "annotation", None) if f else None
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                sub = ann
                fields = list(sub.model_fields)
        close = difflib.get_close_matches(loc[-1], fields, n=1)
        msg = f"unknown key{f'; did you mean {close[0]!r}?' if close else ''} (allowed: {', '.join(fields)})"
    elif err["type"] == "missing":
        msg = "required key is missing"
    msg = re.sub(r"(^| or )(Value|Assertion) error, ", r"\1", msg)  # pydantic's prefix for a validator's own message
    where = _where(locs, prefix + loc)
    where.setdefault("file", file)
    return UserError(msg, **where)


def _no_nan(obj: Any, path: tuple, locs: dict, file: str) -> None:
    if isinstance(obj, float) and math.isnan(obj):
        raise UserError("NaN is not a valid value", **{"file": file, **_where(locs, path)})
    if isinstance(obj, dict):
        for k, v in obj.items():
            _no_nan(v, path + (k,), locs, file)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _no_nan(v, path + (str(i),), locs, file)


def resolve(data: dict[str, Any], locs: dict[tuple, Loc], registry: Registry, source: str = "") -> Recipe:
    data = copy.deepcopy(data)
    file = source or "<recipe>"
    for key in data:
        if key not in TOP_LEVEL:
            close = difflib.get_close_matches(key, TOP_LEVEL, n=1)
            raise UserError(f"unknown section{f'; did you mean {close[0]!r}?' if close else ''}",
                            **{"file": file, **_where(locs, (key,))})
    _no_nan(data, (), locs, file)

    # `model:` and `data:` at the top level are the objective's `model` and `data` parameters.
    for alias in ("model", "data"):
        if alias in data:
            obj = data.get("objective")
            obj = {"name": obj} if isinstance(obj, str) else (obj or {})
            if alias in obj:
                raise UserError(f"{alias} given both at the top level and in objective",
                                **{"file": file, **_where(locs, (alias,))})
            obj[alias] = data.pop(alias)
            data["objective"] = obj
            for k in [k for k in locs if k[:1] == (alias,)]:
                locs[("objective",) + k] = locs[k]

    alg_spec = data.get("algorithm")
    if alg_spec is None:
        raise UserError("a recipe needs an algorithm (run `dpreg plugins` for the list)", file=file, key="algorithm")
    alg_name = _section_name(alg_spec)
    if not isinstance(alg_name, str):
        raise UserError("algorithm must be a name or a mapping with a name", **{"file": file, **_where(locs, ("algorithm",))})
    try:
        alg_entry = registry.get("algorithm", alg_name)
    except UserError as e:
        raise UserError(e.message, **{"file": file, **_where(locs, ("algorithm",))}) from None

    stages: dict[str, tuple[Entry, Any]] = {}
    resolved: dict[str, Any] = {}
    alg_params = {k: v for k, v in (alg_spec if isinstance(alg_spec, dict) else {}).items() if k != "name"}
    try:
        ap = alg_entry.cls.Params.model_validate(alg_params)
    except ValidationError as e:
        raise _pydantic_error(e, ("algorithm",), locs, alg_entry.cls.Params, file, alg_params) from None
    _no_nan(ap.model_dump(), ("algorithm",), locs, file)
    stages["algorithm"] = (alg_entry, ap)
    resolved["algorithm"] = {"name": alg_name, **ap.model_dump(mode="json", by_alias=True)}

    for section, kind in SECTIONS.items():
        default = copy.deepcopy(alg_entry.cls.defaults.get(section))
        given = data.get(section)
        spec = _merge(default, given, (section,)) if default is not None and given is not None else (
            given if given is not None else default)
        if isinstance(spec, str):
            spec = {"name": spec}
        if spec is None:
            raise UserError(f"algorithm {alg_name!r} has no default {section}; the recipe must name one",
                            file=file, key=section)
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise UserError(f"{section} must be a stage name or a mapping with `name`",
                            **{"file": file, **_where(locs, (section,))})
        try:
            entry = registry.get(kind, spec["name"])
        except UserError as e:
            raise UserError(e.message, **{"file": file, **_where(locs, (section, "name"))}) from None
        params = {k: v for k, v in spec.items() if k != "name"}
        try:
            p = entry.cls.Params.model_validate(params)
        except ValidationError as e:
            raise _pydantic_error(e, (section,), locs, entry.cls.Params, file, params) from None
        _no_nan(p.model_dump(), (section,), locs, file)  # "nan" strings become NaN floats in pydantic
        stages[kind] = (entry, p)
        resolved[section] = {"name": entry.name, **p.model_dump(mode="json", by_alias=True)}

    if isinstance(data.get("privacy"), dict) and "secure_noise" in data["privacy"]:
        write = "noise: secure (the default)" if data["privacy"]["secure_noise"] else "noise: reproducible"
        raise UserError(f"replaced by privacy.noise: secure | keyed | reproducible; "
                        f"write privacy.{write}", **{"file": file, **_where(locs, ("privacy", "secure_noise"))})
    try:
        privacy = PrivacySection.model_validate(data.get("privacy") or {})
    except ValidationError as e:
        raise _pydantic_error(e, ("privacy",), locs, PrivacySection, file, data.get("privacy")) from None
    if "train" not in data:
        raise UserError("a recipe needs a train section with steps", file=file, key="train")
    try:
        train = TrainSection.model_validate(data["train"])
    except ValidationError as e:
        raise _pydantic_error(e, ("train",), locs, TrainSection, file, data["train"]) from None
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UserError("seed must be a non-negative integer", **{"file": file, **_where(locs, ("seed",))})
    output = data.get("output", "last")
    if output not in ("last", "random_iterate"):
        raise UserError("output must be 'last' or 'random_iterate'", **{"file": file, **_where(locs, ("output",))})
    resolved.update(seed=seed, output=output, privacy=privacy.model_dump(mode="json"),
                    train=train.model_dump(mode="json"), description=data.get("description", ""))
    _check_stored_size(resolved, file)
    recipe = Recipe(resolved, stages, privacy, train, seed, output, source=file, locs=locs)
    check_compatibility(recipe, registry)
    return recipe


def _check_stored_size(resolved: dict[str, Any], file: str) -> None:
    """Every checkpoint stores the resolved recipe in its safetensors header (JSON inside JSON),
    which readers refuse beyond checkpoint.HEADER_LIMIT: a recipe too large for it would run and
    never resume. It may take a tenth of the header; the rest is for the ledger and stage state."""
    from .checkpoint import HEADER_LIMIT

    size = len(json.dumps(json.dumps(resolved, default=str)))
    if size > HEADER_LIMIT // 10:
        raise UserError(f"the resolved recipe would take {size:,} bytes of every checkpoint's header, more than "
                        f"{HEADER_LIMIT // 10:,} (a tenth of the {HEADER_LIMIT:,}-byte limit of a safetensors "
                        f"header): the run could never be resumed", file=file)


def load(path: Path | str, sets: list[str] | tuple = (), registry: Registry | None = None) -> Recipe:
    from .registry import get_registry

    registry = registry or get_registry()
    data, locs = load_raw(path, sets)
    return resolve(data, locs, registry, source=str(path))


# --------------------------------------------------------------------------------------------
# cross-stage checks
# --------------------------------------------------------------------------------------------


def release_space(space: str) -> str:
    """The space of a privatized aggregate (vector-ZO sums are lifted, noise is d-dim)."""
    return DENSE if space == VECTOR_ZO else space


def check_compatibility(recipe: Recipe, registry: Registry) -> None:
    est, _ = recipe.stages["estimator"]
    priv, _ = recipe.stages["privatizer"]
    upd, _ = recipe.stages["update_rule"]
    acc, _ = recipe.stages["accountant"]
    alg, _ = recipe.stages["algorithm"]
    file = recipe.source
    space = est.cls.space

    if priv.cls.accepts is not None and space not in priv.cls.accepts:
        fit = [e.name for e in registry.entries["privatizer"].values()
               if e.cls.accepts is None or space in e.cls.accepts]
        raise UserError(f"privatizer {priv.name!r} works in {', '.join(sorted(priv.cls.accepts))}, but estimator "
                        f"{est.name!r} yields {space} contributions; privatizers that fit: {', '.join(sorted(fit))}",
                        **{"file": file, **recipe.where("privatizer", "name")})
    if est.cls.contribution_kind not in priv.cls.accepts_kinds:
        fit = [e.name for e in registry.entries["privatizer"].values() if est.cls.contribution_kind in e.cls.accepts_kinds]
        raise UserError(f"estimator {est.name!r} yields {est.cls.contribution_kind}s, which privatizer {priv.name!r} "
                        f"cannot release; privatizers that fit: {', '.join(sorted(fit)) or 'none'}",
                        **{"file": file, **recipe.where("privatizer", "name")})
    rspace = release_space(space)
    if rspace not in upd.cls.accepts | upd.cls.lifts:
        fit = sorted(e.name + (" (lifts to dense, not memory-free)" if rspace in e.cls.lifts else "")
                     for e in registry.entries["update_rule"].values() if rspace in e.cls.accepts | e.cls.lifts)
        raise UserError(f"update rule {upd.name!r} accepts {', '.join(sorted(upd.cls.accepts))} releases, but "
                        f"estimator {est.name!r} yields {rspace}; update rules that fit: {', '.join(fit)}",
                        **{"file": file, **recipe.where("update", "name")})
    if alg.cls.adaptive and not acc.cls.can_filter:
        fit = sorted(e.name for e in registry.entries["accountant"].values() if e.cls.can_filter)
        raise UserError(f"algorithm {alg.name!r} chooses its noise adaptively, so its accountant must be a privacy "
                        f"filter; {acc.name!r} is not (a PLD/PRV accountant is invalid under fully adaptive "
                        f"composition); use one of: {', '.join(fit)}",
                        **{"file": file, **recipe.where("accountant", "name")})
