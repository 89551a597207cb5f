"""dpregistry's DP-Adam and DP-GRAPE against non-private Adam and Opacus 1.6: time and memory.

Models are built from configurations (benchmarks/configs/*.json, random weights): a RoBERTa-style
encoder with a linear head on the first token, the same at RoBERTa-large's shape (``roberta-large``,
355M: the model of the DP-GRAPE paper's memory figure; not in the default ``--models``, each process
holds several GiB), and a small ViT (patch 4, 32 px). Every method runs
the same model, batch and inputs; the private ones use flat clipping C = 1, noise multiplier 1.0:

* adam          torch.optim.Adam on the mean loss (non-private: the cost to beat)
* adam_noise    the same plus d Gaussians from dpregistry's default (secure) generator added to the
                gradient, no clipping: the baseline plus the noise alone, the reference a DP step
                with that noise can only beat by a leaner optimizer (timed only; it shows when a
                time target lies below what the noise costs)
* dp_adam       dpregistry per_example_grad (hooks: ghost norms + book-keeping) + gaussian + adam
* dp_adam_2p    the same with ``passes: 2`` (norms in one backward, the clipped sum from a second)
* dp_adam_pl    the same with per-layer clipping (``privatizer.clipping: per_layer``, opt-in: each
                layer to C/√layers, summed in the one backward as it goes; another algorithm than
                flat clipping, with the same sensitivity and noise)
* dp_grape      dpregistry projected_per_example_grad + gaussian + projected_adam (rank r)
* dp_grape_e    the same with the embedding tables projected too (``project.embeddings``; not the paper's)
* dp_grape_2p   dp_grape with ``passes: 2``
* dp_grape_pl   dp_grape with per-layer clipping (in the projected space)
* opacus_ghost  Opacus 1.6 PrivacyEngine, grad_sample_mode="ghost" (ghost clipping, two backwards)
* opacus_hooks  Opacus 1.6 PrivacyEngine, grad_sample_mode="hooks" (per-sample gradients stored)
* NAME_ckpt     method NAME on the model with Hugging Face's activation checkpointing on
                (``gradient_checkpointing_enable()``: each layer's activations are recomputed in
                the backward, not kept; non-reentrant): adam_ckpt, dp_adam_pl_ckpt, dp_grape_pl_ckpt,
                dp_grape_e_pl_ckpt (embeddings projected too), opacus_ghost_ckpt (``passes: 2``
                refuses checkpointing: its two backwards would recompute the blocks twice)

Time: every method is built in ONE process (one copy of the model each, the same initial weights)
and the methods' steps alternate, round after round (the order rotates each round), so a change of
the shared machine's load hits all of them alike. A ratio is taken within each round (the two
steps a few seconds apart) and min / median / max over the rounds are printed.

Memory: each (method, batch) runs in a fresh process. After the method's libraries are imported
(``import_libraries``: transformers' model code too, which loads at first use) the process resets
the kernel's peak-RSS counter (``/proc/self/clear_refs``), builds the model, takes two steps
(Adam's state exists from the first update) and reads VmHWM: peak = VmHWM − the RSS after the
imports, i.e. model, optimizer state, activations, per-example buffers and what glibc's heap keeps
of freed memory. Every child, whatever its method, keeps freed memory for its next step as a
dpregistry run on a CPU does (``dpregistry/heap.py``), unless the environment tunes glibc (run with
``MALLOC_MMAP_THRESHOLD_=1048576`` to give every large block back: the children inherit the
environment, and the report's header names the setting). On a GPU (``--device cuda``):
torch.cuda.max_memory_allocated.

Largest batch in a memory budget: the largest batch of the sweep whose measured peak fits, then
(``--search N``) N bisection steps between it and the first batch that did not fit, each one more
fresh-process run: every number printed was measured, none is extrapolated.

Each ratio is printed with the target of issue 18 and MET / NOT MET.

    python benchmarks/grape_vs_opacus.py [--models vit roberta] [--batches 8 16 32 64 128 256]
        [--methods ...] [--rounds 5] [--search 3] [--device cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import import_dpregistry, reset_peak_rss, status_kib  # noqa: E402

HERE = Path(__file__).resolve().parent
METHODS = ("adam", "adam_noise", "dp_adam", "dp_adam_2p", "dp_adam_pl", "dp_grape", "dp_grape_e", "opacus_ghost", "opacus_hooks",
           "dp_grape_2p", "dp_grape_pl", "adam_ckpt", "dp_adam_pl_ckpt", "dp_grape_pl_ckpt", "dp_grape_e_pl_ckpt",
           "opacus_ghost_ckpt")
DEFAULT_METHODS = ("adam", "adam_noise", "dp_adam", "dp_adam_pl_ckpt", "dp_grape", "opacus_ghost")
TIME_ONLY = {"adam_noise"}
BATCHES = (8, 16, 32, 64, 128, 256)
MODELS = {
    # name: (config, sequence length or None, rank, memory budget in MiB)
    "vit": ("vit-small.json", None, 32, 2048),
    "roberta": ("roberta-style.json", 32, 16, 4096),
    # RoBERTa-large's shape (355M, 24 layers, H 1024), the model of the DP-GRAPE paper's memory figure
    "roberta-large": ("roberta-large.json", 32, 16, 16384),
}
# (numerator, denominator, what, target): issue 18's table; "≤ x" holds at every batch
TIME_TARGETS = [("dp_adam", "adam", 1.15), ("dp_adam_2p", "adam", 1.15), ("dp_adam_pl", "adam", 1.15),
                ("dp_grape", "dp_adam", 1.2),
                ("dp_grape_e", "dp_adam", 1.2)]
MEMORY_TARGETS = [("dp_adam", "opacus_ghost", 0.75), ("dp_adam", "adam", 1.10), ("dp_grape", "opacus_ghost", 0.5),
                  ("dp_grape", "dp_adam", 0.4), ("dp_adam_2p", "opacus_ghost", 0.75), ("dp_adam_2p", "adam", 1.10),
                  ("dp_grape_e", "opacus_ghost", 0.5), ("dp_grape_e", "dp_adam", 0.4),
                  ("dp_adam_pl", "opacus_ghost", 0.75), ("dp_adam_pl", "adam", 1.10),
                  ("dp_adam_pl_ckpt", "opacus_ghost", 0.75), ("dp_adam_pl_ckpt", "adam_ckpt", 1.10),
                  ("dp_grape_pl_ckpt", "opacus_ghost", 0.5), ("dp_grape_pl_ckpt", "dp_adam_pl_ckpt", 0.4),
                  ("dp_grape_e_pl_ckpt", "opacus_ghost", 0.5), ("dp_grape_e_pl_ckpt", "dp_adam_pl_ckpt", 0.4)]
# ours ≥ 2× Opacus ghost's largest batch
BATCH_TARGETS = [(m, "opacus_ghost", 2.0) for m in ("dp_adam", "dp_adam_2p", "dp_adam_pl", "dp_grape",
                                                    "dp_adam_pl_ckpt")]


def sequence(model: str) -> int | None:
    """The model's sequence length (``--seq`` reaches the child processes through the environment)."""
    T = MODELS[model][1]
    return int(os.environ.get("GRAPE_BENCH_SEQ") or T) if T else None


def verdict(value: float, target: float) -> str:
    return "MET" if value <= target else "NOT MET"


# -- building a method ----------------------------------------------------------------------------


def import_libraries(method: str) -> None:
    """Import what ``method`` runs on before the baseline RSS is taken, so its peak counts what the
    method allocates, not library code (``tests/test_benchmark_memory_window.py`` checks that
    building and stepping ``method`` afterwards imports nothing)."""
    import torch  # noqa: F401
    import transformers

    # transformers imports a model's code at its first use: left to the build, that import (84 MiB
    # for OPT, more than ViT-small's weights) would be charged to whichever method built first
    transformers.ViTForImageClassification, transformers.RobertaModel  # noqa: B018
    try:
        import torch.profiler._cupti_monitor  # noqa: F401  (an optimizer's first step imports it)
    except ImportError:  # another torch
        pass

    if method.startswith("opacus"):
        import opacus  # noqa: F401
    elif method.startswith("adam"):
        import dpregistry.privacy.secret  # noqa: F401  (adam_noise's generator)
    else:
        import_dpregistry()


def build(model: str, device: str, checkpointing: bool = False):
    import torch
    import transformers
    from torch import nn

    cfg_file, _, rank, _ = MODELS[model]
    T = sequence(model)
    cfg = json.loads((HERE / "configs" / cfg_file).read_text())
    torch.manual_seed(0)
    if model.startswith("roberta"):
        class Classifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.encoder = transformers.RobertaModel(transformers.RobertaConfig(**cfg), add_pooling_layer=False)
                self.head = nn.Linear(cfg["hidden_size"], 2)

            def forward(self, x):
                return self.head(self.encoder(input_ids=x).last_hidden_state[:, 0])

        net = Classifier()
        if checkpointing:
            net.encoder.gradient_checkpointing_enable()
        make_x = lambda n, g: torch.randint(3, cfg["vocab_size"], (n, T), generator=g)  # noqa: E731
    else:
        class Vit(nn.Module):
            def __init__(self):
                super().__init__()
                self.vit = transformers.ViTForImageClassification(transformers.ViTConfig(**cfg))

            def forward(self, x):
                return self.vit(pixel_values=x).logits

        net = Vit()
        if checkpointing:
            net.vit.gradient_checkpointing_enable()
        make_x = lambda n, g: torch.randn(n, 3, cfg["image_size"], cfg["image_size"], generator=g)  # noqa: E731
    return net.to(device).train(), make_x, rank


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
    if method.startswith("dp_grape"):
        algorithm, estimator, update = "dp_grape", {"name": "projected_per_example_grad", "rank": rank}, \
            {"name": "projected_adam"}
        if method.startswith("dp_grape_e"):  # the default exclusions, less "embed"
            from dpreg_grape.projection import DEFAULT_EXCLUDE

            estimator["project"] = {"embeddings": True, "exclude": [p for p in DEFAULT_EXCLUDE if p != "embed"]}
    else:
        algorithm, update = "dp_adam", {"name": "adam"}
        estimator = {"name": "per_example_grad", "backend": "hooks"}
    estimator["passes"] = 2 if method.endswith("_2p") else 1
    privatizer = {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0,
                  "clipping": "per_layer" if method.endswith("_pl") else "flat"}
    recipe = {"algorithm": algorithm, "seed": 0, "objective": {"name": Batch.name}, "sampler": {"name": "full_batch"},
              "estimator": estimator, "privatizer": privatizer,
              "update": {**update, "lr": 1e-4}, "accountant": {"name": "rdp"},
              "train": {"steps": 100_000, "device": device, "progress": False}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return Run(load(path, registry=registry)).prepare()


def make_step(method: str, model: str, B: int, device: str):
    """(step function, number of parameters) of ``method`` on a fresh copy of the model."""
    import torch
    import torch.nn.functional as F

    method, checkpointing = method.removesuffix("_ckpt"), method.endswith("_ckpt")
    net, make_x, rank = build(model, device, checkpointing)
    g = torch.Generator().manual_seed(1)
    X = make_x(B, g).to(device)
    y = torch.randint(0, 2, (B,), generator=g).to(device)
    d = sum(p.numel() for p in net.parameters())
    if method in ("adam", "adam_noise"):
        from dpregistry.privacy.secret import CipherStream, new_key

        # foreach=False: torch's default multi-tensor Adam holds a temporary per parameter at once,
        # which would flatter every ratio against this baseline
        opt = torch.optim.Adam(net.parameters(), lr=1e-4, foreach=False)
        noise = CipherStream(new_key()) if method == "adam_noise" else None

        def step():
            F.cross_entropy(net(X), y).backward()
            if noise:
                noise.add_noise_([p.grad for p in net.parameters()], 1e-6)
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif method.startswith("opacus"):
        from opacus import PrivacyEngine

        opt = torch.optim.Adam(net.parameters(), lr=1e-4, foreach=False)
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
    return step, d


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


# -- the two kinds of child process ---------------------------------------------------------------


def same_heap_as_a_run(device: str) -> None:
    """Every method's child keeps freed memory for its next step, as a dpregistry run on a CPU does
    (``dpregistry/heap.py``; glibc's defaults return it and fault it back in), unless the
    environment tunes glibc itself, which the children inherit."""
    if device == "cpu":
        from dpregistry import heap

        heap.keep_freed_memory()


def memory_child(method: str, model: str, B: int, device: str) -> dict:
    """Peak memory of two steps of ``method`` in this fresh process."""
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(os.environ.get("GRAPE_BENCH_THREADS", "2")))
    import_libraries(method)
    same_heap_as_a_run(device)
    cuda = device != "cpu"
    base = status_kib("VmRSS")
    reset_peak_rss()
    step, d = make_step(method, model, B, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step()
    step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else (status_kib("VmHWM") - base) / 1024
    return {"method": method, "model": model, "batch": B, "peak_mib": peak, "params": d}


def time_child(methods: list[str], model: str, B: int, device: str, rounds: int) -> dict:
    """Every method in this one process; ``rounds`` rounds of one step each, order rotating."""
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(os.environ.get("GRAPE_BENCH_THREADS", "2")))
    same_heap_as_a_run(device)
    steps = {}
    for m in methods:
        steps[m], _ = make_step(m, model, B, device)
        steps[m]()  # warm-up: lazy allocations, Adam's state
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            _sync(device)
            t = time.perf_counter()
            steps[m]()
            _sync(device)
            times[m].append(time.perf_counter() - t)
    return {"model": model, "batch": B, "times": times}


def spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    for line in out.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (out.stderr or out.stdout)[-600:].strip()}


def peak(method, model, B, device) -> dict:
    return spawn(["--memory-child", method, model, str(B), "--device", device])


# -- the report -----------------------------------------------------------------------------------


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"


def report_times(model: str, B: int, res: dict, say) -> None:
    t = res["times"]
    say(f"  step time, s (median of {len(next(iter(t.values())))} alternating rounds): " +
        ", ".join(f"{m} {statistics.median(v):.3f}" for m, v in t.items()))
    def ratio(num, den, tail):  # tail: the verdict for a target, or what the ratio shows
        if num in t and den in t:
            ratios = [a / b for a, b in zip(t[num], t[den])]
            say(f"  time   {num} ÷ {den}: {spread(ratios)}   {tail(statistics.median(ratios))}")

    for num, den, target in TIME_TARGETS:
        ratio(num, den, lambda r: f"target ≤ {target}: {verdict(r, target)}")
    for num, den, what in [("adam_noise", "adam", "(Adam plus the noise alone: what the d Gaussians cost)"),
                           ("dp_adam", "adam_noise", "(DP-Adam against Adam plus the noise)"),
                           ("adam_ckpt", "adam", "(what recomputing the activations costs)"),
                           ("dp_adam_pl_ckpt", "adam_ckpt", "(per-layer DP-Adam against Adam, both checkpointed)"),
                           ("dp_adam_pl_ckpt", "adam", "(no target)"),
                           ("dp_adam", "opacus_ghost", "(no target)"), ("dp_grape", "opacus_ghost", "(no target)")]:
        ratio(num, den, lambda r: what)


def report_memory(model: str, B: int, mem: dict, say) -> None:
    say("  peak MiB (fresh process each): " + ", ".join(f"{m} {r['peak_mib']:.0f}" if "peak_mib" in r else f"{m} failed"
                                                      for m, r in mem.items()))
    for m, r in mem.items():
        if "error" in r:
            say(f"    {m} failed: {r['error'].splitlines()[-1] if r['error'] else '?'}")
    for num, den, target in MEMORY_TARGETS:
        if "peak_mib" in mem.get(num, {}) and "peak_mib" in mem.get(den, {}):
            ratio = mem[num]["peak_mib"] / mem[den]["peak_mib"]
            say(f"  memory {num} ÷ {den}: {ratio:.3f}   target ≤ {target}: {verdict(ratio, target)}")
    for num, den, what in [("adam", "opacus_ghost", "(non-private Adam's own: a ÷ Opacus ghost target below it "
                                                    "needs recomputation)"),
                           ("adam_ckpt", "opacus_ghost", "(checkpointed Adam's own)")]:
        if "peak_mib" in mem.get(num, {}) and "peak_mib" in mem.get(den, {}):
            say(f"  memory {num} ÷ {den}: {mem[num]['peak_mib'] / mem[den]['peak_mib']:.3f}   {what}")


def largest_batch(method: str, model: str, budget: float, sweep: dict, steps: int, device: str,
                  say) -> tuple[int | None, int | None]:
    """(the largest batch measured to fit the budget, the smallest larger one measured not to, or
    None when every larger batch tried fits): the sweep's, narrowed by bisection."""
    fits = [B for B, r in sweep.items() if r.get("peak_mib", float("inf")) <= budget]
    over = [B for B, r in sweep.items() if r.get("peak_mib", float("inf")) > budget]
    lo = max(fits) if fits else None
    hi = min((B for B in over if lo is None or B > lo), default=None)
    measured = {B: r.get("peak_mib") for B, r in sweep.items()}
    for _ in range(steps if lo is not None and hi is not None else 0):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        r = peak(method, model, mid, device)
        measured[mid] = r.get("peak_mib")
        if r.get("peak_mib", float("inf")) <= budget:
            lo = mid
        else:
            hi = mid
    runs = ", ".join(f"{B}: {p:.0f}" if p is not None else f"{B}: failed" for B, p in sorted(measured.items()))
    say(f"  {method:<13} largest batch measured to fit {budget:.0f} MiB: {lo if lo is not None else 'none'}"
        f"{f' (B = {hi} did not)' if hi is not None else ' (the largest batch tried)'}   [peak MiB by batch: {runs}]")
    return lo, hi


def batch_ratio(num: tuple, den: tuple) -> tuple[float, float]:
    """Bounds on (largest batch of num) ÷ (largest batch of den) from what was measured: a method's
    largest batch lies in [fits, did-not − 1], unbounded above when the largest batch tried fit."""
    (ln, hn), (ld, hd) = num, den
    return ln / (hd - 1) if hd else 0.0, (hn - 1) / ld if hn else math.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["vit", "roberta"], choices=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES),
                    help="the batch sizes swept (a shorter list for a slow machine)")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per batch")
    ap.add_argument("--time-batches", nargs="+", type=int, default=None,
                    help="time only these batches (default: all of --batches)")
    ap.add_argument("--search", type=int, default=0, help="bisection steps for the largest batch in the budget")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=None, help="sequence length of the text models (default: theirs above)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    ap.add_argument("--memory-child", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-child", nargs=4, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.seq:
        os.environ["GRAPE_BENCH_SEQ"] = str(a.seq)
    if a.memory_child:
        m, model, B = a.memory_child
        print(json.dumps(memory_child(m, model, int(B), a.device)))
        return
    if a.time_child:
        methods, model, B, rounds = a.time_child
        print(json.dumps(time_child(methods.split(","), model, int(B), a.device, int(rounds))))
        return

    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"# python benchmarks/grape_vs_opacus.py {' '.join(sys.argv[1:])}")
    say(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f} at start, {os.environ.get('GRAPE_BENCH_THREADS', '2')} torch threads, {a.device}")
    from dpregistry import heap

    glibc = heap.tuned_by_environment()
    if glibc:  # the children inherit it: e.g. MALLOC_MMAP_THRESHOLD_ gives every large tensor its own mapping
        say(f"# glibc malloc settings: {' '.join(f'{k}={v}' for k, v in sorted(glibc.items()))}")
    elif a.device == "cpu":
        say("# glibc: every method keeps freed memory for its next step, as a CPU run does (dpregistry/heap.py)")
    for model in a.models:
        _, _, rank, budget = MODELS[model]
        T = sequence(model)
        say(f"\n== {model} (benchmarks/configs/{MODELS[model][0]}){f', sequence {T}' if T else ''}, C = 1, σ = 1, "
            f"Adam, DP-GRAPE rank {rank}")
        sweep: dict[str, dict[int, dict]] = {m: {} for m in a.methods if m not in TIME_ONLY}
        for B in a.batches:
            say(f"\n-- batch {B}")
            if not a.no_time and (a.time_batches is None or B in a.time_batches):
                res = spawn(["--time-child", ",".join(a.methods), model, str(B), str(a.rounds), "--device", a.device])
                if "error" in res:
                    say(f"  timing failed: {res['error'].splitlines()[-1]}")
                else:
                    report_times(model, B, res, say)
            if not a.no_memory:
                mem = {m: peak(m, model, B, a.device) for m in a.methods if m not in TIME_ONLY}
                for m, r in mem.items():
                    sweep[m][B] = r
                report_memory(model, B, mem, say)
        if not a.no_memory:
            say(f"\n-- largest batch in {budget} MiB (measured runs only; {a.search} bisection steps)")
            best = {m: largest_batch(m, model, budget, sweep[m], a.search, a.device, say) for m in sweep}
            for num, den, target in BATCH_TARGETS:
                if best.get(num, (None,))[0] and best.get(den, (None,))[0]:
                    low, high = batch_ratio(best[num], best[den])
                    shown = f"{low:.2f}" if low == high else f"between {low:.2f} and {high:.2f}"
                    say(f"  largest batch {num} ÷ {den}: {shown}   target ≥ {target}: " +
                        ("MET" if low >= target else "NOT MET" if high < target else
                         "not settled by these runs (narrow them with --search N)"))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
