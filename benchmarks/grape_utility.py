"""Utility of DP-GRAPE against DP-Adam and zero-shot on the packaged MiniLM + SST-2 (issue 5, item 6).

Both private runs use the shipped recipes (recipes/minilm_sst2_dp_adam.yaml and
recipes/minilm_sst2_dpgrape.yaml): the same data (k = 512 per class), Poisson batches of 64, clip,
steps and budget ((6, 1e-5)-DP, replace-one, RDP). Zero-shot is the starting point of both: the
pretrained encoder with the label-description head, before any step. Each method runs in its own
process (in parallel); the table prints test accuracy on SST-2's labelled test split.

    python benchmarks/grape_utility.py --data /path/to/sst2 [--steps 100] [--batch 64]

--data (default $DPREG_SST2_DIR) is a full copy of GLUE's SST-2: train.tsv and test.tsv with the
header sentence<TAB>label. The subset in tests/data is for the tests: its 300 test sentences do
not give accuracies comparable with the papers' 872.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"dp_adam": "minilm_sst2_dp_adam.yaml", "dp_grape": "minilm_sst2_dpgrape.yaml"}


def one(method: str, data: str, steps: int | None, batch: int | None, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("GRAPE_BENCH_THREADS", "1")))
    from dpregistry.run import Run
    from dpregistry.recipe import load

    recipe = RECIPES.get(method, RECIPES["dp_adam"])
    sets = [f"data.path={data}", "train.eval_every=null", "train.checkpoint_every=null"]
    if steps:
        sets.append(f"train.steps={steps}")
    if batch:
        sets.append(f"sampler.batch_size={batch}")
    run = Run(load(REPO / "recipes" / recipe, sets)).prepare()
    t0 = time.time()
    if method == "zero_shot":
        res = {"accuracy": run.objective.evaluate()["accuracy"], "epsilon": 0.0, "steps": 0}
    else:
        s = run.train()
        res = {"accuracy": s["metrics"]["accuracy"], "epsilon": s["epsilon"], "steps": s["step"],
               "noise_multiplier": s["noise_multiplier"], "batch": run.recipe.data["sampler"]["batch_size"],
               "lr": run.recipe.data["update"]["lr"]}
    res["seconds"] = time.time() - t0
    out.write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.environ.get("DPREG_SST2_DIR"),
                    help="a folder with SST-2's train.tsv and test.tsv (default: $DPREG_SST2_DIR)")
    ap.add_argument("--steps", type=int, default=None, help="override the recipes' steps (both methods)")
    ap.add_argument("--batch", type=int, default=None, help="override the recipes' expected batch size (both)")
    ap.add_argument("--out", default="runs/grape_utility")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.data or not all((Path(a.data) / f).is_file() for f in ("train.tsv", "test.tsv")):
        sys.exit(f"SST-2 not found{f' in {a.data}' if a.data else ''}: pass --data DIR or set DPREG_SST2_DIR to a "
                 "full copy of GLUE's SST-2 (train.tsv and test.tsv, header sentence<TAB>label)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.one:
        one(a.one, a.data, a.steps, a.batch, out / f"{a.one}.json")
        return
    procs = {}
    for m in ("zero_shot", "dp_adam", "dp_grape"):
        cmd = [sys.executable, __file__, "--one", m, "--data", a.data, "--out", str(out)]
        if a.steps:
            cmd += ["--steps", str(a.steps)]
        if a.batch:
            cmd += ["--batch", str(a.batch)]
        procs[m] = subprocess.Popen(cmd)
    for m, p in procs.items():
        if p.wait() != 0:
            sys.exit(f"{m} failed")
    res = {m: json.loads((out / f"{m}.json").read_text()) for m in procs}
    print("\nMiniLM + SST-2 (k = 512 per class), same steps, batch and budget; test accuracy")
    print(f"{'method':<10} {'accuracy':>9} {'ε':>6} {'steps':>6} {'σ':>7} {'lr':>8} {'seconds':>8}")
    for m, r in res.items():
        print(f"{m:<10} {r['accuracy']:>9.4f} {r['epsilon']:>6.2f} {r['steps']:>6} "
              f"{r.get('noise_multiplier') or 0:>7.3f} {r.get('lr', 0):>8.1e} {r['seconds']:>8.0f}")
    gap = 100 * (res["dp_grape"]["accuracy"] - res["dp_adam"]["accuracy"])
    print(f"DP-GRAPE − DP-Adam: {gap:+.1f} points (target ≥ −2.0); "
          f"over zero-shot: DP-Adam {100 * (res['dp_adam']['accuracy'] - res['zero_shot']['accuracy']):+.1f}, "
          f"DP-GRAPE {100 * (res['dp_grape']['accuracy'] - res['zero_shot']['accuracy']):+.1f} points")


if __name__ == "__main__":
    main()
