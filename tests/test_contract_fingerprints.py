"""Behaviour unchanged across the contract redesign (issue 15): every shipped recipe that runs on a
CPU ends, after a few steps in reproducible noise mode, at the parameters and the ledger recorded
before it (tests/data/fingerprints.json, written by tests/fingerprints.py)."""

from __future__ import annotations

import json

import pytest

import fingerprints as fp

RECORD = json.loads(fp.RECORD.read_text())


def test_every_shipped_recipe_is_fingerprinted_or_says_why_not():
    shipped = {p.stem for p in (fp.REPO / "recipes").glob("*.yaml")}
    assert shipped == set(fp.RECIPES) | set(fp.NOT_ON_A_CPU)
    assert set(RECORD["recipes"]) == set(fp.RECIPES)


def _close(got, want) -> bool:
    """The same JSON, floats to 1e-6 relative (a calibrated noise multiplier is the root of sums
    that numpy and torch round by their CPU's vector width)."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        return got == pytest.approx(want, rel=1e-6, abs=0)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_close, got, want))
    return got == want


#: the recipes that load a transformer (20-46 s each on 2 cores) run with the long tests (-m slow)
HEAVY = {"minilm_sst2_dp_adam", "minilm_sst2_dpgrape", "minilm_sst2_dpzero", "minilm_sst2_user_dp_adam",
         "vit-base_cifar10_dpgrape"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in sorted(fp.RECIPES)])
def test_fingerprint_is_unchanged(name):
    want, got = RECORD["recipes"][name], fp.fingerprint(name)
    assert got["step"] == want["step"]
    if fp.machine() == RECORD["machine"]:  # bit for bit where the arithmetic is the same
        assert got["ledger"] == want["ledger"]
        assert got["params"] == want["params"]
    else:  # another CPU or torch build may round differently (an AVX-512 record failed on AVX2)
        assert _close(got["entries"], want["entries"])
        for k, (s, n) in want["sums"].items():
            assert got["sums"][k] == pytest.approx([s, n], rel=1e-5, abs=1e-7), k
