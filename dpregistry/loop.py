"""The training loop: one step at a time, each a transaction, logged and checkpointed.

A step either completes, charged in full, or leaves no trace: an exception before its charge
undoes a zeroth-order displacement and writes nothing, and nothing is logged or checkpointed
before the step's charge. Rows of metrics average the steps since the last row; held-out metrics
are added every ``train.eval_every`` steps. The run folder (if the run has one) gets the rows,
the checkpoints, the output model and the summary.
"""

from __future__ import annotations

import json
import platform
import signal
import time
from typing import Any, Callable

import torch

from . import __version__, checkpoint as ckpt
from .folder import json_or_none
from .registry import third_party
from .errors import BudgetExhausted
from .run import _OUT_OF_MEMORY, Run
from .signals import Interrupted, graceful_stop


def train(run: Run, progress: Callable | None = None) -> dict[str, Any]:
    """Take the run's remaining steps and finish it; returns the summary.

    ``progress(run, metrics)`` is called after every step. SIGINT/SIGTERM stop after the step in
    progress; a second one interrupts it (see :mod:`dpregistry.signals`)."""
    t0 = time.time()
    tau = _random_iterate_step(run)
    state = {"in_step": False}

    def stop(signum: int) -> None:
        run.stop_reason = f"stopped by {signal.Signals(signum).name}"
        run.stop_signal = signum

    try:
        with graceful_stop(stop):
            _steps(run, progress, tau, t0, state)
    except Interrupted as e:
        run.stop_signal = e.signum
        if state["in_step"]:
            # Half a step: the parameters may be half updated, so nothing of it is written; the newest
            # checkpoint stays the state, and its ledger covers everything released so far.
            run.stop_reason = f"interrupted by {signal.Signals(e.signum).name} during step {run.step + 1}"
            # The caller gets that state back too: the half-updated parameters (a release of this
            # step, perhaps) would be released again, with other noise, by a resume.
            found = run.folder and ckpt.latest_valid(run.folder.checkpoints, warn=lambda m: None)
            if found:
                run.load_state(*found[:2])
            return _summary(run, {}, t0, written=False)
        run.stop_reason = f"interrupted by {signal.Signals(e.signum).name} after step {run.step}"
        return finish(run, t0, evaluate=False)
    return finish(run, t0)


def _steps(run: Run, progress, tau, t0, state) -> None:
    train_cfg = run.recipe.train
    window = run.log_window  # step metrics since the last row (restored by a resume)
    folder = run.folder
    if train_cfg.eval_every and run.step == 0 and not run.history:
        # The baseline every later evaluation is read against (zero-shot, or an untrained model).
        # It reads only held-out data and the initial parameters, so it costs no privacy.
        row = {"step": 0, "epsilon": run.epsilon(), **{f"eval/{k}": v for k, v in run.objective.evaluate().items()}}
        run.history.append(row)
        if folder:
            folder.append_metrics(row)
    while True:
        ctx = run.begin_step()
        if run.algorithm.done(ctx):
            break
        # Ranks vote before every step: one that stopped alone (a signal during a checkpoint
        # write, after the last vote) would leave the others inside a collective.
        stop = run.stop_reason is not None
        if run.comm.world_size > 1:
            stop = run.comm.any_flag(stop)
            if stop and not run.stop_reason:
                run.stop_reason = f"stopped at step {run.step}: another rank was stopped"
        if stop:
            break
        if tau is not None and run.step == tau:
            run.iterate_snapshot = {k: v.detach().clone() for k, v in run.params.items()}
        state["in_step"] = True
        try:
            result = run.algorithm.step(run)
        except BudgetExhausted as e:
            run.stop_reason = f"privacy budget exhausted at step {run.step}: {e}"
            state["in_step"] = False
            if run.accountant.ledger.last_step == run.step:
                # A query was released and charged before the budget ran out (the norm query that
                # decided the stop): the step counts, so the final checkpoint holds its charge.
                run.step += 1
            break
        except _OUT_OF_MEMORY:
            # Nothing of this step reaches the disk; the newest checkpoint stays the state.
            raise run.recipe.error(f"out of memory in step {run.step}; lower train.micro_batch_size (the physical "
                                   f"batch), then `dpreg resume` continues from the last checkpoint",
                                   "train", "micro_batch_size") from None
        finally:
            ctx.undo_displacement()
        run.check_charged(ctx)
        run.check_state()
        run.step += 1
        state["in_step"] = False
        window.append(result.metrics)
        if result.metrics.get("nonfinite", 0):
            run.nonfinite_steps += 1
            # Opt-in only: the count is of the private batch, without noise, so a stop on it tells a data
            # set with a record whose loss is NaN from one without (review 24: 11 steps against 40).
            if run.stopped_at_private_count:
                run.stop_reason = (f"{run.nonfinite_steps} steps had non-finite losses or gradients "
                                   f"(train.max_nonfinite_steps = {train_cfg.max_nonfinite_steps}; a stop on a "
                                   f"count of the private batch, which the guarantee does not cover)")
        # A stop (signal, non-finite limit) logs no extra row: the open window is checkpointed,
        # so a resumed run logs exactly the rows of an uninterrupted one.
        last = run.step >= run.total_steps or result.done
        saved = False
        evaluate = bool(train_cfg.eval_every) and run.step % train_cfg.eval_every == 0
        if run.step % train_cfg.log_every == 0 or last or evaluate:
            row = _log_row(run, window, t0)
            window.clear()
            if evaluate:
                row.update({f"eval/{k}": v for k, v in run.objective.evaluate().items()})
            if (evaluate or run.algorithm.logs_releases) and run.rng.guarantee and folder:
                # Held-out metrics (and some algorithms' step metrics) reveal this step's releases.
                # With secure noise a resume redraws the noise of steps after its checkpoint, so
                # checkpoint (and charge) them before anything that depends on them is written; a
                # keyed replay must reproduce the checkpoint's digest (RunFolder.save_checkpoint).
                folder.save_checkpoint(run)
                saved = True
            if folder:
                folder.append_metrics(row)
        if progress:
            progress(run, result.metrics)
        sc = train_cfg.sync_check_every
        if run.comm.world_size > 1 and sc and (run.step % sc == 0 or last):
            run.comm.check_replicas(run.params, run.step)
        ce = train_cfg.checkpoint_every
        if folder and ce and run.step % ce == 0 and not (last or saved or run.stop_reason):
            folder.save_checkpoint(run)
        if result.done:
            break


def finish(run: Run, t0: float, *, evaluate: bool = True) -> dict[str, Any]:
    """The final checkpoint (the training state: a resume continues from the iterate, not from the
    output, which an update rule may pick as an average or an earlier iterate), the output
    parameters, the held-out metrics and the summary."""
    # A first signal while the final files are written lets them be finished (a second interrupts).
    with graceful_stop(lambda signum: None, then="writing the run's final checkpoint and model first"):
        # Written unless the loop just wrote this step with this ledger (were a charge made since,
        # the ledger file would refuse the checkpoint loudly rather than lose it).
        if run.folder and run.folder.saved != (run.step, json.loads(json.dumps(run.accountant.ledger.to_json()))):
            run.folder.save_checkpoint(run)
        run.check_state(values=True)
        final = run.output_params()
        if final is not run.params:
            with torch.no_grad():
                for k, v in final.items():
                    run.params[k].copy_(v)
        if run.folder:
            run.folder.write_model(run)
    metrics = {}
    if evaluate:
        try:
            with graceful_stop(lambda signum: None):
                metrics = run.objective.evaluate()
        except Interrupted as e:
            run.stop_signal = e.signum
            run.stop_reason = f"interrupted by {signal.Signals(e.signum).name} during the final evaluation"
    return _summary(run, metrics, t0)


def _summary(run: Run, metrics: dict[str, float], t0: float, *, written: bool = True) -> dict[str, Any]:
    spent = run.spent()
    summary = {
        "step": run.step,
        "epsilon": spent.get("epsilon"),
        "delta": spent.get("delta"),
        "target_epsilon": run.target.epsilon,
        "rho": spent.get("rho"),
        "target_rho": spent.get("target_rho"),
        "accountant": run.accountant.name,
        "relation": run.relation,
        "noise_multiplier": run.privatizer.noise_multiplier,
        **{k: spent[k] for k in ("delta_fail", "unit", "users", "max_examples_per_user", "user_mechanism",
                                 "user_selection", "example_level") if k in spent},
        "noise": run.rng.noise_mode,
        "guarantee": run.guarantee,
        **({"private_stop": True} if run.stopped_at_private_count else {}),  # (the opt-in non-finite limit)
        "third_party_stages": third_party(entry for entry, _ in run.recipe.stages.values()),
        "metrics": metrics,
        "wall_seconds": time.time() - t0,
        "stopped": run.stop_reason,
        "recipe_hash": run.recipe.hash,
        "versions": versions(),
    }
    if run.folder and written:
        summary["wall_seconds"] += _earlier_wall_seconds(run)
        run.folder.write_json("summary.json", summary)
    return summary


def _earlier_wall_seconds(run: Run) -> float:
    """The time of the run's earlier segments, as the summary of the last one said (a resumed run
    reports its whole time, and resuming a finished run does not reset it to the last call's)."""
    earlier = json_or_none(run.folder.path / "summary.json")
    if not isinstance(earlier, dict):
        return 0.0
    same = earlier.get("recipe_hash") == run.recipe.hash and earlier.get("step", run.step + 1) <= run.step
    return float(earlier.get("wall_seconds") or 0.0) if same else 0.0


def _random_iterate_step(run: Run) -> int | None:
    if run.recipe.output != "random_iterate":
        return None
    g = run.rng.generator("output_iterate", 0)
    return int(torch.randint(0, run.total_steps, (1,), generator=g))


def _log_row(run: Run, window: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    row: dict[str, Any] = {"step": run.step}
    keys = {k for m in window for k in m}
    for k in sorted(keys):
        vals = [m[k] for m in window if k in m and isinstance(m[k], (int, float))]
        if vals:
            row[k] = sum(vals) if k == "nonfinite" else sum(vals) / len(vals)
    row["epsilon"] = run.epsilon()
    row["wall_seconds"] = time.time() - t0
    if run.comm.world_size > 1:  # payload bytes this rank sent, per step since the last row
        row["comm_bytes_per_step"] = (run.comm.bytes_sent - run.bytes_logged) / max(len(window), 1)
        run.bytes_logged = run.comm.bytes_sent
    run.history.append(row)
    return row


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from .registry import get_registry

    out = {"dpregistry": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("dp-accounting", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    out["plugins"] = sorted({e.origin for e in get_registry().all()})
    return out

