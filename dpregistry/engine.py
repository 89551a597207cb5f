"""The engine: builds a run from a recipe, owns data, accounting, checkpoints and logging.

The algorithm owns the control flow of a step (see :mod:`dpregistry.stages`); the engine gives
it the services below and makes every step a transaction: a step either completes, charged in
full, or leaves no trace (a parameter displacement left by a zeroth-order estimator is undone,
and nothing is logged or checkpointed before the step's charge).
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__
from . import checkpoint as ckpt
from .directions import Direction
from .errors import BudgetExhausted, RunStopped, UserError
from .privacy.accountant import Budget
from .recipe import Recipe, recipe_hash, resolve
from .registry import get_registry
from .rng import RunRNG
from .stages import Charge, ClippedSum, Release


class LocalComm:
    """Single-process communication (the distributed one lives in dpregistry.distributed)."""

    rank = 0
    world_size = 1
    bytes_sent = 0
    micro_batch = None

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        return indices

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def all_reduce(self, total: ClippedSum) -> ClippedSum:
        return total

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def check_replicas(self, params, step) -> None:
        pass


@dataclass
class Displacement:
    """Parameters currently sit at x + scale·u(direction); whoever consumes it must undo it."""

    direction: Direction
    names: tuple[str, ...]
    scale: float


class Run:
    """One training run: stages, parameters, the privacy ledger and the output folder."""

    def __init__(self, recipe: Recipe, out_dir: Path | None = None, *, comm=None, console=None):
        self.recipe = recipe
        self.out_dir = Path(out_dir) if out_dir else None
        self.comm = comm or LocalComm()
        self.comm.micro_batch = recipe.train.micro_batch_size
        self.console = console
        p = recipe.privacy
        self.budget = Budget(p.epsilon, p.delta, p.rho, p.relation)
        self.relation = p.relation
        self.rng = RunRNG(recipe.seed, p.secure_noise)
        self.device = torch.device(recipe.train.device)
        self.step = 0
        self.stop_reason: str | None = None
        self.nonfinite_steps = 0
        self.displacement: Displacement | None = None
        self._noise_calls = 0
        self._bytes_logged = 0
        self._iterate_snapshot: dict[str, torch.Tensor] | None = None
        self.history: list[dict[str, Any]] = []

        def make(kind):
            entry, params = recipe.stages[kind]
            return entry.cls(params)

        self.algorithm = make("algorithm")
        self.objective = make("objective")
        self.sampler = make("sampler")
        self.estimator = make("estimator")
        self.privatizer = make("privatizer")
        self.update_rule = make("update_rule")
        self.accountant = make("accountant")
        self.params: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ stages

    @property
    def stages(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "objective": self.objective, "sampler": self.sampler,
                "estimator": self.estimator, "privatizer": self.privatizer,
                "update_rule": self.update_rule, "accountant": self.accountant}

    @property
    def n_train(self) -> int:
        return self.objective.n_train

    @property
    def total_steps(self) -> int:
        return self.algorithm.total_steps(self)

    def prepare(self) -> "Run":
        """Load data and model, bind stages, calibrate noise and check the plan against the budget."""
        self.objective.setup(self)
        n = self.objective.n_train
        if n <= 0:
            raise UserError("the training data set is empty", file=self.recipe.source, key="data")
        d = self.budget.delta
        if d is not None and d >= 1.0 / n:
            raise UserError(f"δ = {d:g} is not below 1/n = {1.0 / n:.3g}; such a δ allows publishing a record",
                            file=self.recipe.source, **_key(self.recipe, "privacy", "delta"))
        self.params = self.objective.params()
        if not self.params:
            raise UserError("the model has no trainable parameters", file=self.recipe.source,
                            key="objective")
        for stage in self.stages.values():
            if stage is not self.objective:
                stage.setup(self)
        for stage in self.stages.values():
            stage.validate(self)
        self._calibrate_and_check()
        return self

    def _calibrate_and_check(self) -> None:
        priv = self.privatizer
        if getattr(priv, "needs_calibration", False):
            if not (self.budget.epsilon and self.budget.delta) and self.budget.rho is None:
                raise UserError("noise_multiplier: auto needs a privacy budget (privacy.epsilon and privacy.delta, or rho)",
                                file=self.recipe.source, key="privatizer.noise_multiplier")
            z = self.accountant.calibrate(lambda z: self.algorithm.plan(self, z))
            priv.set_noise_multiplier(z)
        self.check_plan()

    def check_plan(self) -> None:
        """Refuse a run whose planned charges (on top of the ledger) exceed the budget."""
        z = getattr(self.privatizer, "noise_multiplier", None)
        plan = self.algorithm.plan(self, z) if z is not None or not self.algorithm.adaptive else []
        self.accountant.check_events(c.event for c in plan)
        has_budget = (self.budget.epsilon is not None and self.budget.delta is not None) or self.budget.rho is not None
        if has_budget and plan:
            try:
                self.accountant.approve(plan)
            except BudgetExhausted:
                spent = "the ledger so far and the rest of the plan" if self.accountant.ledger.entries else "the planned run"
                raise UserError(f"{spent} spends {self.accountant.overspend(plan)}; raise the noise, lower the "
                                f"steps or the sampling rate, or set privatizer.noise_multiplier: auto",
                                file=self.recipe.source, key="privacy") from None

    # ------------------------------------------------------------------ step services

    def noise(self):
        """The secret noise source of the next release in this step (identical on every rank)."""
        src = self.rng.noise(self.step, self._noise_calls)
        self._noise_calls += 1
        if self.rng.secure_noise and self.comm.world_size > 1:
            from .distributed import BroadcastNoise

            src = BroadcastNoise(src, self.comm)
        return src

    def charge(self, events) -> list[Charge]:
        charges = self.sampler.account(self.step, list(events), self)
        self.accountant.charge(charges, self.step)
        return charges

    def privatize_batch(self, indices: torch.Tensor) -> ClippedSum:
        """Clip-and-sum every contribution of this rank's shard, and combine across ranks.

        Contributions small enough to send (per-example scalars) are gathered first, so every rank
        clips the whole batch in the single-process order; others all-reduce their clipped sums."""
        total: ClippedSum | None = None
        gathered = False
        for contrib in self.estimator.contributions(self.objective, self.comm.shard(indices), self):
            full = contrib.gather(self.comm) if self.comm.world_size > 1 else None
            gathered = full is not None
            part = self.privatizer.clip_sum(full if gathered else contrib)
            total = part if total is None else total.add_(part)
            del contrib, full  # free activations before the next micro-batch
        if total is None:
            raise RuntimeError(f"estimator {self.estimator.name!r} yielded no contribution")
        return total if gathered else self.comm.all_reduce(total)

    def take_displacement(self) -> Displacement | None:
        d, self.displacement = self.displacement, None
        return d

    def undo_displacement(self) -> None:
        d = self.take_displacement()
        if d is not None:
            d.direction.add_([self.params[n] for n in d.names], -d.scale)

    def step_metrics(self, total: ClippedSum, release: Release) -> dict[str, float]:
        m = {"batch_size": total.count,
             "loss": total.loss_sum / max(total.count - total.nonfinite, 1),
             "clipped_fraction": total.clipped / max(total.count, 1),
             "nonfinite": total.nonfinite}
        m.update(release.stats)
        return m

    # ------------------------------------------------------------------ training loop

    def train(self, progress: Callable | None = None) -> dict[str, Any]:
        t0 = time.time()
        rows: list[dict[str, Any]] = []
        window: list[dict[str, float]] = []
        tau = self._random_iterate_step()
        with self._signals():
            while not self.algorithm.done(self):
                if self.stop_reason:
                    break
                if tau is not None and self.step == tau:
                    self._iterate_snapshot = {k: v.detach().clone() for k, v in self.params.items()}
                self._noise_calls = 0
                try:
                    result = self.algorithm.step(self)
                except BudgetExhausted as e:
                    self.stop_reason = f"privacy budget exhausted at step {self.step}: {e}"
                    break
                finally:
                    self.undo_displacement()
                self.step += 1
                window.append(result.metrics)
                if result.metrics.get("nonfinite", 0):
                    self.nonfinite_steps += 1
                    if self.nonfinite_steps > self.recipe.train.max_nonfinite_steps:
                        self.stop_reason = (f"{self.nonfinite_steps} steps had non-finite losses or gradients "
                                            f"(train.max_nonfinite_steps = {self.recipe.train.max_nonfinite_steps})")
                last = self.step >= self.total_steps or result.done or self.stop_reason
                if self.step % self.recipe.train.log_every == 0 or last:
                    row = self._log_row(window, t0)
                    window = []
                    ev = self.recipe.train.eval_every
                    if ev and self.step % ev == 0:
                        row.update({f"eval/{k}": v for k, v in self.objective.evaluate().items()})
                    rows.append(row)
                    self._append_metrics(row)
                if progress:
                    progress(self, result.metrics)
                sc = self.recipe.train.sync_check_every
                if self.comm.world_size > 1 and sc and (self.step % sc == 0 or last):
                    self.comm.check_replicas(self.params, self.step)
                ce = self.recipe.train.checkpoint_every
                if ce and self.step % ce == 0 and not last:
                    self.save_checkpoint()
                if result.done:
                    break
        return self.finish(t0)

    def _random_iterate_step(self) -> int | None:
        if self.recipe.output != "random_iterate":
            return None
        g = self.rng.generator("output_iterate", 0)
        return int(torch.randint(0, self.total_steps, (1,), generator=g))

    def _log_row(self, window, t0) -> dict[str, Any]:
        row: dict[str, Any] = {"step": self.step}
        keys = {k for m in window for k in m}
        for k in sorted(keys):
            vals = [m[k] for m in window if k in m and isinstance(m[k], (int, float))]
            if vals:
                row[k] = sum(vals) if k == "nonfinite" else sum(vals) / len(vals)
        row["epsilon"] = self.epsilon()
        row["wall_seconds"] = time.time() - t0
        if self.comm.world_size > 1:  # payload bytes this rank sent, per step since the last row
            row["comm_bytes_per_step"] = (self.comm.bytes_sent - self._bytes_logged) / max(len(window), 1)
            self._bytes_logged = self.comm.bytes_sent
        self.history.append(row)
        return row

    def epsilon(self) -> float | None:
        if self.budget.delta is None:
            return None
        return self.accountant.epsilon()

    def output_params(self) -> dict[str, torch.Tensor]:
        out = self.update_rule.output(self.params, self)
        if out is not None:
            return out
        if self._iterate_snapshot is not None:
            return self._iterate_snapshot
        return self.params

    def finish(self, t0: float) -> dict[str, Any]:
        # The checkpoint keeps the training state (a resume continues from the iterate, not from the
        # output, which an update rule may pick as an average or an earlier iterate).
        self.save_checkpoint()
        final = self.output_params()
        if final is not self.params:
            with torch.no_grad():
                for k, v in final.items():
                    self.params[k].copy_(v)
        metrics = self.objective.evaluate()
        if self.out_dir and self.comm.rank == 0:
            ckpt.write_atomic(self.out_dir / "model.safetensors",
                              {k: v.detach().cpu() for k, v in self.params.items()},
                              {"step": self.step, "recipe_hash": self.recipe.hash})
        spent = self.accountant.spent()
        summary = {
            "step": self.step,
            "epsilon": spent.get("epsilon"),
            "delta": spent.get("delta"),
            "target_epsilon": self.budget.epsilon,
            "rho": spent.get("rho"),
            "target_rho": spent.get("target_rho"),
            "accountant": self.accountant.name,
            "relation": self.relation,
            "noise_multiplier": getattr(self.privatizer, "noise_multiplier", None),
            "metrics": metrics,
            "wall_seconds": time.time() - t0,
            "stopped": self.stop_reason,
            "recipe_hash": self.recipe.hash,
            "versions": versions(),
        }
        if self.out_dir and self.comm.rank == 0:
            _write_json(self.out_dir / "summary.json", summary)
        return summary

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {f"params/{k}": v.detach().cpu() for k, v in self.params.items()}
        stage_state = {kind: ckpt.split_state(s.state_dict(), f"state/{kind}", tensors)
                       for kind, s in self.stages.items()}
        if self._iterate_snapshot is not None:
            for k, v in self._iterate_snapshot.items():
                tensors[f"iterate/{k}"] = v.cpu()
        meta = {"step": self.step, "recipe": self.recipe.data, "recipe_hash": self.recipe.hash,
                "version": __version__, "state": stage_state,
                "noise_multiplier": getattr(self.privatizer, "noise_multiplier", None),
                "nonfinite_steps": self.nonfinite_steps,
                "ledger": self.accountant.ledger.to_json()}
        return tensors, meta

    def save_checkpoint(self) -> Path | None:
        if not self.out_dir or self.comm.rank != 0:
            return None
        folder = self.out_dir / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        tensors, meta = self.state()
        path = ckpt.checkpoint_path(folder, self.step)
        try:
            ckpt.write_atomic(path, tensors, meta)
        except OSError as e:
            raise UserError(f"cannot write checkpoint {path} ({e.strerror or e}); the previous checkpoint is kept",
                            file=str(folder)) from None
        ckpt.prune(folder, self.recipe.train.keep_checkpoints)
        return path

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if meta["recipe_hash"] != self.recipe.hash:
            raise UserError("the checkpoint was written by a different recipe; resuming would change the "
                            "results or the privacy guarantee", key="recipe")
        with torch.no_grad():
            for k, v in self.params.items():
                v.copy_(tensors[f"params/{k}"].to(v.device, v.dtype))
        state = ckpt.join_state(meta["state"], tensors)
        for kind, s in self.stages.items():
            s.load_state_dict(state.get(kind, {}))
        self.step = int(meta["step"])
        self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        if meta.get("noise_multiplier") is not None and hasattr(self.privatizer, "set_noise_multiplier"):
            self.privatizer.set_noise_multiplier(meta["noise_multiplier"])
        it = {k[len("iterate/"):]: v for k, v in tensors.items() if k.startswith("iterate/")}
        self._iterate_snapshot = it or None
        self.check_plan()  # the remaining plan must still fit on top of the restored ledger

    # ------------------------------------------------------------------ output folder

    def _append_metrics(self, row: dict[str, Any]) -> None:
        if self.out_dir and self.comm.rank == 0:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row, default=_json_default) + "\n")

    def truncate_metrics(self) -> None:
        """Drop metric rows logged after the checkpoint a resume starts from."""
        path = self.out_dir / "metrics.jsonl" if self.out_dir else None
        if path and path.exists():
            rows = [line for line in path.read_text().splitlines() if line.strip()
                    and json.loads(line).get("step", 0) <= self.step]
            path.write_text("".join(r + "\n" for r in rows))

    @contextmanager
    def _signals(self):
        """SIGINT/SIGTERM finish the current step, then write a checkpoint and exit cleanly."""
        def handler(signum, frame):
            self.stop_reason = f"stopped by {signal.Signals(signum).name}"

        old = {}
        try:
            for s in (signal.SIGINT, signal.SIGTERM):
                old[s] = signal.signal(s, handler)
        except ValueError:  # not the main thread
            old = {}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _key(recipe: Recipe, *path: str) -> dict[str, Any]:
    w = recipe.where(*path)
    return {k: v for k, v in w.items() if k in ("line", "key")}


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return str(o)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"dpregistry": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("dp-accounting", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    out["plugins"] = sorted({e.origin for e in get_registry().all()})
    return out


def resume_run(out_dir: Path, *, comm=None, console=None, warn=print) -> Run:
    """Rebuild the run of ``out_dir`` and restore its newest valid checkpoint."""
    out_dir = Path(out_dir)
    rpath = out_dir / "recipe.json"
    if not rpath.exists():
        raise UserError("not a dpregistry run folder (no recipe.json)", file=str(out_dir))
    stored = json.loads(rpath.read_text())
    recipe = resolve(stored["recipe"], {}, get_registry(), source=str(rpath))
    if recipe.hash != stored["recipe_hash"]:
        raise UserError("the installed stages resolve this recipe differently than when the run started "
                        "(a plugin changed its defaults); resuming would change the results", file=str(rpath))
    run = Run(recipe, out_dir, comm=comm, console=console)
    run.prepare()
    found = ckpt.latest_valid(out_dir / "checkpoints", warn=warn)
    if found is None:
        raise UserError("no valid checkpoint to resume from", file=str(out_dir / "checkpoints"))
    tensors, meta, _ = found
    run.load_state(tensors, meta)
    run.truncate_metrics()
    return run


def start_run(run: Run, out_dir: Path | None) -> Run:
    """Attach a prepared run to its output folder: the resolved recipe and a step-0 checkpoint."""
    run.out_dir = Path(out_dir) if out_dir else None
    if run.out_dir and run.comm.rank == 0:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run.out_dir / "recipe.json", {"recipe": run.recipe.data, "recipe_hash": run.recipe.hash,
                                                  "source": run.recipe.source})
        run.save_checkpoint()  # step 0: a resume never has to start from nothing
    return run
