"""The Triton kernels (CUDA's DPZero sweep and secret noise) against the torch code they replace,
in Triton's interpreter: tests/interpreted/ in a process of its own, since Triton reads
TRITON_INTERPRET when it is first imported and this process may have imported it already."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a heavy check, out of the default run (.ci/run runs -m slow)


def test_the_triton_kernels_compute_the_torch_codes_numbers():
    if importlib.util.find_spec("triton") is None and (sys.platform, platform.machine()) != ("linux", "x86_64"):
        pytest.skip("Triton publishes no wheel for this platform (the test extra installs it on Linux x86-64)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).parent / "interpreted")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
