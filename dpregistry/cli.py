"""``dpreg``: run, resume, validate and inspect private training recipes.

Bad input of any kind prints one line and exits with code 2, and writes nothing. A run stopped by
SIGINT/SIGTERM exits 128 + the signal, one stopped at the non-finite limit exits 1; both wrote a
final checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from .errors import UserError
from .progress import saying

# click's exceptions, from whichever click typer uses (recent typer vendors its own copy)
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_click_exceptions = sys.modules[_ClickException.__module__]
_NoArgsIsHelp = getattr(_click_exceptions, "NoArgsIsHelpError", ())
_ClickAbort = getattr(_click_exceptions, "Abort", ())


class OneLineErrors(TyperGroup):
    """Usage errors (an unknown option, a missing argument, a bad value) print one line and exit 2,
    like every other bad input, instead of click's usage box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        prog_name = "dpreg"  # also under `python -m dpregistry` and in tests
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NoArgsIsHelp as e:
            e.show()
            sys.exit(e.exit_code)
        except _ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            say_error(f"{where}{e.format_message()}{hint}")
            sys.exit(2)
        except _ClickAbort:
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="dpregistry: differentially private optimizers as plugins.")
privacy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Privacy accounting tools.")
app.add_typer(privacy_app, name="privacy")


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        print(f"dpreg {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", metavar="", is_eager=True, callback=_print_version,
                                                   help="print the version and exit")] = False):
    """dpregistry: differentially private optimizers as plugins."""

console = Console()
err = Console(stderr=True)

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE",
                                                     help="override a recipe key (key.path=value), once per value")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", metavar="", help="no progress bar or step lines")]
Json = Annotated[bool, typer.Option("--json", metavar="", help="print JSON")]
Recipe = Annotated[str, typer.Argument(metavar="RECIPE", help="recipe file, or the name of a shipped recipe")]


def flag(name: str, help: str):
    """A switch (no value, so --help shows no placeholder after it)."""
    return typer.Option(name, metavar="", help=help)



def say_error(msg: str) -> None:
    """One line on stderr; the message is printed literally (it may contain brackets)."""
    err.print(f"[bold red]error:[/] {escape(msg.replace(chr(10), ' '))}", highlight=False, soft_wrap=True)


def fail(e: Exception) -> None:
    say_error(str(e))
    raise typer.Exit(2)


@contextmanager
def user_errors():
    try:
        yield
    except UserError as e:
        fail(e)
    except OSError as e:  # a path from the command line the file system refuses (a name too long, ...)
        if e.filename is None:
            raise
        fail(UserError(f"cannot use this path ({e.strerror or e})", file=str(e.filename)))


def load_recipe(path: str, sets):
    from .api import load_recipe

    return load_recipe(path, sets)


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------


def _print_summary(summary: dict, out: Path | None) -> None:
    t = Table(show_header=False, box=None)
    eps, target = summary.get("epsilon"), summary.get("target_epsilon")
    if eps is not None:
        budget = f" of {target:g}" if target else ""
        t.add_row("privacy", f"ε = {eps:.4g}{budget} at δ = {summary.get('delta'):g} "
                             f"({summary['accountant']}, {summary['relation'].replace('_', '-')})")
    if summary.get("rho") is not None:
        target = summary.get("target_rho")
        t.add_row("zCDP", f"ρ = {summary['rho']:.4g}" + (f" of {target:.4g}" if target is not None else ""))
    if summary.get("unit"):
        from .users import unit_statement

        t.add_row("privacy unit", unit_statement(summary))
    if summary.get("noise_multiplier") is not None:
        t.add_row("noise multiplier", f"{summary['noise_multiplier']:.4g}")
    if summary.get("noise"):
        from .rng import noise_statement

        t.add_row("noise", noise_statement(summary["noise"]))
    if summary.get("third_party_stages"):
        from .registry import trust_statement

        t.add_row("third-party stages", trust_statement(summary["third_party_stages"]))
    t.add_row("steps", str(summary["step"]))
    for k, v in (summary.get("metrics") or {}).items():
        label = k.replace("_", " ") if k.startswith("train") else f"held-out {k}"
        t.add_row(label, f"{v:.4f}" if isinstance(v, float) else str(v))
    t.add_row("wall time", f"{summary['wall_seconds']:.1f} s")
    if summary.get("stopped"):
        t.add_row("stopped", summary["stopped"])
    if out:
        t.add_row("output", str(out))
    console.print(t)


def _relaunch(nproc: int) -> None:
    """`dpreg run --nproc N ...`: the same command under torchrun on this node."""
    import subprocess

    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip or a.startswith("--nproc="):
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dpregistry", *argv]
    raise typer.Exit(subprocess.run(cmd).returncode)


def _even_if_stopped(call):
    """The Result of a run, also of one a signal stopped (the API raises then; ``_finish`` reports
    it and exits with 128 + the signal)."""
    from .api import Stopped, Terminated

    try:
        return call()
    except (Stopped, Terminated) as stop:
        return stop.result


@app.command()
def run(recipe: Recipe,
        out: Annotated[Optional[Path], typer.Option("--out", metavar="DIR", help="output folder (default: runs/RECIPE-YYYYmmdd-HHMMSS)")] = None,
        set_: SetOpt = None,
        overwrite: Annotated[bool, flag("--overwrite", "replace an earlier run in --out")] = False,
        quiet: Quiet = False,
        nproc: Annotated[int, typer.Option("--nproc", metavar="N",
                                           help="data-parallel processes on this node (torchrun)")] = 1):
    """Train privately with RECIPE; writes metrics.jsonl, summary.json and checkpoints/ under --out."""
    from .api import train
    from .folder import default_out

    if nproc < 1:
        fail(UserError("--nproc must be at least 1"))
    if nproc > 1:
        _relaunch(nproc)
    with user_errors():
        result = _even_if_stopped(lambda: train(recipe, set=set_, out=out or default_out(recipe),
                                                overwrite=overwrite, verbose=not quiet, console=console))
    _finish(result)


@app.command()
def resume(run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="folder of an interrupted run")],
           quiet: Quiet = False,
           max_nonfinite_steps: Annotated[Optional[int], typer.Option(
               "--max-nonfinite-steps", min=0, metavar="N",
               help="raise train.max_nonfinite_steps of a run stopped at it")] = None):
    """Continue a run from its newest valid checkpoint (the privacy ledger continues too)."""
    from .api import resume

    with user_errors():
        result = _even_if_stopped(lambda: resume(run_dir, verbose=not quiet, max_nonfinite_steps=max_nonfinite_steps,
                                                 console=console, warn=lambda m: err.print(escape(m), style="yellow"),
                                                 say=lambda m: console.print(escape(m), highlight=False)))
    _finish(result)


def _finish(result) -> None:
    if result.run.comm.rank == 0:
        _print_summary(result.summary, result.run_dir)
    _exit_if_stopped(result.run, result.run_dir)


def _exit_if_stopped(run_, out: Path | None) -> None:
    """A run stopped by a signal exits 128 + the signal (as shells report it); one stopped by the
    non-finite limit exits 1. Both wrote a final checkpoint; `dpreg resume` continues them."""
    if run_.stop_signal is not None:
        if out is not None and run_.comm.rank == 0:
            err.print(f"{escape(run_.stop_reason or 'stopped')}; resume with: dpreg resume {escape(str(out))}",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(128 + int(run_.stop_signal))
    if run_.stop_reason and run_.stopped_at_private_count:
        say_error(f"{out}: {run_.stop_reason}; the final checkpoint is written")
        raise typer.Exit(1)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="folder of a run (finished or interrupted)")]):
    """Write DIR/report/: report.md and PNG plots (training loss, held-out metrics, ε spent)."""
    from .report import write_report

    with user_errors():
        written = write_report(run_dir)
    for p in written:
        console.print(str(p), highlight=False)


@app.command()
def export(run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="folder of a finished run")],
           to: Annotated[Path, typer.Option("--to", metavar="DIR", help="the folder to write (new or empty)")],
           merge: Annotated[bool, flag("--merge", "LoRA: merge the adapters into the base weights")] = False,
           overwrite: Annotated[bool, flag("--overwrite", "replace what --to holds")] = False):
    """Write the run's model as a Hugging Face folder, with a model card that states its privacy guarantee."""
    from .export import CARD, export_run_folder

    with user_errors():
        out = export_run_folder(run_dir, to, merge=merge, overwrite=overwrite)
    console.print(f"exported to {escape(str(out))} (model card: {escape(str(out / CARD))})", highlight=False)


@app.command()
def validate(recipe: Recipe, set_: SetOpt = None):
    """Check a recipe (schema, stages, data and model paths, budget) without training."""
    from .run import Run

    with user_errors():
        r = load_recipe(recipe, set_)
        run_ = Run(r).prepare()
    z = run_.privatizer.noise_multiplier
    eps = run_.planned_epsilon() if run_.budget.delta and z is not None and not run_.algorithm.adaptive else None
    msg = f"ok: {recipe}"
    if z is not None:
        msg += f" (noise multiplier {z:.4g}"
        msg += f", planned ε = {eps:.4g})" if eps is not None and math.isfinite(eps) else ")"
    console.print(msg)


@app.command()
def show(recipe: Recipe, set_: SetOpt = None):
    """Print the fully resolved recipe (presets, extends and --set applied, defaults filled in)."""
    import yaml

    with user_errors():
        r = load_recipe(recipe, set_)
    console.print(yaml.safe_dump(r.data, sort_keys=False), end="", highlight=False)


@app.command()
def plugins(as_json: Json = False):
    """List every registered stage by kind, with its plugin and description."""
    from .registry import get_registry

    with user_errors():
        reg = get_registry()
        entries = reg.all()
    if as_json:
        print(json.dumps([e.as_json() for e in entries], indent=2))
        return
    _print_plugins(entries, reg.broken)


def _print_plugins(entries, broken) -> None:
    """One block per kind that fits the terminal: names are never cut, descriptions wrap, and
    each ends with its plugin (entry-point name); a footer says which distribution holds which."""
    from .registry import KINDS

    for kind in KINDS:
        group = [e for e in entries if e.kind == kind]
        if not group:
            continue
        t = Table(show_header=False, box=None, padding=(0, 0, 0, 2))
        t.add_column(no_wrap=True, min_width=max(len(e.name) for e in group))
        t.add_column(overflow="fold")
        for e in group:
            t.add_row(e.name, f"{escape(_description(e))} [dim]({escape(e.plugin or e.origin)})[/]")
        _print_stripped(f"[bold]{kind.replace('_', ' ')}s[/] ({len(group)})", t)
    by_dist: dict[str, list[str]] = {}
    for e in entries:
        names = by_dist.setdefault(e.distribution, [])
        if e.plugin and e.plugin not in names:
            names.append(e.plugin)
    for dist, names in by_dist.items():
        _print_stripped(f"plugins of {escape(dist)}: {', '.join(sorted(names))}" if names else f"from {escape(dist)}")
    if broken:
        t = Table(show_header=False, box=None, padding=(0, 0, 0, 2))
        t.add_column(no_wrap=True)
        t.add_column(overflow="fold")
        for b in broken:
            t.add_row(escape(b.plugin), f"{escape(b.distribution)}: {escape(b.error)}")
        _print_stripped(f"[bold red]broken plugins[/] ({len(broken)}, not loaded)", t)


def _print_stripped(*renderables) -> None:
    """Print at the console's width without the trailing blanks that table cells are padded with."""
    with console.capture() as cap:
        for r in renderables:
            console.print(r, highlight=False)
    for line in cap.get().splitlines():
        console.out(line.rstrip(), highlight=False)  # already rendered: no markup left to read


def _description(entry) -> str:
    try:
        return entry.description
    except UserError as e:  # a lazily registered stage that fails to import
        return f"broken: {e}"


# ------------------------------------------------------------------------------------------
# privacy tools
# ------------------------------------------------------------------------------------------


def _accountant(name: str, epsilon=None, delta=None, relation="replace_one"):
    from .privacy.accountant import Budget, make_accountant

    return make_accountant(name, Budget(epsilon=epsilon, delta=delta, relation=relation))


def _subsampled_plan(steps: int, q: float, relation: str):
    from .privacy.events import Gaussian, PoissonSampled, clipped_sum_sensitivity
    from .stages import Charge

    sens = clipped_sum_sensitivity(1.0, relation)

    def plan(z: float):
        ev = Gaussian(std=z, sensitivity=sens)
        ev = PoissonSampled(q, ev) if q < 1 else ev
        return [Charge(ev, count=steps)]

    return plan


Relation = Annotated[str, typer.Option("--relation", metavar="NAME",
                                       help="replace_one (the papers) or add_remove (Opacus)")]
Epsilon = Annotated[float, typer.Option("--epsilon", metavar="EPS", help="the ε to meet")]
Delta = Annotated[float, typer.Option("--delta", metavar="DELTA", help="δ")]
Steps = Annotated[int, typer.Option("--steps", metavar="N", help="steps")]
SampleRate = Annotated[float, typer.Option("--sample-rate", metavar="Q", help="each example's chance to be in a batch")]
Accountant = Annotated[str, typer.Option("--accountant", metavar="NAME",
                                         help="a registered accountant: rdp, pld, ... (dpreg plugins)")]
MAX_POINTS = 1000  # `privacy report --points`: each point is one accountant evaluation


@privacy_app.command("calibrate")
def privacy_calibrate(epsilon: Epsilon, delta: Delta, steps: Steps, sample_rate: SampleRate,
                      accountant: Accountant = "rdp", relation: Relation = "replace_one", as_json: Json = False):
    """The smallest noise multiplier (noise std ÷ clip) that meets (ε, δ) for Poisson-sampled steps."""
    with user_errors():
        _check_ranges(epsilon=epsilon, delta=delta, steps=steps, sample_rate=sample_rate, relation=relation)
        acc = _accountant(accountant, epsilon, delta, relation)
        t0 = time.time()
        with saying(None if as_json else lambda m: err.print(escape(m), style="yellow", soft_wrap=True)):
            z = acc.calibrate(_subsampled_plan(steps, sample_rate, relation))
        secs = time.time() - t0
        achieved = acc.epsilon(delta, extra=_subsampled_plan(steps, sample_rate, relation)(z))
    if as_json:
        print(json.dumps({"noise_multiplier": z, "epsilon": achieved, "delta": delta, "steps": steps,
                          "sample_rate": sample_rate, "accountant": accountant, "relation": relation,
                          "seconds": secs}))
    else:
        console.print(f"noise multiplier {z:.6g} (ε = {achieved:.4g} at δ = {delta:g}; {accountant}, "
                      f"{relation.replace('_', '-')}; {secs:.2f} s)")


@privacy_app.command("epsilon")
def privacy_epsilon(noise_multiplier: Annotated[float, typer.Option("--noise-multiplier", metavar="Z",
                                                                    help="noise std ÷ clip")],
                    steps: Steps, sample_rate: SampleRate, delta: Delta,
                    accountant: Accountant = "rdp", relation: Relation = "replace_one", as_json: Json = False):
    """ε spent by Poisson-sampled Gaussian steps at a noise multiplier."""
    with user_errors():
        _check_ranges(delta=delta, steps=steps, sample_rate=sample_rate, relation=relation)
        if not noise_multiplier > 0:
            raise UserError("--noise-multiplier must be positive")
        acc = _accountant(accountant, None, delta, relation)
        eps = acc.epsilon(delta, extra=_subsampled_plan(steps, sample_rate, relation)(noise_multiplier))
    if as_json:
        print(json.dumps({"epsilon": eps, "delta": delta, "noise_multiplier": noise_multiplier, "steps": steps,
                          "sample_rate": sample_rate, "accountant": accountant, "relation": relation}))
    else:
        console.print(f"ε = {eps:.6g} at δ = {delta:g} ({accountant}, {relation.replace('_', '-')})")


def _check_ranges(epsilon=None, delta=None, steps=None, sample_rate=None, relation=None):
    from .limits import MAX_STEPS

    if epsilon is not None and not 0 < epsilon < math.inf:
        raise UserError("--epsilon must be positive and finite")
    if delta is not None and not 0 < delta < 1:
        raise UserError("--delta must be in (0, 1)")
    if steps is not None and not 0 < steps <= MAX_STEPS:
        raise UserError(f"--steps must be between 1 and {MAX_STEPS:,}")
    if sample_rate is not None and not 0 < sample_rate <= 1:
        raise UserError("--sample-rate must be in (0, 1]")
    if relation is not None and relation not in ("replace_one", "add_remove"):
        raise UserError("--relation must be replace_one or add_remove")


@privacy_app.command("report")
def privacy_report(run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="folder of a run")],
                   points: Annotated[int, typer.Option("--points", metavar="N",
                                                       help="steps at which to recompute ε")] = 25,
                   as_json: Json = False):
    """The privacy ledger of a run: events, ε over steps, the accountant, and a PNG plot."""
    from .report import ledger_rows, privacy_report as build, unit_line

    with user_errors():
        if not 1 <= points <= MAX_POINTS:
            raise UserError(f"--points must be between 1 and {MAX_POINTS}")
        rep = build(run_dir, points=points)
    if as_json:
        print(json.dumps(rep, default=str, indent=2))
        return
    from .export import NOTIONS

    head = f"accountant [bold]{rep['accountant']}[/] ({NOTIONS.get(rep['notion'], rep['notion'])}, " \
           f"{rep['relation'].replace('_', '-')}), " \
           f"{rep['charges']} charges over {rep['step']} steps"
    if rep.get("epsilon") is not None:
        head += f": ε = {rep['epsilon']:.4g} at δ = {rep['delta']:g}"
        if rep.get("delta_fail"):
            head += f" (of which δ_fail = {rep['delta_fail']:.3g})"
        if rep.get("target_epsilon"):
            head += f" (budget {rep['target_epsilon']:g})"
    if rep.get("rho") is not None:
        head += f"; ρ = {rep['rho']:.4g}" + (f" of {rep['target_rho']:.4g}" if rep.get("target_rho") else "")
    console.print(head)
    if rep.get("noise"):
        from .rng import noise_statement

        console.print(f"noise: {noise_statement(rep['noise'])} (privacy.noise: {rep['noise']})")
    console.print(f"privacy unit: {unit_line(rep)}")
    if rep.get("noise_multiplier") is not None:
        console.print(f"noise multiplier {rep['noise_multiplier']:.6g}")
    t = Table("steps", "count", "partition", "event", title="ledger (entries alike on one row; --json lists each)")
    for r in ledger_rows(rep["ledger"]):
        t.add_row(r["steps"], r["count"], r["partition"], r["event"])
    console.print(t)
    curve = rep["spent_over_steps"]
    if curve:
        t = Table("steps", rep["spent_label"], title="privacy spent over steps")
        for k, v in curve:
            t.add_row(str(k), f"{v:.4g}")
        console.print(t)
    if rep.get("plot"):
        console.print(f"plot: {rep['plot']}")


def quiet_libraries() -> None:
    """Defaults for dpreg's own process, read by the Hugging Face libraries when first imported:
    no tokenizer-fork warning, transformers' advisories and bars off (a Python caller's environment
    is left alone; loads are silenced while they run by ``dpregistry.hf.quiet``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def main():
    quiet_libraries()
    try:
        app()
    except UserError as e:  # raised outside a command (plugin loading)
        say_error(str(e))
        sys.exit(2)
    except RuntimeError as e:
        from .distributed import launched_by_torchrun

        if not launched_by_torchrun():
            raise
        # A peer died or hung up mid-collective: say so plainly; checkpoints are written atomically.
        rank = os.environ.get("RANK", "?")
        say_error(f"rank {rank} lost contact with another rank ({str(e).splitlines()[0][:200]}). "
                  "The last checkpoint is intact; continue with `dpreg resume DIR`.")
        sys.exit(1)


if __name__ == "__main__":
    main()
