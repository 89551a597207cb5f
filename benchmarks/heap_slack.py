"""How much of a method's peak RSS is glibc heap slack, and how much of it the first forward makes.

Runs grape_vs_opacus.py's memory child (a fresh process per method and batch: the same model,
batch and two steps) and reads, besides the peak (VmHWM − the RSS after the imports):

* the RSS after the first step's forward pass (hook estimators: when the sampler makes the step's
  contribution, before its backward), as the same difference;
* glibc's ``mallinfo2`` after the two steps: bytes in use in the heap and bytes free in it. Free
  heap bytes below the highest live chunk stay resident, so they count in a peak like live ones.

Diagnostic only (glibc, CPU); the numbers issue 18 judges come from grape_vs_opacus.py.

    python benchmarks/heap_slack.py [--model roberta-large] [--batches 8 40]
        [--methods dp_grape_e_pl_ckpt dp_adam_pl_ckpt adam_ckpt]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grape_vs_opacus as bench  # noqa: E402
from fresh_process import reset_peak_rss, status_kib  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_mib() -> tuple[float, float]:
    """(in use, free) in glibc's heaps, MiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return m.uordblks / 2 ** 20, m.fordblks / 2 ** 20


def child(method: str, model: str, B: int) -> dict:
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(os.environ.get("GRAPE_BENCH_THREADS", "2")))
    bench.import_libraries(method)
    base = status_kib("VmRSS")
    reset_peak_rss()
    forward = []
    if method != "adam_ckpt" and not method.startswith("opacus"):
        from dpregistry.persample import GradSampler

        contribution = GradSampler.contribution

        def after_forward(self, *args, **kwargs):  # the step's forward is done; its backward waits
            forward.append((status_kib("VmRSS") - base) / 1024)
            return contribution(self, *args, **kwargs)

        GradSampler.contribution = after_forward
    step, _ = bench.make_step(method, model, B, "cpu")
    setup = len(forward)  # the estimator's own check at setup makes one contribution
    step()
    step()
    used, free = heap_mib()
    return {"method": method, "batch": B, "peak_mib": (status_kib("VmHWM") - base) / 1024,
            "forward_mib": forward[setup] if len(forward) > setup else None, "heap_used_mib": used,
            "heap_free_mib": free}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="roberta-large", choices=list(bench.MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 40])
    ap.add_argument("--methods", nargs="+", default=["dp_grape_e_pl_ckpt", "dp_adam_pl_ckpt"], choices=bench.METHODS)
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
        return
    print(f"# python benchmarks/heap_slack.py {' '.join(sys.argv[1:])}")
    for B in a.batches:
        for method in a.methods:
            out = subprocess.run([sys.executable, __file__, "--child", method, a.model, str(B)],
                                 capture_output=True, text=True)
            line = next((s for s in out.stdout.splitlines()[::-1] if s.startswith("{")), None)
            if line is None:
                print(f"  batch {B} {method}: failed: {(out.stderr or out.stdout)[-300:]}")
                continue
            r = json.loads(line)
            fw = f"{r['forward_mib']:6.0f}" if r["forward_mib"] is not None else "     -"
            print(f"  batch {B:3d} {method:20s} peak {r['peak_mib']:6.0f} MiB; after the first forward {fw} MiB; "
                  f"glibc heap after two steps: {r['heap_used_mib']:6.0f} MiB in use, "
                  f"{r['heap_free_mib']:6.0f} MiB free")


if __name__ == "__main__":
    main()
