"""Noise modes: secure (default, a fresh OS-entropy key), keyed (DPREG_NOISE_KEY), reproducible
(from the seed, and reported as no guarantee)."""

from __future__ import annotations

import json
import math
import signal

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from conftest import make_run, write_recipe
from fake_compile import FakeCompile
from dpregistry.folder import resume_run
from dpregistry.errors import UserError
from dpregistry.privacy import chacha, secret
from dpregistry.rng import NOISE_KEY_ENV, RunRNG, key_from_env
from test_core_cli import dpreg

KEY = "3f1c9a7be2d54c6a8b0e1f2a3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d"  # 256 bits, hex
OTHER = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"

RECIPE = {
    "seed": 2,
    "algorithm": "dp_sgd",
    "objective": {"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 2.0},
    "privacy": {"epsilon": 50.0, "delta": 1e-3},
    "train": {"steps": 6, "checkpoint_every": 3, "keep_checkpoints": 5, "progress": False},
}


def mode(name, recipe=RECIPE):
    return dict(recipe, privacy=dict(recipe["privacy"], noise=name))


def final(run):
    run.train()
    return {k: v.detach().clone() for k, v in run.params.items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_secure_is_the_default_and_every_run_draws_its_own_key(tmp_path):
    one, two = make_run(RECIPE, tmp_path), make_run(RECIPE, tmp_path)
    assert one.rng.noise_mode == "secure" and one.rng.guarantee
    assert len(one.rng.key) == 32 and one.rng.key != two.rng.key
    # within a run a release's noise is a function of (key, step, call): the same release twice is
    # the same draw, another release is a fresh one
    z = one.rng.noise(3, 0).randn((64,))
    assert torch.equal(z, one.rng.noise(3, 0).randn((64,))) and not torch.equal(z, one.rng.noise(3, 1).randn((64,)))
    assert not torch.equal(z, two.rng.noise(3, 0).randn((64,)))
    assert not same(final(one), final(two))


def test_keyed_noise_is_secret_and_reproducible_for_the_key_holder(tmp_path, monkeypatch):
    rng = RunRNG(7, "keyed", key=key_from_env(KEY))
    a = rng.noise(3).randn((100,))
    assert torch.equal(a, RunRNG(7, "keyed", key=key_from_env(KEY)).noise(3).randn((100,)))
    assert not torch.equal(a, RunRNG(7, "keyed", key=key_from_env(OTHER)).noise(3).randn((100,)))
    assert not torch.equal(a, RunRNG(7, "reproducible").noise(3).randn((100,)))
    fp = rng.noise_fingerprint
    assert fp != RunRNG(7, "keyed", key=key_from_env(OTHER)).noise_fingerprint
    assert KEY not in fp and key_from_env(KEY).hex() not in fp

    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    keyed = mode("keyed")
    assert same(final(make_run(keyed, tmp_path)), final(make_run(keyed, tmp_path)))
    monkeypatch.setenv(NOISE_KEY_ENV, OTHER)
    assert not same(final(make_run(keyed, tmp_path)), final(make_run(mode("reproducible"), tmp_path)))


@pytest.mark.parametrize("weak", ["s3cret", "0123456789abcdef0123456789abcde", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                                  "correct horse battery staple", "QUJDREVGR0hJSktMTU5PUFFS"[:21],
                                  "0123456789abcdef0123456789abcdef", "deadbeefcafebabe" * 2,
                                  "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef"])
def test_a_key_with_less_than_128_bits_is_refused_with_how_to_make_one(weak):
    with pytest.raises(UserError, match="secrets.token_hex"):
        key_from_env(weak)


def test_strong_keys_in_hex_and_base64_are_accepted():
    import secrets

    assert len(key_from_env(KEY[:32])) == 32
    assert len(key_from_env("q3Zk9_Lm2Xv7Rt4Yp1Wn8s")) == 32  # 22 base64 characters (132 bits)
    for _ in range(2000):  # the pattern checks refuse no drawn key
        key_from_env(secrets.token_hex(16)), key_from_env(secrets.token_urlsafe(16))


def test_keyed_mode_without_a_key_is_refused_at_the_recipe_key(tmp_path, monkeypatch):
    monkeypatch.delenv(NOISE_KEY_ENV, raising=False)
    path = write_recipe(tmp_path, mode("keyed"))
    res = dpreg("validate", path)
    assert res.returncode == 2 and "DPREG_NOISE_KEY" in res.stderr and "privacy.noise" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_keyed_run_resumes_only_with_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    run = make_run(mode("keyed"), tmp_path, out=tmp_path / "r")
    straight = final(run)
    monkeypatch.delenv(NOISE_KEY_ENV)
    with pytest.raises(UserError, match="DPREG_NOISE_KEY"):
        resume_run(tmp_path / "r")
    monkeypatch.setenv(NOISE_KEY_ENV, OTHER)
    with pytest.raises(UserError, match="same secret key"):
        resume_run(tmp_path / "r")
    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    r = resume_run(tmp_path / "r")
    assert r.step == 6 and same(straight, r.params)


def test_no_file_of_a_run_holds_its_key(tmp_path, monkeypatch):
    for name in ("secure", "keyed"):
        monkeypatch.setenv(NOISE_KEY_ENV, KEY)
        out = tmp_path / name
        run = make_run(mode(name), tmp_path, out=out)
        key = run.rng.key
        run.train()
        needles = [key, key.hex().encode(), KEY.encode()]
        files = [p for p in out.rglob("*") if p.is_file()]
        assert len(files) >= 5
        for p in files:
            data = p.read_bytes()
            assert not any(n in data for n in needles), p


def test_a_secure_resume_continues_the_ledger_and_the_public_randomness_with_a_fresh_key(tmp_path):
    recipe = mode("secure", dict(RECIPE, train=dict(RECIPE["train"], steps=6)))
    straight = make_run(recipe, tmp_path, out=tmp_path / "a")
    final(straight)
    eps = json.loads((tmp_path / "a" / "summary.json").read_text())["epsilon"]

    class Killed(Exception):
        pass

    def kill_at_5(run, metrics):
        if run.step == 5:
            raise Killed

    run = make_run(recipe, tmp_path, out=tmp_path / "r")
    first_key = run.rng.key
    with pytest.raises(Killed):
        run.train(progress=kill_at_5)
    r = resume_run(tmp_path / "r")
    assert r.step == 3 and r.rng.key != first_key and r.rng.noise_mode == "secure"
    assert r.accountant.ledger.to_json()[0]["count"] == 3  # the three checkpointed steps are kept
    r.train()
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["epsilon"] == pytest.approx(eps, rel=1e-12)
    assert r.rng.step_seed("direction", 4) == straight.rng.step_seed("direction", 4)


def test_summary_and_report_state_the_mode_and_whether_epsilon_is_a_guarantee(tmp_path, monkeypatch):
    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    for name, guarantee in (("secure", True), ("keyed", True), ("reproducible", False)):
        path = write_recipe(tmp_path, mode(name), f"{name}.yaml")
        res = dpreg("run", path, "--out", tmp_path / name)
        assert res.returncode == 0, res.stderr
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["noise"] == name and summary["guarantee"] is guarantee
        said = " ".join(res.stdout.split())
        assert ("NOT a privacy guarantee" in said) is (not guarantee)
        rep = dpreg("privacy", "report", tmp_path / name)
        assert ("NOT a privacy guarantee" in " ".join(rep.stdout.split())) is (not guarantee)
        assert dpreg("report", tmp_path / name).returncode == 0
        md = (tmp_path / name / "report" / "report.md").read_text()
        assert ("NOT a privacy guarantee" in md) is (not guarantee)


def test_the_progress_line_of_a_reproducible_run_says_no_guarantee(tmp_path):
    from dpregistry import cli

    recipe = mode("reproducible")
    run = make_run(dict(recipe, train=dict(recipe["train"], progress=True)), tmp_path)
    from dpregistry.api import _train

    with cli.console.capture() as cap:
        _train(run, True, cli.console)
    assert "no guarantee" in cap.get()


def test_an_old_recipe_with_secure_noise_gets_one_line_saying_what_to_write(tmp_path):
    for value, write in ((True, "privacy.noise: secure"), (False, "privacy.noise: reproducible")):
        path = write_recipe(tmp_path, dict(RECIPE, privacy=dict(RECIPE["privacy"], secure_noise=value)))
        res = dpreg("validate", path)
        assert res.returncode == 2 and write in res.stderr and ":" in res.stderr.split("privacy.secure_noise")[0]
        assert len(res.stderr.strip().splitlines()) == 1


# -- the generator ------------------------------------------------------------------------------


def test_cipher_gaussians_are_the_sum_of_two_box_muller_samples_from_the_keystream():
    """Recompute outputs from the AES-256-CTR keystream in plain float64 math: each output is
    (BM(pair j) + BM(pair j + m/2))/√2 (the defence against the floating-point attack on a single
    Box–Muller sample), pair j taking u = 1 - ⌊a/2¹²⌋/2⁵² on (0, 1] from word j and θ = π·b/2⁶³
    from word m + j read as signed."""
    key = bytes(range(32))
    n = 10
    z = secret.CipherStream(key).randn((n,), dtype=torch.float64)
    m = n
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(16 * m))
    words = np.frombuffer(stream, dtype=np.uint64)
    u = [1 - (int(w) >> 12) / 2.0 ** 52 for w in words[:m]]
    th = [math.pi * int(w) / 2.0 ** 63 for w in words[m:].view(np.int64)]
    r = [math.sqrt(-2 * math.log(x)) for x in u]
    h = m // 2
    expect = [(r[j] * math.cos(th[j]) + r[j + h] * math.cos(th[j + h])) / math.sqrt(2) for j in range(h)] + \
             [(r[j] * math.sin(th[j]) + r[j + h] * math.sin(th[j + h])) / math.sqrt(2) for j in range(h)]
    assert z.tolist() == pytest.approx(expect, rel=1e-12, abs=1e-9)  # sin θ via √(1 - cos²θ): ≤ 2·10⁻⁸


def _formula(a: np.ndarray, b: np.ndarray) -> list[float]:
    """The outputs of radius words a and angle words b (uint64), in plain float64 math: output j
    < m/2 is ρ_j·cos θ_j + ρ_{j+m/2}·cos θ_{j+m/2}, output m/2 + j the same with sines, where
    ρ = √(-ln(1 - ⌊a/2¹²⌋/2⁵²)) and θ = π·b/2⁶³ with b read as signed."""
    rho = [math.sqrt(-math.log(1 - (int(w) >> 12) / 2.0 ** 52)) for w in a]
    th = [math.pi * int(w) / 2.0 ** 63 for w in b.view(np.int64)]
    h = len(a) // 2
    return [rho[j] * math.cos(th[j]) + rho[j + h] * math.cos(th[j + h]) for j in range(h)] + \
           [rho[j] * math.sin(th[j]) + rho[j + h] * math.sin(th[j + h]) for j in range(h)]


def test_the_extreme_keystream_words_give_finite_samples(monkeypatch):
    """Radius words 0 and 2⁶⁴-1 (u = 1 and u = 2⁻⁵², the largest radius), angle words at 0, ±π and
    next to them (cos θ = ±1, where sin θ comes from √(1 - cos²θ)): every output is finite and
    equals the float64 formula."""
    extremes = np.array([0, 2 ** 64 - 1, 1 << 12, 2 ** 63, 2 ** 63 - 1, 1], dtype=np.uint64)
    m = len(extremes)
    a, b = np.repeat(extremes, m), np.tile(extremes, m)  # every radius word with every angle word
    words = np.concatenate([a, b])
    monkeypatch.setattr(secret, "_keystream", lambda key, first, blocks, zeros, out: words.copy())
    z = secret.CipherStream(secret.new_key()).randn((m * m,), dtype=torch.float64)
    assert bool(torch.isfinite(z).all())
    assert z.tolist() == pytest.approx(_formula(a, b), rel=1e-12, abs=1e-7)


def test_cipher_gaussians_are_standard_normal_and_independent_of_the_thread_count(monkeypatch):
    from scipy import stats

    state = torch.get_rng_state()
    key = secret.new_key()
    n = 3 * secret.CHUNK + 7  # several chunks and an odd tail
    z = secret.CipherStream(key).randn((n,), dtype=torch.float64)
    assert torch.equal(state, torch.get_rng_state())  # torch's global stream is untouched
    assert abs(float(z.mean())) < 5 / math.sqrt(n) and abs(float(z.std()) - 1) < 0.01
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-4
    assert len(torch.unique(z)) == n
    monkeypatch.setattr(secret._POOL, "workers", 1)
    assert torch.equal(z, secret.CipherStream(key).randn((n,), dtype=torch.float64))
    s = secret.CipherStream(key)  # successive draws continue the stream
    assert not torch.equal(s.randn((8,)), s.randn((8,)))
    assert secret.CipherStream(key).randn((3, 4), dtype=torch.float16).dtype == torch.float16


def _assert_laid_end_to_end(ts: list[torch.Tensor], base: float, z: torch.Tensor) -> None:
    """Each tensor, filled with ``base`` before, holds base + its slice of z (the tensors laid end to
    end, a non-contiguous one in row order), rounded once to its dtype."""
    start = 0
    for t in ts:
        k = t.numel()
        assert torch.equal(t.reshape(-1), (base + z[start:start + k]).to(t.dtype))
        start += k


def test_cipher_noise_is_added_as_one_stream_over_the_tensors_whatever_the_thread_count(monkeypatch):
    """add_noise_ adds std·z with z the stream's next Gaussians laid end to end over the tensors
    (chunks crossing tensor boundaries, each dtype rounded once), and the pool does not change it."""
    key = secret.new_key()
    shapes = [((5, 7), torch.float32), ((secret.CHUNK + 3,), torch.float32), ((3,), torch.float64),
              ((2 * secret.CHUNK // 3,), torch.bfloat16), ((10,), torch.float16)]
    z = 2.0 * secret.CipherStream(key).randn((sum(math.prod(s) for s, _ in shapes),), dtype=torch.float64)

    def noised(workers):
        monkeypatch.setattr(secret._POOL, "workers", workers)
        ts = [torch.full(s, 0.5, dtype=d) for s, d in shapes]
        secret.CipherStream(key).add_noise_(ts, 2.0)
        return ts

    ts = noised(2)
    _assert_laid_end_to_end(ts, 0.5, z)
    assert all(torch.equal(a, b) for a, b in zip(ts, noised(1)))


def test_cipher_uniforms_sample_at_the_requested_rate():
    u = secret.CipherStream(secret.new_key()).uniform(200_000)
    assert u.dtype == torch.float64 and float(u.min()) > 0 and float(u.max()) <= 1
    assert abs(float((u <= 0.016).double().mean()) - 0.016) < 5 * math.sqrt(0.016 / 200_000)


# -- the device half: ChaCha20 in torch ops, for noise drawn where the tensors live -------------


@pytest.fixture
def small_chunks(monkeypatch):
    """Device chunks of 1,000 outputs (4 M by default; the eager CPU run of one takes seconds),
    used for draws of any size (by default draws under 65,536 come from the host's stream)."""
    monkeypatch.setattr(chacha, "CHUNK", 1000)
    monkeypatch.setattr(chacha, "MIN_DRAW", 1)


@pytest.mark.parametrize("first", [0, 5, (1 << 32) + 5])  # the last has a high word (64-bit counter)
def test_the_torch_chacha20_keystream_is_that_of_the_cryptography_library(first):
    key = secret.new_key()
    blocks = 7
    nonce = (first & 0xFFFFFFFF).to_bytes(4, "little") + (first >> 32).to_bytes(4, "little") + bytes(8)
    expect = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(64 * blocks))
    got = chacha.keystream(chacha.key_words(key, "cpu"), torch.tensor(first), blocks)
    assert got.numpy().tobytes() == expect


def test_device_gaussians_are_the_float64_formula_on_the_chacha_keystream(monkeypatch):
    """The device half draws each output exactly as the AES half does (the normalised sum of one
    Box–Muller sample of each of two pairs), from ChaCha20 under HMAC(key, "device"), a chunk of
    m outputs reading pair j's radius from word j and its angle from word m + j."""
    key = secret.new_key()
    n = 10
    monkeypatch.setattr(chacha, "CHUNK", n)
    monkeypatch.setattr(chacha, "MIN_DRAW", 1)
    z = secret.CipherStream(key).randn((n,), dtype=torch.float64, device="meta")
    assert z.device.type == "meta"  # drawn on the tensors' device (meta: shapes only)
    z = _device_randn(key, n)
    m = n
    stream = Cipher(algorithms.ChaCha20(secret.subkey(key, "device"), bytes(16)), mode=None).encryptor() \
        .update(bytes(16 * m))
    words = np.frombuffer(stream, dtype=np.uint64)
    assert z.tolist() == pytest.approx(_formula(words[:m], words[m:]), rel=1e-12, abs=1e-9)


def test_the_extreme_words_give_finite_device_samples(monkeypatch, small_chunks):
    """The torch transform's bit operations on int64 (arithmetic shifts of words with the top bit
    set, the sign taken from the angle word) at the extreme words, against the float64 formula."""
    extremes = np.array([0, 2 ** 64 - 1, 1 << 12, 2 ** 63, 2 ** 63 - 1, 1], dtype=np.uint64)
    m = len(extremes)
    a, b = np.repeat(extremes, m), np.tile(extremes, m)
    words = torch.from_numpy(np.concatenate([a, b]).view(np.int64))
    z = chacha.gaussians_from_words(words, m * m)
    assert bool(torch.isfinite(z).all())
    assert z.tolist() == pytest.approx(_formula(a, b), rel=1e-12, abs=1e-7)


def _device_randn(key: bytes, n: int) -> torch.Tensor:
    """The device half's next n Gaussians, computed on the CPU (CI has no GPU; the ops are the same)."""
    out = torch.empty(n, dtype=torch.float64)
    secret.CipherStream(key)._device_chunks(n, torch.device("cpu"), lambda s, z: out[s:s + len(z)].copy_(z))
    return out


def test_device_gaussians_are_standard_normal_across_chunks(small_chunks):
    from scipy import stats

    n = 200_003
    z = _device_randn(secret.new_key(), n)
    assert abs(float(z.mean())) < 5 / math.sqrt(n) and abs(float(z.std()) - 1) < 0.01
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-4
    assert len(torch.unique(z)) == n  # no chunk repeats another's blocks


def test_device_noise_is_added_as_one_stream_over_the_tensors(small_chunks):
    """As on the CPU: std·z laid end to end over the tensors, chunks crossing tensor boundaries,
    each dtype rounded once from float64; a non-contiguous tensor gets its elements in row order."""
    key = secret.new_key()
    shapes = [((5, 7), torch.float32), ((1003,), torch.float32), ((3,), torch.float64),
              ((700,), torch.bfloat16), ((10,), torch.float16), ((40, 30), torch.float32)]
    ts = [torch.full(s, 0.5, dtype=d) for s, d in shapes]
    ts[-1] = ts[-1].t()  # not contiguous
    secret.CipherStream(key)._add_noise_on_device(ts, 2.0)
    _assert_laid_end_to_end(ts, 0.5, 2.0 * _device_randn(key, sum(t.numel() for t in ts)))


def test_successive_device_draws_continue_the_stream_in_whole_chunks(small_chunks):
    """Two calls on one stream read disjoint blocks: the second starts at the next whole chunk
    (what one call drawing both would read there), never at blocks the first call read."""
    key = secret.new_key()
    stream, n = secret.CipherStream(key), 1000
    first, second = torch.empty(n + 3, dtype=torch.float64), torch.empty(7, dtype=torch.float64)
    stream._device_chunks(n + 3, torch.device("cpu"), lambda s, z: first[s:s + len(z)].copy_(z))
    stream._device_chunks(7, torch.device("cpu"), lambda s, z: second[s:s + len(z)].copy_(z))
    assert stream.device_position == 3 * chacha.blocks_for(n)
    one_call = _device_randn(key, 3 * n)
    assert torch.equal(first, one_call[:n + 3]) and torch.equal(second, one_call[2 * n:2 * n + 7])


@pytest.fixture
def kernel_cpu(monkeypatch, small_chunks):
    """Chunks on the CPU take the kernel's path (CI has no GPU), with a fresh cache: the kernel is
    the torch ops (``FakeCompile``), and fails on the calls a test lists."""
    monkeypatch.setattr(chacha, "compiles_on", lambda device: True)
    monkeypatch.setattr(chacha, "_kernels", {})

    def use(fake):
        monkeypatch.setattr(chacha, "_triton_chunk", fake(chacha._chunk))
        return fake
    return use


def test_a_kernel_that_has_run_raises_its_later_errors_instead_of_switching_path(kernel_cpu):
    """Once a device's kernel has drawn a chunk, an error (out of memory, say) propagates:
    answering it with the torch ops would change the rounding in the middle of a run (a keyed run
    would no longer replay bit for bit, ranks would disagree)."""
    fake = kernel_cpu(FakeCompile(fail={1}))
    key = chacha.key_words(secret.new_key(), "cpu")
    assert torch.equal(chacha.gaussian_chunk(key, torch.tensor(0)), chacha._chunk(key, torch.tensor(0)))
    with pytest.raises(RuntimeError, match="out of memory"):
        chacha.gaussian_chunk(key, torch.tensor(250))
    chacha.gaussian_chunk(key, torch.tensor(500))
    assert fake.calls == 3  # still the kernel


def test_the_user_hears_of_the_kernel_build_once_before_it_starts(kernel_cpu):
    """The first chunk on a GPU waits for the kernel's build: the run's message channel says so
    before it starts, once per device, and never again once the kernel has run."""
    from dpregistry import progress

    heard = []
    kernel_cpu(lambda fn: FakeCompile()(lambda *a: (heard.append("ran"), fn(*a))[1]))
    key = chacha.key_words(secret.new_key(), "cpu")
    with progress.saying(heard.append):
        for start in (0, 250, 500):
            chacha.gaussian_chunk(key, torch.tensor(start))
    assert len(heard) == 4 and heard[1:] == ["ran"] * 3
    assert heard[0].startswith("secret noise: building the noise kernel for cpu, once per process")


def test_a_failed_kernel_build_warns_once_and_draws_with_torch_ops(kernel_cpu):
    fake = kernel_cpu(FakeCompile(fail={0}))
    raw = secret.new_key()
    key = chacha.key_words(raw, "cpu")
    with pytest.warns(RuntimeWarning, match="drawn by torch ops") as caught:
        z = chacha.gaussian_chunk(key, torch.tensor(0))
    assert torch.equal(z, chacha._chunk(key, torch.tensor(0)))
    assert raw.hex() not in str(caught[0].message) and "out of memory" not in str(caught[0].message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(chacha.gaussian_chunk(key, torch.tensor(250)), chacha._chunk(key, torch.tensor(250)))
    assert fake.calls == 1  # settled: the torch ops from then on


def test_tensors_on_a_device_without_float64_get_the_hosts_noise(monkeypatch):
    """MPS has no float64 (the device formula's arithmetic): its tensors keep the AES noise drawn
    on the host and copied, as before the device half existed; CUDA draws on the device."""
    assert chacha.draws_on("cuda") and chacha.draws_on(torch.device("cuda", 1))
    assert not chacha.draws_on("mps") and not chacha.draws_on("cpu")
    # The routing, on meta tensors standing for such a device (CI has no MPS): the host path, not
    # the device half, and not the CPU's in-place NumPy path (which cannot reach another device).
    monkeypatch.setattr(chacha, "draws_on", lambda device: torch.device(device).type not in ("cpu", "meta"))
    stream = secret.CipherStream(secret.new_key())
    ts = [torch.zeros(5, device="meta"), torch.zeros(3, device="meta")]
    stream.add_noise_(ts, 1.0)
    z = stream.randn((4,), device="meta")
    assert z.device.type == "meta" and stream.device_position == 0 and stream.position == 6 + 4 + 4  # a 16-byte block per output, pairs rounded up


def test_a_small_draw_on_a_device_comes_from_the_hosts_stream():
    """Under chacha.MIN_DRAW outputs (DPZero's one noised scalar, a bias), a device draw takes the
    AES stream's next Gaussians, copied, added in float64 and rounded once: a device chunk would
    compute 4M outputs, and the first would compile the kernel."""
    key = secret.new_key()
    ts = [torch.full((30,), 0.5, dtype=torch.bfloat16), torch.full((7, 3), 0.5)]
    stream = secret.CipherStream(key)
    stream._add_noise_on_device(ts, 2.0)
    z = 2.0 * secret.CipherStream(key).randn((51,), dtype=torch.float64)
    _assert_laid_end_to_end(ts, 0.5, z)
    assert stream.device_position == 0 and stream.position == 52  # no ChaCha20 block; an AES block per output, rounded up to even


def test_keyed_runs_with_another_seed_or_recipe_draw_independent_noise():
    """One key, two runs: the same noise on two releases would cancel in their difference and give
    away the difference of the clipped sums, so a keyed run's streams are keyed by the run too."""
    key = key_from_env(KEY)
    a = RunRNG(7, "keyed", key=key, run="recipe-a").noise(3).randn((1000,))
    assert torch.equal(a, RunRNG(7, "keyed", key=key, run="recipe-a").noise(3).randn((1000,)))
    for other in (RunRNG(8, "keyed", key=key, run="recipe-a"), RunRNG(7, "keyed", key=key, run="recipe-b")):
        b = other.noise(3).randn((1000,))
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.15
        assert not torch.equal(other.secret("poisson", 3).uniform(64), RunRNG(7, "keyed", key=key, run="recipe-a")
                               .secret("poisson", 3).uniform(64))


def test_a_keyed_run_keys_its_noise_by_its_seed_and_recipe(monkeypatch):
    """What a Run passes as the run's identity: the same recipe draws the same noise (a resume),
    another seed other noise."""
    from dpregistry.api import load_recipe
    from dpregistry.run import Run

    monkeypatch.setenv(NOISE_KEY_ENV, KEY)

    def noise(*sets):
        return Run(load_recipe("quickstart", ["privacy.noise=keyed", *sets])).rng.noise(3).randn((64,))

    assert torch.equal(noise("seed=1"), noise("seed=1"))
    assert not torch.equal(noise("seed=1"), noise("seed=2"))
    assert not torch.equal(noise("seed=1"), noise("seed=1", "train.steps=61"))


def test_a_forked_child_draws_noise_without_its_parents_threads():
    """A child forked after the parent drew on the thread pool has the pool but none of its threads:
    a draw of several chunks waited on them for ever."""
    import os
    import signal

    from dpregistry.privacy.secret import CHUNK, CipherStream

    CipherStream(bytes(32)).randn(3 * CHUNK)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        signal.alarm(30)
        torch.set_num_threads(1)  # GNU OpenMP's own threads do not survive a fork either (torch's matter)
        ok = torch.equal(CipherStream(bytes(32)).randn(3 * CHUNK), CipherStream(bytes(32)).randn(3 * CHUNK))
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_secret_generator_takes_its_whole_state_from_the_stream():
    """manual_seed keeps 32 bits of a seed (2³² direction sets, all computable offline); the secret
    generator's 624-word Mersenne-Twister state is the stream's keystream instead."""
    import numpy as np

    from dpregistry.privacy.secret import _BLOCK, _keystream, CipherStream

    key = bytes(range(32))
    g = CipherStream(key).generator()
    mt = g.get_state().numpy()[24:24 + 8 * 624].view(np.uint64)
    words = _keystream(key, 0, 312, memoryview(bytes(312 * _BLOCK)), bytearray(313 * _BLOCK)) & np.uint64(0xFFFFFFFF)
    words[0] |= np.uint64(0x80000000)
    assert np.array_equal(mt, words)
    z = torch.randn(200_000, generator=g, dtype=torch.float64)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert torch.equal(torch.randn(8, generator=CipherStream(key).generator()),
                       torch.randn(8, generator=CipherStream(key).generator()))


def _lose_checkpoints_after(out, step):
    """A crash, or a disk that lost files, leaves checkpoints up to ``step`` but ledger.jsonl whole."""
    from dpregistry import checkpoint as ckpt

    for s, p in ckpt.list_checkpoints(out / "checkpoints"):
        if s > step:
            p.unlink()
    for name in ("summary.json", "model.safetensors"):
        (out / name).unlink()


def test_a_keyed_replay_that_recomputes_bit_for_bit_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    out = tmp_path / "r"
    straight = final(make_run(mode("keyed"), tmp_path, out=out))
    assert all("state" in json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines())
    _lose_checkpoints_after(out, 3)
    r = resume_run(out)
    assert r.step == 3
    r.train()
    assert same(straight, r.params)


def test_a_keyed_replay_that_differs_in_the_last_bit_stops_before_it_releases_anything(tmp_path, monkeypatch):
    """Steps 4-6 were released (their checkpoint at step 6) before the checkpoints after step 3 were
    lost. A replay whose sums differ by rounding (here the features moved by a few units in the last
    place, as other kernels would move the sums) draws the same keyed noise, so the two releases would differ by a noise-free amount: it
    stops at step 6 before writing the checkpoint, the model or any row."""
    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    out = tmp_path / "r"
    final(make_run(mode("keyed"), tmp_path, out=out))
    _lose_checkpoints_after(out, 3)
    ledger = (out / "ledger.jsonl").read_bytes()
    r = resume_run(out)
    r.objective.x_train.mul_(1 + 2 ** -20)
    rows = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(UserError, match="step 6 was checkpointed before"):
        r.train()
    from dpregistry import checkpoint as ckpt

    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [0, 3]
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()
    assert (out / "ledger.jsonl").read_bytes() == ledger
    assert (out / "metrics.jsonl").read_bytes().startswith(rows)  # at most training diagnostics were added


@pytest.mark.parametrize("noise", ["secure", "keyed"])
def test_every_held_out_row_is_written_after_the_checkpoint_of_its_step(tmp_path, monkeypatch, noise):
    """Held-out metrics reveal the releases up to their step, so that step is checkpointed (and its
    ledger recorded) first, the last step included: a crash between the row and the checkpoint
    would let a secure resume release the steps again with fresh noise."""
    from dpregistry import checkpoint as ckpt
    from dpregistry.folder import RunFolder

    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    order = []
    append = RunFolder.append_metrics

    def spy(self, row):
        if any(k.startswith("eval/") for k in row):
            order.append((row["step"], row["step"] in [s for s, _ in ckpt.list_checkpoints(self.checkpoints)]))
        append(self, row)

    monkeypatch.setattr(RunFolder, "append_metrics", spy)
    recipe = mode(noise, dict(RECIPE, train=dict(RECIPE["train"], eval_every=2, checkpoint_every=5)))
    make_run(recipe, tmp_path, out=tmp_path / noise).train()
    assert order == [(0, True), (2, True), (4, True), (6, True)]  # checkpoints every 5 steps would not give these


def test_stream_labels_name_one_stream_per_tuple_of_parts():
    """Labels are joined by a separator that no part may hold, so two purposes never share a stream."""
    from dpregistry.rng import derive

    key = secret.new_key()
    with pytest.raises(ValueError, match="separator"):
        secret.subkey(key, "noise\x1f3")
    with pytest.raises(ValueError, match="separator"):
        derive("batches\x1f3")
    assert secret.subkey(key, "noise", 3) != secret.subkey(key, "noise3") != secret.subkey(key, "noise", "3", "")


def test_a_keyed_replay_stopped_between_recorded_steps_writes_nothing_there(tmp_path, monkeypatch):
    """A replay stopped at step 5 (recorded: 3 and 6) would write a checkpoint and a model at a step
    with no digest, which a second replay elsewhere could release again unchecked."""
    from dpregistry import checkpoint as ckpt

    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    out = tmp_path / "r"
    final(make_run(mode("keyed"), tmp_path, out=out))
    _lose_checkpoints_after(out, 3)
    r = resume_run(out)

    def stop(run, metrics):
        if run.step == 5:
            run.stop_reason = "test"

    with pytest.raises(UserError, match="step 5 lies inside a replay"):
        r.train(progress=stop)
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [0, 3]
    assert not (out / "model.safetensors").exists()
    resume_run(out).train()  # resumed again, the replay reaches the recorded step 6 and goes on
    assert (out / "model.safetensors").exists()


def test_a_keyed_replay_of_steps_recorded_without_a_digest_is_refused(tmp_path, monkeypatch):
    """ledger.jsonl lines written before the digests: a replay of them cannot be checked."""
    from dpregistry.ledger_file import GENESIS, LedgerFile, _digest

    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    out = tmp_path / "r"
    final(make_run(mode("keyed"), tmp_path, out=out))
    prev, lines = GENESIS, []
    for line in LedgerFile(out).lines():  # each with the whole ledger, as those versions wrote it
        rec = {"step": line["step"], "entries": line["entries"]}
        rec.update(prev=prev, hash=_digest(prev, rec["step"], rec["entries"]))
        prev = rec["hash"]
        lines.append(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
    (out / "ledger.jsonl").write_text("".join(lines))
    _lose_checkpoints_after(out, 3)
    with pytest.raises(UserError, match="step 6 was recorded by an earlier dpregistry"):
        resume_run(out).train()


def test_an_interrupted_step_hands_back_the_checkpointed_state(tmp_path):
    """A second signal inside step 5 (after its update) writes nothing of it; the run handed back
    (dpregistry.train's Stopped.result) holds the newest checkpoint's parameters and ledger, not the
    half step's, which a resume would release again with other noise."""
    from dpregistry.signals import Interrupted

    out = tmp_path / "r"
    run = make_run(mode("secure"), tmp_path, out=out)
    step = run.algorithm.step

    def interrupted(r):
        result = step(r)
        if r.step == 4:
            raise Interrupted(signal.SIGINT)
        return result

    run.algorithm.step = interrupted
    summary = run.train()
    assert summary["stopped"] == "interrupted by SIGINT during step 5" and run.step == 3
    from dpregistry import checkpoint as ckpt

    tensors, meta = ckpt.read(ckpt.checkpoint_path(out / "checkpoints", 3))
    assert all(torch.equal(tensors[f"params/{k}"], v) for k, v in run.params.items())
    assert run.accountant.ledger.to_json() == meta["ledger"]


def test_a_keyed_checkpoint_swapped_for_another_at_its_step_is_refused(tmp_path, monkeypatch):
    """The checkpoint a keyed run resumes from must be the one recorded at its step: another one (of
    a second run of the same recipe, here with other data) would continue under this run's noise."""
    from dpregistry import checkpoint as ckpt

    monkeypatch.setenv(NOISE_KEY_ENV, KEY)
    a, b = tmp_path / "a", tmp_path / "b"
    final(make_run(mode("keyed"), tmp_path, out=a))
    other = make_run(mode("keyed"), tmp_path, out=b)
    other.objective.x_train.mul_(1.5)
    other.train()
    _lose_checkpoints_after(a, 3)
    path = ckpt.checkpoint_path(a / "checkpoints", 3)
    path.write_bytes(ckpt.checkpoint_path(b / "checkpoints", 3).read_bytes())
    with pytest.raises(UserError, match="not the one ledger.jsonl recorded at step 3"):
        resume_run(a)
