"""Peak accelerator memory and step time of a recipe's run, in this process (no output folder).

For models whose checkpoints would take longer to write than the measurement (OPT-6.7B in fp32:
27 GB per copy): the run is prepared as ``dpreg run`` prepares it, N steps are taken, and the
step times, torch's peak allocation and the ε spent are printed as one JSON line.

    python benchmarks/recipe_steps.py RECIPE N [key.path=value ...]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dpregistry.recipe import load
from dpregistry.run import Run


def take_step(run: Run) -> None:
    """One step as dpregistry.loop takes it (the charge is a ledger entry), no logging or saving."""
    ctx = run.begin_step()
    try:
        run.algorithm.step(run)
    finally:
        ctx.undo_displacement()
    run.step += 1


def main(argv: list[str]) -> dict:
    path, n, *sets = argv
    t0 = time.perf_counter()
    run = Run(load(path, sets)).prepare()
    build = time.perf_counter() - t0
    cuda = run.device.type == "cuda"
    times = []
    for _ in range(int(n)):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        take_step(run)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    spent = run.spent()
    return {"recipe": path, "sets": sets, "device": str(run.device),
            "trainable_params": sum(p.numel() for p in run.params.values()), "build_s": round(build, 1),
            "step_s": [round(x, 3) for x in times],
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if cuda else None,
            "epsilon": spent.get("epsilon"), "delta": spent.get("delta")}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
