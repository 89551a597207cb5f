"""Export a trained model as a Hugging Face folder, with a model card that states its privacy guarantee.

    dpreg export RUN_DIR --to DIR [--merge] [--overwrite]
    result.export(DIR)                                # dpregistry.train's Result

DIR holds what ``from_pretrained`` loads: ``config.json``, ``model.safetensors`` and the tokenizer
files, or, for LoRA, ``adapter_config.json`` and ``adapter_model.safetensors``, which peft (and
transformers, with peft installed) load onto the base model; ``--merge`` writes the adapters
merged into the base weights instead. Beside them, ``README.md`` is a model card (what the model
is, how to load and use it, the privacy guarantee: ε, δ, the accountant, the neighbouring relation,
the privacy unit, the noise mode, steps, sample rate, clip, noise multiplier, data set) and
``dpregistry.json`` holds the same guarantee and the resolved recipe for programs.

Only a model that computes what the run trained is exported: each objective writes its own model
(:meth:`dpregistry.stages.Objective.export`) or refuses in one line, saying why. The folder is
built beside DIR and renamed into place, so a refusal or a failure writes nothing.

The card states the guarantee as the run did: the privacy unit and the noise multiplier from the
run's summary, the sampling and the charges from its ledger (the newest valid checkpoint's,
checksummed), the clip and the data set from its recipe. From a run folder, what summary.json
cannot vouch for (it has no checksum) is taken from checked records: the ledger must be the last
one ledger.jsonl recorded, ε, δ and ρ are recomputed from it, and the noise mode is the
hash-checked recipe's. The parameters are those of ``model.safetensors`` (the run's output), and
all of them must be of the same step: a run that finished, or stopped and saved its step.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import checkpoint as ckpt
from . import files
from .errors import UserError

CARD = "README.md"
METADATA = "dpregistry.json"
FORMAT = 1
#: where an objective's usage snippet names the export folder (replaced by the folder's path)
MODEL_DIR = "<export folder>"


@dataclass
class ModelExport:
    """What an objective wrote into an export folder, for the model card."""

    what: str                          # one line: the model and its task
    usage: str                         # Python that loads the folder and predicts (no dpregistry in it)
    library: str = "transformers"      # transformers, or peft for an adapter
    pipeline_tag: str | None = None    # the Hugging Face task (text-classification, ...)
    base_model: str | None = None      # a hub id, when the model was fine-tuned from one
    details: dict[str, Any] = field(default_factory=dict)  # labels, lengths, prompt: what using it needs
    notes: list[str] = field(default_factory=list)         # what a user must know (a merge rounds)


# ------------------------------------------------------------------------------------------------
# the guarantee
# ------------------------------------------------------------------------------------------------

NOTIONS = {"approx_dp": "(ε, δ)-DP", "rdp": "Rényi DP", "zcdp": "zero-concentrated DP"}
RELATIONS = {"replace_one": "replace-one: the data sets differ in the content of one unit",
             "add_remove": "add/remove: one data set holds one more unit than the other"}
#: what the guarantee is, as the run's summary states it (summary.json, Result.summary)
STATED = ("epsilon", "delta", "target_epsilon", "rho", "target_rho", "accountant", "relation", "noise_multiplier",
          "unit", "users", "max_examples_per_user", "user_mechanism", "example_level", "noise", "guarantee", "stopped",
          "third_party_stages")


def guarantee(summary: dict[str, Any], recipe: dict[str, Any], ledger: list[dict[str, Any]],
              notion: str | None) -> dict[str, Any]:
    """The privacy guarantee of a model as its run stated it, recomputing nothing: ε, δ, the unit,
    the noise mode and multiplier from the run's summary; the sampling and the charges from its
    ledger; the clip and the data set from its resolved recipe."""
    from .privacy.events import PrivacyEvent, any_nonprivate
    from .rng import noise_statement
    from .users import unit_statement

    events = [PrivacyEvent.from_dict(e["event"]) for e in ledger]
    stated = {k: summary.get(k) for k in STATED}
    stated["unit"] = stated["unit"] or "example"  # runs from before user-level DP
    stated["nonprivate"] = any_nonprivate(events)
    stated["private_stop"] = bool(summary.get("private_stop"))
    stated["guarantee"] = bool(stated["guarantee"]) and not stated["nonprivate"] and not stated["private_stop"]
    summary = {**summary, "guarantee": stated["guarantee"]}
    return {
        **stated, "notion": notion, "steps": summary["step"],
        "unit_statement": unit_statement(summary), "noise_statement": noise_statement(stated["noise"]),
        "sampling": sampling(events), "clip": (recipe.get("privatizer") or {}).get("clip"),
        "dataset": dataset_name(recipe),
        "charges": [dict(first_step=e["first_step"], last_step=e["last_step"], count=e["count"],
                         partition=e.get("partition"), event=ev.describe()) for e, ev in zip(ledger, events)],
    }


def checked_guarantee(run_dir: Path, summary: dict[str, Any], recipe: dict[str, Any], meta: dict[str, Any],
                      notion: str | None) -> dict[str, Any]:
    """:func:`guarantee` for a run folder, with what it states about privacy taken from checked
    records, not from summary.json (which carries no checksum): the ledger must be the one
    ledger.jsonl recorded at the model's step, and its last line; ε, δ and ρ are recomputed from it;
    the noise mode comes from the hash-checked recipe."""
    from .ledger_file import LedgerFile
    from .report import private_stop, recomputed, uncomputable
    from .users import unit_terms

    step, entries = meta["step"], meta.get("ledger", [])
    last = LedgerFile(run_dir).last
    if last is None or last["step"] != step or last["entries"] != entries:
        where = "is missing" if last is None else f"records steps up to {last['step']}" if last["step"] != step \
            else f"records another ledger at step {step}"
        raise UserError(f"ledger.jsonl {where}: the model's ledger (step {step}) is not the last one recorded, so its "
                        f"card could state less than was spent", file=str(run_dir))
    try:
        acc, spent, _ = recomputed(recipe, entries)
    except ArithmeticError:
        raise uncomputable(run_dir) from None
    privacy = recipe["privacy"]
    noise = privacy.get("noise")
    checked = {"epsilon": spent.get("epsilon"), "delta": privacy.get("delta"), "rho": spent.get("rho"),
               "target_epsilon": privacy.get("epsilon"), "target_rho": spent.get("target_rho", privacy.get("rho")),
               "accountant": acc.name, "noise_multiplier": meta.get("noise_multiplier"),
               "example_level": spent.get("example_level"), "noise": noise, "guarantee": noise != "reproducible",
               "private_stop": private_stop(recipe, meta),
               **unit_terms(recipe)}
    return guarantee({**summary, **checked}, recipe, entries, notion)


def sampling(events) -> list[str]:
    """How the charged batches were drawn, as the accountant amplified them (once per distinct rate)."""
    from .privacy.events import PoissonSampled, SampledWithoutReplacement, nodes

    seen: list[str] = []
    for ev in events:
        for node in nodes(ev):
            if isinstance(node, PoissonSampled):
                text = f"{node.q:.6g} (Poisson)"
            elif isinstance(node, SampledWithoutReplacement):
                text = f"{node.batch_size / node.n:.6g} ({node.batch_size} of {node.n}, without replacement)"
            else:
                continue
            if text not in seen:
                seen.append(text)
    return seen


def dataset_name(recipe: dict[str, Any]) -> str:
    """The training data as the recipe names it: a hub id (with its subset), or its files."""
    obj = recipe.get("objective") or {}
    if isinstance(obj, dict) and obj.get("name") == "python":
        return "the train_data given to dpregistry.train"
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, dict):
        return f"the data of objective {obj.get('name') if isinstance(obj, dict) else obj!r}"
    if isinstance(data.get("hub"), str):
        return data["hub"] + (f" ({data['subset']})" if isinstance(data.get("subset"), str) else "")
    parts = [str(data[k]) for k in ("path", "train") if data.get(k)]
    return " / ".join(parts) or f"the data of objective {obj.get('name')!r}"


def hub_dataset(recipe: dict[str, Any]) -> str | None:
    """The hub data set id the recipe trains on, for the card's metadata."""
    obj = recipe.get("objective")
    data = obj.get("data") if isinstance(obj, dict) else None
    return data.get("hub") if isinstance(data, dict) and isinstance(data.get("hub"), str) else None


# ------------------------------------------------------------------------------------------------
# exporting
# ------------------------------------------------------------------------------------------------


def export_objective(objective, to: str | Path, *, recipe, privacy: dict[str, Any],
                     metrics: dict[str, Any] | None = None, merge: bool = False, overwrite: bool = False,
                     keep_out: Path | None = None) -> Path:
    """Write ``objective``'s trained model, the card and the metadata into ``to`` (see the module
    doc); ``recipe`` is the run's (a :class:`~dpregistry.recipe.Recipe`). ``keep_out``: a folder
    (the run's) that ``to`` must neither be nor hold."""
    to = Path(to)

    def fill(folder: Path) -> None:
        try:
            exported = objective.export(folder, merge=merge)
        except UserError as e:
            raise (recipe.locate(e, "objective") if e.key else e) from None
        exported.usage = exported.usage.replace(MODEL_DIR, str(to))
        # plain writes: the whole folder is renamed into place once complete
        (folder / CARD).write_text(model_card(exported, recipe.data, recipe.hash, privacy, metrics or {}))
        (folder / METADATA).write_text(json.dumps(
            {"format": FORMAT, "privacy": privacy, "model": asdict(exported), "metrics": metrics or {},
             "recipe": recipe.data, "recipe_hash": recipe.hash}, indent=2, default=str) + "\n")

    return publish(to, fill, overwrite=overwrite, keep_out=keep_out)


def publish(to: Path, fill: Callable[[Path], None], *, overwrite: bool, keep_out: Path | None = None) -> Path:
    """Build a folder with ``fill`` beside ``to`` and rename it into place: a refusal or a failure
    leaves ``to`` as it was. ``to`` must be new or empty, unless ``overwrite``."""
    to = Path(os.path.abspath(to))  # "." has no name to put a temporary folder beside
    _check_target(to, overwrite, keep_out)
    tmp = files.temp_path(to)
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a killed export of this process id
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"cannot write the export folder ({e.strerror or e})", file=str(to)) from None
    try:
        fill(tmp)
        for f in tmp.rglob("*"):  # on disk before the folder appears under its name
            if f.is_file():
                files.fsync_path(f)
        _replace(tmp, to)
    except OSError as e:
        raise UserError(f"cannot write the export folder ({e.strerror or e})", file=str(to)) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return to


def _check_target(to: Path, overwrite: bool, keep_out: Path | None) -> None:
    try:
        exists = os.path.lexists(to)
        if to.is_symlink():  # replacing it would replace the link, not the folder it points to
            raise UserError("the export target is a symbolic link; give the folder itself", file=str(to))
        if exists and not to.is_dir():
            raise UserError("the export target exists and is not a folder", file=str(to))
        if keep_out is not None:
            run, target = keep_out.resolve(), to.resolve()
            if target == run or target in run.parents or run in target.parents:
                # inside it, --overwrite would replace its checkpoints or report: resume and the privacy
                # report need them
                raise UserError("the export target is the run folder, inside it or holds it; choose another folder",
                                file=str(to))
        if exists and any(to.iterdir()) and not overwrite:
            raise UserError("the export folder is not empty; pass --overwrite to replace it", file=str(to))
    except OSError as e:
        raise UserError(f"cannot use the export folder ({e.strerror or e})", file=str(to)) from None


def _replace(tmp: Path, to: Path) -> None:
    """Rename ``tmp`` to ``to``; an existing ``to`` (empty, or replaced under --overwrite) goes
    only after the new folder is in place."""
    old = None
    if os.path.lexists(to):
        old = to.with_name(f".{to.name}.old-{os.getpid()}")
        os.rename(to, old)
    try:
        os.rename(tmp, to)
    except OSError:
        if old is not None:
            os.rename(old, to)
        raise
    files.fsync_path(to.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# from a run folder
# ------------------------------------------------------------------------------------------------


def export_run_folder(run_dir: str | Path, to: str | Path, *, merge: bool = False, overwrite: bool = False) -> Path:
    """Export the model of a finished run folder (``dpreg export``). An unfinished run is refused
    rather than its latest checkpoint exported: a checkpoint holds the iterate, not the output an
    update rule may choose, and the run has stated no guarantee and no held-out metrics for it."""
    from .folder import lock_holder

    run_dir = Path(run_dir)
    recipe = _stored_recipe(run_dir)
    if lock_holder(run_dir) is not None:
        raise UserError("a run is using this folder; export it once the run has finished", file=str(run_dir))
    unfinished = f"the run has not finished; continue it with `dpreg resume {run_dir}`, then export"
    model_path = run_dir / "model.safetensors"
    if not model_path.is_file():
        raise UserError(f"no model.safetensors: {unfinished}", file=str(run_dir))
    try:
        tensors, model_meta = ckpt.read(model_path)
    except ckpt.CorruptCheckpoint as e:
        raise UserError(f"unreadable model ({e})", file=str(model_path)) from None
    step = model_meta.get("step")
    if model_meta.get("recipe_hash") != recipe.hash:
        raise UserError("model.safetensors was written by another recipe than recipe.json's", file=str(model_path))
    summary = _summary(run_dir)
    if summary.get("step") != step or summary.get("recipe_hash") != recipe.hash:
        raise UserError(f"no summary.json of the model's step {step}: {unfinished}", file=str(run_dir))
    found = ckpt.latest_valid(run_dir / "checkpoints", warn=lambda m: None)
    if found is None:
        raise UserError("no readable checkpoint, so no ledger to state the charges from", file=str(run_dir))
    _, meta, path = found
    if meta.get("step") != step or meta.get("recipe_hash") != recipe.hash:
        raise UserError(f"the newest valid checkpoint (step {meta.get('step')}) is not of the model's step {step}; "
                        f"its ledger would not be the model's", file=str(path))
    privacy = checked_guarantee(run_dir, summary, recipe.data, meta, recipe.stages["accountant"][0].cls.notion)
    objective = build_objective(recipe)
    load_params(objective, tensors, model_path)
    return export_objective(objective, to, recipe=recipe, privacy=privacy, metrics=summary.get("metrics"),
                            merge=merge, overwrite=overwrite, keep_out=run_dir)


def _stored_recipe(run_dir: Path):
    from .folder import not_a_run_folder
    from .recipe import resolve
    from .registry import get_registry
    from .report import _read_json

    if not run_dir.is_dir():
        raise UserError("run folder not found", file=str(run_dir))
    rpath = run_dir / "recipe.json"
    if not rpath.exists():
        raise not_a_run_folder(run_dir)
    stored = _read_json(rpath)
    if not (isinstance(stored.get("recipe"), dict) and isinstance(stored.get("recipe_hash"), str)):
        raise UserError("unreadable recipe.json (not the one `dpreg run` wrote)", file=str(rpath))
    recipe = resolve(stored["recipe"], {}, get_registry(), source=str(rpath))
    if recipe.hash != stored["recipe_hash"]:
        raise UserError("the installed stages resolve this recipe differently than when the run started (a plugin "
                        "changed its defaults); the model rebuilt from it could differ", file=str(rpath))
    return recipe


def _summary(run_dir: Path) -> dict[str, Any]:
    from .report import _read_json

    path = run_dir / "summary.json"
    return _read_json(path) if path.is_file() else {}


def build_objective(recipe):
    """The recipe's objective, set up as the run set it up (its public initialisation seed, its
    model and data), without the rest of the run: exporting needs neither the noise key of a keyed
    run nor a calibration."""
    import dataclasses

    from .run import Run

    quiet = recipe.privacy.model_copy(update={"noise": "reproducible"})
    shell = Run(dataclasses.replace(recipe, privacy=quiet))
    if shell.objective.name == "python":
        raise UserError("this run trained your own model (objective: python), which only your script can rebuild; "
                        "export it from Python: result.export(DIR)", file=recipe.source)
    try:
        shell._check_needs()
        shell.objective.setup(shell.context())
    except UserError as e:
        raise recipe.locate(e, "objective") from None
    return shell.objective


def load_params(objective, tensors: dict[str, Any], source: Path) -> None:
    """Put the run's output parameters into the objective's model, refusing any mismatch."""
    import torch

    params = objective.params()
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise UserError(f"the model's parameters do not match the objective's (missing {missing[:3]}, "
                        f"unexpected {extra[:3]})", file=str(source))
    with torch.no_grad():
        for k, p in params.items():
            t = tensors[k]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise UserError(f"parameter {k} is {tuple(t.shape)} {t.dtype} in the file, {tuple(p.shape)} {p.dtype} "
                                f"in the objective", file=str(source))
            p.copy_(t.to(p.device))


# ------------------------------------------------------------------------------------------------
# the model card
# ------------------------------------------------------------------------------------------------


def _num(v: Any) -> str:
    """A number as the run stated it, to the last digit (the card's table is read by programs too)."""
    if v is None:
        return "–"
    return repr(v) if isinstance(v, float) else str(v)


def model_card(exported: ModelExport, recipe: dict[str, Any], recipe_hash: str, privacy: dict[str, Any],
               metrics: dict[str, Any]) -> str:
    from . import __version__

    algorithm = (recipe.get("algorithm") or {}).get("name", "?")
    front = ["---", f"library_name: {exported.library}"]
    if exported.pipeline_tag:
        front.append(f"pipeline_tag: {exported.pipeline_tag}")
    if exported.base_model:
        front.append(f"base_model: {json.dumps(exported.base_model)}")
    if hub_dataset(recipe):
        front.append(f"datasets: [{json.dumps(hub_dataset(recipe))}]")
    # a hub search for differentially private models should not find one whose noise anyone can redraw
    front += [f"tags: [{'differential-privacy, ' if privacy['guarantee'] else ''}dpregistry]", "---", ""]
    # The title states what ran; the recipe's description is quoted, not trusted: an override
    # (--set privacy.epsilon=3) leaves "(6, 1e-5)-DP" in it
    lines = front + [f"# {algorithm} on {(recipe.get('objective') or {}).get('name')}", "",
                     f"{exported.what}, trained {'with differential privacy ' if privacy['guarantee'] else ''}by dpregistry "
                     f"(algorithm `{algorithm}`).", ""]
    if recipe.get("description"):
        lines += [f"The recipe's own description: \"{recipe['description']}\" (the guarantee below is what this "
                  f"run did).", ""]
    lines += _privacy_section(privacy)
    lines += ["## Use", "", "```python", exported.usage.strip(), "```", ""]
    for k, v in exported.details.items():
        lines.append(f"- {k.replace('_', ' ')}: {json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}")
    lines += [f"- {n}" for n in exported.notes]
    if exported.details or exported.notes:
        lines.append("")
    if metrics:
        lines += ["## Held-out metrics", "", "Measured by the run on its held-out split (not training data).", "",
                  "| metric | value |", "|---|---|"] + [f"| {k} | {_num(v)} |" for k, v in metrics.items()] + [""]
    lines += ["## Provenance", "", f"- recipe hash: `{recipe_hash}` (the resolved recipe is in `{METADATA}`)",
              f"- seed: {recipe.get('seed')}", f"- dpregistry {__version__}", ""]
    return "\n".join(lines)


def _privacy_section(p: dict[str, Any]) -> list[str]:
    from .registry import trust_statement

    lines = ["## Privacy guarantee", ""]
    if p.get("nonprivate"):
        lines += ["**NOT a privacy guarantee.** Some releases of this run were not private (a `none` privatizer, "
                  "or no noise): the ledger charges them as non-private, and its ε is infinite.", ""]
    elif p.get("private_stop"):
        lines += ["**NOT a privacy guarantee.** The run stopped on a count of the private batch without noise "
                  "(`train.max_nonfinite_steps`, opt-in), so when it stopped depends on the training data.", ""]
    elif not p["guarantee"]:
        lines += [f"**NOT a privacy guarantee.** The noise is {p['noise_statement']}.", ""]
    if p["stopped"]:
        lines += [f"The run stopped early, at step {p['steps']}: {p['stopped']}.", ""]
    if p["epsilon"] is not None:
        head = f"(ε = {p['epsilon']:.4g}, δ = {p['delta']:g})-differential privacy"
    elif p["rho"] is not None:
        head = f"ρ = {p['rho']:.4g} zero-concentrated differential privacy"
    else:
        head = "Differential privacy as the ledger below states"
    per_user = p["unit"] == "user" and p["user_mechanism"] == "uls"  # ELS clips examples, read as groups of k
    budget = f" (budget {_num(p['target_epsilon'])})" if p.get("target_epsilon") is not None else ""
    lines += [f"{head} ({p['accountant']} accountant), for {p['unit']}-level neighbouring training data sets "
              f"({p['relation'].replace('_', '-')}). It covers the training data only: not the pretrained base "
              f"model's data, nor the held-out split the metrics use.", "",
              "| quantity | value |", "|---|---|",
              f"| ε | {_num(p['epsilon'])}{budget} |", f"| δ | {_num(p['delta'])} |"]
    if p["rho"] is not None:
        lines.append(f"| ρ (zCDP) | {_num(p['rho'])} |")
    lines += [f"| accountant | {p['accountant']} ({NOTIONS.get(p['notion'], p['notion'])}) |",
              f"| neighbouring relation | {RELATIONS.get(p['relation'], p['relation'])} |",
              f"| privacy unit | {p['unit_statement']} |",
              f"| noise | {p['noise_statement']} (privacy.noise: {p['noise']}) |",
              *([f"| third-party stages | {trust_statement(p['third_party_stages'])} |"] if p.get("third_party_stages")
                else []),
              f"| steps | {p['steps']} |",
              f"| sample rate | {', '.join(p['sampling']) or 'none: no amplification by sampling is claimed'} |",
              f"| clip (per-{'user' if per_user else 'example'} L2 norm) | {_num(p['clip'])} |",
              f"| noise multiplier (noise std / clip) | {_num(p['noise_multiplier'])} |",
              f"| data set | {p['dataset']} |", ""]
    if p["charges"]:
        lines += ["Charges (the privacy ledger):", ""]
        for c in p["charges"]:
            part = f", partition {c['partition']}" if c.get("partition") else ""
            lines.append(f"- steps {c['first_step']}–{c['last_step']}: {c['count']} × {c['event']}{part}")
        lines.append("")
    return lines
