"""Launch shapes of the two Triton kernels on a CUDA GPU, best of 5: DPZero's Philox sweep over
OPT-6.7B's tensors in fp16 (against one read and write of the same memory, the floor of any
sweep) and the secret noise's ChaCha20 chunks for RoBERTa-large's 366M draws (against the torch
ops). Prints a table; writes the fastest shapes as JSON to the path given (the constants BLOCK and
WARPS of dpregistry/philox_triton.py and dpregistry/privacy/chacha_triton.py come from it).

    python benchmarks/gpu_kernel_shapes.py best.json
"""
import json, sys, time, torch
from dpregistry import philox_triton as pt
from dpregistry.directions import Direction
from dpregistry.privacy import chacha, chacha_triton as ct, secret

dev = torch.device("cuda")
def best(fn, k=5):
    out = []
    for _ in range(k):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); out.append(time.perf_counter() - t)
    return min(out)

h, f, v, L = 4096, 16384, 50272, 32
shapes = [(v, h), (2050, h)] + [s for _ in range(L) for s in [(h, h), (h,)] * 4 + [(f, h), (f,), (h, f), (h,)] + [(h,)] * 4] + [(h,), (h,)]
ts = [torch.zeros(s, dtype=torch.float16, device=dev) for s in shapes]
n = sum(t.numel() for t in ts)
floor = best(lambda: torch._foreach_mul_(ts, 1.0))
print(f"floor (one read+write of {n/1e9:.2f}e9 fp16): {floor*1e3:.1f} ms", flush=True)
seeds = list(range(len(ts)))
res = {}
for block, warps, fast in [(1024, 4, False), (1024, 4, True), (512, 4, True), (256, 4, True), (1024, 8, True), (2048, 8, True)]:
    pt.BLOCK, pt.WARPS, pt.FAST = block, warps, fast
    pt.add_(ts, seeds, 1e-3)
    t = best(lambda: pt.add_(ts, seeds, 1e-3))
    res[(block, warps, fast)] = t
    print(f"philox sweep BLOCK {block} warps {warps} fast {fast}: {t*1e3:.1f} ms, ÷ floor {t/floor:.2f}", flush=True)
bp = min((k for k in res if k[2]), key=res.get)
del ts
key = chacha.key_words(secret.new_key(), dev)
start = torch.tensor(0, dtype=torch.int64, device=dev)
chunks = 88  # RoBERTa-large's 366M outputs
cres = {}
def draw():
    for i in range(chunks):
        ct.gaussian_chunk(key, start, chacha.CHUNK)
eager = best(lambda: [chacha._chunk(key, start) for _ in range(8)], k=2) * chunks / 8
print(f"chacha torch ops: {eager*1e3:.1f} ms for {chunks} chunks", flush=True)
for block, warps in [(1024, 4), (512, 4), (256, 4), (1024, 8), (256, 2), (128, 4)]:
    ct.BLOCK, ct.WARPS = block, warps
    draw()
    t = best(draw)
    cres[(block, warps)] = t
    print(f"chacha chunks BLOCK {block} warps {warps}: {t*1e3:.1f} ms for {chunks} chunks ({t/(chunks*chacha.CHUNK)*1e12:.1f} ps each)", flush=True)
bc = min(cres, key=cres.get)
json.dump({"philox": list(bp), "chacha": list(bc)}, open(sys.argv[1], "w"))
print("best", bp, bc)
