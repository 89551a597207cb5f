"""Prompt-based classification with language models: OPT (causal) and RoBERTa (masked).

The loss of example i is the cross-entropy over the label words' logits at the position that
predicts the label word (MeZO/DPZero setting, spec §5.2):

* causal LM: the prompt is ``template`` (e.g. "{sentence} It was"); the label word would be the
  next token, so the logits come from the last prompt token;
* masked LM: the prompt holds ``{mask}`` (e.g. "{sentence} It was {mask} ."); the logits come from
  the mask position.

Only the hidden state of that one position goes through the LM head, and only the label words'
columns are kept: the same numbers as the full vocabulary logits, without a [B, L, V] tensor.
Sequences are right-padded with an attention mask, so padding never changes another example's
loss (causal attention never looks right; masked keys get zero weight; positions count real tokens).

Models: ``model.path`` is a local folder, a hub id (used only if already downloaded, see
:mod:`dpregistry.hf`), or a configuration that ships with this plugin (``opt-125m``, ``opt-1.3b``,
``opt-6.7b``, ``roberta-base``, ``roberta-large``, also under their hub ids). With
``init: random`` the architecture is built from that configuration and nothing is loaded, which is
how memory and speed are measured without the weights. Then, unless ``model.tokenizer`` names a
folder, a byte-level tokenizer stands in (:class:`ByteTokenizer`).

Trainable subsets: every parameter (default), name filters (``trainable.include``/``exclude``,
regular expressions), or LoRA adapters injected with ``peft`` (``model.lora``; the base weights
are then frozen unless ``trainable`` says otherwise). Parameters may be fp32, fp16 or bf16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dpregistry import StageParams, UserError
from dpregistry.data import Encoded, TextData, user_ids
from dpregistry.hf import quiet
from dpregistry.objectives import (DTYPES, Lora, TorchObjective, Trainable, activation_checkpointing_option,
                                   checkpoint_blocks, inject_lora, seeded)
from dpregistry.progress import track
from dpregistry.users import UserIds

CONFIGS = Path(__file__).with_name("configs")
#: names (and hub ids) whose architecture ships with the plugin, as small JSON configs
HUB_IDS = {"opt-125m": "facebook/opt-125m", "opt-1.3b": "facebook/opt-1.3b", "opt-6.7b": "facebook/opt-6.7b",
           "roberta-base": "FacebookAI/roberta-base", "roberta-large": "FacebookAI/roberta-large"}
SHIPPED = {**{k: k for k in HUB_IDS}, **{v: k for k, v in HUB_IDS.items()}}
MASK = "{mask}"


class _Sub(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptModel(_Sub):
    path: str = Field(default="opt-125m", description="folder, hub id (if downloaded) or a shipped config name")
    init: Literal["pretrained", "random"] = "pretrained"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_length: int = Field(default=128, gt=1)
    tokenizer: str | None = Field(default=None, description="tokenizer folder, or 'byte' (default: the model's; "
                                                            "byte-level for random init without one)")
    lora: Lora | None = None
    activation_checkpointing: bool = activation_checkpointing_option()


class PromptSection(_Sub):
    template: str | None = Field(default=None, description="text with {column} fields (and {mask} for masked LMs)")
    label_words: list[str] = Field(default_factory=lambda: [" terrible", " great"],
                                   description="one word per label, in label order (mind the leading space)")


class PromptParams(StageParams):
    model: PromptModel = Field(default_factory=PromptModel)
    prompt: PromptSection = Field(default_factory=PromptSection)
    data: TextData = Field(default_factory=TextData)
    trainable: Trainable = Field(default_factory=Trainable)

    @model_validator(mode="after")
    def _lora_trains_adapters(self):
        if self.model.lora is not None and not self.trainable.include:
            self.trainable = Trainable(include=["lora_"], exclude=self.trainable.exclude)
        return self


# ------------------------------------------------------------------------------------------
# tokenizers
# ------------------------------------------------------------------------------------------


class HFPromptTokenizer:
    """A Hugging Face tokenizer: the prompt with the model's special tokens; label words must be one token."""

    def __init__(self, tok):
        self.tok = tok
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.mask_text = tok.mask_token
        self.mask_id = tok.mask_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def word_id(self, word: str) -> int:
        ids = self.tok(word, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise UserError(f"label word {word!r} is {len(ids)} tokens for this tokenizer; prompt-based "
                            "classification needs one token per word (a word inside a sentence usually needs its "
                            "leading space, e.g. ' great')", key="objective.prompt.label_words")
        return ids[0]


class ByteTokenizer:
    """Stand-in tokenizer for randomly initialised models: UTF-8 bytes as ids 4–259, each label
    word and the mask as one whole token (ids 260+), the model's own bos/eos/pad ids.

    It exists so that a run from random weights (memory and speed measurements) needs no download;
    it means nothing to a pretrained model.
    """

    BYTE0 = 4

    def __init__(self, config, label_words: list[str], masked: bool):
        self.bos = config.bos_token_id
        self.eos = config.eos_token_id
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 1
        self.masked = masked
        self.words = {w: self.BYTE0 + 256 + k for k, w in enumerate(label_words)}
        self.mask_id = self.BYTE0 + 256 + len(label_words)
        self.mask_text = "\x00<mask>\x00"
        if self.mask_id >= config.vocab_size:
            raise UserError("the vocabulary is too small for the byte-level tokenizer")

    def encode(self, text: str) -> list[int]:
        ids = [] if self.bos is None else [self.bos]
        for k, part in enumerate(text.split(self.mask_text)):
            if k:
                ids.append(self.mask_id)
            ids.extend(self.BYTE0 + b for b in part.encode("utf-8"))
        if self.masked and self.eos is not None:
            ids.append(self.eos)
        return ids

    def word_id(self, word: str) -> int:
        return self.words[word]


# ------------------------------------------------------------------------------------------
# model resolution
# ------------------------------------------------------------------------------------------


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")


def _has_tokenizer(folder: str) -> bool:
    return any((Path(folder) / f).exists() for f in TOKENIZER_FILES)


def shipped_config(name: str):
    """The transformers config of a shipped architecture."""
    from transformers import AutoConfig

    data = json.loads((CONFIGS / f"{SHIPPED[name]}.json").read_text())
    data.pop("architectures", None)
    data.pop("_name_or_path", None)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _random_init_hint() -> str:
    return ("; or run with --set model.init=random to build the same architecture from random weights "
            "(for memory and speed measurements)")


def resolve_config(path: str, init: str):
    """(config, folder or None): the architecture and, if there is one, a local folder with files."""
    from transformers import AutoConfig

    from dpregistry.hf import require_regular_files, resolve_model_dir

    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise UserError(f"{p} has no config.json; it is not a Hugging Face model folder", key="model.path")
        require_regular_files(p)
        try:
            return AutoConfig.from_pretrained(p), str(p)
        except (OSError, ValueError) as e:  # not JSON, an unknown model type
            raise UserError(f"{p}/config.json: {str(e).splitlines()[0][:200]}", key="model.path") from None
    if init == "random" and path in SHIPPED:
        return shipped_config(path), None
    if init == "pretrained" and path in SHIPPED and "/" not in path:
        raise UserError(f"{path!r} names a shipped configuration without weights; set model.path to a folder "
                        f"with the weights (a download of {HUB_IDS[path]})" + _random_init_hint(),
                        key="model.path")
    try:
        folder = resolve_model_dir(path, need_weights=init == "pretrained")
    except UserError as e:
        raise UserError(e.message + (_random_init_hint() if init == "pretrained" else ""), key="model.path") from None
    return AutoConfig.from_pretrained(folder), folder


# ------------------------------------------------------------------------------------------
# objectives
# ------------------------------------------------------------------------------------------


class PromptLM(TorchObjective):
    """Shared machinery; subclasses say which position is read and which LM class to build."""

    Params = PromptParams
    masked: bool = False
    default_template: str = ""
    provides = (UserIds,)  # privacy.unit: user, from data.user or data.rows_per_user

    def provide(self, kind):
        return user_ids(self.train_tok.table)

    # -- build ----------------------------------------------------------------------------

    def _auto_class(self):
        from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

        return AutoModelForMaskedLM if self.masked else AutoModelForCausalLM

    def _load_model(self, ctx):
        m = self.cfg.model
        config, folder = resolve_config(m.path, m.init)
        dtype = DTYPES[m.dtype]
        auto = self._auto_class()
        try:
            with seeded(ctx.rng.seed("init", 0)), quiet():
                if m.init == "random":
                    with torch.device(ctx.device):
                        lm = auto.from_config(config, dtype=dtype)
                else:
                    lm = auto.from_pretrained(folder, dtype=dtype).to(ctx.device)
        except ValueError as e:  # a config this LM class does not know
            kind = "masked" if self.masked else "causal"
            raise UserError(f"{m.path!r} is not a {kind} language model ({str(e).splitlines()[0]})",
                            key="model.path") from None
        except OSError as e:
            raise UserError(f"cannot load the weights of {m.path!r} ({str(e).splitlines()[0]})"
                            + _random_init_hint(), key="model.path") from None
        if m.lora is not None:
            lm = inject_lora(lm, m.lora, ctx.rng.seed("lora_init", 0), ctx.device, dtype)
        if m.activation_checkpointing:
            checkpoint_blocks(lm)
        return lm, config, folder

    def _tokenizer(self, config, folder):
        m = self.cfg.model
        words = self.cfg.prompt.label_words
        if m.tokenizer == "byte":
            return ByteTokenizer(config, words, self.masked)
        from transformers import AutoTokenizer

        source = m.tokenizer or (folder if folder is not None and _has_tokenizer(folder) else None)
        if source is not None:
            try:
                return HFPromptTokenizer(AutoTokenizer.from_pretrained(source))
            except (OSError, ValueError):
                if m.tokenizer is not None or m.init == "pretrained":
                    raise UserError(f"no tokenizer found in {source!r}", key="model.tokenizer") from None
        if m.init == "pretrained":
            raise UserError("a pretrained model needs its tokenizer; set model.tokenizer", key="model.tokenizer")
        return ByteTokenizer(config, words, self.masked)

    def build(self, ctx):
        # The model comes first: missing weights are the first thing a user should hear about.
        # (The run locates a UserError's key in the recipe: ``model.path`` is objective.model.path.)
        self.lm, config, folder = self._load_model(ctx)
        self.model = self.lm
        self.model_folder = folder
        self.tok = self._tokenizer(config, folder)
        words = self.cfg.prompt.label_words  # pair with the labels by position: the order must be given
        train, test = self.cfg.data.load(pairs=("prompt.label_words", words))
        self.word_ids = torch.tensor([self.tok.word_id(w) for w in words], device=ctx.device)
        if len(set(self.word_ids.tolist())) != len(words):
            raise UserError("two label words map to the same token", key="objective.prompt.label_words")
        self.n_train = len(train)
        self._fingerprint = train.digest()
        self.label_names = train.label_names
        self.cols = train.columns
        # prompts are encoded per batch from the memory-mapped rows; a set that fits the cache is
        # encoded now, so that a prompt that cannot be read out is refused before step 1
        self.train_tok = Encoded(train, self._encode_all)
        self.test_tok = Encoded(test, self._encode_all)
        for encoded in (self.train_tok, self.test_tok):
            if not encoded.prefetch():
                encoded[0]  # noqa: B018  (the template, at least, is checked before step 1)
        self.y_train = torch.as_tensor(train.labels, device=ctx.device)
        self.y_test = torch.as_tensor(test.labels, device=ctx.device)

    # -- prompts ----------------------------------------------------------------------------

    def _prompt(self, fields: tuple[str, ...]) -> str:
        template = self.cfg.prompt.template or self.default_template
        values = {c: f.strip() for c, f in zip(self.cols, fields)}
        try:
            return template.replace(MASK, "\x00MASK\x00").format(**values).replace(
                "\x00MASK\x00", self.tok.mask_text or "")
        except (KeyError, IndexError) as e:  # {name} of no column; {0}: columns are named, by data.columns
            raise UserError(f"prompt.template names {e} but the data columns are {self.cols}",
                            key="objective.prompt.template") from None
        except ValueError as e:  # a lone brace
            raise UserError(f"prompt.template is not a template ({e})", key="objective.prompt.template") from None

    def _encode_all(self, examples) -> list[tuple[list[int], int]]:
        return [self._encode(fields) for fields in examples]

    def _encode(self, fields) -> tuple[list[int], int]:
        """(token ids, the position whose logits predict the label word)."""
        ids = self.tok.encode(self._prompt(fields))
        L = self.cfg.model.max_length
        if len(ids) > L:  # keep the first (special) token and the end, where the template's anchor is
            ids = ids[:1] + ids[len(ids) - (L - 1):]
        return ids, self._position(ids)

    def _position(self, ids: list[int]) -> int:
        raise NotImplementedError

    # -- losses -------------------------------------------------------------------------------

    def _pad(self, items):
        L = max(len(ids) for ids, _ in items)
        ids = torch.full((len(items), L), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), L), dtype=torch.long)
        for i, (s, _) in enumerate(items):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        pos = torch.tensor([p for _, p in items])
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def _head(self):
        return self.lm.get_output_embeddings()

    def label_logits(self, items) -> torch.Tensor:
        """[B, K] logits of the K label words at each example's read-out position (fp32)."""
        ids, mask, pos = self._pad(items)
        h = self.lm.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        h = h[torch.arange(h.shape[0], device=h.device), pos]
        return self._head()(h)[:, self.word_ids].float()

    def batch_losses(self, indices):
        items = self.train_tok.take(indices.tolist())
        return F.cross_entropy(self.label_logits(items), self.y_train[indices], reduction="none")

    def fingerprint(self) -> str:
        return self._fingerprint

    @torch.no_grad()
    def evaluate(self, batch_size: int = 32):
        n = len(self.test_tok)
        # batches of similar lengths (little padding): sorted by length within windows of the
        # encoding cache's size, which is the whole test set when it fits
        window = max(batch_size, self.test_tok.keep // batch_size * batch_size)
        order: list[int] = []
        correct, loss = 0, 0.0
        starts = range(0, n, batch_size)
        for s in track(starts, len(starts), "held-out evaluation"):
            if s % window == 0:
                span = range(s, min(s + window, n))
                lengths = [len(ids) for ids, _ in self.test_tok.take(span)]
                order = sorted(span, key=lambda i: lengths[i - s])
            idx = order[s % window:s % window + batch_size]
            logits = self.label_logits(self.test_tok.take(idx))
            y = self.y_test[idx]
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}

    # -- export -------------------------------------------------------------------------------

    def export(self, folder, *, merge: bool = False):
        """The language model with its tokenizer; LoRA adapters as a peft adapter of the base
        model, or merged into its weights (``merge``). The prompt and the label words, which turn
        the LM into a classifier, go into the card."""
        from dpregistry.export import ModelExport

        m = self.cfg.model
        if not isinstance(self.tok, HFPromptTokenizer):
            raise UserError("the run used the byte-level stand-in tokenizer, which is no transformers tokenizer: "
                            "the exported model could not be prompted; train with model.tokenizer set to the "
                            "model's tokenizer", key="model.tokenizer")
        if m.lora is None and merge:
            raise UserError("--merge: this model has no LoRA adapters to merge")
        library, notes = "transformers", []
        base = self._hub_id() if m.init == "pretrained" else None  # random weights are fine-tuned from nothing
        if m.lora is None:
            self.lm.save_pretrained(folder)
        elif merge:
            self.lm.save_pretrained(folder, state_dict=self._merged_state_dict())
            notes.append("the LoRA adapters are merged into the base weights (W + (α/r)·B·A, rounded once to the "
                         "weights' dtype, as peft's merge does): the same function up to that rounding")
        else:
            self._save_adapter(folder)
            library = "peft"
        self.tok.tok.save_pretrained(folder)
        return ModelExport(what=self._what(library), usage=self._usage(library), library=library,
                           pipeline_tag="fill-mask" if self.masked else "text-generation", base_model=base,
                           details=self._prompt_details(), notes=notes)

    def _hub_id(self) -> str | None:
        from dpregistry.hf import hub_id

        path = self.cfg.model.path
        return HUB_IDS[path] if path in HUB_IDS else hub_id(path)

    def _merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The base model's state with each LoRA layer's update added to its weight, as peft's
        ``merge_and_unload`` computes it."""
        from peft.tuners.lora import LoraLayer

        state = {k.replace(".base_layer.", "."): v for k, v in self.lm.state_dict().items() if ".lora_" not in k}
        with torch.no_grad():
            for name, module in self.lm.named_modules():
                if isinstance(module, LoraLayer):
                    for adapter in module.active_adapters:
                        weight = state[f"{name}.weight"].clone()
                        weight += module.get_delta_weight(adapter)
                        state[f"{name}.weight"] = weight
        return state

    def _save_adapter(self, folder: Path) -> None:
        """adapter_config.json and adapter_model.safetensors, as ``PeftModel.save_pretrained`` names them."""
        import copy

        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        if self.cfg.model.init == "random" or self.model_folder is None:
            raise UserError("the base weights are random (model.init: random), so no folder holds the base an adapter "
                            "needs; export with --merge to write the whole model", key="model.init")
        config = copy.deepcopy(self.lm.peft_config["default"])
        config.base_model_name_or_path = self._hub_id() or str(Path(self.model_folder).resolve())
        config.task_type = None if self.masked else "CAUSAL_LM"
        config.inference_mode = True
        config.save_pretrained(str(folder))
        state = {f"base_model.model.{k}": v.detach().cpu().contiguous()
                 for k, v in get_peft_model_state_dict(self.lm).items()}
        save_file(state, str(Path(folder) / "adapter_model.safetensors"), metadata={"format": "pt"})

    def _prompt_details(self) -> dict:
        return {"template": self.cfg.prompt.template or self.default_template,
                "label_words": list(self.cfg.prompt.label_words), "labels": [str(n) for n in self.label_names],
                "text_columns": list(self.cols), "max_length": self.cfg.model.max_length,
                "read_out": "the mask position" if self.masked else "the last prompt token (the next-token logits)",
                "truncation": f"a prompt longer than {self.cfg.model.max_length} tokens keeps its first token and its "
                              f"last {self.cfg.model.max_length - 1}"}

    def _what(self, library: str) -> str:
        kind = "masked" if self.masked else "causal"
        model = type(self.lm).__name__ + (" (a LoRA adapter)" if library == "peft" else "")
        return f"{model}, a {kind} language model prompted to classify text by the logits of its label words"

    def _usage(self, library: str) -> str:
        from dpregistry.export import MODEL_DIR

        auto = "AutoModelForMaskedLM" if self.masked else "AutoModelForCausalLM"
        d = self._prompt_details()
        fields = ", ".join(f"{c}={'a gripping, beautifully made film' if i == 0 else '...'!r}"
                           for i, c in enumerate(d["text_columns"]))
        position = ("(batch[\"input_ids\"][0] == tokenizer.mask_token_id).nonzero()[0, 0]" if self.masked
                    else "-1  # the next token after the prompt")
        loads = "# with peft installed, transformers loads the base model adapter_config.json names, then the adapter\n" \
            if library == "peft" else ""
        return f"""import torch
from transformers import {auto}, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{MODEL_DIR}")
{loads}model = {auto}.from_pretrained("{MODEL_DIR}").eval()
template, labels = {d["template"]!r}, {d["labels"]!r}
words = [tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in {d["label_words"]!r}]
batch = tokenizer(template.replace("{{mask}}", tokenizer.mask_token or "").format({fields}), return_tensors="pt")
position = {position}
with torch.no_grad():
    logits = model(**batch).logits[0, position, words]
print(labels[int(logits.argmax())])"""


class CausalLMPrompt(PromptLM):
    """Causal LM (OPT) prompt classification: cross-entropy over label-word logits after the template."""

    name = "causal_lm_prompt"
    masked = False
    default_template = "{sentence} It was"

    def _position(self, ids):
        return len(ids) - 1


class MaskedLMPrompt(PromptLM):
    """Masked LM (RoBERTa) prompt classification: cross-entropy over label-word logits at the mask."""

    name = "masked_lm_prompt"
    masked = True
    default_template = "{sentence} It was {mask} ."

    def _head(self):
        head = getattr(self.lm, "lm_head", None) or getattr(self.lm, "cls", None)
        if head is None:
            raise UserError(f"{type(self.lm).__name__} has no masked-LM head (lm_head or cls)", key="model.path")
        return head

    def _position(self, ids):
        if self.tok.mask_id is None or ids.count(self.tok.mask_id) != 1:
            raise UserError("a masked-LM prompt needs exactly one {mask} (after truncation to model.max_length); "
                            "check prompt.template or raise model.max_length", key="objective.prompt.template")
        return ids.index(self.tok.mask_id)


OBJECTIVES = (CausalLMPrompt, MaskedLMPrompt)
