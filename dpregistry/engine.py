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
from .errors import BudgetExhausted, UserError
from .ledger_file import LedgerFile, extends
from .privacy.accountant import Budget
from .recipe import SECTIONS, Recipe, resolve
from .registry import get_registry
from .rng import RunRNG
from .stages import Charge, ClippedSum, Release


class LocalComm:
    """Single-process communication (the distributed one lives in dpregistry.distributed)."""

    rank = 0
    world_size = 1
    bytes_sent = 0
    micro_batch = None

    positions = None  # the whole batch is local

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

    def any_flag(self, flag: bool) -> bool:
        return flag


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
        try:
            self.rng = RunRNG(recipe.seed, p.noise)
        except UserError as e:
            raise UserError(e.message, file=recipe.source, **_key(recipe, "privacy", "noise")) from None
        try:
            self._device = torch.device(recipe.train.device)
            self._device_checked = False
        except RuntimeError as e:
            raise UserError(f"not a torch device ({str(e).splitlines()[0]})", file=recipe.source,
                            **_key(recipe, "train", "device")) from None
        self.step = 0
        self.stop_reason: str | None = None
        self.stop_signal: int | None = None  # the signal that stopped the run (the CLI exits 128 + it)
        self.nonfinite_steps = 0
        self.displacement: Displacement | None = None
        self._noise_calls = 0
        self._sampled_charge_step: int | None = None  # see charge()
        self._bytes_logged = 0
        self._iterate_snapshot: dict[str, torch.Tensor] | None = None
        self._log_window: list[dict[str, Any]] = []
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
        """Load data and model, bind stages, calibrate noise and check the plan against the budget.

        A UserError that a stage raises without a file is located in the recipe (file, line, key)."""
        self._section: str | None = None
        self._check_ranks_share_the_noise_key()
        try:
            self._prepare_stages()
            self.device  # noqa: B018  (an objective that never placed a tensor still gets the check)
        except UserError as e:
            raise _locate(e, self.recipe, self._section)
        except (MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            # a model or data set sized by the recipe that does not fit: bad input, not a bug
            raise _locate(UserError(f"out of memory while building the run ({str(e).splitlines()[0][:200]})"),
                          self.recipe, self._section) from None
        except OSError as e:  # preparing only reads: a data or model path the recipe names (too long, ...)
            name = f" {e.filename}" if e.filename else ""
            raise _locate(UserError(f"cannot read{name} ({e.strerror or e})"), self.recipe, self._section) from None
        except (ArithmeticError, ValueError) as e:
            if not isinstance(e, ArithmeticError) and str(e) != "math domain error":
                raise
            # a stage's theory constants from absurd recipe numbers (stat_tol: 1e300 overflowed β³)
            raise _locate(UserError(f"a number of the recipe is out of range: computing with it failed "
                                    f"({type(e).__name__}: {e})"), self.recipe, self._section) from None
        return self

    def _check_ranks_share_the_noise_key(self) -> None:
        """Ranks resolve one recipe (checked first) and share the noise key: a rank with another key
        would add other noise and cut its shard from another batch (a record summed twice). A secure
        run's key is drawn by rank 0 and sent to the others once, here; keyed runs derive it from
        DPREG_NOISE_KEY on every rank, which must agree."""
        if self.comm.world_size == 1:
            return
        # Each rank loads the recipe itself (on several nodes, from its own copy): a rank with another
        # clip would add an unaccounted-for sum to the all-reduce, and the ranks would not even drift.
        mine = (self.recipe.hash, self.rng.noise_mode, self.rng.noise_fingerprint)
        first = self.comm.broadcast_object(mine + (self.recipe.data,))
        if self.comm.any_flag(first[0] != mine[0]):
            key = _first_difference(first[3], self.recipe.data)
            where = {"file": self.recipe.source, **(self.recipe.where(*key.split(".")) if key else {})}
            what = f"{key} differs from rank 0's" if key else "another recipe" if first[0] != mine[0] else "as rank 0"
            raise UserError(f"the ranks resolved different recipes (rank {self.comm.rank}: {what}); give every "
                            f"rank the same recipe file and --set options", **where)
        first = first[:3]
        differs = first != mine
        if self.comm.any_flag(differs):
            raise UserError(f"the ranks do not share one DPREG_NOISE_KEY (rank {self.comm.rank}: "
                            f"{'a different key' if differs else 'as rank 0'}); give every rank the same key")
        if self.rng.noise_mode == "secure":
            self.rng = RunRNG(self.recipe.seed, "secure", key=self.comm.broadcast_object(self.rng.key))

    @property
    def device(self) -> torch.device:
        """The run's device, checked on first use: objectives resolve their model and data paths
        before they place anything, so a missing model is reported even on a machine without the
        device the recipe asks for."""
        if not self._device_checked:
            _check_device(self._device, self.recipe)
            self._device_checked = True
        return self._device

    def _prepare_stages(self) -> None:
        self._section = "objective"
        self.objective.setup(self)
        self._section = None
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
        for kind, stage in self.stages.items():
            if stage is not self.objective:
                self._section = SECTION_OF[kind]
                stage.setup(self)
        for kind, stage in self.stages.items():
            self._section = SECTION_OF[kind]
            stage.validate(self)
        self._section = None
        self._calibrate_and_check()

    def _calibrate_and_check(self) -> None:
        priv = self.privatizer
        if getattr(priv, "needs_calibration", False):
            if not (self.budget.epsilon and self.budget.delta) and self.budget.rho is None:
                raise UserError("noise_multiplier: auto needs a privacy budget (privacy.epsilon and privacy.delta, or rho)",
                                file=self.recipe.source, **_key(self.recipe, "privatizer", "noise_multiplier"))
            z = self.accountant.calibrate(lambda z: self.algorithm.plan(self, z))
            priv.set_noise_multiplier(z)
        self.check_plan()

    def check_plan(self) -> None:
        """Refuse a run whose planned charges (on top of the ledger) exceed the budget."""
        if self.algorithm.adaptive and not self.budget.is_set:
            # A filter's guarantee holds for a budget fixed in advance; the sum of adaptively chosen
            # costs is none (Rogers et al. 2016), so without one the filter would admit every charge.
            raise UserError(f"algorithm {self.algorithm.name!r} chooses its noise adaptively: its privacy filter "
                            f"needs a budget set in advance (privacy.rho, or privacy.epsilon and privacy.delta)",
                            file=self.recipe.source, **_key(self.recipe, "privacy"))
        z = getattr(self.privatizer, "noise_multiplier", None)
        plan = self.algorithm.plan(self, z) if z is not None or not self.algorithm.adaptive else []
        self.accountant.check_events(c.event for c in plan)
        if self.budget.is_set and plan:
            try:
                self.accountant.approve(plan)
            except BudgetExhausted:
                spent = "the ledger so far and the rest of the plan" if self.accountant.ledger.entries else "the planned run"
                raise UserError(f"{spent} spends {self.accountant.overspend(plan)}; raise the noise, lower the "
                                f"steps or the sampling rate, or set privatizer.noise_multiplier: auto",
                                file=self.recipe.source, **_key(self.recipe, "privacy")) from None

    # ------------------------------------------------------------------ step services

    def noise(self):
        """The secret noise of the next release in this step (identical on every rank)."""
        src = self.rng.noise(self.step, self._noise_calls)
        self._noise_calls += 1
        return src

    def secret(self, purpose: str, step: int, *extra):
        """Secret randomness other than noise, such as the batches whose secrecy privacy
        amplification assumes (see :mod:`dpregistry.rng`); the same on every rank."""
        return self.rng.secret(purpose, step, *extra)

    def charge(self, events) -> list[Charge]:
        if self.sampler.amplifies:
            # A second release from the same secret batch, amplified on its own, would under-count:
            # the releases of one batch are one sampled mechanism (Release.events holds them all).
            if self._sampled_charge_step == self.step:
                raise RuntimeError(f"step {self.step} charged twice on a {self.sampler.name!r} batch; charge every "
                                   "release of a sampled batch in one Run.charge call")
            self._sampled_charge_step = self.step
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
        window = self._log_window  # step metrics since the last row (restored by a resume)
        tau = self._random_iterate_step()
        with self._signals():
            while not self.algorithm.done(self):
                # Ranks vote before every step: one that stopped alone (a signal during a checkpoint
                # write, after the last vote) would leave the others inside a collective.
                stop = self.stop_reason is not None
                if self.comm.world_size > 1:
                    stop = self.comm.any_flag(stop)
                    if stop and not self.stop_reason:
                        self.stop_reason = f"stopped at step {self.step}: another rank was stopped"
                if stop:
                    break
                if tau is not None and self.step == tau:
                    self._iterate_snapshot = {k: v.detach().clone() for k, v in self.params.items()}
                self._noise_calls = 0
                try:
                    result = self.algorithm.step(self)
                except BudgetExhausted as e:
                    self.stop_reason = f"privacy budget exhausted at step {self.step}: {e}"
                    break
                except _OUT_OF_MEMORY:
                    # Nothing of this step reaches the disk; the newest checkpoint stays the state.
                    raise UserError(f"out of memory in step {self.step}; lower train.micro_batch_size (the "
                                    f"physical batch), then `dpreg resume` continues from the last checkpoint",
                                    file=self.recipe.source, **_key(self.recipe, "train", "micro_batch_size")) from None
                finally:
                    self.undo_displacement()
                self.step += 1
                window.append(result.metrics)
                if result.metrics.get("nonfinite", 0):
                    self.nonfinite_steps += 1
                    if self.nonfinite_steps > self.recipe.train.max_nonfinite_steps:
                        self.stop_reason = (f"{self.nonfinite_steps} steps had non-finite losses or gradients "
                                            f"(train.max_nonfinite_steps = {self.recipe.train.max_nonfinite_steps})")
                # A stop (signal, non-finite limit) logs no extra row: the open window is checkpointed,
                # so a resumed run logs exactly the rows of an uninterrupted one.
                last = self.step >= self.total_steps or result.done
                saved = False
                ev = self.recipe.train.eval_every
                evaluate = bool(ev) and self.step % ev == 0
                if self.step % self.recipe.train.log_every == 0 or last or evaluate:
                    row = self._log_row(window, t0)
                    window.clear()
                    if evaluate:
                        row.update({f"eval/{k}": v for k, v in self.objective.evaluate().items()})
                        if not self.rng.replayable and not last:
                            # Held-out metrics reveal this step's releases. With secure noise a resume
                            # redraws the noise of steps after its checkpoint, so checkpoint (and charge)
                            # them before anything that depends on them is written.
                            self.save_checkpoint()
                            saved = True
                    rows.append(row)
                    self._append_metrics(row)
                if progress:
                    progress(self, result.metrics)
                sc = self.recipe.train.sync_check_every
                if self.comm.world_size > 1 and sc and (self.step % sc == 0 or last):
                    self.comm.check_replicas(self.params, self.step)
                ce = self.recipe.train.checkpoint_every
                if ce and self.step % ce == 0 and not (last or saved or self.stop_reason):
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
            with self._storage(self.out_dir / "model.safetensors"):
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
            "noise": self.rng.noise_mode,
            "guarantee": self.rng.guarantee,
            "metrics": metrics,
            "wall_seconds": time.time() - t0,
            "stopped": self.stop_reason,
            "recipe_hash": self.recipe.hash,
            "versions": versions(),
        }
        if self.out_dir and self.comm.rank == 0:
            with self._storage(self.out_dir / "summary.json"):
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
                "noise": {"mode": self.rng.noise_mode, "key_fingerprint": self.rng.noise_fingerprint},
                "nonfinite_steps": self.nonfinite_steps,
                "log_window": [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in self._log_window],
                "ledger": self.accountant.ledger.to_json()}
        return tensors, meta

    def save_checkpoint(self) -> Path | None:
        if not self.out_dir or self.comm.rank != 0:
            return None
        folder = self.out_dir / "checkpoints"
        tensors, meta = self.state()
        path = ckpt.checkpoint_path(folder, self.step)
        with self._storage(path):
            folder.mkdir(parents=True, exist_ok=True)
            _fsync_file(self.out_dir / "metrics.jsonl")  # rows up to this step survive a power loss too
            ckpt.write_atomic(path, tensors, meta)
            # After the rename: a kill in between leaves the checkpoint one line ahead of the ledger
            # file, which a resume accepts (the checkpoint's ledger extends the last line).
            LedgerFile(self.out_dir).record(self.step, meta["ledger"])
            ckpt.prune(folder, self.recipe.train.keep_checkpoints)
        return path

    @contextmanager
    def _storage(self, path: Path):
        """A failed write (full disk, read-only or vanished folder) is one clear line, not a traceback."""
        try:
            yield
        except OSError as e:
            try:
                newest = ckpt.list_checkpoints(self.out_dir / "checkpoints") if self.out_dir else []
            except OSError:
                newest = []
            kept = (f"the last good checkpoint (step {newest[-1][0]}) is kept; free space or fix the folder, "
                    f"then `dpreg resume {self.out_dir}`") if newest else "no checkpoint was written"
            raise UserError(f"cannot write {getattr(e, 'filename', None) or path} ({e.strerror or e}); {kept}",
                            file=str(self.out_dir or path)) from None

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if meta["recipe_hash"] != self.recipe.hash:
            raise UserError("the checkpoint was written by a different recipe; resuming would change the "
                            "results or the privacy guarantee", key="recipe")
        noise = meta.get("noise") or {}
        if noise.get("mode") != self.rng.noise_mode:
            raise UserError(f"the checkpoint's noise mode {noise.get('mode')!r} is not the recipe's "
                            f"{self.rng.noise_mode!r}; the checkpoint was not written by this run")
        if noise.get("key_fingerprint") != self.rng.noise_fingerprint:
            raise UserError("the run's privacy noise was keyed: set DPREG_NOISE_KEY to the same secret key to "
                            "resume it (a different key would change the noise of the remaining steps)")
        with torch.no_grad():
            for k, v in self.params.items():
                v.copy_(tensors[f"params/{k}"].to(v.device, v.dtype))
        state = ckpt.join_state(meta["state"], tensors)
        for kind, s in self.stages.items():
            s.load_state_dict(state.get(kind, {}))
        self.step = int(meta["step"])
        self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        self._log_window[:] = meta.get("log_window", [])  # the next row averages the same steps
        if meta.get("noise_multiplier") is not None and hasattr(self.privatizer, "set_noise_multiplier"):
            self.privatizer.set_noise_multiplier(meta["noise_multiplier"])
        it = {k[len("iterate/"):]: v for k, v in tensors.items() if k.startswith("iterate/")}
        self._iterate_snapshot = it or None
        self.check_plan()  # the remaining plan must still fit on top of the restored ledger

    # ------------------------------------------------------------------ output folder

    def _append_metrics(self, row: dict[str, Any]) -> None:
        if self.out_dir and self.comm.rank == 0:
            path = self.out_dir / "metrics.jsonl"
            with self._storage(path), open(path, "a") as f:
                f.write(json.dumps(row, default=_json_default) + "\n")

    def truncate_metrics(self) -> None:
        """Drop metric rows logged after the checkpoint a resume starts from, and a row torn by a kill."""
        path = self.out_dir / "metrics.jsonl" if self.out_dir else None
        if path and path.exists() and self.comm.rank == 0:  # rank 0 owns the folder (as for every write)
            keep = [json.dumps(r, default=_json_default) for r in read_rows(path) if r.get("step", 0) <= self.step]
            with self._storage(path):
                _write_text(path, "".join(r + "\n" for r in keep))

    @contextmanager
    def _signals(self):
        """SIGINT/SIGTERM finish the current step, then write a checkpoint and exit cleanly."""
        def handler(signum, frame):
            self.stop_reason = f"stopped by {signal.Signals(signum).name}"
            self.stop_signal = signum

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


_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed (torch's CPU allocator raises a plain RuntimeError)."""
    return isinstance(e, (MemoryError, _OUT_OF_MEMORY)) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "not enough memory" in str(e)))

SECTION_OF = {kind: section for section, kind in SECTIONS.items()} | {"algorithm": "algorithm"}


def _locate(e: UserError, recipe: Recipe, section: str | None) -> UserError:
    """Give a stage's UserError the recipe's file and the line of its key (stages know only keys,
    often relative to their own section: ``model.path`` of the objective)."""
    if e.file is not None:
        return e
    e.file = recipe.source
    parts = tuple(e.key.split(".")) if e.key else ()
    candidates = [parts] if parts else []
    if section and parts and parts[:1] != (section,):
        candidates.insert(0, (section,) + parts)  # `model.path` of the objective: objective.model.path
    for path in candidates:
        if path and path in recipe.locs:
            e.key, (e.file, e.line) = ".".join(path), recipe.locs[path]
            return e
    for path in candidates:  # the nearest enclosing key that the recipe wrote (or --set)
        w = recipe.where(*path)
        if "file" in w:
            e.key, e.file, e.line = ".".join(path), w["file"], w["line"]
            return e
    if not parts and section:
        e.key = section
        w = recipe.where(section)
        e.file, e.line = w.get("file", recipe.source), w.get("line")
    return e


def _first_difference(a: Any, b: Any, path: tuple = ()) -> str | None:
    """The first key path (``privatizer.clip``) at which two resolved recipes differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return ".".join(path + (k,))
            found = _first_difference(a[k], b[k], path + (k,))
            if found:
                return found
        return None
    return None if a == b else ".".join(path) or None


def _key(recipe: Recipe, *path: str) -> dict[str, Any]:
    w = recipe.where(*path)
    return {k: v for k, v in w.items() if k in ("line", "key")}


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return str(o)


def _write_text(path: Path, text: str) -> None:
    """Atomically: a temporary file, fsync, rename (a kill leaves the old file or the new one)."""
    tmp = ckpt.temp_path(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_json(path: Path, obj) -> None:
    _write_text(path, json.dumps(obj, indent=2, default=_json_default))


def _fsync_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line torn by a kill mid-write (always the last) is skipped."""
    rows = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _check_device(device: torch.device, recipe: Recipe) -> None:
    if device.type == "cpu":
        return
    mod = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    available = getattr(mod, "is_available", None)
    if available is None or not available():
        raise UserError(f"device {str(device)!r} is not available on this machine", file=recipe.source,
                        **_key(recipe, "train", "device"))
    count = getattr(mod, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise UserError(f"device {str(device)!r} does not exist ({count} {device.type} device(s) here)",
                        file=recipe.source, **_key(recipe, "train", "device"))


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


def not_a_run_folder(out_dir: Path) -> UserError:
    """The refusal for a folder without recipe.json: a run killed before it wrote one (only a lock
    or temporary files are left) took no step, so the advice is to start it again."""
    try:
        names = [p.name for p in Path(out_dir).iterdir()]
    except OSError:
        names = []
    if names and all(n == ".lock" or ckpt.TEMP.match(n) for n in names):
        return UserError("the run stopped before it started (no recipe.json): nothing was trained or spent; "
                         "start it again with `dpreg run RECIPE --out DIR --overwrite`", file=str(out_dir))
    return UserError("not a dpregistry run folder (no recipe.json)", file=str(out_dir))


def steps_taken(out_dir: Path) -> list[str]:
    """What in a run folder shows that steps were taken (and charged)."""
    found = [name for name in ("summary.json", "model.safetensors") if (out_dir / name).exists()]
    if ckpt.list_checkpoints(out_dir / "checkpoints"):
        found.append("checkpoints/")
    if (out_dir / "metrics.jsonl").exists() and read_rows(out_dir / "metrics.jsonl"):
        found.append("metrics.jsonl")
    if any(r["step"] > 0 for r in LedgerFile(out_dir).lines()):
        found.append("ledger.jsonl")
    return found


def resume_run(out_dir: Path, *, comm=None, console=None, warn=print, max_nonfinite_steps: int | None = None) -> Run:
    """Rebuild the run of ``out_dir`` and restore its newest valid checkpoint, after checking that
    its ledger is all that the folder shows was spent (see :mod:`dpregistry.ledger_file`)."""
    out_dir = Path(out_dir)
    rpath = out_dir / "recipe.json"
    if not rpath.exists():
        raise not_a_run_folder(out_dir)
    try:
        stored = json.loads(rpath.read_text())
    except (OSError, ValueError):
        stored = None
    if not (isinstance(stored, dict) and isinstance(stored.get("recipe"), dict)
            and isinstance(stored.get("recipe_hash"), str)):
        raise UserError("unreadable recipe.json (not the one `dpreg run` wrote)", file=str(rpath))
    if "secure_noise" in (stored["recipe"].get("privacy") or {}):
        raise UserError("this run was started by an earlier dpregistry (privacy.secure_noise, before the noise "
                        "modes); it cannot be resumed by this version, whose noise and ledger checks differ: start "
                        "it again", file=str(rpath))
    if max_nonfinite_steps is not None:
        stored["recipe"].setdefault("train", {})["max_nonfinite_steps"] = max_nonfinite_steps
    recipe = resolve(stored["recipe"], {}, get_registry(), source=str(rpath))
    if recipe.hash != stored["recipe_hash"]:
        raise UserError("the installed stages resolve this recipe differently than when the run started "
                        "(a plugin changed its defaults); resuming would change the results", file=str(rpath))
    run = Run(recipe, out_dir, comm=comm, console=console)
    run.prepare()
    folder = out_dir / "checkpoints"
    if run.comm.rank == 0:
        for d in (out_dir, folder):
            ckpt.remove_stale_temps(d)
    found = ckpt.latest_valid(folder, warn=warn)
    if found is None:
        taken = steps_taken(out_dir)
        if taken:
            # Steps were taken (and charged); starting over would reset the privacy ledger.
            raise UserError(f"no valid checkpoint to resume from, but {', '.join(taken)} show that steps were taken; "
                            f"starting over would forget what they spent", file=str(folder))
        # Killed before the step-0 checkpoint existed: no step ran, nothing was charged or released.
        warn(f"warning: {out_dir} has no checkpoint (the run stopped before its first step); starting at step 0")
        run.truncate_metrics()
        run.save_checkpoint()
        return run
    tensors, meta, path = found
    run.load_state(tensors, meta)
    _check_ledger(run, meta, path)
    if run.nonfinite_steps > recipe.train.max_nonfinite_steps:
        raise UserError(f"the run stopped at its non-finite limit ({run.nonfinite_steps} steps had non-finite losses "
                        f"or gradients; train.max_nonfinite_steps = {recipe.train.max_nonfinite_steps}); fix the "
                        f"cause, then raise the limit: `dpreg resume {out_dir} --max-nonfinite-steps N`",
                        file=str(out_dir))
    if max_nonfinite_steps is not None and run.comm.rank == 0:  # later resumes keep the raised limit
        stored["recipe"] = recipe.data
        _write_json(rpath, stored)
    run.truncate_metrics()
    return run


def _check_ledger(run: Run, meta: dict[str, Any], path: Path) -> None:
    """The checkpoint's ledger must be what the ledger file recorded at its step, cover every step
    before it, and not be less than the ε the metrics logged; a secure run cannot go back."""
    step, entries, out = run.step, run.accountant.ledger.to_json(), run.out_dir
    journal = LedgerFile(out)
    recorded, last = journal.at(step), journal.last

    def refuse(why: str):
        raise UserError(f"{why}; refusing to resume from a ledger that may under-report the spending", file=str(path))

    if json.loads(json.dumps(entries)) != meta.get("ledger"):
        refuse("the accountant's state and the checkpoint's ledger differ")

    if recorded is not None and recorded != entries:
        refuse(f"its ledger differs from the one ledger.jsonl recorded at step {step}")
    if recorded is None:
        if last is None and step > 0:
            refuse(f"ledger.jsonl is missing but the checkpoint is at step {step}")
        if last is not None and not (step > last["step"] and extends(last["entries"], entries)):
            refuse(f"its ledger at step {step} does not continue ledger.jsonl (last recorded at step {last['step']})")
    if any(e["last_step"] >= step for e in entries):
        refuse(f"its ledger charges steps after its own step {step}")
    if last is not None and last["step"] > step and not run.rng.replayable:
        raise UserError(f"ledger.jsonl records steps up to {last['step']}, but the newest valid checkpoint is at step "
                        f"{step}: with secure noise steps {step + 1}-{last['step']} cannot be replayed, and taking them "
                        f"again would release them twice; restore the newer checkpoint or start a new run", file=str(out))
    rows = read_rows(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    logged = [("metrics.jsonl", r) for r in rows]
    try:
        logged.append(("summary.json", json.loads((out / "summary.json").read_text())))
    except (OSError, ValueError):
        pass
    logged = [(name, r["step"], r["epsilon"]) for name, r in logged if isinstance(r, dict)
              and isinstance(r.get("step"), int) and r["step"] <= step and isinstance(r.get("epsilon"), (int, float))]
    if logged:
        name, at, most = max(logged, key=lambda x: x[2])
        eps = run.epsilon()
        if eps is not None and most > eps * (1 + 1e-9) + 1e-12:
            refuse(f"{name} logged ε = {most:.6g} at step {at}, more than its ledger gives ({eps:.6g})")


def start_run(run: Run, out_dir: Path | None) -> Run:
    """Attach a prepared run to its output folder: the resolved recipe and a step-0 checkpoint."""
    run.out_dir = Path(out_dir) if out_dir else None
    if run.out_dir and run.comm.rank == 0:
        with run._storage(run.out_dir / "recipe.json"):
            run.out_dir.mkdir(parents=True, exist_ok=True)
            ckpt.remove_stale_temps(run.out_dir)
            _write_json(run.out_dir / "recipe.json", {"recipe": run.recipe.data, "recipe_hash": run.recipe.hash,
                                                      "source": run.recipe.source})
        # Step 0, before any step: a kill before it leaves no step taken (resume starts over).
        run.save_checkpoint()
    return run
