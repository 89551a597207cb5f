"""Text tables (TSV, CSV, JSONL) with named text and label columns, and :class:`TextData`, the
recipe schema of a text data set that text objectives share (``objective.data``).

Errors name the file and the line: a malformed row, a missing column, a label outside the
declared set.
"""

from __future__ import annotations

import csv
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UserError
from ..files import open_regular, require_regular

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass
class TextTable:
    texts: list[tuple[str, ...]]   # one tuple of text fields per example
    labels: list[int]
    label_names: list[str]
    source: str


def _rows(path: Path, fmt: str):
    """Yield (line number, dict row)."""
    if fmt == "jsonl":
        with open_regular(path, "data file", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"malformed JSON ({e.msg})", file=str(path), line=i) from None
                if not isinstance(row, dict):
                    raise UserError("each JSONL line must be an object", file=str(path), line=i)
                yield i, row
        return
    delim = "\t" if fmt == "tsv" else ","
    with open_regular(path, "data file", encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter=delim, quoting=csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL)
        try:
            header = next(reader)
        except StopIteration:
            return
        for row in reader:
            line = reader.line_num
            if not row or row == [""]:
                continue
            if len(row) != len(header):
                raise UserError(f"malformed {fmt.upper()} row: {len(row)} fields, the header has {len(header)}",
                                file=str(path), line=line)
            yield line, dict(zip(header, row))


def load_table(path: str | Path, *, text_columns: list[str], label_column: str,
               labels: list[str] | None = None, fmt: str | None = None) -> TextTable:
    repeated = [n for n, c in Counter(str(x) for x in labels or ()).items() if c > 1]
    if repeated:  # two indices for one label: the second could never be predicted
        raise UserError(f"duplicate label {repeated[0]!r}", key="data.labels")
    path = Path(path).expanduser()
    require_regular(path, "data file")  # not found, a folder, a FIFO (would block), a device (never ends)
    fmt = fmt or FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"unknown data format {path.suffix!r} (use .tsv, .csv or .jsonl, or set data.format)",
                        file=str(path))
    texts: list[tuple[str, ...]] = []
    raw_labels: list[tuple[int, str]] = []
    try:
        for line, row in _rows(path, fmt):
            for c in text_columns + [label_column]:
                if c not in row:
                    raise UserError(f"column {c!r} is missing (columns: {', '.join(row)})", file=str(path), line=line)
            texts.append(tuple(str(row[c]) for c in text_columns))
            raw_labels.append((line, str(row[label_column]).strip()))
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text (byte {e.start}: {e.reason})", file=str(path)) from None
    except csv.Error as e:
        raise UserError(f"malformed {fmt.upper()} ({e})", file=str(path)) from None
    if not raw_labels:  # an empty test set would report accuracy 0 and loss 0 as if measured
        raise UserError("the data file is empty: it holds no examples", file=str(path))
    names = [str(x) for x in labels] if labels is not None else sorted({lab for _, lab in raw_labels})
    index = {n: i for i, n in enumerate(names)}
    out = []
    for line, lab in raw_labels:
        if lab not in index:
            raise UserError(f"label {lab!r} is not one of the declared labels {names}", file=str(path), line=line)
        out.append(index[lab])
    return TextTable(texts, out, names, str(path))


def k_shot(table: TextTable, k: int, seed: int) -> TextTable:
    """k examples per class, drawn with ``seed`` (the papers' few-shot protocol)."""
    rng = random.Random(seed)
    by_class: dict[int, list[int]] = {}
    for i, y in enumerate(table.labels):
        by_class.setdefault(y, []).append(i)
    keep: list[int] = []
    for y in sorted(by_class):
        idx = by_class[y]
        rng.shuffle(idx)
        keep.extend(idx[:k])
    rng.shuffle(keep)
    return TextTable([table.texts[i] for i in keep], [table.labels[i] for i in keep], table.label_names, table.source)


class TextData(BaseModel):
    """A text classification data set as a recipe gives it: train and test tables (in a folder or
    by path), their text and label columns, and the few-shot and test-size choices.

    An objective's ``Params`` declares ``data: TextData = Field(default_factory=TextData)`` and
    calls :meth:`load` where it wants data errors reported (keys are relative to the objective's
    section: ``data.path``)."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(default=None, description="folder with train/test files")
    train: str = "train.tsv"
    test: str = "test.tsv"
    format: Literal["tsv", "csv", "jsonl"] | None = None
    text: str | list[str] = "sentence"
    label: str = "label"
    labels: list[str] | None = None
    k_per_class: int | None = Field(default=None, gt=0)
    seed: int = 42
    max_test: int | None = Field(default=None, gt=0)

    @property
    def columns(self) -> list[str]:
        """The text columns, in the order their fields reach a template or a tokenizer."""
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def file(self, name: str) -> Path:
        """A table's path: relative names are inside ``path`` when it is set."""
        p = Path(name).expanduser()
        return Path(self.path).expanduser() / p if self.path is not None and not p.is_absolute() else p

    def load(self) -> tuple[TextTable, TextTable]:
        """(train, test): the test labels are indexed as the training labels; ``k_per_class`` draws
        the few-shot training set, ``max_test`` keeps the first test examples."""
        if self.path is not None and not Path(self.path).expanduser().is_dir():
            raise UserError(f"data folder {self.path!r} not found; set data.path (e.g. --set data.path=DIR with "
                            f"{self.train} and {self.test})", key="data.path")
        cols = self.columns
        train = load_table(self.file(self.train), text_columns=cols, label_column=self.label, labels=self.labels,
                           fmt=self.format)
        test = load_table(self.file(self.test), text_columns=cols, label_column=self.label,
                          labels=train.label_names, fmt=self.format)
        if self.k_per_class:
            train = k_shot(train, self.k_per_class, self.seed)
        if self.max_test:
            test = TextTable(test.texts[:self.max_test], test.labels[:self.max_test], test.label_names, test.source)
        if not train.labels:
            raise UserError("the training data set is empty", file=train.source)
        return train, test
