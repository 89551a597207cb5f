"""Fingerprints of the shipped recipes: a hash of the final parameters and of the ledger after a
few steps in reproducible noise mode (and the ledger itself, for other machines), recorded before
a refactor and checked after it (tests/test_contract_fingerprints.py). Regenerate deliberately,
when behaviour is meant to change, after checking that nothing else did:

    python tests/fingerprints.py --write

Rewritten on 2026-11-27 on an AVX2 machine (the record before was an AVX-512 one's): on this
machine the code before and after that day's changes gave bit-identical parameters and ledgers for
every recipe but minilm_sst2_user_dp_adam (user-level clipping now releases each user's formed
sum: the summation order changed), and every recipe matched the AVX-512 record's parameter sums.
Then quadratic_dpgd0th's parameters (not its ledger) changed on purpose: vector zeroth-order norms
and lifts are computed in float64.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "data" / "fingerprints.json"
SST2 = REPO / "tests" / "data" / "sst2"
COMMON = ["privacy.noise=reproducible", "train.progress=false", "train.eval_every=null",
          "train.checkpoint_every=null", "train.log_every=1000000"]
SMALL_TEXT = [f"data.path={SST2}", "data.k_per_class=16", "sampler.batch_size=8", "model.max_length=32"]

#: recipe -> the --set options that make it a few CPU steps
RECIPES = {
    "quickstart": ["train.steps=5"],
    "quadratic_dpzero": ["train.steps=5"],
    "quadratic_dpgd0th": ["train.steps=5"],
    "ztc_l1": ["train.steps=120"],
    "ztc_naive_l1": ["train.steps=60"],
    "ztc_relu_breast_cancer": ["train.steps=30"],
    "klt_sp_zo_ring": ["train.steps=60"],
    "klt_sp_fo_min_of_norms": ["train.steps=60"],
    "klt_mp_zo_erm_ring": ["train.steps=20"],
    "klt_oracle_ztc_tree": ["train.steps=120"],
    "kl_spider_pl": ["train.steps=20", "objective.n=2000"],
    "kl_proximal_point_logistic": ["train.steps=20"],
    "kl_adaptive_gd_diabetes": ["train.steps=8"],
    "kl_adaptive_gd_zo": ["train.steps=8"],
    "minilm_sst2_dp_adam": SMALL_TEXT + ["train.steps=2"],
    "minilm_sst2_dpgrape": SMALL_TEXT + ["train.steps=2"],
    "minilm_sst2_dpzero": SMALL_TEXT + ["train.steps=3"],
    "minilm_sst2_user_dp_adam": [f"data.path={SST2}", "sampler.users_per_step=8", "model.max_length=32",
                                 "train.steps=2"],
    "vit-base_cifar10_dpgrape": ["train.steps=1", "sampler.batch_size=4", "train.micro_batch_size=4"],
}
#: shipped recipes that do not run on a CPU in a test, and why
NOT_ON_A_CPU = {
    "opt6.7b_dpzero": "6.7B parameters on cuda",
    "opt6.7b_dpgrape": "6.7B parameters on cuda",
    "roberta-large_sst2_dpgrape": "needs roberta-large's weights",
    "roberta-large_sst2_dpgrape_eps2": "needs roberta-large's weights",
    "roberta-large_sst2_dpzero": "needs roberta-large's weights",
    "minilm_sst2_hub_dp_adam": "reads stanfordnlp/sst2 from the Hugging Face cache; tests/test_data_text.py trains "
                               "it from a pre-filled one, bit for bit as minilm_sst2_dp_adam",
}


def fake_cifar(folder: Path, per_file: int = 8) -> None:
    """CIFAR-10's binary layout (a label byte, then 3072 pixel bytes) with deterministic content."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]):
        rows = bytearray()
        for r in range(per_file):
            rows.append((i + r) % 10)
            rows.extend(((i * 31 + r * 7 + j) % 251) for j in range(3072))
        (folder / name).write_bytes(bytes(rows))


def fingerprint(name: str) -> dict:
    import torch

    from dpregistry.run import Run
    from dpregistry.recipe import load

    sets = COMMON + RECIPES[name]
    with tempfile.TemporaryDirectory() as d:
        if name.startswith("vit-"):
            fake_cifar(Path(d) / "cifar")
            sets = sets + [f"objective.data.path={Path(d) / 'cifar'}"]
        run = Run(load(REPO / "recipes" / f"{name}.yaml", sets)).prepare()
        run.train()
    h = hashlib.sha256()
    for k in sorted(run.params):
        t = run.params[k].detach().contiguous().cpu()
        h.update(k.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    ledger = json.dumps(run.accountant.ledger.to_json(), sort_keys=True)
    sums = {k: [float(v.detach().double().sum()), float(v.detach().double().norm())] for k, v in sorted(run.params.items())}
    return {"params": h.hexdigest(), "ledger": hashlib.sha256(ledger.encode()).hexdigest(), "step": run.step,
            "sums": sums, "entries": run.accountant.ledger.to_json()}


def machine() -> dict:
    import torch

    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "byteorder": sys.byteorder,
            "float": struct.calcsize("d")}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "--write" not in sys.argv:
        sys.exit(__doc__)
    record = {"machine": machine(), "recipes": {n: fingerprint(n) for n in RECIPES},
              "not_on_a_cpu": NOT_ON_A_CPU}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")


if __name__ == "__main__":
    main()
