"""Text classification data through Hugging Face ``datasets``: local CSV, TSV, JSON Lines and
Parquet files, folders written by ``save_to_disk``, and data sets on the hub; and
:class:`TextData`, the recipe schema of a text data set that text objectives share
(``objective.data``).

``datasets`` converts a file once into an Arrow file in its cache (``HF_DATASETS_CACHE``, keyed
by the file's content) and memory-maps it, so a large file costs disk, not memory: a
:class:`TextTable` keeps the label of each example as one integer array and reads text only for
the rows a batch asks for. Objectives encode those rows per batch (:class:`Encoded`).

Errors name the file and the line (a row for Arrow data): a malformed row, a missing column, a
label outside the declared set, a first line that looks like data.
"""

from __future__ import annotations

import array
import csv
import hashlib
import json
import os
import random
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import UserError
from ..files import open_regular, require_regular
from ..hf import quiet
from ..progress import say

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
BUILDERS = {"tsv": "csv", "csv": "csv", "jsonl": "json", "parquet": "parquet"}
#: a column by name or by position
Column = str | int
#: the longest first line of a CSV/TSV file (the column names) read
FIRST_LINE_LIMIT = 1 << 20
#: rows read to decide whether a missing column's header line is really data
HINT_ROWS = 10_000


# ------------------------------------------------------------------------------------------
# reading with datasets
# ------------------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    """The content's hash: the key of the file's Arrow copy in the cache (datasets itself keys a
    local file by its mtime, which a rewrite within the clock's tick leaves unchanged)."""
    h = hashlib.blake2b(digest_size=16)
    with open_regular(path, "data file", "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _csv_dialect(fmt: str) -> dict:
    # GLUE's TSV files hold unbalanced quotes ("a "brilliant" film): TSV fields are never quoted
    return {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if fmt == "tsv" else {"delimiter": ",",
                                                                                "quoting": csv.QUOTE_MINIMAL}


def _first_row(path: Path, fmt: str) -> tuple[int, list[str]] | None:
    """(line, cells) of the first line of a CSV or TSV file that is not blank (None: there is none)."""
    with open_regular(path, "data file", "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(FIRST_LINE_LIMIT + 1), b""), 1):
            if len(raw) > FIRST_LINE_LIMIT:
                raise UserError(f"a line is longer than {FIRST_LINE_LIMIT:,} bytes", file=str(path), line=number)
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"not UTF-8 text (byte {e.start} of the line: {e.reason})", file=str(path),
                                line=number) from None
            if not line.strip("\r\n"):
                continue
            try:
                return number, next(csv.reader([line], **_csv_dialect(fmt)))
            except csv.Error as e:
                raise UserError(f"malformed {fmt.upper()} ({e})", file=str(path), line=number) from None
    return None


def read_file(path: str | Path, *, fmt: str | None = None, header: bool = True,
              columns: list[str] | None = None):
    """A local CSV, TSV, JSON Lines or Parquet file as a memory-mapped ``datasets.Dataset``.

    CSV and TSV cells are read as text, exactly as written (no type guessing, no missing-value
    markers). With ``header=False`` the first line is data and the columns are named by
    ``columns``, or by their positions "0", "1", ...."""
    import datasets

    path = Path(path).expanduser()
    require_regular(path, "data file")  # not found, a folder, a FIFO (would block), a device (never ends)
    fmt = fmt or FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"unknown data format {path.suffix!r} (use .tsv, .csv, .jsonl or .parquet, or set "
                        "data.format)", file=str(path))
    if fmt not in ("tsv", "csv") and (not header or columns is not None):
        raise UserError(f"data.header and data.columns are for CSV and TSV files; a {fmt} file names its columns",
                        file=str(path))
    if path.stat().st_size == 0:
        raise UserError("the data file is empty: it holds no examples", file=str(path))
    kwargs: dict[str, Any] = {}
    if fmt in ("tsv", "csv"):
        first = _first_row(path, fmt)
        if first is None:
            raise UserError("the data file is empty: it holds no examples", file=str(path))
        names = _column_names(path, *first, header, columns)
        d = _csv_dialect(fmt)
        kwargs = dict(sep=d["delimiter"], quoting=d["quoting"], header=0 if header else None, column_names=names,
                      na_filter=False, encoding="utf-8",
                      features=datasets.Features({n: datasets.Value("string") for n in names}))
    if fmt == "jsonl":
        _check_nesting(path)
    import glob

    with quiet():
        try:
            ds = datasets.load_dataset(BUILDERS[fmt], name=f"dpreg-{_digest(path)}", split="rows",
                                       data_files={"rows": glob.escape(str(path.resolve()))}, **kwargs)
        except Exception as e:  # noqa: BLE001 -- whatever a reader raises on this file is about the file
            raise _problem(path, fmt, header) or _empty(path, fmt, header) or _unreadable(path, e) from None
    return ds


#: the deepest JSON nesting a JSON Lines row may have (Arrow's reader crashes the process, SIGSEGV,
#: on a row nested 50,000 deep, on one line or over many; text data is nested one or two levels)
MAX_JSON_DEPTH = 100


def _check_nesting(path: Path) -> None:
    """Refuse JSON nested deeper than :data:`MAX_JSON_DEPTH` before any reader sees the file. The
    depth is counted over the brackets outside strings and carried from line to line (a row may be
    spread over lines); a quote is a string's edge unless an odd run of backslashes precedes it, and
    a string never spans lines."""
    depth, first_line = 0, 1
    with open_regular(path, "data file", "rb") as f:
        while block := f.readlines(1 << 24):
            codes = np.frombuffer(b"".join(block), dtype=np.uint8)
            lines = np.flatnonzero(codes == ord("\n"))
            quotes = np.flatnonzero(codes == ord('"'))
            after = np.flatnonzero(codes[np.maximum(quotes - 1, 0)] == ord("\\"))  # (rare) after a backslash
            escaped = [k for k in after.tolist() if (quotes[k] - _run_start(codes, quotes[k] - 1)) % 2 == 1]
            quotes = np.delete(quotes, escaped)
            brackets = np.flatnonzero(_DEPTH[codes] != 0)
            # quotes before each bracket on its own line: an odd number puts it inside a string
            line_start = np.searchsorted(quotes, np.concatenate([[0], lines + 1])[np.searchsorted(lines, brackets)])
            outside = (np.searchsorted(quotes, brackets) - line_start) % 2 == 0
            brackets = brackets[outside]
            levels = depth + np.cumsum(_DEPTH[codes[brackets]], dtype=np.int64)
            if len(levels) and levels.max() > MAX_JSON_DEPTH:
                at = int(brackets[int(np.argmax(levels > MAX_JSON_DEPTH))])
                raise UserError(f"a row nested deeper than {MAX_JSON_DEPTH} levels (text data needs one or two)",
                                file=str(path), line=first_line + int(np.searchsorted(lines, at)))
            depth = int(levels[-1]) if len(levels) else depth
            first_line += len(block)


def _run_start(codes: np.ndarray, end: int) -> int:
    """Where the run of backslashes that ends at ``end`` begins."""
    start = end
    while start > 0 and codes[start - 1] == ord("\\"):
        start -= 1
    return start


_DEPTH = np.zeros(256, dtype=np.int8)
_DEPTH[[ord("["), ord("{")]] = 1
_DEPTH[[ord("]"), ord("}")]] = -1


def _column_names(path: Path, line: int, first: list[str], header: bool, columns: list[str] | None) -> list[str]:
    if header:
        names = [c.strip() for c in first]
        repeated = [n for n, c in Counter(names).items() if c > 1]
        if repeated:
            raise UserError(f"the header names column {repeated[0]!r} twice", file=str(path), line=line)
        return names
    if columns is None:
        return [str(i) for i in range(len(first))]
    if len(columns) != len(first) or len(set(columns)) != len(columns):
        raise UserError(f"data.columns names {len(columns)} distinct columns; the first line has {len(first)} fields",
                        file=str(path), line=line)
    return list(columns)


def _empty(path: Path, fmt: str, header: bool) -> UserError | None:
    """A file with no data row (a header alone): datasets finds "no data" in it."""
    if fmt != "parquet" and _line_of(path, fmt, header, 0) is None:
        return UserError("the data file is empty: it holds no examples", file=str(path))
    return None


def _unreadable(path: Path, e: BaseException) -> UserError:
    while e.__cause__ is not None and "error occurred while generating" in str(e):
        e = e.__cause__  # datasets wraps the reader's own error
    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, UnicodeDecodeError):
        return UserError(f"not UTF-8 text (byte {e.start}: {e.reason})", file=str(path))
    return UserError(f"cannot read the data file ({type(e).__name__}: {first})", file=str(path))


def _problem(path: Path, fmt: str, header: bool, needed: Sequence[str] = ()) -> UserError | None:
    """The first malformed line of a CSV, TSV or JSON Lines file, found by reading it line by line:
    the readers report a bad row without a line a user can open (or not at all: pandas fills a short
    row with missing values). None if every line is well formed."""
    if fmt == "parquet":
        return None
    with open_regular(path, "data file", "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return UserError(f"not UTF-8 text (byte {e.start} of the line: {e.reason})", file=str(path), line=i)
    if fmt == "jsonl":
        with open_regular(path, "data file", encoding="utf-8-sig") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    return UserError(f"malformed JSON ({e.msg})", file=str(path), line=i)
                except RecursionError:
                    return UserError(f"a row nested deeper than {MAX_JSON_DEPTH} levels", file=str(path), line=i)
                if not isinstance(row, dict):
                    return UserError("each JSON Lines line must be an object", file=str(path), line=i)
                for c in needed:
                    if row.get(c) is None:
                        return UserError(f"column {c!r} is missing (columns: {', '.join(row)})", file=str(path),
                                         line=i)
        return None
    with open_regular(path, "data file", encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, **_csv_dialect(fmt))
        try:
            width = None
            for row in reader:
                if not row:
                    continue
                if width is None:
                    width = len(row)
                elif len(row) != width:
                    of = "the header has" if header else "the first line has"
                    return UserError(f"malformed {fmt.upper()} row: {len(row)} fields, {of} {width}",
                                     file=str(path), line=reader.line_num)
        except csv.Error as e:
            return UserError(f"malformed {fmt.upper()} ({e})", file=str(path), line=reader.line_num)
    return None


def _line_of(path: Path, fmt: str, header: bool, row: int) -> int | None:
    """The line of data row ``row`` (from 0) of a CSV, TSV or JSON Lines file (blank lines skipped)."""
    seen = -1 if header and fmt != "jsonl" else 0
    with open_regular(path, "data file", encoding="utf-8-sig", newline="" if fmt != "jsonl" else None) as f:
        lines = csv.reader(f, **_csv_dialect(fmt)) if fmt != "jsonl" else None
        if lines is not None:
            for r in lines:
                if r:
                    if seen == row:
                        return lines.line_num
                    seen += 1
            return None
        for i, line in enumerate(f, 1):
            if line.strip():
                if seen == row:
                    return i
                seen += 1
    return None


# ------------------------------------------------------------------------------------------
# a table of examples
# ------------------------------------------------------------------------------------------


class Source:
    """Where rows came from, to say where a bad one is: a file's line, or an Arrow table's row."""

    def __init__(self, name: str, path: Path | None = None, fmt: str | None = None, header: bool = True,
                 first: tuple[int, list[str]] | None = None):
        self.name, self.path, self.fmt, self.header = name, path, fmt, header
        # a CSV/TSV file's first line that is not blank: (its number, its cells)
        self.first_line, self.first_row = first if first is not None else (None, None)

    def error(self, message: str, row: int | None = None) -> UserError:
        if row is None:
            return UserError(message, file=self.name)
        if self.path is not None and self.fmt != "parquet":
            return UserError(message, file=self.name, line=_line_of(self.path, self.fmt, self.header, row))
        return UserError(f"row {row + 1}: {message}", file=self.name)

    def __str__(self) -> str:
        return self.name


def _same_source(a: Source, b: Source) -> bool:
    """The same split of one data set, or the same file or folder by any path (hard links too)."""
    if str(a) == str(b):
        return True
    pa, pb = (s.path if s.path is not None else Path(str(s)) for s in (a, b))
    try:
        return pa.exists() and pb.exists() and os.path.samefile(pa, pb)
    except OSError:
        return False


def one_form(texts):
    """Arrow strings in one form: compatibility-decomposed (NFKD), without accents or format
    characters (soft hyphens, zero-width spaces), lower case, single spaces, none at either end:
    two spellings of one person's name compare equal."""
    import pyarrow.compute as pc

    texts = pc.replace_substring_regex(pc.utf8_normalize(texts, form="NFKD"), pattern="[\\p{Mn}\\p{Cf}]+",
                                       replacement="")
    texts = pc.replace_substring_regex(pc.utf8_lower(texts), pattern="[\\s\\p{Z}\\x{85}]+", replacement=" ")
    return pc.utf8_trim_whitespace(texts)


def _keys(table: "TextTable", rows=None):
    """The comparison key of each example (of ``rows``, positions in the table; None: all): its
    text fields joined, decomposed (NFKD), lower case, letters and digits only, so that a copy in
    capitals, with accents, soft hyphens or other spacing and punctuation has the same key as
    its original (a tokenizer would read them alike). Examples without a letter or digit have
    the empty key, which matches nothing."""
    import pyarrow as pa
    import pyarrow.compute as pc

    got = table.arrow(rows)
    columns = [pc.cast(got.column(c), pa.large_string()) for c in table.columns]
    joined = columns[0] if len(columns) == 1 else pc.binary_join_element_wise(
        *columns, pa.scalar(" ", pa.large_string()))
    keys = pc.replace_substring_regex(pc.utf8_normalize(joined, form="NFKD"), pattern="[^\\p{L}\\p{N}]+",
                                      replacement="")
    return pc.utf8_lower(keys)


def shared_texts(test: "TextTable", train: "TextTable", batch: int = 1 << 17) -> int:
    """How many examples of ``test`` have the text of some example of ``train`` (by :func:`_keys`),
    reading ``train`` ``batch`` examples at a time (its keys are never all held at once)."""
    import pyarrow.compute as pc

    keys = _keys(test)
    wanted = pc.unique(pc.filter(keys, pc.not_equal(keys, "")))
    if len(wanted) == 0:
        return 0
    found = pc.is_in(wanted, value_set=_keys(train, range(0, min(batch, len(train)))))
    for start in range(batch, len(train), batch):
        found = pc.or_(found, pc.is_in(wanted, value_set=_keys(train, range(start, min(start + batch, len(train))))))
    return int(pc.sum(pc.is_in(keys, value_set=pc.filter(wanted, found))).as_py() or 0)


class TextTable:
    """Examples of a text data set: their label indices as one array, their text fields read from
    the memory-mapped Arrow table only for the examples asked for.

    ``len(table)`` examples; ``table.labels[i]`` is example i's index into ``label_names``;
    ``table.fields(indices)`` its text fields (a tuple per example, in the order of the text
    columns); ``table.users[i]`` its user id, where the data set has users (None otherwise)."""

    def __init__(self, rows, columns: list[str], labels: np.ndarray, label_names: list[str], source: Source,
                 index: np.ndarray | None = None, users: np.ndarray | None = None):
        self.rows = rows            # a datasets.Dataset of the text columns (memory-mapped)
        self.columns = columns
        self.labels = labels        # int64, one per example
        self.label_names = label_names
        self.source = source
        self.index = index          # the rows of the examples (None: every row, in order)
        self.users = users          # int64, one per example, or None

    def __len__(self) -> int:
        return len(self.labels)

    def fields(self, indices: Sequence[int]) -> list[tuple[str, ...]]:
        """The text fields of examples ``indices`` (positions in this table), read in one gather."""
        idx = [int(i) for i in indices]
        if not idx:
            return []
        rows = idx if self.index is None else [int(self.index[i]) for i in idx]
        got = self.rows[rows]
        return list(zip(*(map(str, got[c]) for c in self.columns)))

    def arrow(self, positions=None):
        """The text columns of examples ``positions`` (None: all; a range is read as one slice) as
        an Arrow table, in that order."""
        data = self.rows.with_format("arrow")
        if self.index is None and (positions is None or isinstance(positions, range) and positions.step == 1):
            return data[:] if positions is None else data[positions.start:positions.stop]
        picked = np.arange(len(self)) if positions is None else np.asarray(positions)
        return data[(picked if self.index is None else self.index[picked]).tolist()]

    def digest(self) -> str:
        """A digest of every example, in order: its text fields and label (for a resume and the
        ranks of a run to compare the data they train on; :mod:`dpregistry.digest`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        h = hashlib.sha256(f"{len(self)} examples".encode())
        h.update(json.dumps(self.label_names).encode() + np.ascontiguousarray(self.labels, dtype=np.int64).tobytes())
        got = self.arrow()
        for c in self.columns:
            text = pc.cast(got.column(c), pa.large_string()).combine_chunks()
            ends = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset:text.offset + len(text) + 1]
            h.update(np.diff(ends).tobytes())
            h.update(memoryview(text.buffers()[2])[int(ends[0]):int(ends[-1])] if len(text) else b"")
        return h.hexdigest()[:16]

    def select(self, positions: Sequence[int] | np.ndarray) -> "TextTable":
        """The examples at ``positions``, in that order."""
        pos = np.asarray(positions, dtype=np.int64)
        rows = pos if self.index is None else self.index[pos]
        users = None if self.users is None else self.users[pos]
        return TextTable(self.rows, self.columns, self.labels[pos], self.label_names, self.source, rows, users)


def _column(rows, col: Column, source: Source, what: str) -> str:
    """A column's name from a name or a position."""
    names = list(rows.column_names)
    if isinstance(col, int) and not isinstance(col, bool):
        if not 0 <= col < len(names):
            raise source.error(f"{what} column {col} is out of range: the data has {len(names)} columns "
                               f"({', '.join(names)})")
        return names[col]
    if col not in names:
        hint = "; the first line looks like data; set data.header: false" if _first_line_is_data(rows, source) else ""
        raise UserError(f"column {col!r} is missing (columns: {', '.join(names)}){hint}", file=str(source),
                        line=source.first_line)
    return col


def _first_line_is_data(rows, source: Source) -> bool:
    """Whether the header line of a CSV/TSV file looks like a data row: one of its cells is a value
    found in that cell's column below it (a label, most often), in the first rows."""
    import pyarrow.compute as pc

    if source.first_row is None or not source.header:
        return False
    head = rows.data.slice(0, HINT_ROWS)
    for j, cell in enumerate(source.first_row[:head.num_columns]):
        column = pc.utf8_trim_whitespace(head.column(j))
        if cell.strip() and pc.any(pc.equal(column, cell.strip())).as_py():
            return True
    return False


def _check_cells(rows, columns: list[str], source: Source) -> None:
    """Refuse a missing value in a column the objective reads. pandas fills the missing fields of a
    short CSV/TSV row with empty text, so an empty cell there sends for the line-by-line check."""
    import pyarrow.compute as pc

    for c in dict.fromkeys(columns):
        column = rows.data.column(c)
        if column.null_count:
            first = int(pc.index(pc.is_null(column), True).as_py())
            raise (_problem(source.path, source.fmt, source.header, columns) if source.path else None) \
                or source.error(f"no value in column {c!r}", first)
        if source.fmt in ("csv", "tsv") and pc.any(pc.equal(column, "")).as_py():
            problem = _problem(source.path, source.fmt, source.header, columns)
            if problem is not None:
                raise problem


def _label_values(rows, col: str, source: Source):
    """The label column as stripped strings (a ClassLabel column: its names), and the ClassLabel's
    names (None for a plain column)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import ClassLabel

    feature = rows.features[col]
    column = rows.data.column(col)
    if isinstance(feature, ClassLabel):
        ids = pc.if_else(pc.less(column, 0), pa.scalar(None, column.type), column)  # -1: no label
        return pc.take(pa.array(feature.names), ids), list(feature.names)
    try:
        text = pc.cast(column, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise source.error(f"label column {col!r} holds {column.type} values, not labels") from None
    return pc.utf8_trim_whitespace(text), None


def make_table(rows, *, text_columns: list[str | int], label_column: str | int, labels: list[str] | None,
               source: Source, paired_with: str | None = None, label_names: list[str] | None = None,
               user_column: Column | None = None, rows_per_user: int | None = None,
               declared: bool = True) -> TextTable:
    """A :class:`TextTable` of ``rows`` (a ``datasets.Dataset``).

    The label order is ``label_names`` (another split's), else ``labels`` (the recipe's), else the
    data set's ClassLabel names, else the sorted labels found, unless ``paired_with`` (the key of
    descriptions or label words that pair with the labels by position): then guessing is refused.
    ``declared``: whether ``label_names`` were declared (the recipe's or a ClassLabel's) rather
    than found in the held-out split, for the message when a row's label is not among them.

    Users (``privacy.unit: user``): the ``user_column``'s values numbered in order of first
    appearance, or the public rule user = row // ``rows_per_user`` (rows of ``rows``, in order)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = list(rows.column_names)
    if len(rows) == 0:  # an empty test set would report accuracy 0 and loss 0 as if measured
        raise source.error("the data file is empty: it holds no examples")
    cols = [_column(rows, c, source, "text") for c in text_columns]
    for c in cols:
        kind = rows.data.column(c).type
        if pa.types.is_nested(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            raise source.error(f"text column {c!r} holds {kind} values; a text column holds text")
    label = _column(rows, label_column, source, "label")
    user = None if user_column is None else _column(rows, user_column, source, "user")
    _check_cells(rows, cols + [label] + ([user] if user is not None else []), source)
    values, class_names = _label_values(rows, label, source)
    if class_names is None and pc.any(pc.equal(values, "")).as_py():
        raise source.error("the label is empty", int(pc.index(values, "").as_py()))
    found = sorted(str(v) for v in pc.unique(values).to_pylist() if v is not None)
    if source.first_row is not None and source.header and names.index(label) < len(source.first_row) \
            and source.first_row[names.index(label)].strip() in found:
        raise UserError("the first line looks like data; set data.header: false (and name the columns with "
                        "data.columns or give their positions)", file=str(source), line=source.first_line)
    if label_names is None:
        if labels is not None:
            label_names = labels
        elif class_names is not None:
            label_names = class_names
        elif paired_with:
            raise UserError(f"{paired_with} pairs with the labels by position, but the data set does not say their "
                            f"order (labels found: {', '.join(found)}); set data.labels in the order of {paired_with}, "
                            f"e.g. data.labels: [{', '.join(map(json.dumps, found))}]", key="data.labels")
        else:
            label_names = found
    y = pc.index_in(values, value_set=pa.array(label_names, pa.string()))
    if y.null_count:
        first = int(pc.index(pc.is_null(y), True).as_py())
        value = values[first].as_py()
        if value is None:
            raise source.error("the row has no label (a ClassLabel of -1: an unlabelled split; choose a labelled "
                               "one)", first)
        if not declared and class_names is None:
            raise source.error(f"label {value!r} is not among the held-out split's labels {label_names}, which "
                               f"set the classes when data.labels does not (the training labels are private); "
                               f"list every class in data.labels", first)
        raise source.error(f"label {value!r} is not one of the declared labels {label_names}", first)
    y = np.asarray(y.to_numpy(zero_copy_only=False), dtype=np.int64)
    users = _user_ids(rows, user, source) if user is not None else \
        np.arange(len(rows), dtype=np.int64) // rows_per_user if rows_per_user is not None else None
    return TextTable(rows.select_columns(list(dict.fromkeys(cols))), cols, y, list(label_names), source,
                     users=users)


def _user_ids(rows, col: str, source: Source) -> np.ndarray:
    return user_numbers(rows.data.column(col), f"column {col!r}", source.error)


def user_numbers(column, what: str, error: Callable[[str, int | None], Exception]) -> np.ndarray:
    """User ids (an Arrow array: ``what`` names it, ``error(message, row)`` refuses) as int64 ids
    0, 1, ... in order of first appearance (any text or integer). Text ids are compared in one
    form (:func:`one_form`): "ann ", "Ann" and "Ａｎｎ" are one user. Counted as several, one person
    would contribute k examples under each spelling, and the guarantee of size-k groups would not
    cover them; merging two people costs only examples."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_nested(column.type) or pa.types.is_binary(column.type) or pa.types.is_boolean(column.type):
        raise error(f"{what} holds {column.type} values; a user id is a text or a number", None)
    if column.null_count:
        raise error(f"no user in {what}", int(pc.index(pc.is_null(column), True).as_py()))
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = one_form(column)
        if pc.any(pc.equal(column, "")).as_py():
            raise error(f"no user in {what}", int(pc.index(column, "").as_py()))
    if pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py():  # NaN: no user, like None
        raise error(f"no user in {what} (NaN)", int(pc.index(pc.is_nan(column), True).as_py()))
    # Arrow's hash kernel lists distinct values in the order it meets them
    ids = pc.index_in(column, value_set=pc.unique(column))
    return np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64)


def k_shot(table: TextTable, k: int, seed: int) -> TextTable:
    """k examples per class, drawn with ``seed`` (the papers' few-shot protocol): each class's
    examples, in their order, shuffled by ``random.Random(seed)``, its first k kept, and the kept
    ones shuffled again."""
    rng = random.Random(seed)
    keep: list[int] = []
    for y in np.unique(table.labels):
        idx = array.array("q", np.flatnonzero(table.labels == y).tobytes())  # 8 bytes a row, fast to swap
        rng.shuffle(idx)
        keep.extend(idx[:k])
    rng.shuffle(keep)
    return table.select(keep)


class Encoded:
    """The examples of a :class:`TextTable`, encoded (tokenised) when a batch asks for them: at most
    ``keep`` encodings are kept, the most recently used, so memory does not grow with the data set.

    ``encode`` maps a list of examples' text fields to a list of encodings. ``enc[i]`` and
    ``enc.take(indices)`` give encodings; a set no larger than ``keep`` can be encoded at once with
    :meth:`prefetch` (it then stays)."""

    def __init__(self, table: TextTable, encode: Callable[[list[tuple[str, ...]]], list], keep: int = 4096):
        self.table, self.encode, self.keep = table, encode, keep
        self._cache: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.take([i % len(self)])[0]

    def take(self, indices: Sequence[int]) -> list:
        idx = [int(i) for i in indices]
        missing = list(dict.fromkeys(i for i in idx if i not in self._cache))
        if missing:
            for i, e in zip(missing, self.encode(self.table.fields(missing))):
                self._cache[i] = e
        out = []
        for i in idx:
            self._cache.move_to_end(i)
            out.append(self._cache[i])
        while len(self._cache) > max(self.keep, len(idx)):
            self._cache.popitem(last=False)
        return out

    def prefetch(self, batch: int = 512) -> bool:
        """Encode every example now if they all fit in the cache (errors in them surface before
        training); True if it did."""
        if len(self) > self.keep:
            return False
        for s in range(0, len(self), batch):
            self.take(range(s, min(s + batch, len(self))))
        return True


# ------------------------------------------------------------------------------------------
# the recipe schema
# ------------------------------------------------------------------------------------------


class TextData(BaseModel):
    """A text classification data set as a recipe gives it, and the few-shot and test-size choices.

    Where the data is, one of:

    * ``path``: a folder with the ``train`` and ``test`` files (default ``train.tsv`` and
      ``test.tsv``; CSV, TSV, JSON Lines or Parquet, or folders written by ``Dataset.save_to_disk``),
      or a folder written by ``DatasetDict.save_to_disk`` whose splits ``train`` and ``test`` name
      (default ``train`` and ``test``). Without ``path``, ``train`` and ``test`` are paths.
    * ``hub``: a data set on the Hugging Face hub (``subset``: its configuration), loaded with
      ``datasets.load_dataset`` and cached; ``train`` and ``test`` name its splits.

    Users, for ``privacy.unit: user``: ``user`` names the training data's user id column (any text
    or number; ids are numbered in order of first appearance). A data set without users may take
    the public synthetic rule ``rows_per_user: N``: the user of row r of the training data is
    r // N, counted before ``k_per_class`` draws from it (the draw looks at labels; the rule must
    not), so that a user's rows are N neighbours in the file whatever the few-shot draw keeps.

    An objective's ``Params`` declares ``data: TextData = Field(default_factory=TextData)`` and
    calls :meth:`load` where it wants data errors reported (keys are relative to the objective's
    section: ``data.path``)."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(default=None, description="folder with the train/test files, or a saved DatasetDict")
    hub: str | None = Field(default=None, description="a Hugging Face hub data set id (instead of path)")
    subset: str | None = Field(default=None, description="the hub data set's configuration (e.g. sst2 of nyu-mll/glue)")
    train: str | None = Field(default=None, description="training file (default train.tsv) or split (default train)")
    test: str | None = Field(default=None, description="held-out file (default test.tsv) or split (default test)")
    format: Literal["tsv", "csv", "jsonl", "parquet"] | None = None
    header: bool = Field(default=True, description="CSV/TSV: the first line names the columns")
    columns: list[str] | None = Field(default=None, description="CSV/TSV without a header: the columns' names")
    text: Column | list[Column] = Field(default="sentence", description="text column(s): names or positions")
    label: Column = "label"
    labels: list[str | int] | None = Field(default=None, description="the labels, in order (label index i is "
                                                                     "labels[i])")
    user: Column | None = Field(default=None, description="privacy.unit: user: the user id column of the training "
                                                          "data (a name or a position)")
    rows_per_user: int | None = Field(default=None, gt=0, description="no user column: the public rule user = row "
                                      "// rows_per_user of the training data, before k_per_class draws from it")
    k_per_class: int | None = Field(default=None, gt=0)
    seed: int = 42
    max_test: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_source(self):
        if self.hub is not None and self.path is not None:
            raise ValueError("give data.path (local files) or data.hub (a hub data set), not both")
        if self.subset is not None and self.hub is None:
            raise ValueError("data.subset is the configuration of a hub data set; it needs data.hub")
        if self.user is not None and self.rows_per_user is not None:
            raise ValueError("give data.user (a user id column) or data.rows_per_user (synthetic users), not both")
        return self

    @property
    def columns_of_text(self) -> list[Column]:
        """The text columns, in the order their fields reach a template or a tokenizer."""
        return list(self.text) if isinstance(self.text, list) else [self.text]

    def file(self, name: str) -> Path:
        """A table's path: relative names are inside ``path`` when it is set."""
        p = Path(name).expanduser()
        return Path(self.path).expanduser() / p if self.path is not None and not p.is_absolute() else p

    # -- reading -----------------------------------------------------------------------------

    def _splits(self) -> tuple[Any, Source] | None:
        """(DatasetDict, what to call it) for a hub data set or a saved DatasetDict; None for files."""
        import datasets

        if self.hub is not None:
            with quiet():
                try:
                    return datasets.load_dataset(self.hub, self.subset), Source(self.hub)
                except ConnectionError:
                    raise UserError(how_to_provide(self.hub, self.subset), key="data.hub") from None
                except Exception as e:  # noqa: BLE001 -- a missing, gated or broken data set: bad input
                    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
                    key = "data.subset" if "config" in str(e) else "data.hub"
                    raise UserError(f"cannot load {self.hub!r} ({type(e).__name__}: {'; '.join(lines)[:300]})",
                                    key=key) from None
        folder = Path(self.path).expanduser() if self.path is not None else None
        if folder is not None and (folder / datasets.config.DATASETDICT_JSON_FILENAME).is_file():
            return _load_from_disk(folder, "data.path"), Source(str(folder))
        return None

    def _split(self, splits, source: Source, which: str):
        name = getattr(self, which) or which
        if name not in splits:
            raise UserError(f"{source} has no split {name!r} (splits: {', '.join(splits)})", key=f"data.{which}")
        return splits[name], Source(f"{source} (split {name})")

    def _file(self, which: str):
        p = self.file(getattr(self, which) or f"{which}.tsv")
        if p.is_dir():
            return _load_from_disk(p, f"data.{which}"), Source(str(p))
        rows = read_file(p, fmt=self.format, header=self.header, columns=self.columns)
        fmt = self.format or FORMATS.get(p.suffix.lower())
        first = _first_row(p, fmt) if fmt in ("tsv", "csv") else None
        return rows, Source(str(p), p, fmt, self.header, first)

    def load(self, pairs: tuple[str, list[str] | None] | None = None) -> tuple[TextTable, TextTable]:
        """(train, test): the test labels are indexed as the training labels; ``k_per_class`` draws
        the few-shot training set, ``max_test`` keeps the first test examples.

        ``pairs`` = (key, texts): the objective pairs ``texts`` (label descriptions, label words)
        with the labels by position. Then the label order must be given (``data.labels`` or the data
        set's ClassLabel), never guessed, and the pairing is said (:func:`dpregistry.progress.say`)."""
        labels = None if self.labels is None else [str(x) for x in self.labels]
        repeated = [n for n, c in Counter(labels or ()).items() if c > 1]
        if repeated:  # two indices for one label: the second could never be predicted
            raise UserError(f"duplicate label {repeated[0]!r}", key="data.labels")
        if self.path is not None and Path(self.path).expanduser().is_file():
            folder = Path(self.path)
            raise UserError(f"data.path {self.path!r} is a file; data.path names the folder, and data.train the file "
                            f"in it (--set data.path={folder.parent} --set data.train={folder.name})", key="data.path")
        if self.path is not None and not Path(self.path).expanduser().is_dir():
            raise UserError(f"data folder {self.path!r} not found; set data.path (e.g. --set data.path=DIR with "
                            f"{self.train or 'train.tsv'} and {self.test or 'test.tsv'})", key="data.path")
        splits = self._splits()
        if splits is not None:
            (train_rows, train_src), (test_rows, test_src) = (self._split(*splits, "train"),
                                                              self._split(*splits, "test"))
        else:
            (train_rows, train_src), (test_rows, test_src) = self._file("train"), self._file("test")
        if _same_source(train_src, test_src):
            raise UserError(f"data.test is the training data ({train_src}): held-out metrics computed on it measure "
                            f"the training examples themselves, which the guarantee does not cover; name a held-out "
                            f"file or split", key="data.test")
        cols = self.columns_of_text
        # The label set is public: the recipe's, the data set's ClassLabel, or the held-out split's
        # labels; never read off the private training rows (a label only one training row holds
        # would widen the head, and the model and an export's config would show it).
        test = make_table(test_rows, text_columns=cols, label_column=self.label, labels=labels, source=test_src,
                          paired_with=pairs[0] if pairs is not None else None)
        train = make_table(train_rows, text_columns=cols, label_column=self.label, labels=labels, source=train_src,
                           label_names=test.label_names, user_column=self.user, rows_per_user=self.rows_per_user,
                           declared=labels is not None)
        if pairs is not None:
            _pair(train.label_names, *pairs)
        if self.max_test:
            test = test.select(range(min(self.max_test, len(test))))
        whole = train
        if self.k_per_class:
            train = k_shot(train, self.k_per_class, self.seed)
        _check_held_out(test, whole, train, test_src)
        return train, test


#: the share of held-out examples with a training example's text from which the held-out set is
#: taken for a copy of training data (SST-2, whose phrases recur: 2 of its 872 test sentences and
#: 1,553 of the 6,735 dev phrases that ../shared/data/sst2 splits off its training set)
MAX_SHARED_HELD_OUT = 0.5


def _check_held_out(test: TextTable, whole: TextTable, train: TextTable, source: Source) -> None:
    """Held-out metrics are released as measured, without noise: they are covered by the guarantee
    only when the held-out set does not depend on the training data (a review told a flipped label
    from the step-0 accuracy on a copy of the training file). A held-out set of which half or
    more has a training example's text (over the whole training file) is refused as made from it;
    fewer shared texts (common phrases) are said."""
    copied = shared_texts(test, whole)
    if copied >= MAX_SHARED_HELD_OUT * len(test):
        raise UserError(f"{copied} of the {len(test)} held-out examples in {source} have the text of a training "
                        f"example (compared by their letters and digits, in lower case and without accents): a "
                        f"held-out set made from the training data gives metrics, released without noise, that "
                        f"measure the private examples themselves; name a held-out file or split",
                        key="data.test")
    drawn = copied if train is whole or not copied else shared_texts(test, train)
    if drawn:
        say(f"{drawn} of the {len(test)} held-out examples have the text of a training example: their metrics are "
            f"covered by the guarantee only if the held-out data was not made from the training data")


def user_ids(train: TextTable):
    """The :class:`~dpregistry.users.UserIds` of a training table, for an objective that provides
    them (``privacy.unit: user``)."""
    import torch

    from ..users import UserIds

    if train.users is None:
        raise UserError("privacy.unit: user needs the user of each training example: name the user id column with "
                        "data.user (or, for a data set without users, set data.rows_per_user: N)", key="data.user")
    return UserIds(torch.from_numpy(train.users))


def _pair(label_names: list[str], key: str, texts: list[str] | None) -> None:
    if not texts or len(texts) != len(label_names):
        raise UserError(f"{key} needs one text per label ({len(label_names)}: {label_names})", key=key)
    noun = key.split(".")[-1].replace("_", " ").removesuffix("s")  # model.label_descriptions: label description
    say(f"label → {noun}: " + ", ".join(f"{n} → {json.dumps(t, ensure_ascii=False)}" for n, t in zip(label_names, texts)))


def _load_from_disk(folder: Path, key: str):
    """A folder written by ``save_to_disk`` (a Dataset or a DatasetDict), memory-mapped."""
    import datasets

    from ..hf import require_regular_files

    for sub in [folder, *(p for p in folder.iterdir() if p.is_dir())]:
        require_regular_files(sub, key=key)  # a FIFO among the Arrow files would block the run
    with quiet():
        try:
            return datasets.load_from_disk(str(folder))
        except Exception as e:  # noqa: BLE001 -- not a saved data set, or a damaged one
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise UserError(f"{folder} is not a folder written by save_to_disk ({type(e).__name__}: {first})",
                            key=key) from None


def how_to_provide(hub: str, subset: str | None = None) -> str:
    args = ", ".join(map(repr, [hub] + ([subset] if subset else [])))
    return (f"data set {hub!r} is not in the local Hugging Face cache and the hub cannot be reached (HF_HUB_OFFLINE "
            f"or no network). On a machine with internet run `python -c \"import datasets; "
            f"datasets.load_dataset({args}).save_to_disk('DIR')\"`, copy DIR here and give data.path: DIR in place of "
            f"data.hub (--set data.hub=null --set data.path=DIR), or copy that machine's HF_HOME cache here")
