"""Launch shapes of the two Triton kernels on a CUDA GPU, best of 5: DPZero's Philox sweep over
OPT-6.7B's tensors in fp16 (against one read and write of the same memory, the floor of any
sweep) and the secret noise's ChaCha20 chunks for RoBERTa-large's 366M draws (against the torch
ops). Prints a table; writes the fastest shapes as JSON to the path given (the constants BLOCK and
WARPS of dpregistry/philox_triton.py and dpregistry/privacy/chacha_triton.py come from it).

    python benchmarks/gpu_kernel_shapes.py best.json
"""

from __future__ import annotations

import json
import sys

import torch

from gpu_checks import best_of, opt_6_7b_shapes  # benchmarks/, the script's folder, is on the path
from dpregistry import philox_triton
from dpregistry.privacy import chacha, chacha_triton, secret

SWEEP_SHAPES = [(1024, 4, False), (1024, 4, True), (512, 4, True), (256, 4, True), (1024, 8, True), (2048, 8, True)]
NOISE_SHAPES = [(1024, 4), (512, 4), (256, 4), (1024, 8), (256, 2), (128, 4)]
NOISE_CHUNKS = 88  # RoBERTa-large's 366M draws


def sweeps(device) -> tuple[int, int]:
    ts = [torch.zeros(s, dtype=torch.float16, device=device) for s in opt_6_7b_shapes()]
    n, seeds = sum(t.numel() for t in ts), list(range(len(ts)))
    floor = best_of(device, lambda: torch._foreach_mul_(ts, 1.0), k=5)
    print(f"floor (one read+write of {n / 1e9:.2f}e9 fp16): {floor * 1e3:.1f} ms", flush=True)
    times = {}
    for block, warps, fast in SWEEP_SHAPES:
        philox_triton.BLOCK, philox_triton.WARPS, philox_triton.FAST = block, warps, fast
        philox_triton.add_(ts, seeds, 1e-3)  # builds
        times[block, warps, fast] = t = best_of(device, lambda: philox_triton.add_(ts, seeds, 1e-3), k=5)
        print(f"philox sweep BLOCK {block} warps {warps} fast {fast}: {t * 1e3:.1f} ms, ÷ floor {t / floor:.2f}",
              flush=True)
    return min((k for k in times if k[2]), key=times.get)[:2]


def noise(device) -> tuple[int, int]:
    key = chacha.key_words(secret.new_key(), device)
    start = torch.tensor(0, dtype=torch.int64, device=device)

    def draw():
        for _ in range(NOISE_CHUNKS):
            chacha_triton.gaussian_chunk(key, start, chacha.CHUNK)

    ops = best_of(device, lambda: [chacha._chunk(key, start) for _ in range(8)], k=2) * NOISE_CHUNKS / 8
    print(f"chacha torch ops: {ops * 1e3:.1f} ms for {NOISE_CHUNKS} chunks", flush=True)
    times = {}
    for block, warps in NOISE_SHAPES:
        chacha_triton.BLOCK, chacha_triton.WARPS = block, warps
        draw()  # builds
        times[block, warps] = t = best_of(device, draw, k=5)
        print(f"chacha chunks BLOCK {block} warps {warps}: {t * 1e3:.1f} ms for {NOISE_CHUNKS} chunks "
              f"({t / (NOISE_CHUNKS * chacha.CHUNK) * 1e12:.1f} ps each)", flush=True)
    return min(times, key=times.get)


def main(argv=None) -> int:
    out = (argv or sys.argv[1:])[0]
    device = torch.device("cuda")
    best = {"philox": sweeps(device), "chacha": noise(device)}
    json.dump(best, open(out, "w"))
    print("best", best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
