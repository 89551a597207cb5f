"""Export to Hugging Face (issue 16, item 3): `dpreg export RUN --to DIR` and `Result.export(DIR)`.

The round trip is checked in a fresh Python process that imports only transformers (and peft): the
reloaded model must give the run's held-out predictions, its logits bit for bit. The model card's
numbers are summary.json's to the last digit (user-level ones included) and agree with an
independent accounting of the same plan; what cannot be exported exactly is refused in one line
with nothing written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dpregistry
from conftest import SST2_SUBSET, held_out_tsv
from test_core_cli import dpreg

MINILM = {"seed": 0, "algorithm": "dp_adam", "description": "MiniLM at (1, 1e-5)-DP",  # stale, as after --set
          "objective": {"name": "hf_text_classification", "trainable": {"exclude": [r"embeddings\.word_embeddings"]}},
          "model": {"path": "minilm", "max_length": 32, "pooling": "transformers"},
          "data": {"path": str(SST2_SUBSET), "k_per_class": 32, "max_test": 100},
          "sampler": {"name": "poisson", "batch_size": 16}, "privatizer": {"clip": 1.0, "noise_multiplier": "auto"},
          "update": {"lr": 2e-3}, "accountant": "rdp", "privacy": {"epsilon": 6.0, "delta": 1e-5},
          "train": {"steps": 3, "progress": False}}


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """A trained MiniLM run (the transformers head) and its export by `dpreg export`."""
    root = tmp_path_factory.mktemp("minilm")
    result = dpregistry.train(MINILM, out=root / "run", verbose=False)
    res = dpreg("export", root / "run", "--to", root / "hf")
    assert res.returncode == 0, res.stderr
    return result, root / "hf"


#: a fresh interpreter's environment: no PYTHONPATH (so no worktree of dpregistry), no network
PLAIN_ENV = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error",
             "HOME": os.environ.get("HOME", "/tmp")}


def fresh_python(code: str) -> tuple[dict, list[str]]:
    """Run ``code`` in a new interpreter: (the JSON line it printed, its other lines). The modules it
    imported are checked: nothing of dpregistry may be on the reload path."""
    code += "\nimport sys as _s, json as _j\nprint(_j.dumps({'dpregistry_modules': [m for m in _s.modules if " \
            "m.startswith(('dpregistry', 'dpreg_'))]}))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=PLAIN_ENV)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert lines[-1] == {"dpregistry_modules": []}
    return (lines[0] if len(lines) > 1 else {}), [line for line in res.stdout.splitlines() if not line.startswith("{")]


RELOAD = """
import csv, json, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({folder!r})
model = AutoModelForSequenceClassification.from_pretrained({folder!r}).eval()
with open({test!r}, newline="") as f:
    rows = list(csv.DictReader(f, delimiter="\\t", quoting=csv.QUOTE_NONE))[:100]   # the run's data.max_test
texts, labels = [r["sentence"].strip() for r in rows], [model.config.label2id[r["label"]] for r in rows]
logits = []
with torch.no_grad():
    for s in range(0, len(texts), 128):   # the run's evaluation batches
        batch = tokenizer(texts[s:s + 128], padding=True, truncation=True, return_tensors="pt")
        logits += model(**batch).logits.tolist()
predicted = [max(range(len(l)), key=l.__getitem__) for l in logits]
accuracy = sum(p == y for p, y in zip(predicted, labels)) / len(labels)
print(json.dumps({{"logits": logits, "predicted": predicted, "accuracy": accuracy}}))
"""


def run_logits(objective) -> tuple[torch.Tensor, dict]:
    """The run's own held-out logits, as its evaluation computes them (its tokenization, padding and
    batches), and the metrics of that evaluation."""
    seen = []
    own = objective._logits

    def record(ids, mask):
        seen.append(own(ids, mask).float())
        return seen[-1]

    objective._logits = record
    try:
        metrics = objective.evaluate()
    finally:
        del objective._logits
    return torch.cat(seen), metrics


def card_snippet(folder: Path) -> str:
    return re.search(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S).group(1)


def test_a_minilm_export_reloads_in_plain_transformers_with_the_runs_held_out_predictions(minilm):
    """One fresh interpreter (plain transformers) evaluates the export on the held-out file and
    then runs the model card's snippet as written."""
    result, folder = minilm
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "dpregistry.json"} <= {p.name for p in folder.iterdir()}
    assert not list(folder.parent.glob(".hf*"))  # no temporary folder left beside it
    snippet = card_snippet(folder)
    assert "dpregistry" not in snippet and str(folder) in snippet
    got, printed = fresh_python(RELOAD.format(folder=str(folder), test=str(SST2_SUBSET / "test.tsv"))
                                + f"\nexec({snippet!r})")
    assert printed in (["['0']"], ["['1']"])  # the snippet's prediction, a label of the data
    mine, metrics = run_logits(result.run.objective)
    assert metrics == result.metrics   # the evaluation the logits come from is the run's
    assert len(got["predicted"]) == len(mine) == 100
    assert got["accuracy"] == result.metrics["accuracy"]
    assert got["predicted"] == mine.argmax(-1).tolist()
    assert torch.equal(torch.tensor(got["logits"], dtype=torch.float32), mine)   # the same function, bit for bit
    # the file holds the trained encoder, and the frozen word embeddings as the pretrained model has them
    from safetensors.torch import load_file

    from dpregistry.hf import resolve_model_dir

    saved, pretrained = load_file(folder / "model.safetensors"), load_file(Path(resolve_model_dir("minilm")) /
                                                                           "model.safetensors")
    q = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(saved[f"bert.{q}"], pretrained[q])
    w = "embeddings.word_embeddings.weight"
    assert torch.equal(saved[f"bert.{w}"], pretrained[w])


CARD_ROWS = {"ε": "epsilon", "δ": "delta", "steps": "step", "noise multiplier (noise std / clip)": "noise_multiplier"}


def card_table(card: str) -> dict[str, str]:
    """The privacy table's rows of a model card: quantity -> value."""
    section = card.split("## Privacy guarantee", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", section, re.M))


def assert_card_states_the_summary(card: str, summary: dict) -> None:
    """The card's numbers are the run's, to the last digit."""
    rows = card_table(card)
    for quantity, key in CARD_ROWS.items():
        assert float(rows[quantity].split(" ")[0]) == summary[key], (quantity, rows[quantity], summary[key])
    if summary.get("target_epsilon") is not None:
        assert rows["ε"].endswith(f"(budget {summary['target_epsilon']!r})")


def test_the_model_card_states_the_runs_guarantee(minilm):
    """ε, δ, steps and the noise multiplier are summary.json's to the last digit; accountant,
    relation, unit, noise, sample rate, clip and data set are stated; and ε is what `dpreg privacy
    epsilon`'s independent accounting gives for the same Poisson-sampled plan."""
    from dpregistry.cli import _accountant, _subsampled_plan

    result, folder = minilm
    card = (folder / "README.md").read_text()
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert_card_states_the_summary(card, summary)
    meta = json.loads((folder / "dpregistry.json").read_text())
    p = meta["privacy"]
    assert {k: p[k] for k in ("epsilon", "delta", "noise_multiplier", "unit", "noise", "guarantee")} == \
        {k: summary[k] for k in ("epsilon", "delta", "noise_multiplier", "unit", "noise", "guarantee")}
    z, steps, q = summary["noise_multiplier"], 3, 16 / 64   # 32 examples per class, 2 classes
    independent = _accountant("rdp", None, 1e-5).epsilon(1e-5, extra=_subsampled_plan(steps, q, "replace_one")(z))
    assert p["epsilon"] == pytest.approx(independent, rel=1e-9) and p["epsilon"] <= 6.0
    assert (p["delta"], p["accountant"], p["relation"], p["unit"], p["noise"], p["guarantee"]) == \
        (1e-5, "rdp", "replace_one", "example", "secure", True)
    assert (p["steps"], p["sampling"], p["clip"]) == (3, ["0.25 (Poisson)"], 1.0)
    assert p["dataset"].startswith(str(SST2_SUBSET))   # the recipe's data folder (and its train file, if named)
    rows = card_table(card)
    assert rows["accountant"] == "rdp (Rényi DP)" and rows["neighbouring relation"].startswith("replace-one")
    assert rows["privacy unit"].startswith("one example") and rows["noise"].startswith("secret, drawn under a fresh key")
    assert (rows["sample rate"], rows["clip (per-example L2 norm)"]) == ("0.25 (Poisson)", "1.0")
    assert rows["data set"] == p["dataset"]
    assert f"| accuracy | {result.metrics['accuracy']!r} |" in card
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-classification\n"
                           'base_model: "sentence-transformers/all-MiniLM-L6-v2"\n')
    assert "NOT a privacy guarantee" not in card and "tags: [differential-privacy, dpregistry]" in card
    assert meta["recipe_hash"] == result.run.recipe.hash
    # the title says what ran; the recipe's (here stale) description is quoted as its own words
    assert next(line for line in card.splitlines() if line.startswith("# ")) == "# dp_adam on hf_text_classification"
    assert 'The recipe\'s own description: "MiniLM at (1, 1e-5)-DP"' in card


def test_result_export_writes_what_the_cli_writes(minilm, tmp_path):
    """From Python, the in-memory model; from the CLI, the model rebuilt from the run folder:
    the same weights bit for bit (frozen ones included), the same guarantee."""
    from safetensors.torch import load_file

    result, folder = minilm
    out = result.export(tmp_path / "py")
    a, b = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    pa, pb = (json.loads((f / "dpregistry.json").read_text())["privacy"] for f in (out, folder))
    assert pa == pb


def one_line_refusal(res, *words):
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("error:") and "Traceback" not in line, line
    for w in words:
        assert w in line, line


def test_what_cannot_be_exported_is_refused_and_nothing_is_written(minilm, tmp_path):
    import shutil

    result, _ = minilm
    run = result.run_dir
    # a folder that holds something, without --overwrite; the run folder itself, even with it
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    one_line_refusal(dpreg("export", run, "--to", tmp_path / "full"), "not empty", "--overwrite")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    one_line_refusal(dpreg("export", run, "--to", run, "--overwrite"), "run folder")
    one_line_refusal(dpreg("export", run, "--to", run.parent, "--overwrite"), "run folder")
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    # inside it: --overwrite replaced the checkpoints folder, and resume and the privacy report failed (review 14)
    one_line_refusal(dpreg("export", run, "--to", run / "checkpoints", "--overwrite"), "run folder, inside it")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints
    assert (run / "summary.json").exists() and (run / "model.safetensors").exists()
    # nothing to merge
    one_line_refusal(dpreg("export", run, "--to", tmp_path / "m", "--merge"), "--merge", "no LoRA")
    # a run that has not finished
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished)
    (unfinished / "model.safetensors").unlink()
    one_line_refusal(dpreg("export", unfinished, "--to", tmp_path / "u"), "has not finished", "dpreg resume")
    # killed during the final evaluation: the model is written, the summary (its guarantee) is not
    shutil.copy(run / "model.safetensors", unfinished / "model.safetensors")
    (unfinished / "summary.json").unlink()
    one_line_refusal(dpreg("export", unfinished, "--to", tmp_path / "u"), "no summary.json", "has not finished")
    one_line_refusal(dpreg("export", tmp_path / "nowhere", "--to", tmp_path / "n"), "run folder not found")
    assert not any((tmp_path / n).exists() for n in ("m", "u", "n"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_card_states_privacy_from_checked_records_not_from_summary_json(minilm, tmp_path):
    """summary.json has no checksum: a review set its ε to 0.5 and its noise to "secure" in a
    reproducible run, deleted ledger.jsonl, and the card stated (0.5, δ)-DP with no word that the ε
    is no guarantee. ε is recomputed from the checkpoint's ledger and the noise mode is the
    recipe's; a ledger.jsonl that does not end at the model's ledger is refused."""
    import shutil

    result, _ = minilm
    edited = tmp_path / "edited"
    shutil.copytree(result.run_dir, edited)
    summary = json.loads((edited / "summary.json").read_text())
    (edited / "summary.json").write_text(json.dumps({**summary, "epsilon": 0.5, "noise": "secure",
                                                     "guarantee": True}))
    assert dpreg("export", edited, "--to", tmp_path / "hf").returncode == 0
    stated = json.loads((tmp_path / "hf" / "dpregistry.json").read_text())["privacy"]
    assert stated["epsilon"] == pytest.approx(result.epsilon, rel=1e-9) and stated["epsilon"] > 0.5
    assert (stated["noise"], stated["guarantee"]) == (result.summary["noise"], result.summary["guarantee"])
    (edited / "ledger.jsonl").unlink()
    one_line_refusal(dpreg("export", edited, "--to", tmp_path / "hf2"), "ledger.jsonl is missing")
    assert not (tmp_path / "hf2").exists()


def test_a_pooled_linear_head_is_refused_rather_than_approximated(tmp_path):
    """Mean pooling with a head on normalised features (the shipped MiniLM recipes) is no
    transformers architecture: the refusal says so and how to train an exportable model."""
    recipe = {**MINILM, "model": {"path": "minilm", "max_length": 16, "pooling": "mean",
                                  "head_init": "label_descriptions",
                                  "label_descriptions": ["It was terrible.", "It was great."]},
              "data": {"path": str(SST2_SUBSET), "labels": ["0", "1"], "k_per_class": 4, "max_test": 4},
              "sampler": {"batch_size": 4},
              "train": {"steps": 1, "progress": False}}
    result = dpregistry.train(recipe, out=tmp_path / "run", verbose=False)
    res = dpreg("export", tmp_path / "run", "--to", tmp_path / "hf")
    one_line_refusal(res, "recipe.json: model.pooling:", "pooling: mean with normalised features",
                     "pooling: transformers")
    with pytest.raises(dpregistry.UserError, match="not a transformers architecture"):
        result.export(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_objective_without_a_transformers_model_is_refused(tmp_path):
    recipe = {"algorithm": "dp_sgd", "objective": {"name": "quadratic", "dim": 3, "n": 64, "n_test": 8},
              "sampler": {"batch_size": 8}, "privacy": {"epsilon": 2.0, "delta": 1e-5},
              "train": {"steps": 2, "progress": False}}
    result = dpregistry.train(recipe, out=tmp_path / "run", verbose=False)
    one_line_refusal(dpreg("export", tmp_path / "run", "--to", tmp_path / "hf"), "'quadratic'",
                     "no transformers model")
    with pytest.raises(dpregistry.UserError, match="no transformers model"):
        result.export(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_transformers_head_has_no_label_description_init(tmp_path):
    bad = {**MINILM, "model": {**MINILM["model"], "head_init": "label_descriptions"}}
    with pytest.raises(dpregistry.UserError, match="label_descriptions needs pooling: mean or cls") as e:
        dpregistry.train(bad, verbose=False)
    assert e.value.key.startswith("objective.model")


# ------------------------------------------------------------------------------------------------
# prompt-based language models (DPZero's objectives): the LM itself, a LoRA adapter, or merged
# ------------------------------------------------------------------------------------------------

SENTENCES = [("a gripping , beautifully made film", 1), ("dull", 0), ("it never finds its footing and the jokes "
             "fall flat again and again", 0), ("wonderful", 1), ("an utterly charming and moving story of friendship",
             1), ("bad", 0), ("the plot is thin", 0), ("one of the year 's best", 1)]


def word_tokenizer(kind: str):
    """A whole-word tokenizer over the sentences' words (a real transformers tokenizer, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for s, _ in SENTENCES for w in s.split()} | {"It", "was", "terrible", "great", "."})
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if kind == "opt":  # OPT: </s> first; RoBERTa: <s> ... </s>
        tk.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    else:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>" if kind == "roberta" else "</s>",
                                   eos_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>"), len(vocab)


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    """Tiny pretrained OPT and RoBERTa folders (weights and tokenizer) and a small SST-2-like table."""
    from transformers import OPTConfig, OPTForCausalLM, RobertaConfig, RobertaForMaskedLM

    root = tmp_path_factory.mktemp("lms")
    torch.manual_seed(0)
    tok, n = word_tokenizer("opt")
    opt = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
               word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    OPTForCausalLM(OPTConfig(vocab_size=n, **opt)).save_pretrained(root / "opt")
    OPTConfig(vocab_size=300, **opt).save_pretrained(root / "opt_bytes")   # room for the byte-level tokenizer
    tok.save_pretrained(root / "opt")
    tok, n = word_tokenizer("roberta")
    RobertaForMaskedLM(RobertaConfig(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=130, type_vocab_size=1,
                                     pad_token_id=1, bos_token_id=0, eos_token_id=2)).save_pretrained(root / "roberta")
    tok.save_pretrained(root / "roberta")
    (root / "data").mkdir()
    rows = "sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in SENTENCES)
    (root / "data" / "train.tsv").write_text(rows)
    (root / "data" / "test.tsv").write_text(held_out_tsv(rows))
    return root


def lm_recipe(lms, kind="causal_lm_prompt", folder=None, **model):
    folder = folder or ("opt" if kind == "causal_lm_prompt" else "roberta")
    return {"algorithm": "dpzero",
            "objective": {"name": kind, "model": {"path": str(lms / folder), "max_length": 64, **model},
                          "data": {"path": str(lms / "data"), "labels": ["0", "1"]},
                          "prompt": {"label_words": [" terrible", " great"]}},
            "sampler": {"name": "shuffle", "batch_size": 4}, "privatizer": {"clip": 1.0, "noise_multiplier": 1.0},
            "update": {"lr": 0.5}, "privacy": {"delta": 1e-3}, "train": {"steps": 3, "progress": False}}


def label_logits(model, tokenizer, objective) -> torch.Tensor:
    """Each held-out prompt alone through a plain transformers model: the label words' logits where
    the objective reads them (the last token, or the mask)."""
    words = [tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in objective.cfg.prompt.label_words]
    out = []
    with torch.no_grad():
        for s, _ in SENTENCES:
            s = "the " + s  # the held-out text (conftest.held_out_tsv)
            prompt = (objective.cfg.prompt.template or objective.default_template)
            batch = tokenizer(prompt.replace("{mask}", tokenizer.mask_token).format(sentence=s), return_tensors="pt")
            ids = batch["input_ids"][0]
            pos = int((ids == tokenizer.mask_token_id).nonzero()[0, 0]) if objective.masked else len(ids) - 1
            out.append(model(**batch).logits[0, pos, words].float())
    return torch.stack(out)


def objective_logits(objective) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([objective.label_logits([item]) for item in objective.test_tok])


def test_a_lora_run_exports_a_peft_adapter_that_plain_transformers_loads(lms, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = dpregistry.train(lm_recipe(lms, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}),
                              out=tmp_path / "run", verbose=False)
    assert dpreg("export", tmp_path / "run", "--to", tmp_path / "adapter").returncode == 0
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files   # the adapter alone; the base stays where it is
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(lms / "opt") and config["r"] == 4
    tok = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    mine = objective_logits(result.run.objective)
    # transformers' own peft integration, and peft on the base model: the run's predictions
    direct = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lms / "opt"), tmp_path / "adapter").eval()
    for model in (direct, on_base):
        got = label_logits(model, tok, result.run.objective)
        assert got.argmax(-1).tolist() == mine.argmax(-1).tolist()
        assert torch.allclose(got, mine, rtol=0, atol=1e-6)
    assert not torch.allclose(label_logits(AutoModelForCausalLM.from_pretrained(lms / "opt"), tok,
                                           result.run.objective), mine, atol=1e-4)   # the adapter matters
    # --merge: the whole model, with the weights that peft's merge_and_unload gives, bit for bit
    assert dpreg("export", tmp_path / "run", "--to", tmp_path / "merged", "--merge").returncode == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = on_base.merge_and_unload().state_dict()
    assert merged.state_dict().keys() == reference.keys()
    assert all(torch.equal(v, reference[k]) for k, v in merged.state_dict().items())
    got = label_logits(merged, tok, result.run.objective)
    assert got.argmax(-1).tolist() == mine.argmax(-1).tolist() and torch.allclose(got, mine, rtol=0, atol=1e-5)
    assert "merged into the base weights" in (tmp_path / "merged" / "README.md").read_text()


def test_a_masked_lm_run_exports_the_lm_with_its_prompt(lms, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    r = lm_recipe(lms, "masked_lm_prompt")
    r["objective"]["trainable"] = {"include": [r"layer\.1\."]}
    result = dpregistry.train(r, out=tmp_path / "run", verbose=False)
    out = result.export(tmp_path / "hf")
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    got = label_logits(model, AutoTokenizer.from_pretrained(out), result.run.objective)
    mine = objective_logits(result.run.objective)
    assert got.argmax(-1).tolist() == mine.argmax(-1).tolist() and torch.allclose(got, mine, rtol=0, atol=1e-6)
    saved, base = load_file(out / "model.safetensors"), load_file(lms / "roberta" / "model.safetensors")
    for name, p in result.run.params.items():    # trained weights as the run left them; frozen ones as loaded
        assert torch.equal(saved[name], p.detach().cpu()), name
    frozen = [k for k in base if k in saved and k not in result.run.params]
    assert frozen and all(torch.equal(saved[k], base[k]) for k in frozen)
    card = (out / "README.md").read_text()
    assert "{sentence} It was {mask} ." in card and '[" terrible", " great"]' in card
    assert "pipeline_tag: fill-mask" in card and "| δ | 0.001 |" in card and "| sample rate | none" in card


def test_a_keyed_run_exports_without_its_key(lms, tmp_path, monkeypatch):
    """Exporting rebuilds the model only: the secret noise key of a keyed run is not needed."""
    monkeypatch.setenv("DPREG_NOISE_KEY", "9f8e7d6c5b4a39281706f5e4d3c2b1a0")
    r = lm_recipe(lms)
    r["privacy"]["noise"] = "keyed"
    dpregistry.train(r, out=tmp_path / "run", verbose=False)
    monkeypatch.delenv("DPREG_NOISE_KEY")
    assert dpreg("export", tmp_path / "run", "--to", tmp_path / "hf").returncode == 0
    p = json.loads((tmp_path / "hf" / "dpregistry.json").read_text())["privacy"]
    assert p["noise"] == "keyed" and p["guarantee"] is True


def test_a_byte_tokenizer_run_is_refused(lms, tmp_path):
    r = lm_recipe(lms, folder="opt_bytes", init="random", tokenizer="byte")
    result = dpregistry.train(r, out=tmp_path / "run", verbose=False)
    one_line_refusal(dpreg("export", tmp_path / "run", "--to", tmp_path / "hf"), "byte-level", "model.tokenizer")
    with pytest.raises(dpregistry.UserError, match="byte-level"):
        result.export(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def tiny_bert_task(n: int):
    """A seeded one-layer BERT classifier, n examples of token ids labelled by the parity of their
    first token, and a per-example loss(model, batch) for dpregistry.train."""
    import torch.nn.functional as F
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=2))
    ids = torch.randint(3, 30, (n, 6))
    data = [({"input_ids": ids[i]}, int(ids[i, 0]) % 2) for i in range(n)]

    def loss(model, batch):
        inputs, y = batch
        return F.cross_entropy(model(**inputs).logits, y, reduction="none")

    return model, ids, data, loss


def test_own_model_export(tmp_path):
    """dpregistry.train's own-model path: a transformers model is saved as it is; a plain torch
    module is refused with the reason."""
    import torch.nn.functional as F
    from transformers import BertForSequenceClassification

    model, ids, data, loss = tiny_bert_task(40)
    recipe = {"algorithm": "dp_sgd", "sampler": {"batch_size": 8}, "update": {"lr": 0.1},
              "privacy": {"epsilon": 4.0, "delta": 1e-3}, "train": {"steps": 2, "progress": False}}
    result = dpregistry.train(recipe, model=model, loss=loss, train_data=data, out=tmp_path / "run", verbose=False)
    one_line_refusal(dpreg("export", tmp_path / "run", "--to", tmp_path / "cli"), "your own model", "result.export")
    out = result.export(tmp_path / "own")
    back = BertForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    assert "| data set | the train_data given to dpregistry.train |" in (out / "README.md").read_text()
    plain = dpregistry.train(recipe, model=torch.nn.Linear(4, 2), loss=lambda o, t: F.cross_entropy(o, t, reduction="none"),
                             train_data=[(torch.randn(4), i % 2) for i in range(40)], verbose=False)
    with pytest.raises(dpregistry.UserError, match="plain torch module"):
        plain.export(tmp_path / "plain")


def test_a_model_trained_by_two_runs_is_exported_by_neither(tmp_path):
    """Review 17: the module trains in place; after a second run on it, each Result's export wrote
    a card with its own run's ε (0.9995) for weights that both runs trained (composed: 1.408). A
    copy per run exports, and a resumed run's Result exports what its checkpoint continued."""
    import copy

    model, _, data, loss = tiny_bert_task(40)
    recipe = {"algorithm": "dp_sgd", "sampler": {"batch_size": 8}, "update": {"lr": 0.1},
              "privacy": {"epsilon": 4.0, "delta": 1e-3}, "train": {"steps": 2, "progress": False}}
    start = copy.deepcopy(model)
    first = dpregistry.train(recipe, model=model, loss=loss, train_data=data, verbose=False)
    second = dpregistry.train(recipe, model=model, loss=loss, train_data=data, verbose=False)
    with pytest.raises(dpregistry.UserError, match="trained again in place after this run"):
        first.export(tmp_path / "first")
    with pytest.raises(dpregistry.UserError, match=r"trained in place by another run before this one \(ε = "):
        second.export(tmp_path / "second")
    assert not (tmp_path / "first").exists() and not (tmp_path / "second").exists()
    alone = dpregistry.train(recipe, model=copy.deepcopy(start), loss=loss, train_data=data, out=tmp_path / "run",
                             verbose=False)
    assert (alone.export(tmp_path / "alone") / "README.md").exists()
    resumed = dpregistry.resume(tmp_path / "run", model=model, loss=loss, train_data=data, verbose=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), alone.model.state_dict().values()))
    assert (resumed.export(tmp_path / "resumed") / "README.md").exists()  # the checkpoint's weights, not both runs'


@pytest.mark.parametrize("sampler,mechanism,clipped", [({"name": "poisson", "batch_size": 8}, "els", "example"),
                                                      ({"name": "user_poisson", "users_per_step": 4}, "uls", "user")])
def test_a_user_level_card_states_the_users_and_k_as_the_run_did(tmp_path, sampler, mechanism, clipped):
    """User-level DP: the card's ε is the run's user-level ε (ELS: k times the example-level ε of
    the ledger, not the ledger's own), with the number of users, k and the mechanism; reproducible
    noise is said to be NOT a privacy guarantee."""
    model, ids, data, loss = tiny_bert_task(48)
    recipe = {"algorithm": "dp_sgd", "sampler": sampler, "update": {"lr": 0.1},
              "privacy": {"epsilon": 8.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 3,
                          "noise": "reproducible"}, "train": {"steps": 2, "progress": False}}
    result = dpregistry.train(recipe, model=model, loss=loss, train_data=data, users=torch.arange(48) // 4,
                              verbose=False)
    s = result.summary
    assert (s["unit"], s["users"], s["max_examples_per_user"], s["user_mechanism"]) == ("user", 12, 3, mechanism)
    card = (result.export(tmp_path / "hf") / "README.md").read_text()
    assert_card_states_the_summary(card, s)
    rows = card_table(card)
    assert rows["privacy unit"].startswith("one user (12 users)") and "at most 3 examples" in rows["privacy unit"]
    if mechanism == "els":
        example_eps = s["example_level"]["epsilon"]
        assert s["epsilon"] == pytest.approx(3 * example_eps) and f"{example_eps:.4g}" in rows["privacy unit"]
    assert f"clip (per-{clipped} L2 norm)" in rows
    assert "for user-level neighbouring" in card
    assert "**NOT a privacy guarantee.** The noise is reproducible from the recipe seed" in card
    # nor is it tagged as one, for a search of the hub (review 14)
    assert "tags: [dpregistry]" in card and "with differential privacy" not in card
    assert json.loads((tmp_path / "hf" / "dpregistry.json").read_text())["privacy"]["guarantee"] is False


def test_own_peft_model_exports_its_adapter(tmp_path):
    """Your own peft-wrapped transformers model: the adapter, which peft loads onto the same base to
    give the trained model's logits exactly."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import BertForSequenceClassification

    base, ids, data, loss = tiny_bert_task(40)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(BertForSequenceClassification.from_pretrained(tmp_path / "base"),
                           LoraConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"]))
    recipe = {"algorithm": "dp_sgd", "sampler": {"batch_size": 8}, "update": {"lr": 0.5},
              "privacy": {"epsilon": 4.0, "delta": 1e-3}, "train": {"steps": 2, "progress": False}}
    result = dpregistry.train(recipe, model=model, loss=loss, train_data=data, verbose=False)
    out = result.export(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    back = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained(tmp_path / "base"), out).eval()
    base = BertForSequenceClassification.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        mine = model.eval()(input_ids=ids).logits
        assert torch.equal(back(input_ids=ids).logits, mine)
        assert not torch.allclose(base(input_ids=ids).logits, mine)   # the adapter was trained
    assert "library_name: peft" in (out / "README.md").read_text()
    with pytest.raises(dpregistry.UserError, match="merge_and_unload"):
        result.export(tmp_path / "merged", merge=True)
    # adapters injected without a PeftModel: save_pretrained wrote base_layer/lora_A keys, which
    # from_pretrained dropped, loading query and value at random with no warning (review 14)
    from peft import inject_adapter_in_model

    injected = inject_adapter_in_model(LoraConfig(r=2, target_modules=["query", "value"]),
                                       BertForSequenceClassification.from_pretrained(tmp_path / "base"))
    result = dpregistry.train(recipe, model=injected, loss=loss, train_data=data, verbose=False)
    with pytest.raises(dpregistry.UserError, match="peft adapters outside a PeftModel"):
        result.export(tmp_path / "injected")
    assert not (tmp_path / "injected").exists()


def test_a_model_changed_after_its_run_is_not_exported_with_its_card(tmp_path):
    """Review 20: the mark was per module object, so weights trained again through a module that
    wraps them, edited by hand, or replaced by a refused resume of another run were exported with
    the first run's card; resuming a finished folder re-marked the module and refused its export."""
    import copy

    import torch

    model, _, data, loss = tiny_bert_task(40)
    recipe = {"algorithm": "dp_sgd", "sampler": {"batch_size": 8}, "update": {"lr": 0.1},
              "privacy": {"epsilon": 4.0, "delta": 1e-3}, "train": {"steps": 2, "progress": False}}
    start = copy.deepcopy(model)

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kw):
            return self.inner(*args, **kw)

    first = dpregistry.train(recipe, model=model, loss=loss, train_data=data, out=tmp_path / "first", verbose=False)
    dpregistry.train(recipe, model=Wrap(model), loss=loss, train_data=data, verbose=False)
    with pytest.raises(dpregistry.UserError, match="weights changed after this run"):
        first.export(tmp_path / "wrapped")

    edited = dpregistry.train(recipe, model=copy.deepcopy(start), loss=loss, train_data=data, verbose=False)
    with torch.no_grad():
        edited.model.classifier.weight.add_(1.0)
    with pytest.raises(dpregistry.UserError, match="weights changed after this run"):
        edited.export(tmp_path / "edited")

    again = dpregistry.resume(tmp_path / "first", model=model, loss=loss, train_data=data, verbose=False)
    assert (again.export(tmp_path / "again") / "README.md").exists()  # the checkpoint's weights: the run's
    assert (first.export(tmp_path / "first_again") / "README.md").exists()  # the same folder, the same weights
