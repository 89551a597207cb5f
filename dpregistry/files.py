"""Files: reading what input names (regular files only), and writing atomically.

Opening a FIFO blocks until a writer comes, and /dev/zero or /dev/urandom never end: a path in a
recipe could hang a command or fill its memory. Every file opened for input is therefore checked
to be a regular file first, and the check itself never blocks (the file is opened with
O_NONBLOCK and inspected with fstat, so it is the same file that is then read).

Every file a run writes (checkpoints, the model, recipe.json, summary.json, a rewritten
metrics.jsonl) goes through :func:`write_atomic`: a temporary file in the same folder, fsync,
rename, fsync of the folder, so a kill at any moment leaves the old file or the new one.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import IO, Callable

from .errors import UserError


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(path, what: str, mode: int) -> UserError:
    return UserError(f"the {what} is {_kind(mode)}, not a regular file", file=str(path))


def _open_fd(path, what: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UserError(f"{what} not found", file=str(path)) from None
    except OSError as e:
        raise UserError(f"cannot read the {what} ({e.strerror or e})", file=str(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, what, st.st_mode)
    return fd, st


def require_regular(path: str | Path, what: str = "file") -> None:
    """Refuse a path that is not a regular file (stat follows links and never blocks)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{what} not found", file=str(path)) from None
    except OSError as e:
        raise UserError(f"cannot read the {what} ({e.strerror or e})", file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, what, st.st_mode)


def open_regular(path: str | Path, what: str = "file", mode: str = "r", **kwargs) -> IO:
    """``open(path, mode)`` for reading, of a regular file only."""
    fd, _ = _open_fd(path, what)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


#: the most a run folder's logs are read whole (metrics.jsonl and ledger.jsonl): a run of 10⁶
#: logged steps writes a few hundred MB; a larger file was not written by a run
RUN_LOG_LIMIT = 1 << 30
#: the most recipe.json and summary.json are read (a recipe is kilobytes, at most a few MB)
RUN_JSON_LIMIT = 100_000_000


def read_regular(path: str | Path, what: str = "file", *, limit: int | None = None) -> bytes:
    """The bytes of a regular file, refused beyond ``limit`` bytes without reading further."""
    fd, st = _open_fd(path, what)
    with os.fdopen(fd, "rb") as f:
        if limit is not None and st.st_size > limit:
            raise _too_large(path, what, limit)
        if limit is None:
            data = f.read()
        else:  # what fstat saw (a buffer of the limit would be a gigabyte for every read), then any growth
            data = f.read(min(st.st_size, limit) + 1)
            while len(data) <= limit and (more := f.read(min(1 << 24, limit + 1 - len(data)))):
                data += more
    if limit is not None and len(data) > limit:  # it grew since fstat
        raise _too_large(path, what, limit)
    return data


def _too_large(path, what: str, limit: int) -> UserError:
    return UserError(f"the {what} is larger than {limit:,} bytes", file=str(path))


# -- writing ----------------------------------------------------------------------------------

TEMP = re.compile(r"^\..+\.tmp(-\d+)?$")


def temp_path(path: Path) -> Path:
    """Where :func:`write_atomic` writes ``path`` before renaming it (hidden, per process)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a missing one is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def no_follow(path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` (and an ``opener`` for ``open()``) that refuses a symbolic link (ELOOP): a run
    folder handed over by someone else must not have a run's writes land in the file a link names."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` with ``write(f)`` on a temporary file, fsync it, rename it over ``path`` and
    fsync the folder. An OSError (a full disk, a read-only folder) leaves ``path`` as it was."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        fd = no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete temporary files that a killed writer left in ``folder`` (call it holding the run lock)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if TEMP.match(p.name) and p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
