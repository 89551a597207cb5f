"""Files named by input (recipes, data files, model folders): regular files only.

Opening a FIFO blocks until a writer comes, and /dev/zero or /dev/urandom never end: a path in a
recipe could hang a command or fill its memory. Every file opened for input is therefore checked
to be a regular file first, and the check itself never blocks (the file is opened with
O_NONBLOCK and inspected with fstat, so it is the same file that is then read).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

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


def read_regular(path: str | Path, what: str = "file", *, limit: int | None = None) -> bytes:
    """The bytes of a regular file, refused beyond ``limit`` bytes without reading further."""
    fd, st = _open_fd(path, what)
    with os.fdopen(fd, "rb") as f:
        if limit is not None and st.st_size > limit:
            raise _too_large(path, what, limit)
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:  # it grew since fstat
        raise _too_large(path, what, limit)
    return data


def _too_large(path, what: str, limit: int) -> UserError:
    return UserError(f"the {what} is larger than {limit:,} bytes", file=str(path))
