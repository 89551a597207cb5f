"""DPZero memory and speed: one step of OPT (built from a config, random weights) against inference.

Prints, measured in one run of this script (every number from the same machine state):

* peak memory of a DPZero step ÷ peak memory of one inference forward at the same batch (target ≤ 1.10);
* DPZero step time ÷ (2 × forward time) (target ≤ 1.15; 1.0 plus three parameter sweeps is the limit);
* DPZero peak memory ÷ DP-Adam peak memory on the same model (the paper: 2,668 vs 21,494 MiB), and
  DP-Adam step time beside DPZero's. DP-Adam is dpregistry's own batched one (``per_example_grad``
  with hooks: ghost norms and book-keeping, one forward and one backward for the whole batch, then
  gaussian noise and Adam), run as a prepared Run like DPZero.

Memory method (CPU): every measurement runs in a fresh child process. The child imports what a run
imports (``import_libraries``; the DPZero child also loads the compiled direction kernel: Inductor's
code, printed apart), reads its resident set size (``base``), builds the model and data, runs the
operation once to warm up, resets the kernel's peak-RSS counter (``echo 5 >
/proc/self/clear_refs``, Linux ≥ 4.0), runs the operation again and reads ``VmHWM``. "Peak memory"
is VmHWM − base: the parameters, the activations, every temporary and what glibc's heap keeps of
freed ones, without the Python and torch runtime or library code. On CUDA (``--device cuda``):
torch.cuda.max_memory_allocated.

Usage: python benchmarks/dpzero_memory.py [--model opt-125m] [--batch 16] [--max-length 64]
       [--dtype float32] [--device cpu] [--data DIR] [--skip-dp-adam] [--direction rademacher]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import import_dpregistry, reset_peak_rss, status_kib, warn_of_window_imports  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SENTENCES = ["a gripping , beautifully made film that never lets go", "dull and lifeless from start to finish",
             "it never finds its footing and the jokes fall flat", "a wonderful , moving story of friendship",
             "the plot is thin but the performances are terrific", "one of the most charming films of the year"]


def _data_dir(args) -> str:
    if args.data:
        return args.data
    d = Path(tempfile.mkdtemp())
    rows = "sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(SENTENCES * 20))
    (d / "train.tsv").write_text(rows)
    (d / "test.tsv").write_text("sentence\tlabel\n" + "".join(f"the {s}\t{i % 2}\n" for i, s in enumerate(SENTENCES)))
    return str(d)


def _recipe(args, algorithm: str) -> dict:
    r = {"algorithm": algorithm, "seed": 0,
         "objective": {"name": "causal_lm_prompt",
                       "model": {"path": args.model, "init": "random", "dtype": args.dtype,
                                 "max_length": args.max_length, "tokenizer": "byte"},
                       "data": {"path": _data_dir(args), "labels": ["0", "1"], "k_per_class": 48, "max_test": 8}},
         "sampler": {"name": "shuffle", "batch_size": args.batch},
         "privatizer": {"name": "gaussian", "clip": 10.0, "noise_multiplier": 1.0},
         "train": {"steps": 1000, "device": args.device, "log_every": 10_000}}
    if algorithm == "dp_adam":  # the batched per-example gradients (one backward for the batch)
        r["estimator"] = {"name": "per_example_grad", "backend": "hooks"}
        r["update"] = {"name": "adam", "lr": 1e-5}
    else:
        r["estimator"] = {"name": "zo_two_point", "direction": args.direction}
        r["update"] = {"name": "directional_sgd", "lr": 1e-5}
    return r


def import_libraries() -> None:
    """Import what a run imports on its way, before ``base``: left inside the window, transformers'
    OPT code (84 MiB, loaded at first use), the data loader's ``datasets`` and the stages' modules
    would count as the measured operation's memory in every child alike, pulling each ratio
    towards 1 (the child reports any module that still loads inside: ``window_imports``)."""
    import transformers

    transformers.OPTForCausalLM  # noqa: B018
    import_dpregistry()


def child(args) -> dict:
    """One measurement in this (fresh) process; prints JSON."""
    import torch
    import yaml

    from dpregistry.run import Run
    from dpregistry.recipe import load
    from recipe_steps import take_step  # benchmarks/, the script's folder, is on the path

    cuda = args.device.startswith("cuda")
    import_libraries()
    runtime = 0
    if args.measure == "dpzero":  # the direction kernel (Inductor on a CPU, Triton on CUDA), built once a process
        from dpregistry import philox

        before = status_kib("VmRSS")
        philox.takes(torch.zeros(philox.MIN_CHUNK, device=args.device))
        runtime = 0 if cuda else (status_kib("VmRSS") - before) * 1024  # host memory: a CPU run's peak only
    base, modules = status_kib("VmRSS"), set(sys.modules)
    algorithm = "dp_adam" if args.measure == "dp_adam" else "dpzero"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.yaml"
        path.write_text(yaml.safe_dump(_recipe(args, algorithm)))
        run = Run(load(path)).prepare()
    obj = run.objective
    idx = run.sampler.indices(run.ctx.at(0))
    n_params = sum(p.numel() for p in run.params.values())

    def forward():
        with torch.no_grad():
            obj.losses(idx)

    op = forward if args.measure == "forward" else lambda: take_step(run)
    op()  # warm-up: lazy allocations, thread pools
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    fwd_times = []
    for _ in range(args.repeats):
        for fn, out in ((op, times), (forward, fwd_times)):
            # forward passes interleaved with the steps: the time ratio compares like with like
            # even when the machine's load changes (forward-only memory stays below a step's)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else (status_kib("VmHWM") - base) * 1024
    sweep = None
    if args.measure == "dpzero":  # one parameter sweep alone (x += 0·u: regenerates u, changes nothing)
        from dpregistry.directions import Direction

        sweeps = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            Direction(12345, args.direction).add_(list(run.params.values()), 0.0)
            if cuda:
                torch.cuda.synchronize()
            sweeps.append(time.perf_counter() - t0)
        sweep = statistics.median(sweeps)
    return {"measure": args.measure, "peak_bytes": peak, "runtime_bytes": runtime,
            "seconds": statistics.median(times), "times": times, "forward_seconds": statistics.median(fwd_times), "sweep_seconds": sweep,
            "params": n_params, "batch": int(len(idx)), "window_imports": sorted(set(sys.modules) - modules),
            "tokens": sum(len(obj.train_tok[i][0]) for i in idx.tolist())}


def _verdict(value: float, target: float) -> str:
    return "MET" if value <= target else "NOT MET"


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", default=None, help="a folder with train.tsv/test.tsv (default: built-in sentences)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-dp-adam", action="store_true")
    ap.add_argument("--direction", default="gaussian", choices=["gaussian", "rademacher"],
                    help="DPZero's directions (gaussian: the default; rademacher: the cheaper option)")
    ap.add_argument("--measure", choices=["forward", "dpzero", "dp_adam"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(child(args)))
        return

    results = {}
    for m in ["forward", "dpzero"] + ([] if args.skip_dp_adam else ["dp_adam"]):
        cmd = [sys.executable, __file__, "--measure", m, "--model", args.model, "--batch", str(args.batch),
               "--max-length", str(args.max_length), "--dtype", args.dtype, "--device", args.device,
               "--repeats", str(args.repeats), "--direction", args.direction] + (["--data", args.data] if args.data else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"measurement {m} failed")
        results[m] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[m]
        warn_of_window_imports(m, r["window_imports"])
        print(f"{m:8s} peak {r['peak_bytes'] / 2**20:9.1f} MiB   {r['seconds']:8.3f} s   "
              f"({r['params'] / 1e6:.1f} M params, batch {r['batch']}, {r['tokens']} tokens)", flush=True)
    f, z = results["forward"], results["dpzero"]
    print(f"\nmodel {args.model} ({args.dtype}, {args.device}), batch {args.batch}, max_length {args.max_length}")
    mem = z['peak_bytes'] / f['peak_bytes']
    print(f"DPZero step peak ÷ inference forward peak : {mem:.3f}   (target ≤ 1.10: {_verdict(mem, 1.10)})")
    if z["runtime_bytes"]:
        print(f"  the same counting the compiled direction kernel's runtime (Inductor, {z['runtime_bytes'] / 2**20:.0f} MiB "
              f"once a process, like torch's own, not in either peak above): "
              f"{(z['peak_bytes'] + z['runtime_bytes']) / f['peak_bytes']:.3f}")
    tim = z['seconds'] / (2 * z['forward_seconds'])
    print(f"DPZero step time ÷ (2 × forward time)      : {tim:.3f}   (target ≤ 1.15: {_verdict(tim, 1.15)}; forward "
          f"timed interleaved with the steps, medians of {args.repeats})")
    limit = 2 * z["forward_seconds"] + 3 * z["sweep_seconds"]
    sweep = z['sweep_seconds'] / z['forward_seconds']
    print(f"one parameter sweep ÷ one forward          : {sweep:.4f}   (target < 0.1: {'MET' if sweep < 0.1 else 'NOT MET'}; a step "
          f"is two forwards and three sweeps)")
    print(f"DPZero step time ÷ (2 forwards + 3 sweeps)  : {z['seconds'] / limit:.3f}   (1.0 is the physical limit of "
          f"the algorithm; a sweep is {args.direction} draws, {torch_threads()} threads)")
    if "dp_adam" in results:
        a = results["dp_adam"]
        print(f"DPZero step peak ÷ DP-Adam step peak       : {z['peak_bytes'] / a['peak_bytes']:.3f}   "
              f"(paper, RoBERTa-large: 2668/21494 = 0.124)")
        print(f"DP-Adam step time ÷ DPZero step time       : {a['seconds'] / z['seconds']:.2f}   (DP-Adam "
              f"{a['seconds']:.3f} s, DPZero {z['seconds']:.3f} s; DP-Adam ÷ its own interleaved forward: "
              f"{a['seconds'] / a['forward_seconds']:.2f})")


if __name__ == "__main__":
    main()
