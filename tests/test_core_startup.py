"""The CLI answers at once: a command imports only the heavy libraries it uses.

Each case runs the command's entry point in a fresh interpreter and reads ``sys.modules`` after it
(``benchmarks/cli_startup.py`` measures the times these imports cost)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "matplotlib", "dp_accounting", "sklearn", "datasets")

PROBE = """
import json, sys
from dpregistry.cli import main
sys.argv = ["dpreg", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
stages = sorted(m for m in sys.modules if m.startswith("dpreg_") and "." in m)  # plugin modules beyond __init__
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules), "stages": stages}),
      file=sys.stderr)
""" % (HEAVY,)


def imported_by(*args: str) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True)
    return json.loads(res.stderr.strip().splitlines()[-1])


CALIBRATE = ["privacy", "calibrate", "--epsilon", "6", "--delta", "1e-5", "--steps", "20000", "--sample-rate",
             "0.016", "--accountant", "pld", "--relation", "add_remove"]


#: the plugin modules that register an event type on import (dpreg_nonsmooth/__init__.py)
ALWAYS = ["dpreg_nonsmooth.accounting"]


@pytest.mark.parametrize("args,heavy,stages", [
    (["--help"], [], []),
    (["privacy", "--help"], [], []),
    (CALIBRATE, ["dp_accounting"], ["dpreg_accounting.accountants", *ALWAYS]),
    (["validate", "quickstart"], ["dp_accounting", "sklearn", "torch"], None),
], ids=["help", "privacy help", "privacy calibrate", "validate quickstart"])
def test_a_command_imports_only_what_it_needs(args, heavy, stages):
    """--help loads no plugin at all; calibrating noise imports dp-accounting and the one
    accountant module, never torch or another plugin's stages (their pydantic schemas); validating
    the quickstart needs torch and the digits, not transformers or matplotlib. The positive cases
    show that the probe sees what is imported."""
    got = imported_by(*args)
    assert got["code"] == 0
    assert got["heavy"] == heavy
    if stages is not None:
        assert got["stages"] == stages
