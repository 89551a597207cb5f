"""Reports on a finished (or interrupted) run: the privacy ledger, plots and a markdown summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from . import checkpoint as ckpt
from .errors import UserError
from . import files
from .files import read_regular
from .folder import no_linked_folders, read_metrics, released_after
from .ledger_file import LedgerFile, extends
from .privacy.accountant import Accountant, Budget, Ledger, make_accountant
from .privacy.events import PrivacyEvent, any_nonprivate
from .recipe import stopped_at_private_count
from .registry import trust_statement
from .rng import noise_statement
from .users import els_group, example_budget, group_epsilon, unit_statement, unit_terms, user_mechanism

PLOT_NAME = "privacy_epsilon.png"


Series = tuple[str, list, list]  # (label, steps, values)


def _figure(series: list[Series], title: str, limits: dict[str, float] | None = None, last_step: int | None = None):
    """One panel per series against steps, read at a glance: every panel spans steps 0 to the
    run's last step (so an early curve is seen as early, and one evaluation is not a lone dot on
    an empty axis), ticks at whole steps, points marked when there are few, and a series with a
    limit (the ε target) drawn with it as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    limits = limits or {}
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.2), squeeze=False)
    end = max([last_step or 0, *(x for _, xs, _ in series for x in xs)]) or 1
    for ax, (label, xs, ys) in zip(axes[0], series):
        ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, markersize=4)
        if label in limits:
            ax.axhline(limits[label], color="tab:red", linestyle="--", linewidth=1.2,
                       label=f"target {limits[label]:g}")
            ax.set_ylim(bottom=0)
            ax.legend(loc="lower right")
        ax.set_xlim(-0.03 * end, 1.03 * end)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        files.write_atomic(Path(path), lambda f: fig.savefig(f, dpi=110, format="png"))
    finally:
        plt.close(fig)


def _plot(path: Path, series: list[Series], title: str, limits: dict[str, float] | None = None,
          last_step: int | None = None) -> None:
    _save(_figure(series, title, limits, last_step), path)


def spent_curve(acc: Accountant, ledger: Ledger, points: int = 25,
                spent: Callable[[Accountant], float] | None = None) -> list[tuple[int, float]]:
    """(steps completed, privacy spent) along a ledger, at up to ``points`` steps: ``spent(acc)``
    (by default ε at the budget's δ, or ρ for a zCDP accountant without δ). The charges of step
    index s count once s + 1 steps are complete (the convention of metrics.jsonl)."""
    last = ledger.last_step
    if last is None:
        return []
    n = last + 1
    points = min(points, n)  # more points than steps would repeat steps
    steps = sorted({max(1, round(n * i / points)) for i in range(1, points + 1)} | {n})
    use_rho = acc.budget.delta is None
    if use_rho and acc.rho() is None:
        return []
    out = []
    full = acc.ledger
    try:
        for k in steps:
            acc.ledger = ledger.until(k - 1)
            out.append((k, spent(acc) if spent else acc.rho() if use_rho else acc.epsilon()))
    finally:
        acc.ledger = full
    return out


#: what a plot of a reproducible run's ε says under its title
NO_GUARANTEE = ("\nthis ε is not a privacy guarantee (reproducible noise, a non-private release, or a stop on a "
                "count of the private batch)")


def uncomputable(run_dir: Path) -> UserError:
    """The refusal of a ledger whose events overflow its accountant's floats (no run writes one)."""
    return UserError("the ledger holds an event its accountant cannot compute (a number past the floats); no run "
                     "wrote it", file=str(run_dir))


def private_stop(recipe: dict[str, Any], meta: dict[str, Any]) -> bool:
    """:func:`~dpregistry.recipe.stopped_at_private_count` of a checkpoint's run."""
    return stopped_at_private_count((recipe.get("train") or {}).get("max_nonfinite_steps"),
                                    meta.get("nonfinite_steps", 0))


def recomputed(recipe: dict[str, Any], entries: list[dict[str, Any]]):
    """(accountant, what it has spent, spent(accountant) in the recipe's unit) for a ledger: ε at
    the recipe's δ (ELS: group privacy of the example-level ledger, users.group_epsilon) or ρ."""
    privacy = recipe["privacy"]
    k = els_group(recipe)
    target = Budget(privacy.get("epsilon"), privacy.get("delta"), privacy.get("rho"), privacy["relation"])
    acc = make_accountant(recipe["accountant"], example_budget(target, k))
    acc.ledger = Ledger.from_json(entries)
    spent = dict(acc.spent())

    def in_unit(a: Accountant) -> float:  # ε at the recipe's δ in its unit, or ρ (k²ρ₀ for groups of k)
        if a.budget.delta is None:
            return a.rho() * k * k
        return group_epsilon(a, k, target.delta, a.budget.delta)

    if user_mechanism(recipe) == "els":  # the example-level spending that group privacy reads (Run.spent)
        spent["example_level"] = {key: spent.get(key) for key in ("epsilon", "delta", "rho")}
    if k > 1 and spent.get("epsilon") is not None:  # with k = 1 the accountant's own ε is the unit's
        spent["epsilon"] = in_unit(acc)
    if spent.get("rho") is not None and user_mechanism(recipe) == "els":  # as Run.spent
        spent["rho"], spent["target_rho"] = spent["rho"] * k * k, target.rho
    return acc, spent, in_unit


def newest_ledger(run_dir: Path, meta: dict[str, Any],
                  summary: dict[str, Any]) -> tuple[int, list[dict[str, Any]], str | None]:
    """(step, ledger, why) of the most that ``run_dir`` (its ``summary``) shows was spent: the
    newest valid checkpoint's, or ledger.jsonl's last line where it records later steps that
    continue it (the newest checkpoint lost or damaged: the steps after it were still released).
    A ledger file that does not continue the checkpoint's ledger, or whose chain is broken, or a
    release later than both, is refused."""
    journal = LedgerFile(run_dir)
    last = journal.last
    step, entries = meta["step"], meta.get("ledger", [])
    newest = max(step, last["step"]) if last is not None else step
    guarantee = (meta["recipe"].get("privacy") or {}).get("noise") != "reproducible"
    if later := released_after(run_dir, newest, read_metrics(run_dir), summary, guarantee,
                               rows_release=_logs_releases(meta["recipe"])):
        raise UserError(f"{later}, after the last charge that ledger.jsonl and the checkpoints record (step {newest}): "
                        f"their last lines or checkpoints were removed, and what was spent cannot be recomputed",
                        file=str(run_dir))
    # the checkpoint must be this run's: the line recorded at its step, or one that continues the last
    line = journal.line(step)
    if (line is not None and line["entries"] != entries) or (line is None and not journal.fits(step, entries)):
        raise UserError(f"the newest valid checkpoint (step {step}) does not hold the ledger that ledger.jsonl "
                        f"records: it is not this run's", file=str(run_dir))
    if last is None and step > 0:
        raise UserError(f"ledger.jsonl is missing but the newest valid checkpoint is at step {step}", file=str(run_dir))
    if last is None or last["step"] <= step:
        return step, entries, None
    if not extends(entries, last["entries"]):
        raise UserError(f"ledger.jsonl records steps up to {last['step']} that do not continue the ledger of the "
                        f"newest valid checkpoint (step {step}): the folder was edited", file=str(run_dir))
    return last["step"], last["entries"], (f"the newest valid checkpoint is at step {step}, but ledger.jsonl records "
                                           f"charges up to step {last['step']}: what was spent is read from it")


def _logs_releases(recipe: dict[str, Any]) -> bool:
    """Whether the run's algorithm logs functions of its releases in its rows; an algorithm that
    cannot be loaded is taken to (its rows then count as releases)."""
    from .registry import get_registry

    try:
        return bool(get_registry().get("algorithm", recipe["algorithm"]["name"]).cls.logs_releases)
    except Exception:  # a plugin no longer installed, a broken one: assume the stricter
        return True


def privacy_report(run_dir: Path, *, points: int = 25, plot: bool = True) -> dict[str, Any]:
    """Ledger, privacy spent over steps and the accountant of ``run_dir``, recomputed from the
    ledger of its newest valid checkpoint, or of ledger.jsonl where it records more
    (:func:`newest_ledger`); writes ``privacy_epsilon.png`` beside it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError("run folder not found", file=str(run_dir))
    found = ckpt.latest_valid(run_dir / "checkpoints", warn=lambda m: None)
    if found is None:
        raise UserError("no readable checkpoint in this run folder", file=str(run_dir))
    _, meta, _ = found
    recipe = meta["recipe"]
    stored = run_dir / "recipe.json"
    if stored.exists() and _read_json(stored).get("recipe_hash") != meta.get("recipe_hash"):
        raise UserError("the newest valid checkpoint was written by another recipe than recipe.json's: it is not this "
                        "run's", file=str(run_dir))
    privacy = recipe["privacy"]
    summary_path = run_dir / "summary.json"
    summary = _read_json(summary_path) if summary_path.exists() else {}
    step, entries, ledger_note = newest_ledger(run_dir, meta, summary)
    try:
        acc, spent, in_unit = recomputed(recipe, entries)
        curve = spent_curve(acc, acc.ledger, points, in_unit)
    except ArithmeticError:
        raise uncomputable(run_dir) from None
    label = "ρ spent" if acc.budget.delta is None else "ε spent"
    target = spent.get("target_rho") if acc.budget.delta is None else privacy.get("epsilon")
    guarantee = (privacy.get("noise") != "reproducible" and not any_nonprivate(acc.ledger.events)
                 and not private_stop(recipe, meta))
    plot_path = None
    if plot and curve:
        plot_path = run_dir / PLOT_NAME
        _plot(plot_path, [(label, *_from_step_0(curve))],
              f"{recipe['algorithm']['name']}: privacy spent ({acc.name}, "
              f"{privacy['relation'].replace('_', '-')})"
              + ("" if guarantee else NO_GUARANTEE),
              {label: target} if target is not None and math.isfinite(target) else None)
    ledger = [dict(e, describe=PrivacyEvent.from_dict(e["event"]).describe()) for e in acc.ledger.to_json()]
    return {
        "run": str(run_dir), "step": step, "checkpoint_step": meta["step"], "ledger_note": ledger_note,
        "accountant": acc.name, "notion": acc.notion,
        "relation": privacy["relation"], "epsilon": spent.get("epsilon"), "delta": privacy.get("delta"),
        "target_epsilon": privacy.get("epsilon"), "rho": spent.get("rho"), "target_rho": spent.get("target_rho"),
        "delta_fail": spent.get("delta_fail"),  # the failure probability inside δ (zcdp_fail)
        "noise_multiplier": meta.get("noise_multiplier"), "charges": acc.ledger.n_charges,
        "noise": privacy.get("noise"),
        "guarantee": guarantee,
        "unit": privacy.get("unit", "example"),
        "example_level": spent.get("example_level"),
        "ledger": ledger, "spent_label": label, "spent_over_steps": curve,
        "epsilon_over_steps": curve if acc.budget.delta is not None else [],
        "plot": str(plot_path) if plot_path else None,
        "recipe": recipe, "summary": summary if summary.get("step") == step else {},
    }


def unit_line(rep: dict[str, Any]) -> str:
    """:func:`unit_statement` of a :func:`privacy_report`: the unit, relation and example-level ε
    as the recipe and the recomputed ledger state them (summary.json, which has no checksum, gives
    only the number of users), and the guarantee as the report established it."""
    return unit_statement({**(rep.get("summary") or {}), **unit_terms(rep["recipe"]),
                           "example_level": rep["example_level"], "guarantee": rep["guarantee"]})


def ledger_rows(ledger: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The ledger for reading: entries with the same event and count per entry are one row (in the
    order of their first charge), so 400 episodes' tree charges are one line, not 400; the JSON
    report keeps every entry."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for e in ledger:
        groups.setdefault((e["describe"], e["count"], e["last_step"] - e["first_step"]), []).append(e)
    rows = []
    for (describe, count, _), es in groups.items():
        first, last = es[0], es[-1]
        steps = f"{first['first_step']}–{last['last_step']}"
        parts = [e["partition"] or "all" for e in es]
        if len(es) > 1:
            strides = {b["first_step"] - a["first_step"] for a, b in zip(es, es[1:])}
            steps += f", every {strides.pop()}" if len(strides) == 1 else f", {len(es)} spans"
            parts = [parts[0]] if len(set(parts)) == 1 else [f"{parts[0]} … {parts[-1]} ({len(set(parts))})"]
        rows.append({"steps": steps, "count": f"{count}" if len(es) == 1 else f"{len(es)} × {count}",
                     "partition": parts[0], "event": describe})
    return rows


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(read_regular(path, "JSON file", limit=files.RUN_JSON_LIMIT))
    except (OSError, ValueError, RecursionError):
        raise UserError("unreadable JSON", file=str(path)) from None
    return obj if isinstance(obj, dict) else {}


def _num(v: Any) -> str:
    """Numbers at full precision (the report is read by people and by tests)."""
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.6g}"


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def write_report(run_dir: Path) -> list[Path]:
    """``RUN_DIR/report/``: ``report.md`` and PNG plots of the training loss, the held-out metrics
    and ε spent against steps. Works on interrupted runs (ε then comes from the newest checkpoint's
    ledger, or ledger.jsonl's where it records more)."""
    run_dir = Path(run_dir)
    rep = privacy_report(run_dir, plot=False)
    recipe, summary = rep["recipe"], rep["summary"]
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= rep["step"]]
    no_linked_folders(run_dir)
    out = run_dir / "report"
    try:
        out.mkdir(exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the report ({e.strerror or e})", file=str(out)) from None
    alg = recipe["algorithm"]["name"]
    written: list[Path] = []
    figures: list[tuple[str, str]] = []

    def figure(name: str, caption: str, series, title: str, limits=None) -> None:
        series = [s for s in series if s[1]]
        if not series:
            return
        try:
            _plot(out / name, series, title, limits, last_step=rep["step"])
        except OSError as e:
            raise UserError(f"cannot write the report ({e.strerror or e})", file=str(out)) from None
        written.append(out / name)
        figures.append((caption, name))

    loss = ("training loss", *_series(rows, "loss"))
    eval_series = _eval_series(rows, summary)
    eps = ("ε spent", *_epsilon_series(rep))
    target = rep["target_epsilon"]
    eps_limit = {"ε spent": target} if isinstance(target, (int, float)) and math.isfinite(target) else None
    figure("overview.png", "Overview: training loss, held-out metric and ε spent against steps",
           [loss, *_main_metric(eval_series), eps], f"{alg}: overview" + ("" if rep["guarantee"] else NO_GUARANTEE),
           eps_limit)
    figure("loss.png", "Training loss (private batch, before noise; a diagnostic, not covered by the "
           "guarantee)", [loss], f"{alg}: training loss")
    figure("eval.png", "Held-out metrics", eval_series, f"{alg}: held-out metrics")
    figure("epsilon.png", "Privacy spent", [eps], f"{alg}: ε spent ({rep['accountant']}, δ = {_num(rep['delta'])})"
           + ("" if rep["guarantee"] else NO_GUARANTEE),
           eps_limit)

    if summary:
        status = f"stopped at step {summary['step']}: {summary['stopped']}" if summary.get("stopped") \
            else f"finished, {summary['step']} steps"
    elif rep["ledger_note"]:
        status = f"interrupted, and {rep['ledger_note']} (ε below)"
    else:
        status = f"interrupted; the newest valid checkpoint is at step {rep['step']} (continue with `dpreg resume`)"
    lines = [f"# Run report: {alg}", ""]
    if recipe.get("description"):
        lines += [recipe["description"], ""]
    overview = [f"![{cap}]({name})" for cap, name in figures if name == "overview.png"]
    lines += [f"Status: {status}.", ""] + (overview + [""] if overview else [])
    lines += ["## Privacy", "", "| quantity | value |", "|---|---|",
              f"| ε spent | {_num(rep['epsilon'])} |", f"| target ε | {_num(rep['target_epsilon'])} |",
              f"| δ | {_num(rep['delta'])} |"]
    if summary.get("rho") is not None or recipe["privacy"].get("rho") is not None:
        lines += [f"| ρ spent | {_num(rep['rho'])} |", f"| target ρ | {_num(recipe['privacy'].get('rho'))} |"]
    lines += [f"| accountant | {rep['accountant']} |", f"| neighbouring relation | {rep['relation']} |",
              f"| noise multiplier | {_num(rep['noise_multiplier'])} |", f"| steps | {rep['step']} |",
              f"| noise | {noise_statement(recipe['privacy'].get('noise'))} (privacy.noise: {recipe['privacy'].get('noise')}) |",
              f"| privacy unit | {unit_line(rep)} |",
              *([f"| third-party stages | {trust_statement(summary['third_party_stages'])} |"]
                if (summary or {}).get("third_party_stages") else []), ""]
    lines += ["Charges (the privacy ledger):", ""]
    for r in ledger_rows(rep["ledger"]):
        part = f", partition {r['partition']}" if r["partition"] != "all" else ""
        lines.append(f"- steps {r['steps']}: {r['count']} × {r['event']}{part}")
    lines.append("")
    final_metrics = summary.get("metrics") or {}
    for title, keep in (("Held-out metrics (final)", lambda k: not _on_training_data(k)),
                        (f"{TRAINING_METRICS} (final)", _on_training_data)):
        shown = {k: v for k, v in final_metrics.items() if keep(k)}
        if shown:
            lines += [f"## {title}", "", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {_num(v)} |" for k, v in shown.items()] + [""]
    if figures:
        lines += ["## Plots", ""] + [f"![{cap}]({name})" for cap, name in figures if name != "overview.png"] + [""]
    lines += ["## Provenance", "", f"- recipe hash: `{summary.get('recipe_hash') or _recipe_hash(run_dir)}`",
              f"- seed: {recipe.get('seed')}"]
    for k, v in (summary.get("versions") or {}).items():
        lines.append(f"- {k}: {', '.join(v) if isinstance(v, list) else v}")
    if summary.get("wall_seconds") is not None:
        lines.append(f"- wall time: {summary['wall_seconds']:.1f} s")
    md = out / "report.md"
    try:
        files.write_text_atomic(md, "\n".join(lines) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the report ({e.strerror or e})", file=str(out)) from None
    return [md] + written


TRAINING_METRICS = "Metrics of the training data (diagnostics without noise, not covered by the guarantee)"


def _on_training_data(name: str) -> bool:
    """An objective's evaluation of its own training data (train_loss, train_excess_risk, ...)."""
    return name.startswith("train")


def _label(name: str) -> str:
    return f"{name} (training data, not covered)" if _on_training_data(name) else f"held-out {name}"


def _eval_series(rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[Series]:
    """Each held-out metric over steps, ending with the final evaluation of a finished run."""
    final = summary.get("metrics") or {}
    out = []
    for k in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        xs, ys = _series(rows, k)
        name = k[len("eval/"):]
        if isinstance(final.get(name), (int, float)) and (not xs or xs[-1] != summary.get("step")):
            xs, ys = xs + [summary["step"]], ys + [final[name]]
        out.append((_label(name), xs, ys))
    if not out:  # no periodic evaluation: the final held-out metrics alone
        out = [(_label(k), [summary["step"]], [v]) for k, v in sorted(final.items())
               if isinstance(v, (int, float))]
    return out


def _main_metric(eval_series: list[Series]) -> list[Series]:
    """The held-out metric of the overview: accuracy if there is one, else the first that is not
    the loss, else the loss."""
    rank = {"held-out accuracy": 0}
    ordered = sorted(eval_series, key=lambda s: rank.get(s[0], 2 if s[0] == "held-out loss" else 1))
    return ordered[:1]


def _from_step_0(curve: list[tuple[int, float]]) -> tuple[list, list]:
    """(steps, values) of a :func:`spent_curve`, from 0 spent before the first step."""
    return ([0] + [k for k, _ in curve], [0.0] + [v for _, v in curve]) if curve else ([], [])


def _epsilon_series(rep: dict[str, Any]) -> tuple[list, list]:
    """ε against steps, recomputed from the ledger: metrics.jsonl's ε rows are neither checksummed
    nor recomputed, and folders from older versions hold values that later fixes corrected."""
    return _from_step_0(rep["epsilon_over_steps"])


def _recipe_hash(run_dir: Path) -> str:
    path = run_dir / "recipe.json"
    return _read_json(path).get("recipe_hash", "?") if path.exists() else "?"
