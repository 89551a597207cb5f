"""Per-example gradients on a GPU in fp32, bf16 and fp16, against one-example-at-a-time autograd.

The test suite checks the hooks in fp64 on the CPU. This script checks what only a GPU run shows:
CUDA kernels, reduced-precision weights and activations, and the fp32 accumulation of norms and
clipped sums (dpregistry/spaces.py: sums, norms and noise are computed in at least fp32).

For each model (BERT classifier; OPT causal LM with its tied head; the BERT with its blocks
checkpointed; DP-GRAPE's projected gradients of the BERT) and each dtype, three per-example
gradients of the same weights are compared:

* ``ref``       fp64 autograd, one backward per example, on a float64 copy of the dtype's weights
* ``autograd``  the same in the dtype itself: the error any code in that dtype makes
* ``ours``      dpregistry's hooks (``per_example_grad``, one backward for the batch)

The check: ours − ref ≤ 4 × (autograd − ref) + the dtype's epsilon, for the norms and for the
clipped sum at C = the median reference norm, i.e. the hooks add no error beyond the dtype's own;
and the clipped sum is accumulated in fp32 or wider. First, the secret noise drawn on the device
(dpregistry/privacy/chacha.py) is checked against the same draw on the CPU, and DPZero's
directions from the Triton kernel (dpregistry/philox_triton.py) against the CPU's. Prints one
line per case and PASS / FAIL; then times the secret noise and a DPZero parameter sweep.

    python benchmarks/gpu_checks.py [--device cuda] [--dtypes float32 bfloat16 float16]
"""

from __future__ import annotations

import argparse
import copy
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from dpregistry import Objective as ObjectiveStage
from dpregistry import checkpoint_blocks
from dpregistry.clipping import clip_and_sum
from dpregistry.context import Context
from dpreg_baseline.estimators import PerExampleGrad
from dpreg_grape.estimators import ProjectedPerExampleGrad
from dpreg_grape.projection import LayerSelection

N, T = 8, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _batch(vocab: int, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (N, T), generator=g)
    mask = torch.ones_like(ids)
    ids[1, T - 3:], mask[1, T - 3:] = 0, 0  # one padded example
    return ids.to(device), mask.to(device)


def bert(device, checkpointed=False):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg).eval()
    if checkpointed:
        checkpoint_blocks(model)
    ids, mask = _batch(100, device)
    y = (torch.arange(N) % 3).to(device)

    def losses(m, idx):
        out = m(input_ids=ids[idx], attention_mask=mask[idx])
        return F.cross_entropy(out.logits.double(), y[idx], reduction="none")

    return model, losses


def opt(device):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(1)
    cfg = OPTConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                    max_position_embeddings=40, word_embed_proj_dim=64)
    model = OPTForCausalLM(cfg).eval()
    ids, mask = _batch(100, device)
    labels = torch.cat([ids[:, 1:], torch.full((N, 1), -100, device=device)], 1)
    labels[mask == 0] = -100

    def losses(m, idx):
        logits = m(input_ids=ids[idx], attention_mask=mask[idx]).logits.double()
        tok = F.cross_entropy(logits.transpose(1, 2), labels[idx], reduction="none", ignore_index=-100)
        return tok.sum(1) / (labels[idx] != -100).sum(1)

    return model, losses


def autograd_rows(model, losses, projections=None):
    """Each example's gradient by its own backward, as float64 (projected where DP-GRAPE projects)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    out = losses(model, torch.arange(N))
    rows = [torch.autograd.grad(out[i], list(params.values()), retain_graph=True, allow_unused=True) for i in range(N)]
    ref = {k: torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows]).double()
           for j, (k, p) in enumerate(params.items())}
    for name, (P, side) in (projections or {}).items():
        ref[name] = P.T @ ref[name] if side == "left" else ref[name] @ P
    return ref


def ours(model, losses, device, rank=None):
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    obj = SimpleNamespace(n_train=N, module=lambda: model, losses=lambda idx: losses(model, idx))  # what an estimator reads
    ctx = Context.detached(params, n_train=N, device=device, provides={ObjectiveStage: obj})
    if rank is None:
        est = PerExampleGrad(PerExampleGrad.Params(backend="hooks"))
    else:
        est = ProjectedPerExampleGrad(ProjectedPerExampleGrad.Params(
            rank=rank, projector="gaussian", project=LayerSelection(exclude=[], embeddings=False)))
    est.setup(ctx)
    contribs = list(est.contributions(obj, torch.arange(N), ctx))
    projections = None
    if rank is not None:
        # the hooks' P, drawn on the device by the device's generator (a CPU draw is another P)
        projections = {k: (pr.matrix(device, torch.float32).double(), pr.side) for k, pr in est.current.items()}
    return contribs, projections


def _norms(rows):
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in rows.values()))


def _clipped(rows, clip):
    scale = (clip / _norms(rows)).clamp(max=1.0)
    return {k: (g * scale.view(-1, *[1] * (g.dim() - 1))).sum(0) for k, g in rows.items()}


def _rel(a: dict | torch.Tensor, b: dict | torch.Tensor) -> float:
    if isinstance(a, dict):
        num = sum(float((a[k].double() - b[k]).pow(2).sum()) for k in b) ** 0.5
        den = sum(float(b[k].pow(2).sum()) for k in b) ** 0.5
        return num / den
    return float((a.double() - b).abs().max() / b.abs().max())


def check(name: str, build, dtype_name: str, device, rank=None) -> bool:
    dtype = DTYPES[dtype_name]
    model, losses = build()
    model = model.to(device, dtype)
    contribs, projections = ours(model, losses, device, rank)
    ref_model = copy.deepcopy(model).double()  # the same (rounded) weights, differentiated in fp64
    ref = autograd_rows(ref_model, losses, projections)
    same = autograd_rows(model, losses, projections)
    ref_norms = _norms(ref)
    clip = float(ref_norms.median())
    ref_sum = _clipped(ref, clip)
    norms = torch.cat([c.norms() for c in contribs])
    totals = [clip_and_sum(c, clip).aggregate.tensors for c in contribs]
    summed = {k: sum(t[k] for t in totals) for k in totals[0]}
    wide = all(v.dtype in (torch.float32, torch.float64) for v in summed.values())
    finite = bool(torch.isfinite(norms).all()) and all(bool(torch.isfinite(v).all()) for v in summed.values())
    eps = torch.finfo(dtype).eps
    e_norm, a_norm = _rel(norms, ref_norms), _rel(_norms(same), ref_norms)
    e_sum, a_sum = _rel(summed, ref_sum), _rel(_clipped(same, clip), ref_sum)
    ok = finite and wide and e_norm <= 4 * a_norm + 4 * eps and e_sum <= 4 * a_sum + 4 * eps
    print(f"{name:<18} {dtype_name:<9} norms: ours {e_norm:.2e} autograd {a_norm:.2e} | clipped sum: ours "
          f"{e_sum:.2e} autograd {a_sum:.2e} | sums in {sorted({str(v.dtype)[6:] for v in summed.values()})} "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def best_of(device, fn, k=3) -> float:
    """The shortest of k timed calls of fn, the device synchronised around each."""
    import time

    out = []
    for _ in range(k):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return min(out)


def _standard_normal(z: torch.Tensor) -> tuple[bool, str]:
    """Whether z's mean and standard deviation are those of N(0, 1) draws (within 5 standard
    errors and 0.5 %), and the two as text."""
    import math

    mean, std = float(z.mean()), float(z.std())
    return abs(mean) < 5 / math.sqrt(z.numel()) and abs(std - 1) < 5e-3, f"mean {mean:+.1e}, std {std:.5f}"


def check_device_noise(device) -> bool:
    """The device half of the secret noise (ChaCha20; a Triton kernel on a CUDA GPU): the same
    keystream as on the CPU bit for bit, the same Gaussians up to the float64 rounding of log and
    cos, the kernel's equal to the torch ops' on the device bit for bit (the path a device without
    the kernel takes), and standard normal."""
    import time

    from dpregistry.privacy import chacha, secret

    key = secret.new_key()
    kd, kc = chacha.key_words(key, device), chacha.key_words(key, "cpu")
    words_ok = torch.equal(chacha.keystream(kd, torch.tensor(2 ** 32 + 9, device=device), 4096).cpu(),
                           chacha.keystream(kc, torch.tensor(2 ** 32 + 9), 4096))
    t = time.perf_counter()
    z = chacha.gaussian_chunk(kd, torch.tensor(5, device=device))  # the first call builds the kernel
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    first = time.perf_counter() - t
    ref = chacha._chunk(kc, torch.tensor(5))
    diff = float((z.cpu() - ref).abs().max())
    ops = chacha._chunk(kd, torch.tensor(5, device=device))
    same = torch.equal(z, ops)
    normal, moments = _standard_normal(z)
    kernel = chacha._kernels.get(str(kd.device), False)
    ok = kernel and words_ok and same and diff < 1e-6 and normal
    print(f"device noise: keystream equal to the CPU's {words_ok}; {z.numel()} Gaussians, max |GPU - CPU| {diff:.1e}, "
          f"Triton kernel = torch ops on the device bit for bit {same} ({int((z != ops).sum())} differ), "
          f"{moments}; kernel {kernel} (first call {first:.1f} s) "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def check_device_directions(device) -> bool:
    """DPZero's directions from the Triton Philox kernel: a float32 tensor's u equal to the CPU
    kernel's within 10⁻⁵ (the GPU's sine and cosine units; where the CPU's kernel draws: chunks of at least
    philox.MIN_CHUNK elements); a whole-tensor sweep equal bit for bit to the same
    u drawn chunk by chunk (the layout follows the CPU's chunks, not the launch); a float16 sweep
    the float32 sum rounded once; and standard normal."""

    from dpregistry import philox
    from dpregistry.directions import DEVICE_CHUNK, Direction

    sizes = [DEVICE_CHUNK + 3 * philox.LAYOUT + 4 * 5000 + 3, 4096, 10, 1]  # a device chunk and a ragged tail
    d = Direction(seed=(1 << 62) + 12345)
    cpu = d.dense([torch.zeros(sizes[0])])
    chunked = d.dense([torch.zeros(n, device=device) for n in sizes])
    swept = [torch.zeros(n, device=device) for n in sizes]
    d.add_(swept, 1.0)
    kernel = philox.takes_whole(swept[0])
    vs_cpu = float((chunked[0].cpu() - cpu[0]).abs().max())
    same = all(torch.equal(a, b) for a, b in zip(swept, chunked))
    half = [torch.full((n,), 0.5, dtype=torch.float16, device=device) for n in sizes]
    d.add_(half, 1e-2)
    want = [(0.5 + 1e-2 * u).half() for u in chunked]
    off = sum(int((h != w).sum()) for h, w in zip(half, want))
    worst = max(float((h.float() - w.float()).abs().max()) for h, w in zip(half, want))
    normal, moments = _standard_normal(chunked[0])
    ok = kernel and vs_cpu < 1e-5 and same and worst <= 2 ** -11 and normal
    print(f"directions: Triton kernel {kernel}; float32 u, max |GPU - CPU| {vs_cpu:.1e}; whole-tensor sweep = "
          f"chunk by chunk bit for bit {same}; float16 sweep vs the float32 sum rounded: {off} of "
          f"{sum(sizes)} differ, by at most {worst:.1e}; {moments} "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def opt_6_7b_shapes() -> list[tuple[int, ...]]:
    """OPT-6.7B's 516 parameter tensors (6.66e9 entries; the head is tied to the embeddings)."""
    h, f, v, layers = 4096, 16384, 50272, 32
    block = [(h, h), (h,)] * 4 + [(f, h), (f,), (h, f), (h,)] + [(h,)] * 4  # attention, MLP, two layer norms
    return [(v, h), (2050, h)] + block * layers + [(h,), (h,)]


def sweep_timing(device) -> None:
    """One parameter sweep over OPT-6.7B's tensors in float16 (6.66e9 parameters): the Triton
    kernel against torch's generator in chunks (the path before it) and against one read and
    write of the same memory (the physical floor of any sweep), best of 5."""
    from dpregistry import philox
    from dpregistry.directions import Direction

    ts = [torch.zeros(s, dtype=torch.float16, device=device) for s in opt_6_7b_shapes()]
    n = sum(t.numel() for t in ts)

    d = Direction(seed=7)
    floor = best_of(device, lambda: torch._foreach_mul_(ts, 1.0), k=5)
    kernel = best_of(device, lambda: d.add_(ts, 1e-3), k=5)
    saved = philox._kernels.get("cuda")
    philox._kernels["cuda"] = None  # torch's generator, chunk by chunk
    try:
        generator = best_of(device, lambda: d.add_(ts, 1e-3), k=3)
    finally:
        philox._kernels["cuda"] = saved
    gb = 2 * n * 2 / 1e9
    print(f"sweep of {n / 1e9:.2f}e9 float16 parameters ({len(ts)} tensors): Triton kernel {kernel * 1e3:.1f} ms "
          f"({gb / kernel / 1e3:.2f} TB/s), torch's generator {generator * 1e3:.1f} ms, one read and write "
          f"{floor * 1e3:.1f} ms ({gb / floor / 1e3:.2f} TB/s); kernel ÷ floor {kernel / floor:.2f}, "
          f"generator ÷ kernel {generator / kernel:.1f}", flush=True)


def noise_timing(device) -> None:
    """Secret noise into RoBERTa-large-sized tensors (366M entries) against torch.randn, best of 3."""

    from dpregistry.privacy import secret

    ts = [torch.zeros(1024, 1024, device=device) for _ in range(300)] + [torch.zeros(50265, 1024, device=device)]
    n = sum(t.numel() for t in ts)
    g = torch.Generator(device=device).manual_seed(0)

    ours = best_of(device, lambda: secret.CipherStream(secret.new_key()).add_noise_(ts, 1.0))
    randn = best_of(device, lambda: [t.add_(torch.randn(t.shape, device=device, generator=g)) for t in ts])
    print(f"secret noise, {n / 1e6:.0f}M entries: {ours:.3f} s ({ours / n * 1e9:.2f} ns each); "
          f"torch.randn (not secret) {randn:.4f} s; ratio {ours / randn:.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 is a reduced precision of its own)
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}", flush=True)
    cases = [("bert", lambda: bert(device), None), ("opt (tied head)", lambda: opt(device), None),
             ("bert checkpointed", lambda: bert(device, checkpointed=True), None),
             ("bert dp-grape r=8", lambda: bert(device), 8)]
    results = [check_device_noise(device), check_device_directions(device)]
    results += [check(name, build, dt, device, rank) for dt in args.dtypes for name, build, rank in cases]
    if device.type == "cuda":
        noise_timing(device)
        sweep_timing(device)
    print(f"{sum(results)} of {len(results)} cases PASS")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
