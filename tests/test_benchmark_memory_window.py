"""benchmarks/grape_vs_opacus.py charges a method the memory it allocates, not library code: after
``import_libraries(method)`` (taken before the baseline RSS), building the model and taking two
steps imports no module. Before, transformers' lazily imported model code (84 MiB for OPT) and
the generator of Adam's noise landed in the window of whichever method imported them first."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a heavy check, out of the default run (.ci/run runs -m slow)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

CHILD = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
warnings.filterwarnings("ignore")
import grape_vs_opacus as bench
method = sys.argv[2]
bench.import_libraries(method)
before = set(sys.modules)
step, _ = bench.make_step(method, "vit", 2, "cpu")
step()
step()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


@pytest.mark.parametrize("method", ["adam_noise", "opacus_ghost", "dp_grape_e"])
def test_the_measured_window_imports_no_library_code(method):
    out = subprocess.run([sys.executable, "-c", CHILD, str(BENCHMARKS), method], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


TINY_OPT = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 32, "ffn_dim": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 300, "max_position_embeddings": 64,
            "word_embed_proj_dim": 32, "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}


@pytest.mark.parametrize("measure", ["dpzero", "dp_adam"])
def test_the_dpzero_benchmark_window_imports_no_library_code(tmp_path, measure):
    """benchmarks/dpzero_memory.py's children report what loads between their baseline and their
    last measurement: nothing (a random-weight OPT of one block; the forward-only child runs a subset of
    the DPZero one)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_OPT))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "dpzero_memory.py"), "--measure", measure, "--model",
                          str(tmp_path), "--batch", "2", "--max-length", "16", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["window_imports"] == []
