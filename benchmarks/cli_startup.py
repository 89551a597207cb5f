"""Whole-process time of `dpreg` commands, each against `python -c "import torch"` in the same run.

    python benchmarks/cli_startup.py [--runs 7]

Each command runs in a fresh process, as a user types it; the cases take turns within each round
(after one warm-up round that fills the file cache), so a busy machine slows them alike. Prints
the min and median seconds of:

* `python -c "import torch"`: the yardstick (any command that needs torch pays this much);
* `dpreg --help`, which needs no plugin: target at most 0.2 × the torch import;
* `dpreg validate quickstart`, which builds the model, loads the digits and calibrates noise, so
  it imports torch (no target, its ratio is printed);
* `dpreg privacy calibrate --epsilon 6 --delta 1e-5 --steps 20000 --sample-rate 0.016
  --accountant pld --relation add_remove`, which needs dp-accounting only;
* Opacus's PRV calibration of the same target in a process of its own
  (`opacus.accountants.utils.get_noise_multiplier(..., accountant="prv")`, the `bench` extra):
  target, the calibrate process at least 5 × faster (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CALIBRATE = ["privacy", "calibrate", "--epsilon", "6", "--delta", "1e-5", "--steps", "20000",
             "--sample-rate", "0.016", "--accountant", "pld", "--relation", "add_remove"]

OPACUS = ("import warnings; warnings.simplefilter('ignore')\n"
          "from opacus.accountants.utils import get_noise_multiplier\n"
          "print(get_noise_multiplier(target_epsilon=6, target_delta=1e-5, sample_rate=0.016, steps=20000, "
          "accountant='prv'))")


def dpreg_command() -> list[str]:
    """The `dpreg` console script of this interpreter's environment, else `python -m dpregistry`."""
    script = Path(sys.executable).parent / "dpreg"
    if script.exists():
        return [str(script)]
    found = shutil.which("dpreg")
    return [found] if found else [sys.executable, "-m", "dpregistry"]


def cases(opacus: bool) -> dict[str, list[str]]:
    dpreg = dpreg_command()
    out = {
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "dpreg --help": [*dpreg, "--help"],
        "dpreg validate quickstart": [*dpreg, "validate", "quickstart"],
        "dpreg privacy calibrate (pld)": [*dpreg, *CALIBRATE],
    }
    if opacus:
        out["Opacus PRV calibration"] = [sys.executable, "-c", OPACUS]
    return out


def seconds(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    return took


def has_opacus() -> bool:
    return subprocess.run([sys.executable, "-c", "import opacus"], capture_output=True).returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7, help="timed rounds (after one warm-up round)")
    args = p.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    opacus = has_opacus()
    todo = cases(opacus)
    times: dict[str, list[float]] = {name: [] for name in todo}
    for r in range(args.runs + 1):
        for name, cmd in todo.items():
            took = seconds(cmd, env)
            if r:
                times[name].append(took)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.runs} rounds on {os.cpu_count()} CPUs (load average {load:.1f}), Python "
          f"{sys.version.split()[0]}, dpreg = {' '.join(dpreg_command())}")
    median = {name: statistics.median(t) for name, t in times.items()}
    torch_s = median['python -c "import torch"']
    print(f"{'whole process':<32}{'min s':>8}{'median s':>10}{'÷ import torch':>16}")
    for name, t in times.items():
        print(f"{name:<32}{min(t):>8.2f}{median[name]:>10.2f}{median[name] / torch_s:>16.2f}")
    calib = json.loads(subprocess.run(dpreg_command() + CALIBRATE + ["--json"], env=env, capture_output=True,
                                      text=True, check=True).stdout)
    print(f"(of the calibrate process, the calibration itself: {calib['seconds']:.2f} s; σ = "
          f"{calib['noise_multiplier']:.5g}, ε = {calib['epsilon']:.4g})")

    print()
    ratio = median["dpreg --help"] / torch_s
    print(f"target: dpreg --help ≤ 0.2 × import torch: {ratio:.2f} × — {'met' if ratio <= 0.2 else 'NOT met'}")
    if opacus:
        speedup = median["Opacus PRV calibration"] / median["dpreg privacy calibrate (pld)"]
        print(f"target: privacy calibrate ≥ 5 × faster than Opacus PRV (whole process): {speedup:.1f} × — "
              f"{'met' if speedup >= 5 else 'NOT met'}")
    else:
        print("target: privacy calibrate ≥ 5 × faster than Opacus PRV: not measured (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
