"""The Python API: ``dpregistry.train`` and ``dpregistry.resume``; ``dpreg`` is a thin layer over it.

    import dpregistry
    result = dpregistry.train("quickstart")                       # a shipped recipe, a path or a dict
    result = dpregistry.train(recipe, model=net, loss=per_example_loss, train_data=ds, eval_data=test)
    result.epsilon, result.metrics, result.model, result.run_dir

Validation, accounting and checkpoints are those of ``dpreg run``: a bad recipe raises
:class:`~dpregistry.errors.UserError` carrying the same file/line/key message, and a run with
``out=`` writes the same folder, which ``resume`` (or ``dpreg resume``) continues.
"""

from __future__ import annotations

import signal
import sys
import time
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import UserError
from .progress import saying


@dataclass
class Result:
    """What a run gives back: the trained model, its privacy guarantee, its metrics and ledger."""

    run: Any                      # the dpregistry.run.Run (its stages, parameters and accountant)
    summary: dict[str, Any]       # what summary.json holds
    run_dir: Path | None          # the run folder (None: trained in memory only)

    @property
    def model(self):
        """The trained torch module (the objective's), or the parameters when there is no module."""
        return self.run.objective.module() or self.run.params

    @property
    def epsilon(self) -> float | None:
        return self.summary.get("epsilon")

    @property
    def delta(self) -> float | None:
        return self.summary.get("delta")

    @property
    def metrics(self) -> dict[str, float]:
        """Held-out metrics at the end of the run."""
        return self.summary.get("metrics") or {}

    @property
    def history(self) -> list[dict[str, Any]]:
        """The logged rows (what metrics.jsonl holds)."""
        return self.run.history

    @property
    def ledger(self) -> list[dict[str, Any]]:
        """Every charge of the run: the privacy ledger."""
        return self.run.accountant.ledger.to_json()

    @property
    def guarantee(self) -> bool:
        """Whether the ε is a privacy guarantee (secret noise, and no release charged as non-private)."""
        return bool(self.summary.get("guarantee"))

    @property
    def stopped(self) -> str | None:
        return self.summary.get("stopped")

    def export(self, to: str | Path, *, merge: bool = False, overwrite: bool = False) -> Path:
        """Write the trained model as a folder that transformers' ``from_pretrained`` loads, with a
        model card stating its privacy guarantee (see :mod:`dpregistry.export`; ``merge``: LoRA
        adapters merged into the base weights). A model that no transformers architecture computes
        exactly is refused with the reason. Several processes: rank 0 writes."""
        from .export import export_objective, guarantee

        run = self.run
        module = run.objective.module()
        mark = getattr(module, TRAINED, None)
        same_folder = mark is not None and mark.run_dir is not None and self.run_dir is not None and \
            mark.run_dir == str(Path(self.run_dir).resolve())
        if mark is not None and mark.run() is not run and not same_folder:
            raise UserError(f"this model was trained again in place after this run ({mark.spent} by the later run): "
                            f"its weights are not this run's output, and this run's ε is not theirs; pass "
                            f"copy.deepcopy(model) to each run", key="model")
        if mark is not None and mark.fingerprint != fingerprint(module):
            raise UserError("this model's weights changed after this run (trained through another module that "
                            "shares them, loaded from another run, or edited): they are not this run's output, and "
                            "its card would state this run's ε for them", key="model")
        if mark is not None and mark.before:
            raise UserError(f"this model had been trained in place by another run before this one "
                            f"({'; '.join(mark.before)}): its weights carry the privacy cost of every run, and a "
                            f"card can state this run's ε alone; pass copy.deepcopy(model) to each run, or "
                            f"continue one run with dpregistry.resume", key="model")
        if run.comm.rank != 0:
            return Path(to)
        privacy = guarantee(self.summary, run.recipe.data, self.ledger, run.accountant.notion)
        return export_objective(run.objective, to, recipe=run.recipe, privacy=privacy, metrics=self.metrics,
                                merge=merge, overwrite=overwrite, keep_out=self.run_dir)

    def __repr__(self) -> str:
        eps = "-" if self.epsilon is None else f"{self.epsilon:.4g}"
        return f"Result(step={self.summary.get('step')}, epsilon={eps}, metrics={self.metrics}, run_dir={self.run_dir})"


class Stopped(KeyboardInterrupt):
    """SIGINT (Ctrl-C) stopped the run: raised by :func:`train` and :func:`resume` once what the run
    spent is saved, so that a script or a notebook cell stops as Ctrl-C stops it; ``result`` holds
    the run as it stands (``dpregistry.resume(result.run_dir)`` continues it)."""

    def __init__(self, result: Result):
        super().__init__(result.stopped)
        self.result = result


class Terminated(SystemExit):
    """SIGTERM stopped the run: as :class:`Stopped`, then the interpreter exits with 128 + 15, as a
    terminated process does, after running the caller's ``finally`` blocks."""

    def __init__(self, result: Result):
        super().__init__(128 + signal.SIGTERM)
        self.result = result


def _unless_stopped(result: Result) -> Result:
    sig = result.run.stop_signal
    if sig == signal.SIGINT:
        raise Stopped(result)
    if sig == signal.SIGTERM:
        raise Terminated(result)
    return result


# ------------------------------------------------------------------------------------------------
# recipes
# ------------------------------------------------------------------------------------------------


def recipes_dirs() -> list[Path]:
    here = Path(__file__).resolve().parent
    return [here.parent / "recipes", Path(sys.prefix) / "share" / "dpregistry" / "recipes"]


def find_recipe(name: str) -> Path:
    """A recipe path, or the name of a recipe shipped with dpregistry (``quickstart``)."""
    p = Path(name)
    try:
        if p.exists() or p.suffix in (".yaml", ".yml") and p.parent != Path("."):
            return p
        for d in recipes_dirs():
            for cand in (d / name, d / f"{name}.yaml"):
                if cand.exists():
                    return cand
    except OSError:  # a name too long to be a file: reading it says so
        return p
    if p.parent == Path(".") and not p.suffix and not p.exists():
        shipped = sorted({c.stem for d in recipes_dirs() if d.is_dir() for c in d.glob("*.yaml")})
        raise UserError(f"{name}: no such recipe file, and no shipped recipe of that name (shipped: "
                        f"{', '.join(shipped)})")
    return p


def load_recipe(recipe: str | Path | dict, sets=None, *, own: bool = False):
    """A validated recipe from a path, a shipped name or a dict (``sets``: ``key.path=value``
    overrides, as ``--set``). ``own``: the caller brings model, loss and data, so the objective is
    the ``python`` one unless the recipe names another."""
    from .recipe import load, resolve
    from .registry import get_registry

    sets = list(sets or [])
    if own:
        sets = ["objective.name=python", *sets]
    if isinstance(recipe, dict):
        import copy

        from .recipe import _apply_set

        data, locs = copy.deepcopy(recipe), {}
        for s in sets:
            _apply_set(data, locs, s)
        r = resolve(data, locs, get_registry(), source="<recipe>")
    else:
        r = load(find_recipe(str(recipe)), sets)
    if own and not any(s.strip().startswith("objective") for s in sets[1:]):
        # what the objective refuses is the model, loss or data given to train(), not a --set
        for path in (("objective",), ("objective", "name")):
            r.locs[path] = ("dpregistry.train", None)
    return r


# ------------------------------------------------------------------------------------------------
# several processes
# ------------------------------------------------------------------------------------------------


@contextmanager
def process_group():
    """The torch.distributed communicator when torchrun launched us, else None. After a run the
    ranks leave together (rank 0 has written the outputs); after an error each leaves at once,
    since a rank that raised alone would wait at a barrier for peers that never come."""
    from .distributed import init_from_env, launched_by_torchrun

    comm = init_from_env() if launched_by_torchrun() else None
    yield comm
    if comm is not None:
        comm.barrier()


def on_rank0_for_all(comm, fn: Callable):
    """fn() on rank 0 (the folder, its lock), its result or its refusal on every rank: a refusal
    on rank 0 alone would leave the others waiting in the first collective until they time out."""
    result, problem = None, None
    if comm is None or comm.rank == 0:
        try:
            result = fn()
        except UserError as e:
            if comm is None:
                raise
            problem = e
    if comm is not None:
        message, result = comm.broadcast_object((str(problem) if problem else None, result))
        if problem is not None:
            raise problem
        if message:
            raise UserError(message)
    return result


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------


def _own_objects(model, loss, train_data, eval_data, metrics, users=None) -> dict[type, Any] | None:
    given = {"model": model, "loss": loss, "train_data": train_data}
    if all(v is None for v in given.values()) and eval_data is None and not metrics and users is None:
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise UserError(f"bringing your own model, loss and data needs all three; missing: {', '.join(missing)}",
                        key=missing[0])
    from .own import OwnObjects

    return {OwnObjects: OwnObjects(model, loss, train_data, eval_data, dict(metrics or {}), users)}


def train(recipe: str | Path | dict, *, set: list[str] | None = None, out: str | Path | None = None,
          overwrite: bool = False, verbose: bool = True, model=None, loss: Callable | None = None,
          train_data=None, eval_data=None, metrics: dict[str, Callable] | None = None, users=None,
          console=None) -> Result:
    """Train privately with ``recipe`` (a path, a shipped name or a dict) and return the :class:`Result`.

    ``set``: overrides as with ``dpreg run --set`` (``["privatizer.clip=2"]``). ``out``: a run
    folder for checkpoints, metrics and the model (None: in memory only). ``model``, ``loss``,
    ``train_data``, ``eval_data``, ``metrics``: your own, for the ``python`` objective (see
    :mod:`dpregistry.own`); the recipe then holds only the stages, the budget and the schedule.
    ``users``: the user of each training example, for ``privacy.unit: user`` (:mod:`dpregistry.users`).
    ``verbose``: progress bars (terminal or notebook) while it trains. A run stopped by SIGINT or
    SIGTERM raises :class:`Stopped` or :class:`Terminated` once it has saved what it spent.
    On a CPU with glibc, the process keeps freed memory for reuse from then on (:mod:`dpregistry.heap`;
    set any ``MALLOC_*`` variable in the environment to keep glibc's own behaviour)."""
    from .folder import check_out, claim, start_run
    from .run import Run

    provides = _own_objects(model, loss, train_data, eval_data, metrics, users)
    before = getattr(model, TRAINED, None)
    inner = [m for m in (model.modules() if hasattr(model, "modules") else ()) if getattr(m, TRAINED, None)]
    if inner and before is None:  # a module that wraps (shares the weights of) one trained before
        before = getattr(inner[0], TRAINED)
    if before:
        _warn(f"warning: this model was already trained by dpregistry.train in this process ({before.spent}); it trains on "
              f"in place, and this run's ε covers this run alone: the model's privacy cost is the composition of "
              f"both (pass copy.deepcopy(model) to train from the same start)")
    with process_group() as comm:
        r = load_recipe(recipe, set, own=provides is not None)
        if users is not None and r.privacy.unit != "user":
            raise UserError("users= names each example's user, but privacy.unit is example: the guarantee would "
                            "protect one example, not one user; set privacy: {unit: user, max_examples_per_user: k}, "
                            "or leave users out", key="users")
        out_dir = on_rank0_for_all(comm, lambda: check_out(Path(out), overwrite)) if out is not None else None
        # Everything that can fail on bad input happens before the folder is touched.
        sayer = _sayer(verbose and (comm is None or comm.rank == 0), console)
        with saying(sayer):
            run = Run(r, comm=comm, provides=provides).prepare()
        with ExitStack() as held:
            if out_dir is not None:
                with saying(sayer):
                    on_rank0_for_all(comm, lambda: claim(out_dir, overwrite, held))
            start_run(run, out_dir)
            try:
                summary = _train(run, verbose and (comm is None or comm.rank == 0), console)
            finally:  # a run that failed after some steps trained the module too (out of memory, say)
                if model is not None and run.step > 0:
                    _mark(model, run, out_dir, before=(before.before + (before.spent,)) if before else ())
    return _unless_stopped(Result(run, summary, out_dir))


#: set on a module that dpregistry.train or resume trained in place: a :class:`Trained`
TRAINED = "_dpregistry_trained"


@dataclass(frozen=True)
class Trained:
    """The run whose output a module holds (weakly: the module must not keep a run alive), what
    it spent, in words, what the runs that trained the module before it spent, and a fingerprint
    of its weights then (an edit, or training through a module that shares them, changes it)."""

    run: weakref.ref
    spent: str
    before: tuple[str, ...] = ()
    fingerprint: tuple = ()
    run_dir: str | None = None  # the run folder: a resume continues (or only reloads) that run


def fingerprint(module) -> tuple:
    """Each tensor of a module's state by name, summarised as StateWatch summarises a parameter
    (computed where it lives: cheap beside a run, and no copy of a large model)."""
    import torch

    from .persample import tensor_summary

    return tuple((name, tensor_summary(t)) for name, t in module.state_dict().items() if torch.is_tensor(t))


def _mark(model, run, run_dir: Path | None, before: tuple[str, ...] = ()) -> None:
    eps = run.epsilon()
    spent = f"ε = {eps:.4g}" if eps is not None else f"{run.step} private steps"
    setattr(model, TRAINED, Trained(weakref.ref(run), spent, before, fingerprint(model),
                                    None if run_dir is None else str(Path(run_dir).resolve())))


def resume(run_dir: str | Path, *, verbose: bool = True, max_nonfinite_steps: int | None = None, model=None,
           loss: Callable | None = None, train_data=None, eval_data=None, metrics=None, users=None, console=None,
           warn: Callable[[str], None] | None = None, say: Callable[[str], None] | None = None) -> Result:
    """Continue the run of ``run_dir`` from its newest valid checkpoint (the privacy ledger
    continues too). A run of your own model needs the same model, loss and data again. ``say``
    gets the one-line status (from which step it continues, what was spent; default: printed
    when ``verbose``)."""
    from .folder import not_a_run_folder, resume_run, run_lock
    from .loop import finish

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError("run folder not found", file=str(run_dir))
    if not (run_dir / "recipe.json").exists():
        raise not_a_run_folder(run_dir)
    provides = _own_objects(model, loss, train_data, eval_data, metrics, users)
    with process_group() as comm:
        rank0 = comm is None or comm.rank == 0
        with ExitStack() as held:
            on_rank0_for_all(comm, lambda: held.enter_context(run_lock(run_dir)))
            say = say or ((lambda m: _say(console, m)) if verbose else (lambda m: None))
            with saying(say if rank0 else None):
                r = resume_run(run_dir, comm=comm, warn=(warn or _warn) if rank0 else (lambda m: None),
                               max_nonfinite_steps=max_nonfinite_steps, provides=provides)
            try:
                if r.algorithm.done(r.ctx):
                    if rank0:
                        say(f"the run already finished at step {r.step}")
                    summary = finish(r, time.time())
                else:
                    if rank0:
                        say(f"resuming {run_dir} at step {r.step} of {r.total_steps}; spent so far: {spent(r)}")
                    summary = _train(r, verbose and rank0, console)
            finally:  # the module holds the checkpoint's weights, and this run's steps
                if model is not None:
                    _mark(model, r, run_dir)
    return _unless_stopped(Result(r, summary, run_dir))


def spent(run) -> str:
    """What a run's ledger has spent, against its budget, in words."""
    s = run.spent()
    if s.get("epsilon") is not None:
        of = f" of {run.target.epsilon:g}" if run.target.epsilon else ""
        return f"ε = {s['epsilon']:.4g}{of} at δ = {s.get('delta'):g}"
    if s.get("rho") is not None:
        of = f" of {s['target_rho']:.4g}" if s.get("target_rho") is not None else ""
        return f"ρ = {s['rho']:.4g}{of}"
    return f"{run.accountant.ledger.n_charges} charges"


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def _sayer(verbose: bool, console) -> Callable[[str], None] | None:
    """Where a stage's one-line messages (dpregistry.progress.say) go while the run is built."""
    return (lambda m: _say(console, m)) if verbose else None


def _say(console, message: str) -> None:
    if console is None:
        from rich.console import Console

        console = Console()
    from rich.markup import escape

    console.print(escape(message), highlight=False)


def _train(run, verbose: bool, console=None) -> dict[str, Any]:
    """Train with a progress bar (rich: a terminal or a notebook), a bar of its own for a long
    evaluation, and the ε in words when it is no guarantee."""
    from .progress import showing

    if not verbose or not run.recipe.train.progress:
        with showing(None):
            return run.train()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = console or Console()
    state = {"t0": time.time(), "s0": run.step, "loss": float("nan"), "eps": run.epsilon()}
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[loss]}"),
               TextColumn("{task.fields[eps]}"), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False) as prog:
        task = prog.add_task(run.algorithm.name, total=run.total_steps, completed=run.step, rate="", loss="",
                             eps="")

        def update(r, metrics, spent=None):
            if "loss" in metrics:
                state["loss"] = metrics["loss"]
            if spent is not None:
                state["eps"] = spent
            elif r.history and r.history[-1]["step"] == r.step:
                state["eps"] = r.history[-1].get("epsilon")
            rate = (r.step - state["s0"]) / max(time.time() - state["t0"], 1e-9)
            eps = state["eps"]
            caveat = "" if r.guarantee else " (no guarantee: " + (
                "reproducible noise)" if not r.rng.guarantee else "a stop on a private count)"
                if r.stopped_at_private_count else "a non-private release)")
            prog.update(task, completed=r.step, rate=f"{rate:6.1f} steps/s", loss=f"loss {state['loss']:.4g}",
                        eps="ε -" if eps is None else f"ε {eps:.3g}{caveat}")

        def tracker(items, total, description):
            """A stage's long loop (an evaluation) as a bar of its own under the run's, gone when done."""
            sub = prog.add_task(description, total=total, rate="", loss="", eps="")
            try:
                for item in items:
                    yield item
                    prog.advance(sub)
            finally:
                prog.remove_task(sub)

        with showing(tracker):
            summary = run.train(progress=update)
        update(run, {}, spent=summary.get("epsilon"))  # a signal may stop the run between two logged rows
        return summary
