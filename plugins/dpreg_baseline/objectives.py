"""Objectives: scikit-learn tables with linear/MLP models, HF text classifiers, a synthetic quadratic."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from dpregistry import StageParams, UserError
from dpregistry.data import Encoded, TextData, load_tabular, user_ids
from dpregistry.hf import quiet
from dpregistry.progress import track
from dpregistry.objectives import (DTYPES, Lora, TorchObjective, Trainable, activation_checkpointing_option,
                                   checkpoint_blocks, inject_lora, require_memory, seeded)
from dpregistry.stages import Objective
from dpregistry.users import UserIds


class _Sub(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------
# tabular
# ------------------------------------------------------------------------------------------


class TabularModel(_Sub):
    kind: Literal["linear", "mlp"] = "mlp"
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [64], max_length=64,
                                                       description="widths of the hidden layers")
    activation: Literal["relu", "tanh"] = "tanh"


class TabularData(_Sub):
    dataset: str = "digits"
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    seed: int = 0


class TabularParams(StageParams):
    model: TabularModel = Field(default_factory=TabularModel)
    data: TabularData = Field(default_factory=TabularData)
    trainable: Trainable = Field(default_factory=Trainable)


class TabularObjective(TorchObjective):
    """A linear model or MLP on one of scikit-learn's bundled data sets (cross-entropy or squared error)."""

    name = "tabular"
    Params = TabularParams

    def build(self, ctx):
        d = self.cfg.data
        self.table = load_tabular(d.dataset, test_fraction=d.test_fraction, seed=d.seed)
        t = self.table
        self.n_train = len(t.y_train)
        n_in = t.x_train.shape[1]
        n_out = t.n_classes if t.task == "classification" else 1
        m = self.cfg.model
        widths = [n_in, *(m.hidden if m.kind == "mlp" else []), n_out]
        n_params = sum((a + 1) * b for a, b in zip(widths, widths[1:]))
        require_memory(4 * n_params, f"an MLP of {n_params:,} parameters", "model.hidden")
        act = nn.ReLU if m.activation == "relu" else nn.Tanh
        layers: list[nn.Module] = []
        width = n_in
        with seeded(ctx.rng.seed("init", 0)):  # the initialisation is a function of the seed
            if m.kind == "mlp":
                for h in m.hidden:
                    layers += [nn.Linear(width, h), act()]
                    width = h
            layers.append(nn.Linear(width, n_out))
            self.model = nn.Sequential(*layers).to(ctx.device)
        self.x_train, self.y_train = t.x_train.to(ctx.device), t.y_train.to(ctx.device)

    def _loss(self, out, y):
        if self.table.task == "classification":
            return F.cross_entropy(out, y, reduction="none")
        return 0.5 * (out.squeeze(-1) - y) ** 2

    def batch_losses(self, indices):
        return self._loss(self.model(self.x_train[indices]), self.y_train[indices])

    def functional_losses(self, params, indices):
        out = torch.func.functional_call(self.model, params, (self.x_train[indices],))
        return self._loss(out, self.y_train[indices])

    @torch.no_grad()
    def evaluate(self):
        t = self.table
        out = self.model(t.x_test.to(self.device))
        y = t.y_test.to(self.device)
        loss = float(self._loss(out, y).mean())
        if t.task == "classification":
            return {"accuracy": float((out.argmax(-1) == y).float().mean()), "loss": loss}
        return {"mse": 2 * loss}


# ------------------------------------------------------------------------------------------
# Hugging Face text classification (encoder + pooled linear head)
# ------------------------------------------------------------------------------------------


class HFModel(_Sub):
    path: str = Field(default="minilm", description="folder, 'minilm', or a hub id")
    init: Literal["pretrained", "random"] = "pretrained"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_length: int = Field(default=128, gt=0)
    pooling: Literal["mean", "cls", "transformers"] = Field(
        default="mean", description="mean or cls: that pooling and a linear head; transformers: the architecture's "
                                    "own sequence-classification head, which `dpreg export` writes as it is")
    head_init: Literal["random", "label_descriptions"] = "random"
    label_descriptions: list[str] | None = None
    head_scale: float = Field(default=20.0, gt=0, description="logit scale of a label-description head")
    lora: Lora | None = Field(default=None, description="LoRA adapters in the encoder (mean or cls pooling); "
                                                        "they and the head train unless trainable says otherwise")
    activation_checkpointing: bool = activation_checkpointing_option()

    @model_validator(mode="after")
    def _descriptions_need_a_linear_head(self):
        if self.pooling == "transformers" and self.head_init == "label_descriptions":
            raise ValueError("head_init: label_descriptions needs pooling: mean or cls (its head reads normalised "
                             "features, which a transformers sequence-classification head does not)")
        if self.pooling == "transformers" and self.lora is not None:
            raise ValueError("lora needs pooling: mean or cls (adapters in a transformers sequence classifier are "
                             "not supported)")
        return self


class HFTextParams(StageParams):
    model: HFModel = Field(default_factory=HFModel)
    data: TextData = Field(default_factory=TextData)
    trainable: Trainable = Field(default_factory=Trainable)
    cache_features: bool = Field(default=True, description="when only the head trains, encode the training set "
                                                           "once (up to 1 GiB of features) instead of at every step")

    @model_validator(mode="after")
    def _lora_trains_adapters_and_head(self):
        if self.model.lora is not None and not self.trainable.include:
            self.trainable = Trainable(include=["lora_", r"^head\."], exclude=self.trainable.exclude)
        return self


class Encoder(nn.Module):
    """A pretrained encoder with pooling and a linear head: logits = head(pool(encoder(x)))."""

    def __init__(self, encoder: nn.Module, n_labels: int, pooling: str):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, n_labels)
        self.pooling = pooling

    def pool(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "cls":
            return h[:, 0]
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1)

    def forward(self, input_ids, attention_mask):
        return self.head(self.pool(input_ids, attention_mask))


class HFTextClassification(TorchObjective):
    """A Hugging Face encoder (default: the packaged MiniLM) with a pooled linear head, or with the
    architecture's own sequence-classification head (``pooling: transformers``), on a text table."""

    name = "hf_text_classification"
    Params = HFTextParams
    provides = (UserIds,)  # privacy.unit: user, from data.user or data.rows_per_user

    def provide(self, kind):
        return user_ids(self.train_tok.table)

    def build(self, ctx):
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        from dpregistry.hf import resolve_model_dir

        p = self.cfg
        # a description head pairs the descriptions with the labels by position: the order must be given
        pairs = ("model.label_descriptions", p.model.label_descriptions) if p.model.head_init == "label_descriptions" \
            else None
        train, test = p.data.load(pairs=pairs)
        self.n_train = len(train)
        self._fingerprint = train.digest()
        self.label_names = train.label_names
        mdir = resolve_model_dir(p.model.path, need_weights=p.model.init == "pretrained")
        self.tokenizer = AutoTokenizer.from_pretrained(mdir)
        dtype = DTYPES[p.model.dtype]
        with seeded(ctx.rng.seed("init", 0)), quiet():
            if p.model.pooling == "transformers":
                self.model = self._sequence_classifier(mdir, dtype).to(ctx.device, dtype)
            else:
                if p.model.init == "pretrained":
                    enc = AutoModel.from_pretrained(mdir, dtype=dtype)
                else:
                    enc = AutoModel.from_config(AutoConfig.from_pretrained(mdir), dtype=dtype)
                if p.model.lora is not None:
                    enc = inject_lora(enc, p.model.lora, ctx.rng.seed("lora_init", 0), ctx.device, dtype)
                self.model = Encoder(enc, len(self.label_names), p.model.pooling).to(ctx.device, dtype)
            if p.model.activation_checkpointing:
                checkpoint_blocks(self.model)
        # token ids per batch, from the memory-mapped rows (a large data set is never tokenised whole)
        self.train_tok = Encoded(train, self._tokenize)
        self.y_train = torch.as_tensor(train.labels, device=ctx.device)
        self.test_tok = Encoded(test, self._tokenize)
        self.y_test = torch.as_tensor(test.labels, device=ctx.device)
        if p.model.head_init == "label_descriptions":
            self._init_head_from_descriptions()

    def _sequence_classifier(self, mdir: str, dtype):
        """The architecture's own head (AutoModelForSequenceClassification), its labels named as the data's."""
        from transformers import AutoConfig, AutoModelForSequenceClassification

        if self.tokenizer.pad_token_id is None:  # padding would be read as a real token by a last-token head
            raise UserError("pooling: transformers needs a tokenizer with a padding token", key="model.pooling")
        names = [str(n) for n in self.label_names]
        config = AutoConfig.from_pretrained(mdir, num_labels=len(names), id2label=dict(enumerate(names)),
                                            label2id={n: i for i, n in enumerate(names)})
        if getattr(config, "pad_token_id", None) is None:  # a last-token head finds the last token by it
            config.pad_token_id = self.tokenizer.pad_token_id
        try:
            if self.cfg.model.init == "pretrained":
                return AutoModelForSequenceClassification.from_pretrained(mdir, config=config, dtype=dtype)
            return AutoModelForSequenceClassification.from_config(config, dtype=dtype)
        except ValueError as e:  # a model type that has no such head
            raise UserError(f"{self.cfg.model.path!r} has no transformers sequence-classification head "
                            f"({str(e).splitlines()[0][:200]}); use pooling: mean or cls", key="model.pooling") from None

    def _tokenize(self, texts):
        if not texts:
            return []
        enc = self.tokenizer([t[0] for t in texts], [t[1] for t in texts] if len(texts[0]) > 1 else None,
                             truncation=True, max_length=self.cfg.model.max_length)
        return enc["input_ids"]

    def _pad(self, seqs):
        L = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(seqs), L), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def _init_head_from_descriptions(self):
        desc = self.cfg.model.label_descriptions  # one per label, in label order (TextData.load checked)
        ids = self.tokenizer(desc, truncation=True, max_length=self.cfg.model.max_length)["input_ids"]
        e = self.model.pool(*self._pad(ids)).float()
        e = F.normalize(e, dim=-1)
        self.model.head.weight.copy_(self.cfg.model.head_scale * e)
        self.model.head.bias.zero_()
        self._normalize_features = True

    def _features(self, ids, mask):
        feats = self.model.pool(ids, mask)
        return F.normalize(feats, dim=-1) if getattr(self, "_normalize_features", False) else feats

    def _logits(self, ids, mask):
        if self.cfg.model.pooling == "transformers":
            return self.model(input_ids=ids, attention_mask=mask).logits
        return self.model.head(self._features(ids, mask))

    #: when only the head trains, the training set's features are kept if they take at most this
    FEATURE_CACHE_BYTES = 1 << 30

    def setup(self, ctx):
        super().setup(ctx)
        # a frozen encoder maps an example to the same features at every step: encode each once
        self._cache_features = (self.cfg.cache_features and self.cfg.model.pooling != "transformers"
                                and all(n.startswith("head.") for n in self._params)
                                and self.n_train * self.model.head.in_features * 4 <= self.FEATURE_CACHE_BYTES)
        self._train_features = None

    @torch.no_grad()
    def encode(self, rows: Encoded, batch_size: int = 128) -> torch.Tensor:
        """The head's inputs for ``rows`` (``train_tok``, ``test_tok``), in fixed chunks of their
        order: the numbers never depend on which batch first asked for a row."""
        starts = range(0, len(rows), batch_size)
        return torch.cat([self._features(*self._pad(rows.take(range(s, min(s + batch_size, len(rows))))))
                          for s in track(starts, len(starts), "encoding the texts once (only the head trains)")])

    def train_features(self) -> torch.Tensor:
        """Every training example's head input, encoded once (a resumed run encodes the same)."""
        if self._train_features is None:
            self._train_features = self.encode(self.train_tok)
        return self._train_features

    def batch_losses(self, indices):
        if self._cache_features:
            logits = self.model.head(self.train_features()[indices])
        else:
            logits = self._logits(*self._pad(self.train_tok.take(indices.tolist())))
        return F.cross_entropy(logits.float(), self.y_train[indices], reduction="none")

    def fingerprint(self) -> str:
        return self._fingerprint

    @torch.no_grad()
    def evaluate(self, batch_size: int = 128):
        correct, loss = 0, 0.0
        starts = range(0, len(self.test_tok), batch_size)
        for s in track(starts, len(starts), "held-out evaluation"):
            ids, mask = self._pad(self.test_tok.take(range(s, min(s + batch_size, len(self.test_tok)))))
            logits = self._logits(ids, mask).float()
            y = self.y_test[s:s + batch_size]
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        n = max(len(self.test_tok), 1)
        return {"accuracy": correct / n, "loss": loss / n}

    def export(self, folder, *, merge: bool = False):
        """The model as it is, when it is transformers' own sequence classifier (pooling:
        transformers). A pooled linear head (mean or cls pooling, normalised features) is no
        transformers architecture: no model that transformers loads computes it exactly, so it is
        refused rather than approximated."""
        from transformers import AutoTokenizer

        from dpregistry.export import MODEL_DIR, ModelExport
        from dpregistry.hf import hub_id

        m = self.cfg.model
        if m.pooling != "transformers":
            head = "normalised features and a linear head" if getattr(self, "_normalize_features", False) \
                else "a linear head"
            raise UserError(f"pooling: {m.pooling} with {head} is not a transformers architecture, so no model that "
                            f"transformers loads computes it exactly; to export, train with pooling: transformers "
                            f"(the architecture's own sequence-classification head)", key="model.pooling")
        if merge:
            raise UserError("--merge: this model has no LoRA adapters to merge")
        self.model.save_pretrained(folder)
        # The run never passed token types (BERT's second segment saw type 0) and truncated at
        # max_length: the exported tokenizer does the same by default.
        tok = AutoTokenizer.from_pretrained(self.tokenizer.name_or_path, model_max_length=m.max_length,
                                            model_input_names=["input_ids", "attention_mask"])
        tok.save_pretrained(folder)
        return ModelExport(
            what=f"{type(self.model).__name__}, a text classifier of the labels {', '.join(map(str, self.label_names))}",
            pipeline_tag="text-classification",
            base_model=hub_id(m.path) if m.init == "pretrained" else None,
            details={"labels": [str(n) for n in self.label_names], "max_length": m.max_length},
            usage=f"""import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{MODEL_DIR}")
model = AutoModelForSequenceClassification.from_pretrained("{MODEL_DIR}").eval()
texts = ["a gripping, beautifully made film"]  # (a model of text pairs: tokenizer(firsts, seconds, ...))
batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    predicted = model(**batch).logits.argmax(-1)
print([model.config.id2label[int(i)] for i in predicted])""")


# ------------------------------------------------------------------------------------------
# synthetic quadratic (DPZero §5.1)
# ------------------------------------------------------------------------------------------


class QuadraticParams(StageParams):
    dim: int = Field(gt=0)
    n: int = Field(default=10_000, gt=0)
    n_test: int = Field(default=10_000, gt=0)
    hessian: Literal["identity", "sqrt", "harmonic"] = Field(
        default="harmonic", description="A = I (a), diag(1/√i) (b), diag(1/i) (c)")
    seed: int = 0
    dtype: Literal["float32", "float64"] = "float64"


class Quadratic(Objective):
    """f(x; x_i) = ½(x − x_i)ᵀA(x − x_i), x_i ~ N(1, I): the synthetic problem of DPZero §5.1."""

    name = "quadratic"
    Params = QuadraticParams

    def setup(self, ctx):
        p = self.cfg
        dt = DTYPES[p.dtype]
        require_memory(8 * (p.n + p.n_test + 3) * p.dim, f"the quadratic's data ({p.n:,} + {p.n_test:,} records of "
                       f"dimension {p.dim:,})", "objective.dim")
        g = torch.Generator().manual_seed(p.seed)
        i = torch.arange(1, p.dim + 1, dtype=dt)
        self.a = {"identity": torch.ones_like(i), "sqrt": i.rsqrt(), "harmonic": 1.0 / i}[p.hessian]
        self.data = 1.0 + torch.randn(p.n, p.dim, generator=g, dtype=dt)
        self.test_mean = (1.0 + torch.randn(p.n_test, p.dim, generator=g, dtype=dt)).mean(0)
        self.n_train = p.n
        self.x = torch.zeros(p.dim, dtype=dt)

    def params(self):
        return {"x": self.x}

    def functional_losses(self, params, indices):
        diff = params["x"] - self.data[indices]
        return 0.5 * (diff * diff * self.a).sum(-1)

    def losses(self, indices):
        return self.functional_losses({"x": self.x}, indices)

    def evaluate(self):
        grad = self.a * (self.x - self.test_mean)
        train = float(self.losses(torch.arange(self.n_train)).mean())
        return {"test_grad_norm": float(grad.norm()), "train_loss": train}


OBJECTIVES = (TabularObjective, HFTextClassification, Quadratic)
