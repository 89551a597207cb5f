"""User-level DP on MiniLM + SST-2 (issue 19, item 5): held-out accuracy at user-level ε = 6 for
user-level sampling (ULS) and example-level sampling with contribution bounding (ELS), next to
example-level DP-Adam at ε = 6, with the time and memory of each run over the example-level one.

SST-2 has no users, so users are assigned by the documented public rule of the shipped recipe
recipes/minilm_sst2_user_dp_adam.yaml: ``data.rows_per_user: 20`` (user = row index of the training
file // 20, blind to texts and labels). All runs train on every row of SST-2's train.tsv (67,349
rows, 3,368 users) with the shipped DP-Adam recipe's model, clip, learning rate and steps, and
see the same number of examples per step: B rows for the example-level run and ELS, B ÷ k users of
k rows for ULS. The example-level ε protects one row; the ULS and ELS ε protect all 20 rows of a
user (ELS keeps k of them and pays group privacy of size k).

Each run is a fresh process. Its memory is the peak RSS above what it has once the libraries a run
imports are in (torch, transformers' BERT code, ``datasets``, dpregistry and its plugins): data,
model, training and evaluation. The whole process's peak (``ru_maxrss``, read by ``wait4``) is
printed beside it; that one counts the libraries in every run alike, which pulls the ratio towards 1.
Time is the training loop's wall time, with evaluation excluded. The test score is SST-2's 872
labelled test sentences.

    python benchmarks/user_level_sst2.py --data /path/to/sst2 [--steps N] [--batch 256] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fresh_process import import_dpregistry, reset_peak_rss, run_child, status_kib, warn_of_window_imports

REPO = Path(__file__).resolve().parents[1]
#: example-level DP-Adam and ELS run the shipped example-level recipe, ULS its user-level version
RECIPES = {"example": "minilm_sst2_dp_adam.yaml", "els": "minilm_sst2_dp_adam.yaml",
           "uls": "minilm_sst2_user_dp_adam.yaml"}


def sets_for(method: str, data: str, steps: int, batch: int, k: int) -> list[str]:
    common = [f"data.path={data}", "data.k_per_class=null", "train.eval_every=null",
              "train.checkpoint_every=null", "train.progress=false"] + ([f"train.steps={steps}"] if steps else [])
    if method == "example":
        return common + [f"sampler.batch_size={batch}"]
    user = ["privacy.unit=user", f"privacy.max_examples_per_user={k}", "data.rows_per_user=20"]
    if method == "els":
        return common + user + [f"sampler.batch_size={batch}"]
    return common + user + [f"sampler.users_per_step={batch // k}"]


def child(method: str, sets: list[str], out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import dpregistry
    from dpregistry.hf import _alias_dir
    from dpregistry.recipe import load
    from dpregistry.run import Run

    import_dpregistry()
    # the model's code loads at first use, through the Auto classes' lookups: resolve them (the
    # configuration and the 1 MiB tokenizer, not the weights) before the baseline
    transformers.BertModel, transformers.AutoTokenizer.from_pretrained(_alias_dir("minilm"))  # noqa: B018
    base, modules = status_kib("VmRSS"), set(sys.modules)
    reset_peak_rss()
    run = Run(load(REPO / "recipes" / RECIPES[method], sets)).prepare()
    t0 = time.perf_counter()
    s = run.train()
    seconds = time.perf_counter() - t0
    acc = run.objective.evaluate()["accuracy"]
    out.write_text(json.dumps({"accuracy": acc, "epsilon": s["epsilon"], "delta": s["delta"],
                               "unit": s.get("unit", "example"), "users": s.get("users"),
                               "example_level": s.get("example_level"), "seconds": seconds,
                               "noise_multiplier": s.get("noise_multiplier"), "version": dpregistry.__version__,
                               "peak_above_imports_mib": (status_kib("VmHWM") - base) / 1024,
                               "window_imports": sorted(set(sys.modules) - modules)}))


def measure(method: str, sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        _, peak_mib, _ = run_child([sys.executable, __file__, "--child", method, "--out", str(out), "--sets",
                                    json.dumps(sets)], cwd=REPO)
        res = json.loads(out.read_text())
    res["peak_mib"] = peak_mib
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.environ.get("DPREG_SST2_DIR", str(REPO.parent / "shared/data/sst2")),
                    help="a folder with SST-2's train.tsv and test.tsv")
    ap.add_argument("--steps", type=int, help="default: the recipe's")
    ap.add_argument("--batch", type=int, default=256, help="examples per step (ULS: batch ÷ k users of k rows)")
    ap.add_argument("--k", type=int, default=4, help="privacy.max_examples_per_user")
    ap.add_argument("--child"), ap.add_argument("--out"), ap.add_argument("--sets")
    a = ap.parse_args()
    if a.child:
        return child(a.child, json.loads(a.sets), Path(a.out))
    rows = {}
    for method in ("example", "uls", "els"):
        print(f"running {method} ...", flush=True)
        rows[method] = measure(method, sets_for(method, a.data, a.steps, a.batch, a.k))
    base = rows["example"]
    steps = a.steps or "the recipe's"
    print(f"\nMiniLM + SST-2, all of train.tsv ({steps} steps, {a.batch} examples per step, "
          f"k = {a.k}, 20 rows per user)")
    for m, r in rows.items():
        warn_of_window_imports(m, r["window_imports"])
    print(f"{'run':<34} {'unit':<8} {'ε':>6} {'accuracy':>9} {'time ÷ ex.':>11} {'memory ÷ ex.':>13} "
          f"{'process ÷ ex.':>14} {'memory MiB':>11}")
    names = {"example": "example-level DP-Adam", "uls": "ULS (user_poisson)", "els": "ELS (poisson, group k)"}
    for m, r in rows.items():
        print(f"{names[m]:<34} {r['unit']:<8} {r['epsilon']:>6.3f} {r['accuracy']:>9.4f} "
              f"{r['seconds'] / base['seconds']:>11.2f} "
              f"{r['peak_above_imports_mib'] / base['peak_above_imports_mib']:>13.2f} "
              f"{r['peak_mib'] / base['peak_mib']:>14.2f} {r['peak_above_imports_mib']:>11.0f}")
    print("(memory: the peak RSS above the imported libraries; process: the whole process's peak RSS)")
    ratio = rows["uls"]["peak_above_imports_mib"] / base["peak_above_imports_mib"]
    print(f"\nULS peak memory ÷ example-level at the same examples per step: {ratio:.2f} "
          f"(target ≤ 1.2: {'MET' if ratio <= 1.2 else 'NOT MET'})")
    if rows["els"].get("example_level"):
        e = rows["els"]["example_level"]
        print(f"ELS's example-level run: ε = {e['epsilon']:.3f}, δ = {e['delta']:.3g} (group privacy of size {a.k})")


if __name__ == "__main__":
    main()
