"""Bad input, refused clearly: a corpus of malformed recipes, data and CLI invocations.

Every case exits with code 2 and prints exactly one line, ``error: FILE:LINE: KEY: message`` (file,
line and key where they apply), with no traceback, and writes nothing anywhere. The cases run
in-process (typer's CliRunner). Hypothesis then fuzzes the recipe loader: random mutations of a
valid recipe give a valid recipe or a UserError, never anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from test_core_cli import dpreg

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


@dataclass
class Case:
    recipe: str = BASE                       # recipe text ({tmp} is the test's folder)
    edit: tuple[str, str] | None = None      # (old, new) applied to the recipe text
    args: list[str] | None = None            # CLI arguments; default: run the recipe with --out
    sets: list[str] = field(default_factory=list)
    files: dict[str, str | bytes] = field(default_factory=dict)  # extra files to create
    where: str | None = None                 # regex the error line must match (file:line: key)
    says: str = ""                           # substring of the message


R = r"recipe\.yaml"  # the recipe's file name in `where`

CASES: dict[str, Case] = {
    # --- files and YAML ---------------------------------------------------------------------
    "recipe file missing": Case(args=["run", "{tmp}/nope.yaml"], where=r"nope\.yaml: ", says="not found"),
    "recipe is a folder": Case(args=["run", "{tmp}/adir"], files={"adir/x": ""}, where=r"adir: "),
    "recipe is not UTF-8": Case(recipe="", files={"recipe.yaml": b"seed: 0\nalgorithm: \xff\xfe\n"},
                                where=R + ": ", says="cannot read"),
    "YAML: unclosed brace": Case(edit=("update: {lr: 0.1}", "update: {lr: 0.1"), where=R + r":\d+: ",
                                 says="YAML syntax error"),
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
                                    where=R + ":7: objective.trainable: ", says="no trainable parameters"),
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
    "error in a parent recipe": Case(recipe="extends: parent.yaml\ntrain: {steps: 3}\n",
                                     files={"parent.yaml": BASE.replace("clip: 1.0", "clip: 0")},
                                     where=r"parent\.yaml:8: privatizer\.clip: "),
    # --- data -------------------------------------------------------------------------------
    "missing data path": Case(recipe=TEXT.replace("DATA", "{tmp}/nodata"), where=R + ":6: objective.data.path: ",
                              says="not found"),
    "missing data file": Case(recipe=TEXT.replace("DATA", "{tmp}/data"), files={"data/test.tsv": GOOD_TSV},
                              where=r"train\.tsv: ", says="not found"),
    "empty data set": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                           files={"data/train.tsv": "sentence\tlabel\n", "data/test.tsv": GOOD_TSV},
                           where=r"train\.tsv: ", says="empty"),
    "label outside the declared set": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                                           files={"data/train.tsv": GOOD_TSV + "odd\t2\n", "data/test.tsv": GOOD_TSV},
                                           where=r"train\.tsv:5: ", says="'2' is not one of the declared labels"),
    "malformed TSV row": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                              files={"data/train.tsv": GOOD_TSV.replace("splendid\t1", "splendid\t1\textra"),
                                     "data/test.tsv": GOOD_TSV},
                              where=r"train\.tsv:4: ", says="malformed TSV row"),
    "missing label column": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                                 files={"data/train.tsv": GOOD_TSV.replace("label", "stars"), "data/test.tsv": GOOD_TSV},
                                 where=r"train\.tsv:2: ", says="column 'label' is missing"),
    "data file is not UTF-8": Case(recipe=TEXT.replace("DATA", "{tmp}/data"),
                                   files={"data/train.tsv": b"sentence\tlabel\n\xff\xfe bad\t1\n", "data/test.tsv": GOOD_TSV},
                                   where=r"train\.tsv: ", says="UTF-8"),
    "unknown data format": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("train.tsv", "train.xlsx"),
                                files={"data/train.xlsx": "x", "data/test.tsv": GOOD_TSV},
                                where=r"train\.xlsx: ", says="unknown data format"),
    "missing model folder": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("path: minilm", "path: /no/model"),
                                 files={"data/train.tsv": GOOD_TSV, "data/test.tsv": GOOD_TSV},
                                 where=R + ":4: objective.model.path: ", says="not found"),
    "pickle-only model folder": Case(recipe=TEXT.replace("DATA", "{tmp}/data").replace("path: minilm", "path: {tmp}/m"),
                                     files={"data/train.tsv": GOOD_TSV, "data/test.tsv": GOOD_TSV,
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
    "calibrate with an unknown accountant": Case(args=["privacy", "calibrate", "--epsilon", "1", "--delta", "1e-5",
                                                       "--steps", "10", "--sample-rate", "0.1", "--accountant", "pdl"],
                                                 says="pld"),
}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_in_one_line_and_writes_nothing(name, tmp_path):
    case = CASES[name]
    text = case.recipe.replace("{tmp}", str(tmp_path))
    if case.edit:
        assert case.edit[0] in text, "the case's edit does not apply"
        text = text.replace(*case.edit)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    for rel, content in case.files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.replace("{tmp}", str(tmp_path)).encode())
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
    assert tree(tmp_path) == before  # nothing written, not even a lock or an empty folder


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 40
    print(f"\nbad inputs refused: {len(CASES)}")


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
    from dpregistry.engine import Run
    from dpregistry.errors import UserError
    from dpregistry.recipe import load

    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    try:
        Run(load(path), None).prepare()
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
