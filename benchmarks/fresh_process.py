"""A benchmark's measurement in a fresh process: its peak RSS is its own ``ru_maxrss``, read by
``wait4`` (the whole process: Python, torch and the model included), not what an earlier
measurement in the same interpreter left allocated."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time


def run_child(cmd: list[str], *, env: dict | None = None, cwd=None) -> tuple[str, float, float]:
    """(the child's stdout, its peak RSS in MiB, its wall time in seconds); a failed child stops
    the benchmark with the tail of its stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{' '.join(map(str, cmd[1:3]))}: the child failed:\n{err.read()[-3000:]}")
        return out.read(), usage.ru_maxrss / 1024, seconds
