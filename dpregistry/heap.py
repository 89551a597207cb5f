"""A CPU run's heap: glibc keeps what a step frees for the next step instead of returning it.

Every step frees and allocates the same activation-sized blocks. With glibc's defaults the free top
of the heap goes back to the system once it passes the trim threshold, and the next step faults
those pages in again, zeroed by the kernel. A DP step, whose per-layer state keeps the top of the
heap in use while autograd frees blocks below it, trims and faults back more than plain training:
on ViT at B = 128 (2 cores) DP-Adam's step took 3.7–4.6 s with glibc's defaults against 3.4–3.5 s
with the settings below (Adam 2.9–3.05 s either way), and the peaks stayed within glibc's
run-to-run spread (README, "Memory on a CPU").

``keep_freed_memory`` sets, once a process, on Linux with glibc (``mallopt``):

* M_TRIM_THRESHOLD 2 GiB: keep the heap's free top up to that (the next step allocates it again);
* M_TOP_PAD: grow the heap 256 MiB at a time (address space: a page counts once it is touched);
* M_MMAP_THRESHOLD 32 MiB: setting either of the others freezes glibc's adaptive mmap threshold
  at its 128 KiB start, which would give every tensor above that a mapping of its own to fault in
  and unmap; 32 MiB is as high as the adaptive threshold goes.

A process whose environment tunes glibc's malloc (any ``MALLOC_*`` variable, or ``glibc.malloc``
in ``GLIBC_TUNABLES``) keeps what it asked for (``MALLOC_MMAP_THRESHOLD_=1048576`` gives the lowest peak, at 1.25–1.5 × the step time).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {_M_TRIM_THRESHOLD: (1 << 31) - 1, _M_TOP_PAD: 256 << 20, _M_MMAP_THRESHOLD: 32 << 20}

_lock = threading.Lock()
_applied: bool | None = None  # settled by the first call of a process


def tuned_by_environment() -> dict[str, str]:
    """The user's own glibc malloc settings in the environment (``MALLOC_*``, ``GLIBC_TUNABLES``)."""
    return {k: v for k, v in os.environ.items()
            if k.startswith("MALLOC_") or (k == "GLIBC_TUNABLES" and "glibc.malloc." in v)}


def keep_freed_memory() -> bool:
    """Apply the settings above once a process; whether they are in force (not on other C
    libraries, nor where the user tuned glibc through its environment)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = False
            if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and not tuned_by_environment():
                mallopt = ctypes.CDLL(None).mallopt
                _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
        return _applied
