"""A CPU run keeps the memory a step frees for the next step (dpregistry/heap.py): glibc's
defaults return a freed block to the system, and the next step faults it back in."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = """
import json, torch
from dpregistry import heap
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
applied = heap.keep_freed_memory() if {apply} else False
torch.ones(1 << 10).sum()  # torch's first op sets up what it keeps (thread pools), outside the window
before = rss()
t = torch.ones(6 << 20)  # 24 MiB, touched
held = rss()
del t
print(json.dumps({{"applied": applied, "held": held - before, "kept": rss() - before}}))
"""


def _probe(apply: bool, **env) -> dict:
    """The probe in a process with glibc's defaults (none of the environment's malloc tuning) plus ``env``."""
    from dpregistry import heap

    tuned = heap.tuned_by_environment()
    out = subprocess.run([sys.executable, "-c", PROBE.format(apply=apply)], capture_output=True, text=True,
                         env={**{k: v for k, v in os.environ.items() if k not in tuned}, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_freed_block_stays_for_the_next_step_where_glibcs_default_returns_it():
    default, kept = _probe(False), _probe(True)
    assert default["held"] > 23 and kept["held"] > 23
    assert default["kept"] < default["held"] / 2  # glibc mapped the block on its own and unmapped it
    assert kept["applied"] and kept["kept"] > 0.95 * kept["held"]  # in the heap, kept for reuse


def test_glibc_tuning_in_the_environment_is_left_as_the_user_set_it(monkeypatch):
    from dpregistry import heap

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")  # the lowest peak, asked for
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap.ctypes, "CDLL", None)  # mallopt must not even be looked up
    assert heap.keep_freed_memory() is False


def test_a_cpu_run_applies_it(monkeypatch):
    from dpregistry import heap
    from dpregistry.api import load_recipe
    from dpregistry.run import Run

    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    Run(load_recipe("quickstart", [])).prepare()
    assert calls == [1]
