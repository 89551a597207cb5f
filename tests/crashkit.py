"""Start `dpreg` in child processes that tests can kill at any moment.

``launch(argv)`` runs the CLI's real entry point (``dpregistry.cli.main`` with ``sys.argv``) in a
fresh process. By default the process is forked from a fork server that has already imported
dpregistry, torch and the plugins, so it starts in milliseconds instead of seconds (the server
never runs a torch operation, so forking it is safe). ``exec_=True`` starts ``python -m dpregistry``
from scratch instead, exactly as a user would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PRELOAD = ["torch", "dpregistry", "dpregistry.cli", "dpregistry.run", "dpregistry.loop", "dpregistry.folder", "dpregistry.recipe", "dpregistry.report",
           "dpreg_baseline", "dpreg_accounting", "sklearn.datasets", "crashkit"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        os.environ.update(ENV)  # inherited by the fork server when it starts
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _child(argv: list[str], log: str) -> None:
    """The body of a forked `dpreg` process: output to ``log``, then the CLI's entry point."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import torch

    torch.set_num_threads(1)
    sys.argv = ["dpreg", *argv]
    from dpregistry.cli import main

    main()


@dataclass
class Child:
    """A running `dpreg` process."""

    handle: object
    log: Path
    started: float

    @property
    def pid(self) -> int:
        return self.handle.pid

    def poll(self) -> int | None:
        h = self.handle
        return h.poll() if isinstance(h, subprocess.Popen) else h.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        h = self.handle
        if isinstance(h, subprocess.Popen):
            try:
                return h.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        h.join(timeout)
        return h.exitcode

    def signal(self, sig: int) -> bool:
        """Send ``sig``; False if the process had already exited."""
        if self.poll() is not None:
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> bool:
        """SIGKILL; True if it killed a live process (it was still running)."""
        if not self.signal(signal.SIGKILL):
            return False
        code = self.wait(60)
        return code in (-signal.SIGKILL, 128 + signal.SIGKILL)  # a kill, not a normal exit just before

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def launch(argv: list, log: Path, exec_: bool = False) -> Child:
    argv = [str(a) for a in argv]
    if exec_:
        f = open(log, "a")
        h = subprocess.Popen([sys.executable, "-m", "dpregistry", *argv], stdout=f, stderr=subprocess.STDOUT,
                             env=dict(os.environ, **ENV))
        f.close()
        return Child(h, Path(log), time.time())
    p = _context().Process(target=_child, args=(argv, str(log)), daemon=True)
    p.start()
    return Child(p, Path(log), time.time())


def run_to_end(argv: list, log: Path, timeout: float = 300, exec_: bool = False) -> int:
    c = launch(argv, log, exec_)
    code = c.wait(timeout)
    if code is None:
        c.kill()
        raise TimeoutError(f"dpreg {' '.join(map(str, argv))} did not finish in {timeout} s:\n{c.output()[-3000:]}")
    return code


CKPT_TEMP = re.compile(r"^\.step-\d+\.safetensors\.tmp-\d+$")


def checkpoint_temps(out: Path) -> list[str]:
    folder = Path(out) / "checkpoints"
    try:
        return [n for n in os.listdir(folder) if CKPT_TEMP.match(n)]
    except FileNotFoundError:
        return []


def wait_for(pred, timeout: float, interval: float = 0.0005) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(interval)
    return False
