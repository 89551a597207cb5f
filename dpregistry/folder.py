"""The run folder: its lock, and everything a run writes down and reads back.

    DIR/.lock               an flock naming the process that holds the folder
    DIR/recipe.json         the resolved recipe (written before step 0)
    DIR/checkpoints/        step-N.safetensors: parameters, stage states, ledger (dpregistry.checkpoint)
    DIR/ledger.jsonl        every checkpoint's ledger, chained (dpregistry.ledger_file)
    DIR/metrics.jsonl       one row per logged step
    DIR/model.safetensors   the output parameters
    DIR/summary.json        ε, δ, the noise mode, held-out metrics, versions

Only rank 0 writes; every file is written atomically (dpregistry.files.write_atomic). Starting a
run claims the folder under its lock; resuming one checks that the newest valid checkpoint's ledger
is all that the folder shows was spent, before any step.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from safetensors import safe_open

from . import checkpoint as ckpt
from . import files
from .errors import UserError
from .ledger_file import NAME as LEDGER_NAME, LedgerFile
from .recipe import resolve
from .registry import get_registry

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the lock record names the owner, nothing enforces it
    fcntl = None

LOCK = ".lock"


class RunFolder:
    """Where a run writes (rank 0; other ranks hold a folder that writes nothing)."""

    def __init__(self, path: Path, *, writer: bool = True):
        self.path = Path(path)
        self.writer = writer
        self.checkpoints = self.path / "checkpoints"
        self.metrics = self.path / "metrics.jsonl"
        self.saved: tuple[int, list] | None = None  # (step, ledger) of the newest checkpoint this process holds

    # -- writing ------------------------------------------------------------------------------

    @contextmanager
    def storage(self, path: Path):
        """A failed write (full disk, read-only or vanished folder) is one clear line, not a traceback."""
        try:
            yield
        except OSError as e:
            try:
                newest = ckpt.list_checkpoints(self.checkpoints)
            except OSError:
                newest = []
            fix = ("remove the symbolic link (a run writes no file through one)" if e.errno == errno.ELOOP
                   else "free space or fix the folder")
            kept = (f"the last good checkpoint (step {newest[-1][0]}) is kept; {fix}, "
                    f"then `dpreg resume {self.path}`") if newest else "no checkpoint was written"
            raise UserError(f"cannot write {getattr(e, 'filename', None) or path} ({e.strerror or e}); {kept}",
                            file=str(self.path)) from None

    def write_json(self, name: str, obj: Any) -> None:
        if self.writer:
            with self.storage(self.path / name):
                files.write_text_atomic(self.path / name, json.dumps(obj, indent=2, default=json_default))

    def start(self, run) -> None:
        """The resolved recipe and the step-0 checkpoint: a kill before the checkpoint leaves no
        step taken, and `dpreg resume` starts at step 0."""
        if not self.writer:
            return
        with self.storage(self.path / "recipe.json"):
            self.path.mkdir(parents=True, exist_ok=True)
            files.remove_stale_temps(self.path)
        self.write_json("recipe.json", {"recipe": run.recipe.data, "recipe_hash": run.recipe.hash,
                                        "source": run.recipe.source})
        self.save_checkpoint(run)

    def save_checkpoint(self, run) -> Path | None:
        if not self.writer:
            return None
        tensors, meta = run.state()
        path = ckpt.checkpoint_path(self.checkpoints, run.step)
        journal = LedgerFile(self.path)
        # A keyed run may replay steps after its checkpoint with the same noise: each checkpoint's
        # digest is recorded, and a replay that does not reproduce it stops before writing.
        state = ckpt.state_digest(tensors, meta) if run.rng.noise_mode == "keyed" else None
        if state is not None and not (self.saved and self.saved[0] == run.step):  # not this process's own step again
            journal.check_replay(run.step, state)
        with self.storage(path):
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            files.fsync_path(self.metrics)  # rows up to this step survive a power loss too
            ckpt.write_atomic(path, tensors, meta)
            # After the rename: a kill in between leaves the checkpoint one line ahead of the ledger
            # file, which a resume accepts (the checkpoint's ledger extends the last line).
            journal.record(run.step, meta["ledger"], state)
            ckpt.prune(self.checkpoints, run.recipe.train.keep_checkpoints)
        self.saved = (run.step, json.loads(json.dumps(meta["ledger"])))
        return path

    def append_metrics(self, row: dict[str, Any]) -> None:
        if self.writer:
            with self.storage(self.metrics), open(self.metrics, "a", opener=files.no_follow) as f:
                f.write(json.dumps(row, default=json_default) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """Drop metric rows logged after the checkpoint a resume starts from, and a row torn by a kill."""
        if self.writer and self.metrics.exists():
            keep = [json.dumps(r, default=json_default) for r in read_rows(self.metrics) if r.get("step", 0) <= step]
            with self.storage(self.metrics):
                files.write_text_atomic(self.metrics, "".join(r + "\n" for r in keep))

    def write_model(self, run) -> None:
        if self.writer:
            path = self.path / "model.safetensors"
            with self.storage(path):
                ckpt.write_atomic(path, {k: v.detach().cpu() for k, v in run.params.items()},
                                  {"step": run.step, "recipe_hash": run.recipe.hash})


def json_default(o):
    """Non-finite floats and tensors in metric rows and summaries, as text and lists."""
    import math

    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line torn by a kill mid-write (always the last), and a row
    whose step is not a whole number, are skipped."""
    rows = []
    for line in files.read_regular(path, "metrics file", limit=files.RUN_LOG_LIMIT).decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict) and type(row.get("step")) is int:  # a row without its step is damaged
            rows.append(row)
    return rows


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir``'s metrics.jsonl (:func:`read_rows`), none if it has none."""
    path = Path(run_dir) / "metrics.jsonl"
    return read_rows(path) if path.exists() else []


# ---------------------------------------------------------------------------------------------
# claiming a folder for a new run
# ---------------------------------------------------------------------------------------------


def _lock_info(path: Path) -> dict:
    try:
        info = json.loads(files.read_regular(path, "lock file", limit=1 << 16))
    except (OSError, ValueError, RecursionError, UserError):
        return {}
    return info if isinstance(info, dict) else {}


def _busy(out: Path, info: dict) -> UserError:
    host = info.get("host")
    on = f" on {host}" if host and host != socket.gethostname() else ""
    return UserError(f"another run (pid {info.get('pid', '?')}{on}, started {info.get('started', '?')}) is using "
                     f"this folder; wait for it to finish or stop it first", file=str(out))


def _open_lock(path: Path, flags: int) -> int:
    """A descriptor of the lock file, refused unless it is a regular file of its own (a FIFO would
    block the open; a symbolic link would have the lock record written over the file it names)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise UserError("a symbolic link, not a regular file (the run folder's lock); remove it", file=str(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise UserError("not a regular file of its own (the run folder's lock); remove it", file=str(path))
    return fd


def lock_holder(out: Path) -> dict | None:
    """The lock record of the live process that holds ``out``, or None.

    The lock is an flock on ``out/.lock``: the kernel releases it when its process dies, even by
    SIGKILL, so a lock file left behind by a killed run never blocks the folder."""
    path = Path(out) / LOCK
    if fcntl is None:  # pragma: no cover
        return None
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except OSError:
        return None  # no lock file (run_lock refuses one it cannot use)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return _lock_info(path) or {}
    except OSError:  # a file system without locks
        os.close(fd)
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


@contextmanager
def run_lock(out: Path):
    """Hold ``out/.lock`` (an flock naming this process) while a run writes the folder."""
    path = Path(out) / LOCK
    try:
        while True:
            fd = _open_lock(path, os.O_RDWR | os.O_CREAT)
            if fcntl is None:  # pragma: no cover
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _busy(out, _lock_info(path)) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                break  # a file system without locks: the record still names the owner
            try:  # the previous holder may have unlinked the file between our open and flock
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": datetime.now().isoformat(timespec="seconds")})
        os.ftruncate(fd, 0)
        os.write(fd, record.encode())
    except OSError as e:
        raise UserError(f"cannot write to the output folder ({e.strerror or e})", file=str(out)) from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before unlocking: a waiter that opened it sees a stale inode
        os.close(fd)


def _leftover(p: Path) -> bool:
    """Files a run that was killed before it started may leave: a free lock, temporary files."""
    return p.is_file() and not p.is_symlink() and (p.name == LOCK or bool(files.TEMP.match(p.name)))


#: what a run folder holds (the run's files, its report and plot): all that --overwrite removes
RUN_FILES = frozenset({"recipe.json", "checkpoints", LEDGER_NAME, "metrics.jsonl", "summary.json", "model.safetensors",
                       "report", "privacy_epsilon.png", LOCK})


def default_out(recipe_path: str) -> Path:
    return Path("runs") / f"{Path(recipe_path).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def check_out(out: Path, overwrite: bool) -> Path:
    """Refuse an output folder that is busy, not a folder, or holds something (unless ``overwrite``),
    before any work; nothing is written."""
    try:
        os.lstat(out)
    except FileNotFoundError:
        pass
    except OSError as e:  # a name too long, a parent that is a file, ...
        raise UserError(f"cannot use the output folder ({e.strerror or e})", file=str(out)) from None
    if out.exists() and not out.is_dir():
        raise UserError("--out exists and is not a folder", file=str(out))
    if out.is_dir():
        holder = lock_holder(out)
        if holder is not None:
            raise _busy(out, holder)
        try:
            entries = list(out.iterdir())
        except OSError as e:
            raise UserError(f"cannot read the output folder ({e.strerror or e})", file=str(out)) from None
        _refuse_nonempty(out, entries, overwrite)
    return out


#: what a run folder's own folders hold (--overwrite removes them only then)
RUN_SUBFOLDERS = {"checkpoints": lambda name: bool(ckpt.NAME.match(name)),
                  "report": lambda name: name in {"report.md", "overview.png", "loss.png", "eval.png", "epsilon.png"}}


def _run_made(p: Path) -> bool:
    """Whether ``p`` is something a run writes in its folder: a run file, or one of its folders
    holding only what runs write there (a `report/` holding a thesis is not)."""
    if p.name not in RUN_FILES and not _leftover(p):
        return False
    if p.name in RUN_SUBFOLDERS and p.is_dir() and not p.is_symlink():
        return all(RUN_SUBFOLDERS[p.name](q.name) or _leftover(q) for q in p.iterdir())
    return True


def no_linked_folders(out: Path) -> None:
    """Refuse a run folder whose own folders are symbolic links: the run would write and delete
    in the folder they name."""
    for name in RUN_SUBFOLDERS:
        if (out / name).is_symlink():
            raise UserError(f"{name}/ is a symbolic link; a run writes only in its own folders", file=str(out / name))


def _refuse_nonempty(out: Path, entries: list[Path], overwrite: bool) -> None:
    if overwrite and (others := sorted(p.name for p in entries if not _run_made(p))):
        shown = ", ".join(others[:3]) + (", …" if len(others) > 3 else "")
        raise UserError(f"--overwrite replaces a run folder, and this folder holds other files too ({shown}); "
                        f"choose another folder", file=str(out))
    if not all(_leftover(p) for p in entries) and not overwrite:
        summary = json_or_none(out / "summary.json")
        finished = isinstance(summary, dict) and not summary.get("stopped") and (out / "model.safetensors").exists()
        hint = ("choose another folder (the run there has finished)" if finished else
                "`dpreg resume` it" if (out / "recipe.json").exists() else "choose another folder")
        raise UserError(f"the output folder is not empty; pass --overwrite to replace what it holds, or {hint}",
                        file=str(out))


def claim(out: Path, overwrite: bool, held) -> None:
    """Make ``out`` writable, take its lock (kept until ``held``, an ExitStack, closes), check it
    again under the lock (another run may have taken it while this one prepared) and only then clear
    it for ``overwrite``, keeping the lock file."""
    made = [p for p in (out, *out.parents) if not os.path.lexists(p)]  # what mkdir will create
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = files.temp_path(out / "probe")
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        for p in made:  # a refused folder leaves nothing behind (`runs/` of a name too long)
            try:
                p.rmdir()
            except OSError:
                pass
        raise UserError(f"cannot write to the output folder ({e.strerror or e})", file=str(out)) from None
    held.enter_context(run_lock(out))
    entries = [p for p in out.iterdir() if p.name != LOCK]
    _refuse_nonempty(out, entries, overwrite)
    try:
        last = LedgerFile(out).last
    except UserError:  # an unreadable ledger: it is replaced all the same
        last = None
    if last is not None and last["step"] > 0:
        from .progress import say

        say(f"replacing a run that took {last['step']} steps: its ledger goes with it, and privacy spent on the "
            f"same data adds up across runs")
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


# ---------------------------------------------------------------------------------------------
# starting and resuming
# ---------------------------------------------------------------------------------------------


def start_run(run, out_dir: Path | None):
    """Attach a prepared run to its output folder: the resolved recipe and a step-0 checkpoint."""
    if out_dir is not None:
        run.folder = RunFolder(out_dir, writer=run.comm.rank == 0)
        run.folder.start(run)
    return run


def not_a_run_folder(out_dir: Path) -> UserError:
    """The refusal for a folder without recipe.json: a run killed before it wrote one (only a lock
    or temporary files are left) took no step, so the advice is to start it again."""
    try:
        names = [p.name for p in Path(out_dir).iterdir()]
    except OSError:
        names = []
    if names and all(n == LOCK or files.TEMP.match(n) for n in names):
        return UserError("the run stopped before it started (no recipe.json): nothing was trained or spent; "
                         "start it again with `dpreg run RECIPE --out DIR --overwrite`", file=str(out_dir))
    return UserError("not a dpregistry run folder (no recipe.json)", file=str(out_dir))


def steps_taken(out_dir: Path) -> list[str]:
    """What in a run folder shows that steps were taken (and charged)."""
    found = [name for name in ("summary.json", "model.safetensors") if (out_dir / name).exists()]
    if ckpt.list_checkpoints(out_dir / "checkpoints"):
        found.append("checkpoints/")
    if read_metrics(out_dir):
        found.append("metrics.jsonl")
    if any(r["step"] > 0 for r in LedgerFile(out_dir).lines()):
        found.append("ledger.jsonl")
    return found


def resume_run(out_dir: Path, *, comm=None, warn=print, max_nonfinite_steps: int | None = None,
               provides: dict | None = None):
    """Rebuild the run of ``out_dir`` and restore its newest valid checkpoint, after checking that
    its ledger is all that the folder shows was spent (see :mod:`dpregistry.ledger_file`)."""
    from .run import Run

    out_dir = Path(out_dir)
    rpath = out_dir / "recipe.json"
    if not rpath.exists():
        raise not_a_run_folder(out_dir)
    no_linked_folders(out_dir)
    try:
        stored = json.loads(files.read_regular(rpath, "recipe.json", limit=files.RUN_JSON_LIMIT))
    except (OSError, ValueError, RecursionError):
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
    run = Run(recipe, comm=comm, provides=provides).prepare()
    run.folder = folder = RunFolder(out_dir, writer=run.comm.rank == 0)
    if folder.writer:
        for d in (out_dir, folder.checkpoints):
            files.remove_stale_temps(d)
    found = ckpt.latest_valid(folder.checkpoints, warn=warn)
    if found is None:
        taken = steps_taken(out_dir)
        if taken:
            # Steps were taken (and charged); starting over would reset the privacy ledger.
            raise UserError(f"no valid checkpoint to resume from, but {', '.join(taken)} show that steps were taken; "
                            f"starting over would forget what they spent", file=str(folder.checkpoints))
        # Killed before the step-0 checkpoint existed: no step ran, nothing was charged or released.
        warn(f"warning: {out_dir} has no checkpoint (the run stopped before its first step); starting at step 0")
        folder.truncate_metrics(0)
        folder.save_checkpoint(run)
        return run
    tensors, meta, path = found
    try:
        run.load_state(tensors, meta)
    except UserError as e:  # name the checkpoint refused (another run's, copied in, says which file)
        if e.file is None:
            e.file = str(path)
        raise
    if _check_ledger(run, tensors, meta, path):  # (a line torn by a kill is written again by finish)
        folder.saved = (run.step, meta["ledger"])  # so a finished run's finish() need not write it again
    if run.stopped_at_private_count:
        raise UserError(f"the run stopped at its non-finite limit ({run.nonfinite_steps} steps had non-finite losses "
                        f"or gradients; train.max_nonfinite_steps = {recipe.train.max_nonfinite_steps}); fix the "
                        f"cause, then raise the limit: `dpreg resume {out_dir} --max-nonfinite-steps N`",
                        file=str(out_dir))
    if max_nonfinite_steps is not None:  # later resumes keep the raised limit
        stored["recipe"] = recipe.data
        folder.write_json("recipe.json", stored)
    folder.truncate_metrics(run.step)
    if folder.metrics.exists():
        run.history[:] = read_rows(folder.metrics)  # the rows logged up to the checkpoint
    return run


def json_or_none(path: Path) -> Any:
    """A JSON file's value; None when it is missing or does not parse (a non-regular file is refused)."""
    if not path.exists():
        return None
    try:
        return json.loads(files.read_regular(path, f"run file {path.name}", limit=files.RUN_JSON_LIMIT))
    except (ValueError, RecursionError):
        return None


def released_after(out: Path, step: int, rows: list[dict[str, Any]], summary: Any,
                   secret_noise: bool = True, rows_release: bool = False) -> str | None:
    """What in the folder shows a release after ``step``, or None: the model written at the end,
    the summary, a held-out evaluation, or any row of an algorithm whose step metrics are
    functions of its releases (``rows_release``: ``Algorithm.logs_releases``). Each follows the
    checkpoint of its step, which ledger.jsonl records, so with a valid ledger none is later than
    its newest line. Metric rows count only with ``secret_noise`` (a run whose ε is a guarantee):
    a reproducible run logs them between checkpoints."""
    if isinstance(summary, dict) and isinstance(summary.get("step"), int) and summary["step"] > step:
        return f"summary.json records step {summary['step']}"
    model = out / "model.safetensors"
    if model.exists():
        files.require_regular(model, "model file")  # a FIFO would block the open
        try:
            with safe_open(str(model), framework="pt") as f:  # the metadata only
                at = json.loads((f.metadata() or {}).get(ckpt.META_KEY, "{}")).get("step")
        except Exception:  # unreadable: it shows nothing
            at = None
        if isinstance(at, int) and at > step:
            return f"model.safetensors was written at step {at}"
    later = [r for r in rows if secret_noise and r["step"] > step]  # (read_rows: every row has an int step)
    if rows_release and later:
        return f"metrics.jsonl holds a row of step {max(r['step'] for r in later)}, whose metrics are functions of its releases"
    evals = [r["step"] for r in later if any(str(k).startswith("eval/") for k in r)]
    return f"metrics.jsonl holds a held-out evaluation at step {max(evals)}" if evals else None


def _check_ledger(run, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> bool:
    """The checkpoint's ledger must be what the ledger file recorded at its step, cover every step
    before it, and not be less than the ε the metrics logged; a secure run cannot go back; a keyed
    run's checkpoint must be the one recorded. Whether the file records this step."""
    step, entries, out = run.step, run.accountant.ledger.to_json(), run.folder.path
    journal = LedgerFile(out)
    line, last = journal.line(step), journal.last
    recorded = line["entries"] if line else None

    def refuse(why: str):
        raise UserError(f"{why}; refusing to resume from a ledger that may under-report the spending", file=str(path))

    if json.loads(json.dumps(entries)) != meta.get("ledger"):
        refuse("the accountant's state and the checkpoint's ledger differ")
    if recorded is not None and recorded != entries:
        refuse(f"its ledger differs from the one ledger.jsonl recorded at step {step}")
    if recorded is None:
        if last is None and step > 0:
            refuse(f"ledger.jsonl is missing but the checkpoint is at step {step}")
        if last is not None and not journal.fits(step, entries):
            refuse(f"its ledger at step {step} does not fit ledger.jsonl (last recorded at step {last['step']})")
    if any(e["last_step"] >= step for e in entries):
        refuse(f"its ledger charges steps after its own step {step}")
    if line and line.get("state") not in (None, ckpt.state_digest(tensors, meta)):
        raise UserError(f"this checkpoint is not the one ledger.jsonl recorded at step {step} (its parameters or "
                        f"state differ): a keyed run continued from it would replay the noise of other releases",
                        file=str(path))
    if last is not None and last["step"] > step and not run.rng.replayable:
        raise UserError(f"ledger.jsonl records steps up to {last['step']}, but the newest valid checkpoint is at step "
                        f"{step}: with secure noise steps {step + 1}-{last['step']} cannot be replayed, and taking them "
                        f"again would release them twice; restore the newer checkpoint or start a new run", file=str(out))
    rows = read_metrics(out)
    summary = json_or_none(out / "summary.json")
    newest = step if last is None else max(step, last["step"])
    if run.rng.guarantee and (later := released_after(out, newest, rows, summary,
                                                       rows_release=run.algorithm.logs_releases)):
        # secret noise: secure noise cannot replay those steps; keyed noise could, but no recorded
        # digest is left to show that a replay recomputes each release bit for bit
        raise UserError(f"{later}, after the newest charge that ledger.jsonl and the checkpoints record (step "
                        f"{newest}): their last lines or checkpoints were removed, and taking those steps again would "
                        f"release them twice", file=str(out))
    logged = [("metrics.jsonl", r) for r in rows] + ([("summary.json", summary)] if summary is not None else [])
    logged = [(name, r["step"], r["epsilon"]) for name, r in logged if isinstance(r, dict)
              and isinstance(r.get("step"), int) and r["step"] <= step and isinstance(r.get("epsilon"), (int, float))]
    if logged:
        name, at, most = max(logged, key=lambda x: x[2])
        eps = run.epsilon()
        if eps is not None and most > eps * (1 + 1e-9) + 1e-12:
            refuse(f"{name} logged ε = {most:.6g} at step {at}, more than its ledger gives ({eps:.6g})")
    return recorded is not None
