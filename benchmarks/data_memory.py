"""Memory of a text data set that is large on disk: peak RSS of a short MiniLM DP-Adam run on a
generated 2,000,000-row Parquet file ÷ that of the same run on a 10,000-row one (target ≤ 1.5).

Each run is the shipped recipe ``minilm_sst2_dp_adam`` with its data pointed at the generated
file (``--set data.path=DIR --set data.train=FILE --set data.test=test.parquet``), a few steps,
through ``dpregistry.train``, in a fresh process with an empty datasets cache of its own (so the
conversion of the file to Arrow is part of the run, as on a first run). The peak is the child's
``ru_maxrss``, read by ``wait4``: the whole process, Python, torch and the model included. Two
settings are measured:

* ``k-shot``: the recipe as shipped (512 examples per class, drawn from all rows by their labels);
* ``all rows``: ``data.k_per_class=null``, so the sampler draws batches from every row and each
  step reads and tokenises its batch from the memory-mapped table.

Usage: python benchmarks/data_memory.py [--rows 2000000] [--small 10000] [--steps 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fresh_process import run_child

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.5
WORDS = [f"{a}{b}" for a in ("re", "un", "pre", "de", "in", "over", "sub", "", "mis", "out")
         for b in ("film", "plot", "cast", "scene", "story", "act", "shot", "score", "line", "role", "twist", "pace",
                   "mood", "tone", "joke", "hero", "end", "cut", "set", "light")] + \
        ["a", "the", "is", "was", "and", "but", "not", "very", "so", "too", "good", "bad", "dull", "great", "fine"]


def write_rows(path: Path, rows: int, seed: int, chunk: int = 100_000) -> None:
    """``rows`` synthetic reviews (8–24 words) with labels 0/1, written a row group at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = np.array(WORDS, dtype=object)
    schema = pa.schema([("sentence", pa.string()), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            lengths = rng.integers(8, 25, n)
            picks = words[rng.integers(0, len(WORDS), (n, 24))]
            sentences = [" ".join(picks[i, :lengths[i]]) for i in range(n)]
            w.write_table(pa.table({"sentence": sentences, "label": rng.integers(0, 2, n)}, schema=schema))


def child(folder: str, train: str, steps: int, all_rows: bool) -> None:
    """One run (in this fresh process): what the parent measures."""
    import dpregistry

    sets = [f"data.path={folder}", f"data.train={train}", "data.test=test.parquet", f"train.steps={steps}",
            "train.eval_every=null", "train.checkpoint_every=null", "train.log_every=1000000",
            "privacy.delta=1.0e-8"]  # below 1/n for every row of the large file (the recipe's 1e-5 is not)
    if all_rows:
        sets.append("data.k_per_class=null")
    t0 = time.perf_counter()
    result = dpregistry.train("minilm_sst2_dp_adam", set=sets, verbose=False)
    print(json.dumps({"seconds": time.perf_counter() - t0, "n_train": result.run.objective.n_train,
                      "accuracy": result.metrics.get("accuracy")}))


def measure(folder: Path, train: str, steps: int, all_rows: bool) -> dict:
    """Peak RSS (MB) and the child's report of one run in a fresh process and a fresh datasets cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins"), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, __file__, "--child", str(folder), train, str(steps), "1" if all_rows else "0"]
        out, peak_mib, seconds = run_child(cmd, env=env)
    return {"peak_mb": peak_mib, "wall_s": seconds, **json.loads(out.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep", help="write the generated files here (and keep them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for name, rows, seed in (("large.parquet", args.rows, 0), ("small.parquet", args.small, 1),
                                 ("test.parquet", 500, 2)):
            if not (folder / name).exists():
                write_rows(folder / name, rows, seed)
        size = (folder / "large.parquet").stat().st_size / 2**20
        print(f"generated {args.rows:,} + {args.small:,} rows ({size:.0f} MB of Parquet) in "
              f"{time.perf_counter() - t0:.0f} s; MiniLM DP-Adam, {args.steps} steps, fresh process and cache each")
        verdicts = []
        for label, all_rows in (("k-shot (as shipped)", False), ("all rows", True)):
            small = measure(folder, "small.parquet", args.steps, all_rows)
            large = measure(folder, "large.parquet", args.steps, all_rows)
            ratio = large["peak_mb"] / small["peak_mb"]
            ok = ratio <= TARGET
            verdicts.append(ok)
            print(f"{label:>20}: peak RSS {large['peak_mb']:7.0f} MB on {args.rows:,} rows (n_train "
                  f"{large['n_train']:,}, {large['wall_s']:.0f} s) vs {small['peak_mb']:7.0f} MB on {args.small:,} "
                  f"(n_train {small['n_train']:,}, {small['wall_s']:.0f} s): ratio {ratio:.3f} "
                  f"(+{large['peak_mb'] - small['peak_mb']:.0f} MB), target <= {TARGET}: {'PASS' if ok else 'FAIL'}")
        print("verdict:", "PASS" if all(verdicts) else "FAIL")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1")
    else:
        main()
