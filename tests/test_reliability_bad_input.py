"""Bad input, refused clearly: a corpus of malformed recipes, data and CLI invocations.

Every case exits with code 2 and prints exactly one line, ``error: FILE:LINE: KEY: message`` (file,
line and key where they apply), with no traceback, and writes nothing anywhere. The cases run
in-process (typer's CliRunner). Hypothesis then fuzzes the recipe loader: random mutations of a
valid recipe give a valid recipe or a UserError, never anything else.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import RECIPES
from test_core_cli import dpreg

KLT = RECIPES / "klt_mp_zo_erm_ring.yaml"  # an O2NC algorithm whose settings come from theory

# Line numbers below refer to this text.
BASE = """\
seed: 0
algorithm: dp_sgd
objective:
  name: tabular
  model: {kind: linear}
  data: {dataset: iris}
sampler: {name: poisson, batch_size: 16}
privatizer: {clip: 1.0, noise_multiplier: 1.5}
update: {lr: 0.1}
accountant: rdp
privacy: {epsilon: 8.0, delta: 1.0e-3}
train: {steps: 5}
"""

# A text-classification recipe on small TSV files (data errors surface before any model loads).
TEXT = """\
seed: 0
algorithm: dp_adam
objective: hf_text_classification
model: {path: minilm, max_length: 16}
data:
  path: DATA
  train: train.tsv
  test: test.tsv
  labels: ["0", "1"]
sampler: {name: poisson, batch_size: 4}
privatizer: {clip: 1.0, noise_multiplier: 1.0}
update: {lr: 0.001}
accountant: rdp
privacy: {epsilon: 50.0, delta: 1.0e-5}
train: {steps: 2}
"""
GOOD_TSV = "sentence\tlabel\na fine film\t1\na dull film\t0\nsplendid\t1\n"
HELD_OUT_TSV = "sentence\tlabel\na fine story\t1\na dull story\t0\nsplendid acting\t1\n"


def alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine aliases each: 400 bytes that expand to 9^9 = 387 million strings."""
    out, prev = 'x_a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n', "a"
    for name in "bcdefghi"[:levels - 1]:
        out += f"x_{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    return out + f"description: *{prev}\n"


def many_keys(n: int = 2_500_000) -> str:
    return BASE + "".join(f"k{i}: 1\n" for i in range(n))


# One field, four files, a megabyte of quotes each: JSON inside JSON (a checkpoint header) writes
# each quote as four characters, so the resolved recipe would need 16 MB of every header.
QUOTES = '"' * 990_000
CHAIN = {"p1.yaml": f"extends: p2.yaml\nobjective: {{data: {{dataset: '{QUOTES}'}}}}\n",
         "p2.yaml": f"extends: p3.yaml\nobjective: {{trainable: {{include: ['{QUOTES}']}}}}\n",
         "p3.yaml": f"extends: p4.yaml\nobjective: {{trainable: {{exclude: ['{QUOTES}']}}}}\n",
         "p4.yaml": BASE + f"description: '{QUOTES}'\n"}


@dataclass
class Case:
    recipe: str | Callable[[], str] = BASE   # recipe text ({tmp} is the test's folder), or what makes it
    edit: tuple[str, str] | None = None      # (old, new) applied to the recipe text
    args: list[str] | None = None            # CLI arguments; default: run the recipe with --out
    sets: list[str] = field(default_factory=list)
    files: dict[str, str | bytes] = field(default_factory=dict)  # extra files to create
    where: str | None = None                 # regex the error line must match (file:line: key)
    says: str = ""                           # substring of the message
    fifos: tuple[str, ...] = ()              # named pipes to create (a reader would block forever)
    hides: str = ""                          # a text the error must not show (a file's content)


R = r"recipe\.yaml"  # the recipe's file name in `where`

CASES: dict[str, Case] = {
    # --- files and YAML ---------------------------------------------------------------------
    "recipe file missing": Case(args=["run", "{tmp}/nope.yaml"], where=r"nope\.yaml: ", says="not found"),
    "an unknown recipe name": Case(args=["run", "nosuchrecipe"], where=r"nosuchrecipe: ",
                                   says="no shipped recipe of that name (shipped: kl_adaptive"),
    "recipe is a folder": Case(args=["run", "{tmp}/adir"], files={"adir/x": ""}, where=r"adir: "),
    "recipe is not UTF-8": Case(recipe="", files={"recipe.yaml": b"seed: 0\nalgorithm: \xff\xfe\n"},
                                where=R + ": ", says="cannot read"),
    "YAML: unclosed brace": Case(edit=("update: {lr: 0.1}", "update: {lr: 0.1"), where=R + r":\d+: ",
                                 says="YAML syntax error: expected ',' or '}'"),
    "YAML: tab indentation": Case(edit=("  name: tabular", "\tname: tabular"), where=R + r":\d+: ",
                                  says="YAML"),
    "YAML: bad indentation": Case(edit=("  model: {kind: linear}", "    model: {kind: linear}"),
                                  where=R + r":\d+: ", says="YAML"),
    "recipe is a list": Case(recipe="- algorithm: dp_sgd\n- train: {steps: 5}\n", where=R + ":1: ",
                             says="mapping"),
    "recipe is empty": Case(recipe="", where=R + ": algorithm: ", says="needs an algorithm"),
    "duplicate key": Case(recipe=BASE + "train: {steps: 6}\n", where=R + ":13: train: ", says="duplicate"),
    "non-string key": Case(recipe=BASE + "7: seven\n", where=R + ":13: ", says="keys must be strings"),
    # --- unknown and misspelled names -------------------------------------------------------
    "misspelled section": Case(recipe=BASE + "privatiser: {clip: 2}\n", where=R + ":13: privatiser: ",
                               says="did you mean 'privatizer'"),
    "unknown algorithm": Case(edit=("algorithm: dp_sgd", "algorithm: dp_sgdd"), where=R + ":2: algorithm: ",
                              says="dp_sgd"),
    "unknown sampler": Case(edit=("name: poisson", "name: poison"), where=R + ":7: sampler.name: ",
                            says="did you mean 'poisson'"),
    "unknown accountant": Case(edit=("accountant: rdp", "accountant: rdpp"), where=R + ":10: accountant",
                               says="rdp"),
    "misspelled stage key": Case(edit=("clip: 1.0", "clipp: 1.0"), where=R + ":8: privatizer.clipp: ",
                                 says="did you mean 'clip'"),
    "misspelled train key": Case(edit=("steps: 5", "stepz: 5"), where=R + ":12: train.stepz: ",
                                 says="did you mean 'steps'"),
    "unknown model kind": Case(edit=("kind: linear", "kind: cnn"), where=R + ":5: objective.model.kind: "),
    "unknown bundled data set": Case(edit=("dataset: iris", "dataset: irs"), where=R + r":6: objective\.data",
                                     says="unknown bundled data set"),
    "unknown relation": Case(edit=("delta: 1.0e-3}", "delta: 1.0e-3, relation: add_one}"),
                             where=R + ":11: privacy.relation: "),
    # --- wrong types ------------------------------------------------------------------------
    "steps is a word": Case(edit=("steps: 5", "steps: many"), where=R + ":12: train.steps: "),
    "steps is fractional": Case(edit=("steps: 5", "steps: 5.5"), where=R + ":12: train.steps: "),
    "batch size is a word": Case(edit=("batch_size: 16", "batch_size: sixteen"),
                                 where=R + ":7: sampler.batch_size: "),
    "privacy is not a section": Case(edit=("privacy: {epsilon: 8.0, delta: 1.0e-3}", "privacy: 8"),
                                     where=R + ":11: privacy"),
    "section is a number": Case(edit=("sampler: {name: poisson, batch_size: 16}", "sampler: 5"),
                                where=R + ":7: sampler"),
    "algorithm is a list": Case(edit=("algorithm: dp_sgd", "algorithm: [dp_sgd]"), where=R + ":2: algorithm"),
    "seed is negative": Case(edit=("seed: 0", "seed: -1"), where=R + ":1: seed: "),
    "seed is a word": Case(edit=("seed: 0", "seed: abc"), where=R + ":1: seed: "),
    "secure_noise is not a bool": Case(edit=("delta: 1.0e-3}", "delta: 1.0e-3, secure_noise: maybe}"),
                                       where=R + ":11: privacy.secure_noise: "),
    "output is unknown": Case(recipe=BASE + "output: best\n", where=R + ":13: output: "),
    # --- out-of-range values ----------------------------------------------------------------
    "negative epsilon": Case(edit=("epsilon: 8.0", "epsilon: -1"), where=R + ":11: privacy.epsilon: ",
                             says="greater than 0"),
    "zero epsilon": Case(edit=("epsilon: 8.0", "epsilon: 0"), where=R + ":11: privacy.epsilon: "),
    "infinite epsilon": Case(edit=("epsilon: 8.0", "epsilon: .inf"), where=R + ":11: privacy.epsilon: "),
    "delta at least 1/n": Case(edit=("delta: 1.0e-3", "delta: 0.01"), where=R + ":11: privacy.delta: ",
                               says="not below 1/n"),
    "delta of 1": Case(edit=("delta: 1.0e-3", "delta: 1"), where=R + ":11: privacy.delta: "),
    "delta of 0": Case(edit=("delta: 1.0e-3", "delta: 0"), where=R + ":11: privacy.delta: "),
    "clip of 0": Case(edit=("clip: 1.0", "clip: 0"), where=R + ":8: privatizer.clip: "),
    "negative clip": Case(edit=("clip: 1.0", "clip: -2"), where=R + ":8: privatizer.clip: "),
    "learning rate NaN": Case(edit=("lr: 0.1", "lr: .nan"), where=R + ":9: update.lr: ", says="NaN"),
    "learning rate NaN via --set": Case(sets=["update.lr=nan"], where=r"--set: update.lr: "),
    "negative noise multiplier": Case(edit=("noise_multiplier: 1.5", "noise_multiplier: -1"),
                                      where=R + ":8: privatizer.noise_multiplier: "),
    "noise multiplier is a word": Case(edit=("noise_multiplier: 1.5", "noise_multiplier: lots"),
                                       where=R + ":8: privatizer.noise_multiplier: "),
    "zero steps": Case(edit=("steps: 5", "steps: 0"), where=R + ":12: train.steps: "),
    "log_every of 0": Case(edit=("steps: 5}", "steps: 5, log_every: 0}"), where=R + ":12: train.log_every: "),
    "test fraction of 1": Case(edit=("dataset: iris}", "dataset: iris, test_fraction: 1}"),
                               where=R + ":6: objective.data.test_fraction: "),
    "micro batch of 0": Case(edit=("steps: 5}", "steps: 5, micro_batch_size: 0}"),
                             where=R + ":12: train.micro_batch_size: "),
    "batch larger than the data": Case(edit=("{name: poisson, batch_size: 16}", "{name: shuffle, batch_size: 5000}"),
                                       where=R + ":7: sampler.batch_size: ", says="exceeds"),
    # --- budget and structure ---------------------------------------------------------------
    "plan over budget": Case(edit=("noise_multiplier: 1.5", "noise_multiplier: 0.3"), where=R + ":11: privacy: ",
                             says="planned run spends"),
    "auto noise without a budget": Case(edit=("noise_multiplier: 1.5", "noise_multiplier: auto"),
                                        sets=["privacy.epsilon=null"], where=R + ":8: privatizer.noise_multiplier",
                                        says="needs a privacy budget"),
    "no algorithm": Case(edit=("algorithm: dp_sgd\n", ""), where=R + ": algorithm: "),
    "no train section": Case(edit=("train: {steps: 5}\n", ""), where=R + ": train: "),
    "incompatible stages": Case(edit=("update: {lr: 0.1}", "update: {name: directional_sgd, lr: 0.1}"),
                                where=R + ":9: update.name: ", says="update rules that fit"),
    "model given twice": Case(recipe=BASE + "model: {kind: mlp}\n", where=R + ":13: model: ", says="both"),
    "no trainable parameters": Case(edit=("data: {dataset: iris}", "data: {dataset: iris}\n  trainable: {include: [nothing]}"),
                                    where=R + ":7: objective.trainable.include: ", says="matches no parameter"),
    "device that does not exist": Case(edit=("steps: 5}", "steps: 5, device: cuda}"), where=R + ":12: train.device: ",
                                       says="not available"),
    "device that is not a device": Case(edit=("steps: 5}", "steps: 5, device: gpu0}"), where=R + ":12: train.device: "),
    # --- inheritance ------------------------------------------------------------------------
    "extends cycle": Case(recipe="extends: b.yaml\n" + BASE, files={"b.yaml": "extends: recipe.yaml\n"},
                          where=R + ": ", says="extends cycle"),
    "extends itself": Case(recipe="extends: recipe.yaml\n" + BASE, where=R + ": ", says="cycle"),
    "extends a missing file": Case(recipe="extends: parent.yaml\n" + BASE, where=R + ":1: extends: ",
                                   says="not found"),
    "extends is not a path": Case(recipe="extends: [a, b]\n" + BASE, where=R + ":1: extends: "),
    "a YAML date": Case(recipe=BASE + "description: 2024-05-01\n",  # valid, then the run's JSON failed
                        where=R + r":\d+: description: ", says="'2024-05-01' reads as YAML's !!timestamp"),
    "a YAML tag on a list": Case(recipe=BASE + "description: !!python/object/apply:os.system [ls]\n",
                                 where=R + r":\d+: description: ", says="!!python/object/apply:os.system"),
    "error in a parent recipe": Case(recipe="extends: parent.yaml\ntrain: {steps: 3}\n",
                                     files={"parent.yaml": BASE.replace("clip: 1.0", "clip: 0")},
                                     where=r"parent\.yaml:8: privatizer\.clip: "),
    # --- data -------------------------------------------------------------------------------
    "missing data path": Case(recipe=TEXT.replace("DATA", "{tmp}/nodata"), where=R + ":6: objective.data.path: ",
                              says="not found"),
    "missing data file": Case(recipe=TEXT.replace("DATA", "{tmp}/data"), files={"data/test.tsv": HELD_OUT_TSV},
                              where=r"train\.tsv: ", says="not found"),
    "empty data set": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                           files={"data/train.tsv": "sentence\tlabel\n", "data/test.tsv": HELD_OUT_TSV},
                           where=r"train\.tsv: ", says="empty"),
    "label outside the declared set": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                                           files={"data/train.tsv": GOOD_TSV + "odd\t2\n", "data/test.tsv": HELD_OUT_TSV},
                                           where=r"train\.tsv:5: ", says="'2' is not one of the declared labels"),
    "malformed TSV row": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                              files={"data/train.tsv": GOOD_TSV.replace("splendid\t1", "splendid\t1\textra"),
                                     "data/test.tsv": HELD_OUT_TSV},
                              where=r"train\.tsv:4: ", says="malformed TSV row"),
    "missing label column": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                                 files={"data/train.tsv": GOOD_TSV.replace("label", "stars"), "data/test.tsv": HELD_OUT_TSV},
                                 where=r"train\.tsv:1: ", says="column 'label' is missing"),
    "data file is not UTF-8": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                                   files={"data/train.tsv": b"sentence\tlabel\n\xff\xfe bad\t1\n", "data/test.tsv": HELD_OUT_TSV},
                                   where=r"train\.tsv:2: ", says="UTF-8"),
    "JSON Lines row nested 50,000 deep": Case(  # Arrow's reader crashed the process (SIGSEGV)
        recipe=TEXT.replace("DATA", "{tmp}/data").replace("train.tsv", "train.jsonl"),
        files={"data/train.jsonl": '{"sentence": "a fine film", "label": 1}\n{"sentence": "dull", "label": 0, "x": '
                                   + "[" * 50_000 + "]" * 50_000 + "}\n", "data/test.tsv": HELD_OUT_TSV},
        where=r"train\.jsonl:2: ", says="a row nested deeper than 100 levels"),
    "JSON Lines row nested over 50,000 lines": Case(  # the depth is carried from line to line
        recipe=TEXT.replace("DATA", "{tmp}/data").replace("train.tsv", "train.jsonl"),
        files={"data/train.jsonl": '{"sentence": "a fine film", "label": 1}\n{"sentence": "dull", "label": 0, "x":\n'
                                   + "[\n" * 50_000 + "]\n" * 50_000 + "}\n", "data/test.tsv": HELD_OUT_TSV},
        where=r"train\.jsonl:102: ", says="a row nested deeper than 100 levels"),
    "unknown data format": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("train.tsv", "train.xlsx"),
                                files={"data/train.xlsx": "x", "data/test.tsv": HELD_OUT_TSV},
                                where=r"train\.xlsx: ", says="unknown data format"),
    "hub data set not cached": Case(recipe=TEXT.replace("  path: DATA\n  train: train.tsv\n  test: test.tsv\n",
                                                        "  hub: nobody/nothing\n"),
                                    where=R + ":6: objective.data.hub: ", says="not in the local Hugging Face cache"),
    "first line is data": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                               files={"data/train.tsv": GOOD_TSV.split("\n", 1)[1], "data/test.tsv": HELD_OUT_TSV},
                               where=r"train\.tsv:1: ", says="the first line looks like data; set data.header: false"),
    "descriptions without a label order": Case(
        recipe=TEXT.replace("DATA", "{tmp}/data").replace('  labels: ["0", "1"]\n', "").replace(
            "max_length: 16}", "max_length: 16, head_init: label_descriptions, label_descriptions: [bad, good]}"),
        files={"data/train.tsv": GOOD_TSV, "data/test.tsv": HELD_OUT_TSV},
        where=R + ":5: objective.data.labels: ", says="pairs with the labels by position"),
    "missing model folder": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("path: minilm", "path: /no/model"),
                                 files={"data/train.tsv": GOOD_TSV, "data/test.tsv": HELD_OUT_TSV},
                                 where=R + ":4: objective.model.path: ", says="not found"),
    "pickle-only model folder": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("path: minilm", "path: {tmp}/m"),
                                     files={"data/train.tsv": GOOD_TSV, "data/test.tsv": HELD_OUT_TSV,
                                            "m/config.json": '{"model_type": "bert"}',
                                            "m/pytorch_model.bin": b"\x80\x04K\x01."},
                                     where=R + ":4: objective.model.path: ", says="pickle"),
    # --- command line -----------------------------------------------------------------------
    "--set without =": Case(sets=["privatizer.clip"], where="--set: ", says="key.path=value"),
    "--set with an empty key part": Case(sets=["privatizer..clip=1"], where="--set: ", says="malformed key"),
    "--set into a scalar": Case(sets=["seed.x=1"], where="--set: seed.x: ", says="not a section"),
    "--set with bad YAML": Case(sets=["train.steps=[1"], where="--set: train.steps: ", says="cannot parse"),
    "--set unknown stage": Case(sets=["privatizer=gausian"], where="--set: privatizer.name: ",
                                says="did you mean 'gaussian'"),
    "unknown option": Case(args=["run", "{recipe}", "--frobnicate"], where="dpreg run: ", says="--frobnicate"),
    "missing argument": Case(args=["run"], where="dpreg run: ", says="Missing argument"),
    "option of the wrong type": Case(args=["run", "{recipe}", "--nproc", "many"], where="dpreg run: ",
                                     says="'--nproc'"),
    "zero processes": Case(args=["run", "{recipe}", "--nproc", "0", "--out", "{tmp}/out"], says="--nproc"),
    "unknown command": Case(args=["rnu", "{recipe}"], where="dpreg: ", says="'run'"),
    "--out is a file": Case(args=["run", "{recipe}", "--out", "{tmp}/afile"], files={"afile": "x"},
                            where=r"afile: ", says="not a folder"),
    "--out holds another run": Case(args=["run", "{recipe}", "--out", "{tmp}/old"], files={"old/summary.json": "{}"},
                                    where=r"old: ", says="--overwrite"),
    "resume a missing folder": Case(args=["resume", "{tmp}/gone"], where=r"gone: ", says="not found"),
    "resume a folder that is not a run": Case(args=["resume", "{tmp}/plain"], files={"plain/notes.txt": "x"},
                                              where=r"plain: ", says="not a dpregistry run folder"),
    "report on a missing folder": Case(args=["report", "{tmp}/gone"], where=r"gone: ", says="not found"),
    "report on a folder that is not a run": Case(args=["report", "{tmp}/plain"], files={"plain/notes.txt": "x"},
                                                 where=r"plain: ", says="no readable checkpoint"),
    "validate a broken recipe": Case(args=["validate", "{recipe}"], edit=("clip: 1.0", "clip: 0"),
                                     where=R + ":8: privatizer.clip: "),
    "show a broken recipe": Case(args=["show", "{recipe}"], edit=("clip: 1.0", "clipp: 1.0"),
                                 where=R + ":8: privatizer.clipp: "),
    "calibrate with δ = 2": Case(args=["privacy", "calibrate", "--epsilon", "1", "--delta", "2", "--steps", "10",
                                       "--sample-rate", "0.1"], says="--delta"),
    "epsilon at a zero noise multiplier": Case(args=["privacy", "epsilon", "--noise-multiplier", "0", "--steps", "10",
                                                     "--sample-rate", "0.1", "--delta", "1e-5"], says="--noise-multiplier"),
    # --- bounded work on any input (issue 14) -----------------------------------------------
    "YAML alias bomb": Case(recipe=BASE + alias_bomb(), where=R + r":\d+: ", says="aliases included"),
    "recipe nested 5,000 deep": Case(recipe=BASE + "description: " + "[" * 5000 + "]" * 5000 + "\n",
                                     where=R + ":13: ", says="nests deeper than 32 levels"),
    "--set value nested 5,000 deep": Case(sets=["description=" + "[" * 5000 + "]" * 5000], where="--set: ",
                                          says="nests deeper than 32 levels"),
    "--set alias bomb": Case(sets=["description=" + "{" + alias_bomb().replace("\n", ", ").rstrip(", ") + "}"],
                             where="--set", says="aliases included"),
    "recipe over 1 MB": Case(recipe=BASE + "description: '" + "x" * 1_000_000 + "'\n", where=R + ": ",
                             says="larger than 1,000,000 bytes"),
    "2.5 million keys": Case(recipe=many_keys, where=R + ": ", says="larger than 1,000,000 bytes"),
    "half a million values under 1 MB": Case(recipe=BASE + "description: [" + "0," * 450_000 + "0]\n",
                                             where=R + r":13: ", says="more than 100,000 keys and values"),
    "extends /dev/zero": Case(recipe="extends: /dev/zero\n" + BASE, where=r"/dev/zero: ",
                              says="a device, not a regular file"),
    "extends a FIFO": Case(recipe="extends: pipe.yaml\n" + BASE, fifos=("pipe.yaml",), where=r"pipe\.yaml: ",
                           says="a FIFO (named pipe), not a regular file"),
    "recipe is a FIFO": Case(args=["validate", "{tmp}/pipe.yaml"], fifos=("pipe.yaml",), where=r"pipe\.yaml: ",
                             says="FIFO"),
    "data file is a FIFO": Case(recipe=TEXT.replace("DATA", "{tmp}/data"), fifos=("data/train.tsv",),
                                files={"data/test.tsv": HELD_OUT_TSV}, where=r"train\.tsv: ", says="FIFO"),
    "data file is /dev/zero": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("train.tsv", "/dev/zero"),
                                   files={"data/test.tsv": HELD_OUT_TSV}, where=r"/dev/zero: ", says="a device"),
    "model folder with a FIFO": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("path: minilm", "path: {tmp}/m"),
                                     files={"data/train.tsv": GOOD_TSV, "data/test.tsv": HELD_OUT_TSV,
                                            "m/config.json": '{"model_type": "bert"}'}, fifos=("m/vocab.txt",),
                                     where=R + ":4: objective.model.path: ", says="not a regular file"),
    "ten trillion steps": Case(edit=("steps: 5", "steps: 10000000000000"), where=R + ":12: train.steps: ",
                               says="less than or equal to 1000000000"),
    "a billion steps under pld": Case(edit=("steps: 5", "steps: 1000000000"), sets=["accountant=pld"],
                                      where=r"--set: accountant: ", says="privacy-loss array"),
    "pld at a tiny noise": Case(sets=["accountant=pld", "privatizer.noise_multiplier=0.05"],
                                where=r"--set: accountant: ", says="privacy-loss array"),
    # --- no traceback for input (issue 14) ----------------------------------------------------
    "negative hidden width": Case(edit=("kind: linear}", "kind: mlp, hidden: [-5]}"),
                                  where=R + ":5: objective.model.hidden.0: ", says="greater than 0"),
    "zero hidden width": Case(edit=("kind: linear}", "kind: mlp, hidden: [0]}"),
                              where=R + ":5: objective.model.hidden.0: ", says="greater than 0"),
    "hidden width of 10^11": Case(edit=("kind: linear}", "kind: mlp, hidden: [100000000000]}"),
                                  where=R + ":5: objective.model.hidden: ", says="GiB of memory this machine has"),
    "noise multiplier of 1e-320": Case(edit=("noise_multiplier: 1.5", "noise_multiplier: 1.0e-320"),
                                       where=R + ":11: privacy: ", says="spends ε = inf"),
    "noise multiplier of 1e-170 under zcdp": Case(edit=("noise_multiplier: 1.5", "noise_multiplier: 1.0e-170"),
                                                  sets=["accountant=zcdp"], where=R + ":11: privacy: ",
                                                  says="ρ = inf"),
    "calibrate to an infinite ε": Case(args=["privacy", "calibrate", "--epsilon", "inf", "--delta", "1e-5",
                                             "--steps", "10", "--sample-rate", "0.1"],
                                       says="--epsilon must be positive and finite"),
    "calibrate to an ε that underflows": Case(args=["privacy", "calibrate", "--epsilon", "1e-300", "--delta", "1e-5",
                                                    "--steps", "10", "--sample-rate", "0.1", "--accountant", "zcdp"],
                                              says="no noise multiplier"),
    "privacy epsilon over a billion steps": Case(args=["privacy", "epsilon", "--noise-multiplier", "1", "--steps",
                                                       "10000000000", "--sample-rate", "0.1", "--delta", "1e-5"],
                                                 says="--steps must be between 1 and 1,000,000,000"),
    "privacy report of a billion points": Case(args=["privacy", "report", "{tmp}", "--points", "1000000000"],
                                               says="--points must be between 1 and 1000"),
    "NUL byte in a recipe": Case(edit=("seed: 0", "seed: 0\x00"), where=R + ":1: ",
                                 says="unacceptable character #x0000"),
    "--out with a 300-character name": Case(args=["run", "{recipe}", "--out", "{tmp}/" + "o" * 300],
                                            says="cannot use the output folder (File name too long)"),
    "resume a 300-character name": Case(args=["resume", "{tmp}/" + "o" * 300], says="File name too long"),
    "recipe with a 300-character name": Case(args=["validate", "{tmp}/" + "r" * 300 + ".yaml"],
                                             says="File name too long"),
    # --- errors that reveal nothing and mislead nobody (issue 14) -------------------------------
    "extends a password file": Case(recipe="extends: shadow\n" + BASE,
                                    files={"shadow": "root:$6$s4lt$s3cr3th4sh:19000:0:99999:7:::\n"
                                                     "daemon:*:19000:0:99999:7:::\n"},
                                    where=r"shadow: ", says="not a recipe", hides="s3cr3t"),
    "extends a file with a secret tag": Case(recipe="extends: key.yaml\n" + BASE,
                                             files={"key.yaml": "token: !s3cr3t-t0ken x\n"}, where=r"key\.yaml: ",
                                             hides="s3cr3t"),
    "extends a file with a secret key": Case(recipe="extends: key.yaml\n" + BASE,
                                             files={"key.yaml": "12345678: s3cr3t\nalgorithm: dp_sgd\n"},
                                             where=r"key\.yaml:1: ", says="keys must be strings", hides="12345678"),
    "empty test file": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                            files={"data/train.tsv": GOOD_TSV, "data/test.tsv": "sentence\tlabel\n"},
                            where=r"test\.tsv: ", says="empty"),
    "epsilon: true": Case(edit=("epsilon: 8.0", "epsilon: true"), where=R + ":11: privacy.epsilon: ",
                          says="valid number"),
    "clip: true": Case(edit=("clip: 1.0", "clip: true"), where=R + ":8: privatizer.clip: ", says="valid number"),
    "batch size: true": Case(edit=("batch_size: 16", "batch_size: true"), where=R + ":7: sampler.batch_size: "),
    "steps: true": Case(edit=("steps: 5", "steps: true"), where=R + ":12: train.steps: ", says="valid integer"),
    "hidden width: true": Case(edit=("kind: linear}", "kind: mlp, hidden: [true]}"),
                               where=R + ":5: objective.model.hidden.0: ", says="valid integer"),
    "duplicate label": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace('["0", "1"]', '["1", "1"]'),
                            files={"data/train.tsv": GOOD_TSV, "data/test.tsv": HELD_OUT_TSV},
                            where=R + ":9: objective.data.labels: ", says="duplicate label '1'"),
    "--set extends to a missing file": Case(sets=["extends=parent.yaml"], where=r"--set: extends: ",
                                            says="extends: parent.yaml not found"),
    "--set extends to a broken parent": Case(sets=["extends=parent.yaml"],
                                             files={"parent.yaml": BASE.replace("clip: 1.0", "clip: 0")},
                                             edit=("privatizer: {clip: 1.0, noise_multiplier: 1.5}\n", ""),
                                             where=r"parent\.yaml:8: privatizer\.clip: "),
    "delta_fail is a probability": Case(recipe=f"extends: {KLT}\nestimator: {{delta_fail: 100}}\n",
                                        where=R + ":2: estimator.delta_fail: ", says="less than 1"),
    "theory constants that overflow": Case(recipe=f"extends: {KLT}\nalgorithm: {{stat_tol: 3.0e+299}}\n"
                                                  "privatizer: {noise_multiplier: 3}\n",
                                           where=R + ":2: algorithm: ", says="out of range"),
    "a resolved recipe too large for a checkpoint header": Case(recipe="extends: p1.yaml\n", files=CHAIN,
                                                                where=R + ": ", says="could never be resumed"),
    "calibrate with an unknown accountant": Case(args=["privacy", "calibrate", "--epsilon", "1", "--delta", "1e-5",
                                                       "--steps", "10", "--sample-rate", "0.1", "--accountant", "pdl"],
                                                 says="pld"),
}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<not a file>")
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_in_one_line_and_writes_nothing(name, tmp_path):
    case = CASES[name]
    text = (case.recipe() if callable(case.recipe) else case.recipe).replace("{tmp}", str(tmp_path))
    if case.edit:
        assert case.edit[0] in text, "the case's edit does not apply"
        text = text.replace(*case.edit)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    for rel, content in case.files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.replace("{tmp}", str(tmp_path)).encode())
    for rel in case.fifos:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(tmp_path / rel)
    args = case.args or ["run", "{recipe}", "--out", "{tmp}/out"]
    args = [a.replace("{recipe}", str(recipe)).replace("{tmp}", str(tmp_path)) for a in args]
    for s in case.sets:
        args += ["--set", s]
    before = tree(tmp_path)
    res = dpreg(*args, cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    line = lines[0][len("error: "):]
    if case.where:
        assert re.search(case.where, line), (case.where, line)
    assert case.says in line, line
    assert not case.hides or case.hides not in res.stdout + res.stderr
    assert tree(tmp_path) == before  # nothing written, not even a lock or an empty folder


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 40
    print(f"\nbad inputs refused: {len(CASES)}")


def _limits() -> None:
    """A regression fails the test instead of hanging it or filling the machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (120, 120))
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _cost(args: list[str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """(seconds, peak resident MB, result) of the CLI in a fresh process (its own rusage, by wait4)."""
    import sys
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "dpregistry", *args], cwd=cwd, stdout=out, stderr=err,
                                text=True, preexec_fn=_limits)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())
        return seconds, usage.ru_maxrss / 1024, result


PLD = BASE.replace("accountant: rdp", "accountant: pld")
# hostile recipe -> the recipe a plain run of the same work would read (None: a missing file)
HEAVY = {"alias bomb": (BASE + alias_bomb(), None), "2.5 million keys": (many_keys(), None),
         "a billion steps under pld": (PLD.replace("steps: 5", "steps: 1000000000"), PLD)}


@pytest.mark.parametrize("name", sorted(HEAVY))
@pytest.mark.slow
def test_hostile_recipes_cost_seconds_and_megabytes_beyond_a_plain_refusal(name, tmp_path):
    """Issue 14's reproductions in a fresh process, against the same command on a plain recipe (or
    a missing one): at most 10 s and 100 MB more (the alias bomb grew 18 MB/s until it was killed)."""
    hostile, plain = HEAVY[name]
    (tmp_path / "recipe.yaml").write_text(hostile)
    if plain is not None:
        (tmp_path / "plain.yaml").write_text(plain)
    base_s, base_mb, res = _cost(["validate", "plain.yaml" if plain else "missing.yaml"], tmp_path)
    assert res.returncode == (0 if plain else 2), res.stderr
    seconds, peak_mb, res = _cost(["validate", "recipe.yaml"], tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert seconds - base_s < 10, (seconds, base_s)
    assert peak_mb - base_mb < 100, (peak_mb, base_mb)


# ---------------------------------------------------------------------------------------------
# fuzzing the recipe loader
# ---------------------------------------------------------------------------------------------

BASE_DICT = yaml.safe_load(BASE)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["auto", "dp_adam", "gaussian", "poisson", "1e-5", ".nan",
                                                           "sgd", "tabular", "mlp", "rdp", "pld", "zcdp"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


def paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from paths(v, prefix + (k,))


ALL_PATHS = list(paths(BASE_DICT))
KEYS = sorted({p[-1] for p in ALL_PATHS} | {"name", "extends", "clip", "lr", "betas", "hidden", "epsilon"})


@st.composite
def mutated(draw):
    import copy

    d = copy.deepcopy(BASE_DICT)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(ALL_PATHS))
        node = d
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        op = draw(st.sampled_from(["delete", "replace", "add", "rename"]))
        if op == "delete":
            node.pop(path[-1], None)
        elif op == "replace":
            node[path[-1]] = draw(VALUES)
        elif op == "add":
            node[draw(st.sampled_from(KEYS + ["zz"]))] = draw(VALUES)
        elif path[-1] in node:
            node[draw(st.text(min_size=1, max_size=10))] = node.pop(path[-1])
    return d


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(recipe=mutated())
def test_fuzzed_recipes_give_a_recipe_or_a_user_error(recipe, tmp_path_factory):
    from dpregistry.errors import UserError
    from dpregistry.recipe import Recipe, load

    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    try:
        r = load(path)
    except UserError as e:
        assert str(e) and "\n" not in e.message.strip()
        event(f"refused: {e.key}")
        return
    event("valid")
    assert isinstance(r, Recipe)
    assert load(path).hash == r.hash  # and a valid one loads the same way twice


@FUZZ
@given(data=st.data())
def test_fuzzed_recipe_text_gives_a_recipe_or_a_user_error(data, tmp_path_factory):
    """Byte-level damage: cut, duplicate or overwrite characters of the YAML text."""
    from dpregistry.errors import UserError
    from dpregistry.recipe import load

    text = BASE
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 8)))
        text = text[:i] + data.draw(st.sampled_from(["", ":", "{", "}", "[", "-", " ", "\t", "\n", "'", '"', "&a",
                                                     "*a", "!!python/object:os.system", "0", "x", text[i:j]])) + text[j:]
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(text)
    try:
        load(path)
    except UserError:
        pass


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(recipe=mutated())
def test_fuzzed_recipes_that_load_also_prepare_or_give_a_user_error(recipe, tmp_path_factory):
    """Further down: data, model and budget checks of the recipes the loader accepts."""
    from dpregistry.run import Run
    from dpregistry.errors import UserError
    from dpregistry.recipe import load

    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    try:
        Run(load(path)).prepare()
        event("prepared")
    except UserError as e:
        event(f"refused: {e.key}")


def test_nan_that_a_stage_schema_coerces_from_a_string_is_refused(tmp_path):
    """A plugin's unconstrained float accepts the string "nan" (pydantic turns it into NaN): the
    recipe loader checks the validated values too."""
    from dpregistry import StageParams, UpdateRule, hookimpl
    from dpregistry.errors import UserError
    from dpregistry.recipe import load
    from dpregistry.registry import Registry

    class LooseParams(StageParams):
        lr: float = 0.1
        beta: float = 0.5  # no range: NaN passes pydantic

    class Loose(UpdateRule):
        """An update rule with an unconstrained float."""

        name = "loose_sgd"
        Params = LooseParams

    class Plugin:
        @hookimpl
        def dpreg_register_update_rules(self, register):
            register(Loose)

    reg = Registry().load_entry_points()
    reg.add_plugin(Plugin(), origin="test 0 (test)")
    path = tmp_path / "recipe.yaml"
    path.write_text(BASE.replace("update: {lr: 0.1}", "update: {name: loose_sgd, beta: 0.5}"))
    assert load(path, registry=reg).data["update"]["beta"] == 0.5
    with pytest.raises(UserError) as e:
        load(path, ["update.beta=nan"], registry=reg)
    assert e.value.key == "update.beta" and e.value.file == "--set"
    assert "NaN" in e.value.message or "finite" in e.value.message


# ---------------------------------------------------------------------------------------------
# extreme numbers: answers, not tracebacks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld", "zcdp"])
@pytest.mark.parametrize("z, expected", [("1e-170", "inf"), ("1.0e-320", "inf"), ("1e300", "0"), ("inf", "0")])
def test_privacy_epsilon_at_extreme_noise_is_an_answer(accountant, z, expected):
    """σ/Δ of 1e-170 divided by zero in dp-accounting's RDP code, 1e300 overflowed in rdp and pld, and
    pld refused an infinite noise: no noise is no privacy (ε = ∞), infinite noise costs nothing."""
    res = dpreg("privacy", "epsilon", "--noise-multiplier", z, "--steps", "10", "--sample-rate", "0.1",
                "--delta", "1e-5", "--accountant", accountant)
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, res.stderr
    assert res.stdout.startswith(f"ε = {expected} at δ"), res.stdout


@pytest.mark.parametrize("name", ["rdp", "pld", "zcdp"])
def test_noise_beyond_what_the_libraries_compute_is_accounted_conservatively(name):
    """Outside [Z_MIN, Z_MAX] dp-accounting's curves overflow or come out as 0 (ε = 0 at σ/Δ = 1e-160,
    subsampled): rdp and pld account such a release as non-private (below) or at Z_MAX (above),
    never less ε than a multiplier the library computes reliably would give."""
    from dpreg_accounting.accountants import Z_MAX, Z_MIN

    from dpregistry.privacy.accountant import Budget, make_accountant
    from dpregistry.privacy.events import Gaussian, PoissonSampled
    from dpregistry.stages import Charge

    acc = make_accountant(name, Budget(epsilon=1.0, delta=1e-5))

    def eps(z, q=0.1):
        return acc.epsilon(extra=[Charge(PoissonSampled(q, Gaussian(std=z, sensitivity=1.0)), count=10)])

    assert eps(1e-170) == math.inf and eps(0.0) == math.inf
    assert 0 < eps(1.0) < math.inf
    if name == "zcdp":  # closed form: exact at any σ (ρ overflows to ∞ for a tiny one)
        assert eps(1e300) == 0 and eps(1e-100) > 1e100
        return
    assert eps(Z_MIN / 2) == math.inf
    assert eps(1e300) == eps(Z_MAX) >= eps(Z_MAX * 10) >= 0
    assert eps(Z_MAX) < 1e-6


def test_set_extends_is_applied_like_extends_in_the_recipe(tmp_path):
    """`--set extends=…` was silently dropped; it means what `extends:` in the recipe means (a path
    relative to the recipe's folder)."""
    (tmp_path / "parent.yaml").write_text(BASE.replace("clip: 1.0", "clip: 3.5"))
    (tmp_path / "child.yaml").write_text("train: {steps: 7}\n")
    res = dpreg("show", tmp_path / "child.yaml", "--set", "extends=parent.yaml")
    assert res.returncode == 0, res.stderr
    shown = yaml.safe_load(res.stdout)
    assert shown["privatizer"]["clip"] == 3.5 and shown["train"]["steps"] == 7
    # and it replaces the recipe's own parent
    (tmp_path / "child.yaml").write_text("extends: nowhere.yaml\ntrain: {steps: 7}\n")
    assert yaml.safe_load(dpreg("show", tmp_path / "child.yaml", "--set", "extends=parent.yaml").stdout) == shown


def test_ranks_with_different_recipes_are_refused_at_the_key_that_differs(tmp_path):
    """The refusal named no file: it names this rank's recipe, the line and the key that differs."""
    from test_core_review import two_ranks

    from conftest import write_recipe
    from dpregistry.run import Run
    from dpregistry.errors import UserError
    from dpregistry.recipe import load

    ranks = two_ranks()
    first = load(write_recipe(tmp_path, BASE, "rank0.yaml"))
    other = load(write_recipe(tmp_path, BASE.replace("clip: 1.0", "clip: 2.0"), "rank1.yaml"))
    Run(first, comm=ranks(0)).prepare()
    with pytest.raises(UserError, match="ranks resolved different recipes") as e:
        Run(other, comm=ranks(1)).prepare()
    assert (Path(e.value.file).name, e.value.line, e.value.key) == ("rank1.yaml", 8, "privatizer.clip")


def test_a_resolved_recipe_too_large_for_a_checkpoint_header_is_refused_before_it_runs():
    """Every checkpoint stores the resolved recipe in its safetensors header, which safetensors
    refuses beyond 100 MB: a recipe too large for its share would run and never resume."""
    from dpregistry.checkpoint import HEADER_LIMIT
    from dpregistry.errors import UserError
    from dpregistry.recipe import resolve
    from dpregistry.registry import get_registry

    data = yaml.safe_load(BASE)
    data["description"] = '"' * (HEADER_LIMIT // 40)  # 4 header bytes each: 0.1 of the limit
    resolve(dict(data, description="fine"), {}, get_registry())
    with pytest.raises(UserError, match="could never be resumed"):
        resolve(data, {}, get_registry())


# ---------------------------------------------------------------------------------------------
# the CLI guard: every command, on generated recipes and arguments
# ---------------------------------------------------------------------------------------------

NUMBERS = [0, 1, -1, 2, 0.5, 10**13, -10**13, 1e-320, -1e-320, 1e300, -1e300, float("nan"), float("inf"),
           float("-inf")]
STRINGS = ["", "auto", "rdp", "zcdp", "poisson", "shuffle", "gaussian", "mlp", "linear", "/dev/zero", "/etc/passwd",
           "../" * 8 + "etc/shadow", "x" * 300, "é\u202e\u0000", "{not: yaml", "1e-5", "*a", "&a", "%", "true"]
HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from(NUMBERS), st.sampled_from(STRINGS))
DEEP = st.integers(20, 60).map(lambda n: __import__("functools").reduce(lambda v, _: [v], range(n), 0))
HOSTILE_VALUES = st.one_of(HOSTILE, HOSTILE, HOSTILE, DEEP, st.lists(HOSTILE, max_size=3),
                           st.dictionaries(st.sampled_from(KEYS + ["zz", "name"]), HOSTILE, max_size=3))


@st.composite
def hostile_recipe(draw):
    """A shipped-style recipe with one to three keys deleted, renamed, added or given a hostile value."""
    import copy

    d = copy.deepcopy(BASE_DICT)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(ALL_PATHS))
        node = d
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        op = draw(st.sampled_from(["delete", "replace", "replace", "add", "rename"]))
        if op == "delete":
            node.pop(path[-1], None)
        elif op == "replace":
            node[path[-1]] = draw(HOSTILE_VALUES)
        elif op == "add":
            node[draw(st.sampled_from(KEYS + ["zz"]))] = draw(HOSTILE_VALUES)
        elif path[-1] in node:
            node[draw(st.sampled_from(KEYS + ["zz", "x" * 300]))] = node.pop(path[-1])
    return d


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("\n...").strip()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished two-step run, copied into every example that resumes or reports."""
    folder = tmp_path_factory.mktemp("finished")
    (folder / "recipe.yaml").write_text(BASE.replace("steps: 5", "steps: 2"))
    res = dpreg("run", folder / "recipe.yaml", "--out", folder / "run", "-q", cwd=folder)
    assert res.returncode == 0, res.stderr
    return folder / "run"


COMMANDS = ["run", "resume", "validate", "show", "plugins", "report", "privacy calibrate", "privacy epsilon",
            "privacy report"]
# pld is left out of the guard's accountants: calibrating it to an absurd budget is bounded but
# takes half a minute (a PLD of 10^6 points at each step of the search)
ACCOUNTANTS = ["rdp", "zcdp", "rdp_filter", "nope"]


def _arguments(data, command: str, folder: Path, run_dir: Path) -> list[str]:
    draw = data.draw
    number = st.sampled_from([str(x) for x in NUMBERS] + ["0.1", "1e-5", "10", "abc", ""])
    if command in ("run", "validate", "show"):
        path = folder / "recipe.yaml"
        path.write_text(yaml.safe_dump(draw(hostile_recipe()), allow_unicode=True))
        args = [command, str(path)]
        for _ in range(draw(st.integers(0, 2))):
            key = ".".join(draw(st.sampled_from(ALL_PATHS + [("extends",), ("zz",)])))
            args += ["--set", f"{key}={_flow(draw(HOSTILE_VALUES))}"]
        if command == "run":  # short and quiet, whatever the recipe says (these come last: they win)
            args += ["--out", str(folder / draw(st.sampled_from(["out", "o" * 300, "recipe.yaml/out"]))),
                     "-q", "--set", "train.steps=2", "--set", "train.max_nonfinite_steps=10"]
        return args
    if command == "plugins":
        return ["plugins", *draw(st.sampled_from([[], ["--json"], ["--bogus"]]))]
    if command in ("resume", "report", "privacy report"):
        target = folder / "run"
        __import__("shutil").copytree(run_dir, target)
        damage = draw(st.sampled_from(["none", "recipe", "checkpoints", "path"]))
        if damage == "recipe":  # recipe.json holds a hostile recipe
            (target / "recipe.json").write_text(__import__("json").dumps(
                {"recipe": draw(hostile_recipe()), "recipe_hash": "0" * 64}))
        elif damage == "checkpoints":
            for p in (target / "checkpoints").iterdir():
                p.write_bytes(p.read_bytes()[:draw(st.integers(0, 64))])
        elif damage == "path":
            target = folder / draw(st.sampled_from(["gone", "x" * 300, "run/recipe.json"]))
        args = command.split() + [str(target)]
        if command == "privacy report":
            args += ["--points", draw(st.sampled_from(["1", "25", "0", "-1", "1000000000", "x"]))]
        return args
    args = command.split() + ["--steps", draw(st.sampled_from(["1", "10", "0", "-5", "10000000000000", "2.5"])),
                              "--sample-rate", draw(number), "--delta", draw(number),
                              "--accountant", draw(st.sampled_from(ACCOUNTANTS))]
    args += ["--epsilon", draw(number)] if command == "privacy calibrate" else ["--noise-multiplier", draw(number)]
    return args + draw(st.sampled_from([[], ["--json"], ["--relation", "add_remove"], ["--relation", "x"]]))


# 100 fixed examples in the suite (a few seconds); DPREG_GUARD_EXAMPLES=2000 hunts with fresh ones
GUARD_EXAMPLES = int(os.environ.get("DPREG_GUARD_EXAMPLES", "100"))


# No hypothesis deadline (a loaded machine would make it flaky): each example asserts its own bound.
@settings(max_examples=GUARD_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize="DPREG_GUARD_EXAMPLES" not in os.environ, database=None)
@given(data=st.data())
def test_every_command_on_hostile_input_exits_0_or_2_without_a_traceback(data, tmp_path_factory, finished_run):
    """The guard: generated recipes (wrong types, huge, tiny, negative and NaN numbers, deep nesting,
    unknown keys, odd strings) and arguments, for every command. Each exits 0 or 2, never with a
    traceback, and a refusal (2) writes nothing."""
    command = data.draw(st.sampled_from(COMMANDS))
    folder = tmp_path_factory.mktemp("guard")
    args = _arguments(data, command, folder, finished_run)
    before = tree(folder)
    t0 = time.perf_counter()
    res = dpreg(*args, cwd=folder)
    assert time.perf_counter() - t0 < 30, args  # two steps of iris at most, or a refusal
    event(f"{command}: exit {res.returncode}")
    out = res.stdout + res.stderr
    assert res.returncode in (0, 2), (args, out[-2000:])
    assert "Traceback" not in out, (args, out[-2000:])
    if res.returncode == 2:  # one error (a resume may warn about damaged checkpoints first)
        assert len([x for x in res.stderr.splitlines() if x.startswith("error: ")]) == 1, (args, res.stderr)
        assert tree(folder) == before, args
