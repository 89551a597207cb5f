"""Bytes on the wire and step time of data-parallel DPZero and DP-Adam (1 vs 2 processes, CPU).

    python benchmarks/distributed.py [--sst2 DIR] [--steps 6] [--batch 16]

DIR is a folder with SST-2's train.tsv and test.tsv: $DPREG_SST2_DIR, else the subset shipped in
tests/data/sst2 (512 rows per class, all this benchmark reads; the rows do not change what it
measures).

Both methods train the packaged MiniLM (22.7M parameters) on SST-2 with the same batch. DPZero
ranks exchange per-example scalars only; DP-Adam ranks all-reduce a clipped gradient of the size
of the model. Everything printed is measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = """\
seed: 0
objective: hf_text_classification
model: {{path: minilm, max_length: 64, head_init: label_descriptions,
        label_descriptions: ["It was terrible.", "It was great."]}}
data: {{path: {sst2}, k_per_class: 512, max_test: 64}}
sampler: {{name: shuffle, batch_size: {batch}}}
privacy: {{epsilon: 6.0, delta: 1.0e-5}}
train: {{steps: {steps}, log_every: 1, micro_batch_size: {micro}, progress: false}}
"""
DPZERO = """\
algorithm: standard
estimator: {name: zo_two_point, lambda: 1.0e-3}
privatizer: {name: gaussian, clip: 10.0, noise_multiplier: auto}
update: {name: directional_sgd, lr: 1.0e-5}
accountant: rdp
"""
DPADAM = """\
algorithm: dp_adam
privatizer: {clip: 1.0, noise_multiplier: auto}
update: {lr: 5.0e-4}
"""


def run(recipe: Path, nproc: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "dpregistry", "run", str(recipe), "--out", str(out), "-q"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dpregistry", "run", str(recipe), "--out", str(out), "-q"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"run failed:\n{res.stderr[-2000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def step_time(rows: list[dict]) -> float:
    """Median wall time per step, ignoring the first (warm-up) step."""
    walls = [r["wall_seconds"] for r in rows]
    dts = sorted(b - a for a, b in zip(walls, walls[1:]))
    return dts[len(dts) // 2]


def main():
    ap = argparse.ArgumentParser()
    subset = Path(__file__).resolve().parents[1] / "tests" / "data" / "sst2"
    ap.add_argument("--sst2", default=os.environ.get("DPREG_SST2_DIR", str(subset)))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    if not (Path(a.sst2) / "train.tsv").is_file():
        sys.exit(f"SST-2 not found: {a.sst2} has no train.tsv; pass --sst2 DIR, a folder with train.tsv and "
                 f"test.tsv (header sentence<TAB>label)")
    tmp = Path(tempfile.mkdtemp())
    results = {}
    for name, body in (("DPZero", DPZERO), ("DP-Adam", DPADAM)):
        recipe = tmp / f"{name}.yaml"
        recipe.write_text(COMMON.format(sst2=a.sst2, batch=a.batch, steps=a.steps, micro=a.batch // 2) + body)
        for n in (1, 2):
            rows = run(recipe, n, tmp / f"{name}-{n}")
            results[name, n] = rows
    print(f"model: MiniLM (22.7M parameters), batch {a.batch}, {a.steps} steps, CPU")
    print(f"{'method':<9} {'bytes/step/rank (2 proc)':>25} {'step s (1 proc)':>16} {'step s (2 proc)':>16} {'speed-up':>9}")
    for name in ("DPZero", "DP-Adam"):
        b = max(r.get("comm_bytes_per_step", 0) for r in results[name, 2][1:])
        t1, t2 = step_time(results[name, 1]), step_time(results[name, 2])
        print(f"{name:<9} {b:>25,.0f} {t1:>16.3f} {t2:>16.3f} {t1 / t2:>8.2f}x")
    bz = max(r.get("comm_bytes_per_step", 0) for r in results["DPZero", 2][1:])
    ba = max(r.get("comm_bytes_per_step", 0) for r in results["DP-Adam", 2][1:])
    print(f"DP-Adam sends {ba / bz:,.0f}x the bytes of DPZero per step (DPZero: O(B), independent of model size)")


if __name__ == "__main__":
    main()
