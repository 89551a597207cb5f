"""The run folder's append-only ledger: ``ledger.jsonl``, the spending that a resume must continue.

A checkpoint carries the ledger of its step, but a checkpoint can be lost, deleted or replaced
by an older or an edited one; resuming from it would forget spending. So every checkpoint write
also appends the ledger of its step to ``ledger.jsonl``, one line per checkpoint, each line
chained to the one before by SHA-256. A resume refuses a checkpoint whose ledger is not the line
of its step (or, for the newest checkpoint written just before a kill, an extension of the last
line), and a folder with traces of steps taken but no checkpoint.

A line holds what changed since the line before: ``keep``, how many of that line's entries it
keeps, and ``tail``, the entries after them (the last entry may have grown since, and is then in
the tail), so the file grows with the ledger, not with its square (an adaptive run charges a new
event at every step). Lines of earlier versions hold the whole ledger (``entries``); they are read
too.

The chain detects edits of earlier lines and truncation in the middle; anyone who can write the
folder can still rewrite the whole file, which is why a resume also checks the ledger against
the metrics rows (the ε they logged) and the step counter.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import UserError
from .files import RUN_LOG_LIMIT, no_follow, read_regular
from .privacy.events import PrivacyEvent

NAME = "ledger.jsonl"
GENESIS = "0" * 64


FULL = {"step", "entries", "prev", "hash"}     # a line of an earlier version: the whole ledger
CHANGED = {"step", "keep", "tail", "prev", "hash"}  # what changed since the line before


def _line_hash(rec: dict[str, Any]) -> str:
    """SHA-256 of a line's fields but its hash (its ``prev`` chains it to the line before)."""
    body = json.dumps({k: v for k, v in rec.items() if k != "hash"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _digest(prev: str, step: int, entries: list[dict[str, Any]], state: str | None = None) -> str:
    """The hash of a line that holds the whole ledger (as earlier versions wrote them)."""
    return _line_hash({"prev": prev, "step": step, "entries": entries} | ({} if state is None else {"state": state}))


ENTRY = {"event", "count", "partition", "first_step", "last_step"}
LARGEST = 2 ** 53  # no run takes more steps or charges; beyond, an accountant's floats would overflow
DEEPEST = 32       # no event nests deeper (a wrapper around a composition around a mechanism)


def _plain(x: Any, depth: int = 0) -> bool:
    """JSON nested at most DEEPEST deep, its floats finite and its integers at most LARGEST."""
    if isinstance(x, dict):
        return depth < DEEPEST and all(_plain(v, depth + 1) for v in x.values())
    if isinstance(x, list):
        return depth < DEEPEST and all(_plain(v, depth + 1) for v in x)
    if isinstance(x, float):
        return math.isfinite(x)
    return not isinstance(x, int) or isinstance(x, bool) or abs(x) <= LARGEST


def _well_formed(e: Any) -> bool:
    """Whether ``e`` is a ledger entry: at least one charge of an event this dpregistry reads."""
    if not (isinstance(e, dict) and set(e) == ENTRY and _plain(e) and type(e["count"]) is int and e["count"] >= 1
            and (e["partition"] is None or isinstance(e["partition"], str)) and type(e["first_step"]) is int
            and type(e["last_step"]) is int and 0 <= e["first_step"] <= e["last_step"]):
        return False
    try:
        PrivacyEvent.from_dict(e["event"])
    except KeyError:  # perhaps a plugin's event type (a tree's concentration failure): load the plugins
        from .registry import get_registry

        get_registry()
        try:
            PrivacyEvent.from_dict(e["event"])
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return False
    except (ValueError, TypeError, AttributeError, RecursionError):
        return False
    return True


class _Line(dict):
    """A verified line. Its whole ledger, ``entries``, is made when it is read: each line keeps
    every entry of the line before but perhaps the last (which may have grown), so the lines share
    one list, and a file's lines hold memory in proportion to the file, not to lines × entries."""

    def __init__(self, fields: dict[str, Any], shared: list[dict[str, Any]]):
        super().__init__(fields)
        self._shared, self._n = shared, len(shared)
        self._last = shared[-1] if shared else None

    def __missing__(self, key: str) -> list[dict[str, Any]]:
        if key != "entries":
            raise KeyError(key)
        return self._shared[:self._n - 1] + [self._last] if self._n else []


def extends(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> bool:
    """Whether ledger ``new`` is ``old`` plus later charges (entries merge consecutive steps, so the
    last entry of ``old`` may have grown in ``new``)."""
    if len(new) < len(old):
        return False
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if i != len(old) - 1:
            return False
        same = all(a[k] == b[k] for k in ("event", "partition", "first_step"))
        if not (same and b["count"] >= a["count"] and b["last_step"] >= a["last_step"]):
            return False
    return True


class LedgerFile:
    """``DIR/ledger.jsonl``: {step, keep, tail, prev, hash} per line (and ``state`` in keyed runs);
    :meth:`lines` gives each with its whole ledger as ``entries``."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / NAME
        self._lines: list[_Line] | None = None
        self._shared: list[dict[str, Any]] = []  # entry i as the newest line has it (see _Line)

    def lines(self) -> list[dict[str, Any]]:
        """The verified lines; a broken chain or a malformed line is refused in one line. A last
        line torn by a kill mid-append (no newline) is ignored: its checkpoint was written first."""
        if self._lines is not None:
            return self._lines
        out: list[_Line] = []
        self._shared = []
        if self.path.exists():
            raw = read_regular(self.path, "ledger file", limit=RUN_LOG_LIMIT)
            complete = raw.split(b"\n")[:-1]  # text after the last newline is a torn append
            prev = GENESIS
            for i, line in enumerate(complete, 1):
                try:
                    rec = json.loads(line)
                    ok = (isinstance(rec, dict) and set(rec) - {"state"} in (FULL, CHANGED)
                          and type(rec["step"]) is int and rec["prev"] == prev and rec["hash"] == _line_hash(rec))
                except (ValueError, RecursionError):  # (RecursionError: JSON nested too deep)
                    ok = False
                if not ok:
                    raise UserError(f"line {i} does not chain to the line before it (the ledger was edited or "
                                    f"damaged); refusing to resume from a ledger that may under-report", file=str(self.path))
                if out and rec["step"] <= out[-1]["step"]:
                    raise UserError(f"line {i} goes back to step {rec['step']}", file=str(self.path))
                if not self._accept(rec, out):
                    raise UserError(f"line {i} does not continue the ledger of the line before it (an entry lowered, "
                                    f"dropped or malformed); refusing a ledger that may under-report", file=str(self.path))
                prev = rec["hash"]
        self._lines = out
        return out

    def _accept(self, rec: dict[str, Any], lines: list[_Line]) -> bool:
        """Append ``rec`` (a chained line) to ``lines`` if its ledger extends the line before's:
        the entries it keeps are all of that line's, or all but a last one it grows, and the ones
        it adds are well-formed. Whole-ledger lines of earlier versions are checked the same way."""
        n, last = (lines[-1]._n, [lines[-1]._last]) if lines else (0, [])
        full = "entries" in rec
        keep, added = (max(n - 1, 0), rec["entries"]) if full else (rec["keep"], rec["tail"])
        if not (isinstance(added, list) and type(keep) is int and keep in (n, n - 1) and keep >= 0):
            return False
        if full:
            added = added[keep:]
        if not all(_well_formed(e) for e in added):
            return False
        if full and not extends(lines[-1]["entries"] if lines else [], rec["entries"]):
            return False
        if not full and keep < n and not (added and extends(last, added[:1])):
            return False
        del self._shared[keep:]
        self._shared.extend(added)
        lines.append(_Line({k: v for k, v in rec.items() if k not in ("entries", "tail")}, self._shared))
        return True

    def line(self, step: int) -> dict[str, Any] | None:
        """The line recorded at ``step`` (steps only increase, so there is at most one), or None."""
        return next((r for r in self.lines() if r["step"] == step), None)

    def at(self, step: int) -> list[dict[str, Any]] | None:
        """The ledger recorded at ``step``, or None."""
        line = self.line(step)
        return line["entries"] if line else None

    @property
    def last(self) -> dict[str, Any] | None:
        lines = self.lines()
        return lines[-1] if lines else None

    def check_replay(self, step: int, state: str) -> None:
        """Refuse, before anything of it is written, a keyed run's checkpoint at a step it released
        before unless ``state`` (the checkpoint's digest) is the one recorded at that step. A keyed run
        replays a step with the noise it drew before, so a recomputation that differs in the last bit
        (other GPU kernels, thread counts or library versions) would release two sums under one noise
        draw, whose difference is free of noise. A step below the newest recorded one that was never
        checkpointed cannot be checked: a replay writes nothing there (a stop inside a replay)."""
        lines, known = self.lines(), self.line(step)
        if known and known.get("state") == state:
            return
        why = None
        if known and "state" not in known:
            why = (f"step {step} was recorded by an earlier dpregistry without the digest that would show whether this "
                   f"replay of it is the same release; resume with the version that wrote it, or restore the newer "
                   f"checkpoint")
        elif known:
            why = (f"step {step} was checkpointed before with other parameters or state: this machine does not recompute "
                   f"the run bit for bit (GPU kernels, thread counts or library versions differ), and releasing step "
                   f"{step} again under the same keyed noise would reveal the difference of two noise-free sums; resume "
                   f"where the run was taken, with the same versions, or restore the newer checkpoint")
        elif lines and lines[-1]["step"] > step:
            why = (f"step {step} lies inside a replay of steps released before (up to step {lines[-1]['step']}) but was "
                   f"never checkpointed, so nothing written at it could be checked against them; `dpreg resume` again "
                   f"and let the replay reach step {lines[-1]['step']}")
        if why:
            raise UserError(f"{why} (nothing was written)", file=str(self.path))

    def fits(self, step: int, entries: list[dict[str, Any]]) -> bool:
        """Whether the ledger ``entries`` of a checkpoint at ``step`` that no line records fits the
        file: it extends the line before its step and the line after it extends it (a checkpoint
        written by a replay between two recorded steps, or one a kill left ahead of the last line)."""
        lines = self.lines()
        before = [r for r in lines if r["step"] < step]
        after = [r for r in lines if r["step"] > step]
        return (not before or extends(before[-1]["entries"], entries)) and (
            not after or extends(entries, after[0]["entries"]))

    def record(self, step: int, entries: list[dict[str, Any]], state: str | None = None) -> None:
        """Append the ledger of the checkpoint just written at ``step`` (with ``state``, the
        checkpoint's digest, in keyed runs: see :meth:`check_replay`). A step already recorded (a
        replayed step of a reproducible or keyed run, or the final checkpoint at a logged step) must
        agree; a ledger that does not extend the newest line is a bug that would lose spending."""
        entries = json.loads(json.dumps(entries))
        known = self.at(step)
        if known is not None:
            if known != entries:
                raise RuntimeError(f"step {step}: the ledger differs from the one {self.path} recorded at that step")
            return
        lines = self.lines()
        if not self.fits(step, entries):
            raise RuntimeError(f"step {step}: the ledger does not fit between the ones {self.path} recorded")
        if lines and lines[-1]["step"] > step:
            return  # a replayed step between two recorded ones: consistent, and the file only grows at its end
        before = lines[-1]["entries"] if lines else []
        keep = len(before) - (entries[:len(before)] != before)  # (fits: only the last entry may have grown)
        rec = {"step": step, "keep": keep, "tail": entries[keep:], "prev": lines[-1]["hash"] if lines else GENESIS}
        if state is not None:
            rec["state"] = state
        rec["hash"] = _line_hash(rec)
        if not all(_well_formed(e) for e in rec["tail"]):
            raise RuntimeError(f"step {step}: a ledger entry is malformed: {rec['tail']!r}")
        self._drop_torn_tail()
        with open(self.path, "a", opener=no_follow) as f:
            f.write(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._accept(rec, lines)

    def _drop_torn_tail(self) -> None:
        """Cut a line torn by a kill mid-append, so the next line starts on a line of its own."""
        try:
            with open(self.path, "rb+", opener=no_follow) as f:
                data = f.read()
                if data and not data.endswith(b"\n"):
                    f.truncate(data.rfind(b"\n") + 1)
        except FileNotFoundError:
            pass
