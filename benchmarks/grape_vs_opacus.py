"""Peak memory and step time of dpregistry's DP-Adam and DP-GRAPE against Opacus 1.6 DP-Adam.

Models are built from configurations (benchmarks/configs/*.json, random weights): a RoBERTa-style
encoder with a linear head on the first token, and a small ViT (patch 4, 32 px). Every method runs
the same model, batch, inputs, clipping (flat, C = 1) and noise multiplier (1.0), with Adam:

* opacus_hooks  Opacus 1.6 PrivacyEngine, grad_sample_mode="hooks" (per-sample gradients stored)
* opacus_ghost  Opacus 1.6 PrivacyEngine, grad_sample_mode="ghost" (ghost clipping, two backwards)
* dp_adam       dpregistry per_example_grad (hooks: ghost norms + book-keeping) + gaussian + adam
* dp_grape      dpregistry projected_per_example_grad + gaussian + projected_adam (rank r)

Memory (CPU): each configuration runs in a fresh subprocess; peak = the process's resident-set
high-water mark (getrusage ru_maxrss, which the kernel keeps) minus the RSS after the method's
libraries are imported and before the model is built, so it counts the model, optimizer state,
activations and per-example buffers, not the Python/torch/Opacus/dpregistry libraries. On a GPU it is torch.cuda.max_memory_allocated() after
the same steps. Step time: median of the timed steps (default 2) after one warm-up step.

Largest batch in a memory budget: peak(B) is measured at B and at ``--fit-factor``·B (default 6),
the linear fit gives the largest B under the budget (``--verify`` runs one more subprocess at that B to check that it fits).

    python benchmarks/grape_vs_opacus.py [--models roberta vit] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ("opacus_hooks", "opacus_ghost", "dp_adam", "dp_grape")
MODELS = {
    # name: (config, batch, seq/None, rank, budget in MiB)
    "roberta": ("roberta-style.json", 8, 32, 16, 4096),
    "vit": ("vit-small.json", 16, None, 32, 2048),
}


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


def build(model: str, device: str):
    import torch
    import transformers
    from torch import nn

    cfg_file, B, T, rank, _ = MODELS[model]
    cfg = json.loads((HERE / "configs" / cfg_file).read_text())
    torch.manual_seed(0)
    if model == "roberta":
        class Classifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.encoder = transformers.RobertaModel(transformers.RobertaConfig(**cfg), add_pooling_layer=False)
                self.head = nn.Linear(cfg["hidden_size"], 2)

            def forward(self, x):
                return self.head(self.encoder(input_ids=x).last_hidden_state[:, 0])

        net = Classifier()
        make_x = lambda n: torch.randint(3, cfg["vocab_size"], (n, T))  # noqa: E731
    else:
        class Vit(nn.Module):
            def __init__(self):
                super().__init__()
                self.vit = transformers.ViTForImageClassification(transformers.ViTConfig(**cfg))

            def forward(self, x):
                return self.vit(pixel_values=x).logits

        net = Vit()
        make_x = lambda n: torch.randn(n, 3, cfg["image_size"], cfg["image_size"])  # noqa: E731
    return net.to(device).train(), make_x, rank


def import_libraries(method: str) -> None:
    """Import what ``method`` runs on before the baseline RSS is taken, so its peak counts what the
    method allocates, not library code (dpregistry's run, recipe and registry weigh about 70 MiB)."""
    if method.startswith("opacus"):
        import opacus  # noqa: F401
    else:
        import dpreg_accounting.accountants  # noqa: F401
        import dpreg_baseline.estimators  # noqa: F401
        import dpreg_baseline.privatizers  # noqa: F401
        import dpreg_baseline.updates  # noqa: F401
        import dpreg_grape.estimators  # noqa: F401
        import dpreg_grape.updates  # noqa: F401
        import dpregistry.recipe  # noqa: F401
        import dpregistry.run  # noqa: F401


def dpregistry_run(method: str, net, X, y, rank: int, device: str):
    """A prepared dpregistry run of ``method`` on the benchmark's model: its objective serves the
    fixed batch (X, y), every step takes all of it, C = 1, σ = 1, Adam (projected for dp_grape)."""
    import tempfile

    import torch.nn.functional as F
    import yaml

    from dpregistry import Objective, StagePlugin
    from dpregistry.recipe import load
    from dpregistry.registry import Registry
    from dpregistry.run import Run

    class Batch(Objective):
        """The benchmark's model on its fixed batch."""

        name = "benchmark_batch"
        n_train = len(y)

        def params(self):
            return {n: p for n, p in net.named_parameters() if p.requires_grad}

        def module(self):
            return net

        def losses(self, idx):
            return F.cross_entropy(net(X[idx]), y[idx], reduction="none")

    registry = Registry().load_entry_points()
    registry.add_plugin(StagePlugin(Batch), origin="benchmarks/grape_vs_opacus.py")
    if method == "dp_grape":
        estimator, update = {"name": "projected_per_example_grad", "rank": rank}, {"name": "projected_adam"}
    else:
        estimator, update = {"name": "per_example_grad", "backend": "hooks"}, {"name": "adam"}
    recipe = {"algorithm": method, "seed": 0, "objective": {"name": Batch.name}, "sampler": {"name": "full_batch"},
              "estimator": estimator, "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0},
              "update": {**update, "lr": 1e-4}, "accountant": {"name": "rdp"},
              "train": {"steps": 1000, "device": device, "progress": False}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return Run(load(path, registry=registry)).prepare()


def child(method: str, model: str, B: int, device: str, steps: int = 2) -> dict:
    """One configuration in this (fresh) process: warm-up + timed steps, peak memory."""
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(os.environ.get("GRAPE_BENCH_THREADS", "2")))
    import_libraries(method)
    base = rss_mib()
    net, make_x, rank = build(model, device)
    g = torch.Generator().manual_seed(1)
    X = make_x(B).to(device)
    y = torch.randint(0, 2, (B,), generator=g).to(device)
    d = sum(p.numel() for p in net.parameters())

    if method.startswith("opacus"):
        from opacus import PrivacyEngine

        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X.cpu(), y.cpu()), batch_size=B)
        pe = PrivacyEngine(accountant="rdp")
        if method == "opacus_ghost":
            net, opt, crit, _ = pe.make_private(module=net, optimizer=opt, data_loader=dl,
                                                criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0,
                                                max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
        else:
            net, opt, _ = pe.make_private(module=net, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                                          max_grad_norm=1.0, grad_sample_mode="hooks", poisson_sampling=False)
            crit = torch.nn.CrossEntropyLoss()

        def step():
            crit(net(X), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        run = dpregistry_run(method, net, X, y, rank, device)

        def step():  # one step as dpregistry.loop takes it (the charge is a ledger entry)
            run.begin_step()
            run.algorithm.step(run)
            run.step += 1

    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    step()
    times = []
    for _ in range(steps):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if device == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    else:
        peak = torch.cuda.max_memory_allocated() / 2 ** 20
    return {"method": method, "model": model, "batch": B, "peak_mib": peak,
            "step_s": statistics.median(times) if times else float("nan"),
            "params": d}


def spawn(method, model, B, device, steps=2) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", method, model, str(B), "--device", device,
                          "--steps", str(steps)],
                         capture_output=True, text=True)
    for line in out.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    return {"method": method, "model": model, "batch": B, "error": (out.stderr or out.stdout)[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-budget", action="store_true", help="skip the largest-batch search")
    ap.add_argument("--verify", action="store_true", help="check each predicted largest batch in a subprocess")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    ap.add_argument("--fit-factor", type=int, default=6,
                    help="peak(B) is fitted at B and this multiple of B: small batches sit where the optimizer "
                         "step's fixed memory, not the per-example buffers, sets the peak")
    a = ap.parse_args()
    if a.child:
        m, model, B = a.child
        print(json.dumps(child(m, model, int(B), a.device, a.steps)))
        return
    for model in a.models:
        _, B, T, rank, budget = MODELS[model]
        res = {m: spawn(m, model, B, a.device, a.steps) for m in METHODS}
        for m, r in res.items():
            if "error" in r:
                print(f"{model} {m} failed: {r['error']}")
        ok = {m: r for m, r in res.items() if "error" not in r}
        print(f"\n== {model} (from benchmarks/configs/{MODELS[model][0]}; {ok[next(iter(ok))]['params'] / 1e6:.1f}M "
              f"parameters), batch {B}{f', sequence {T}' if T else ''}, C = 1, σ = 1, Adam, {a.device}")
        print(f"{'method':<14} {'peak MiB':>9} {'step s':>8}")
        for m, r in ok.items():
            print(f"{m:<14} {r['peak_mib']:>9.0f} {r['step_s']:>8.2f}")
        for ours in ("dp_adam", "dp_grape"):
            for ref in ("opacus_hooks", "opacus_ghost"):
                if ours in ok and ref in ok:
                    mem = ok[ours]["peak_mib"] / ok[ref]["peak_mib"]
                    tim = ok[ours]["step_s"] / ok[ref]["step_s"]
                    target = "≤ 1.0" if ours == "dp_adam" else "≤ 0.35 (memory)"
                    print(f"{ours} ÷ {ref}: memory {mem:.3f}, time {tim:.3f}   (target {target})")
        if a.no_budget:
            continue
        B2 = a.fit_factor * B
        print(f"largest batch within {budget} MiB (peak(B) fitted at B = {B}, {B2}"
              f"{'; checked at the prediction' if a.verify else ''}):")
        for m in METHODS:
            if m not in ok:
                continue
            r2 = spawn(m, model, B2, a.device, 1)  # two steps: Adam's state exists from the first update
            if "error" in r2:
                print(f"  {m:<14} failed at batch {B2}")
                continue
            slope = (r2["peak_mib"] - ok[m]["peak_mib"]) / (B2 - B)
            fixed = ok[m]["peak_mib"] - slope * B
            pred = int((budget - fixed) / slope) if slope > 0 else 10 ** 6
            chk = spawn(m, model, max(pred, 1), a.device, 1) if a.verify and 0 < pred <= 4096 else None
            fits = chk is not None and "error" not in chk and chk["peak_mib"] <= budget
            print(f"  {m:<14} {pred:>6}  ({fixed:.0f} MiB + {slope:.1f} MiB/example; "
                  f"{'fits: ' + format(chk['peak_mib'], '.0f') + ' MiB' if fits else 'check: ' + (format(chk['peak_mib'], '.0f') + ' MiB' if chk and 'peak_mib' in chk else 'not run')})")


if __name__ == "__main__":
    main()
