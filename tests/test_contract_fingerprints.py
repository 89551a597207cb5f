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


@pytest.mark.parametrize("name", sorted(fp.RECIPES))
def test_fingerprint_is_unchanged(name):
    want, got = RECORD["recipes"][name], fp.fingerprint(name)
    assert got["step"] == want["step"]
    assert got["ledger"] == want["ledger"]
    if fp.machine() == RECORD["machine"]:
        assert got["params"] == want["params"]  # bit for bit where the arithmetic is the same
    else:  # another CPU or torch build may round differently: the parameters, to float rounding
        for k, (s, n) in want["sums"].items():
            assert got["sums"][k] == pytest.approx([s, n], rel=1e-5, abs=1e-7), k
