"""Rebuild tests/data/sst2 from a full SST-2 folder (GLUE's TSV files, header sentence<TAB>label).

    python tests/data/make_sst2_subset.py /path/to/sst2

The rule (deterministic, no randomness): train.tsv keeps the first 512 rows of each label of the
full train.tsv, test.tsv the first 150 rows of each label of the full test.tsv (GLUE's validation
split); rows keep their order in the source file. 512 per class is the papers' k-shot size, so the
shipped recipes run on the subset at their real n = 1,024.
"""

from __future__ import annotations

import sys
from pathlib import Path

PER_LABEL = {"train.tsv": 512, "test.tsv": 150}


def first_per_label(lines: list[str], k: int) -> list[str]:
    seen: dict[str, int] = {}
    keep = []
    for line in lines:
        label = line.rstrip("\n").rsplit("\t", 1)[1]
        if seen.get(label, 0) < k:
            seen[label] = seen.get(label, 0) + 1
            keep.append(line)
    short = {lab: n for lab, n in seen.items() if n < k}
    if short or len(seen) != 2:
        raise SystemExit(f"expected two labels with at least {k} rows each, got {seen}")
    return keep


def main(src: Path, dst: Path) -> None:
    for name, k in PER_LABEL.items():
        header, *rows = (src / name).read_text(encoding="utf-8").splitlines(keepends=True)
        (dst / name).write_text(header + "".join(first_per_label(rows, k)), encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), Path(__file__).resolve().parent / "sst2")
