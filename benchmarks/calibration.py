"""Noise calibration for a Poisson-subsampled Gaussian: dpregistry's accountants against Opacus.

    python benchmarks/calibration.py            # q = 16/1000, T = 20,000, ε = 6, δ = 1e-5
    python benchmarks/calibration.py --relation replace_one --reference-discretization 2e-5

Prints, from one run on this machine, the noise multiplier σ (noise std ÷ clip) and the seconds
of: our `pld` and `rdp` calibrations; Opacus's RDP and PRV calibrations (the `bench` extra,
opacus==1.6.0, default ε tolerance 0.01); and a plain fine-grained PLD bisection (the reference
for tightness), with the ratios. Opacus analyses add/remove neighbours only, so it is compared
under add/remove; our replace-one numbers (the papers' relation) are printed as well.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings


def clear_caches():
    from dpreg_accounting import accountants as A

    for f in (A.rdp_curve, A.pld_of, A._composed_pld, A._pld_epsilon):
        f.cache_clear()


def ours(name, args, relation):
    from dpregistry.privacy.accountant import Budget, make_accountant
    from dpregistry.privacy.events import Gaussian, PoissonSampled, clipped_sum_sensitivity
    from dpregistry.stages import Charge

    sens = clipped_sum_sensitivity(1.0, relation)

    def plan(z):
        return [Charge(PoissonSampled(args.q, Gaussian(std=z, sensitivity=sens)), count=args.steps)]

    acc = make_accountant(name, Budget(args.epsilon, args.delta, relation=relation))
    clear_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    z = acc.calibrate(plan)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return z, (secs, cpu), acc.epsilon(extra=plan(z)), plan


def reference(args, relation, plan, start):
    """Plain bisection on the PLD ε at a fine discretization, from a bracket around ``start``."""
    from dpregistry.privacy.accountant import Budget, make_accountant

    acc = make_accountant({"name": "pld", "discretization": args.reference_discretization},
                          Budget(args.epsilon, args.delta, relation=relation))

    def fits(z):
        return acc.epsilon(extra=plan(z)) <= args.epsilon

    lo, hi = start * 0.98, start * 1.02
    while not fits(hi):
        lo, hi = hi, hi * 1.05
    while fits(lo):
        lo, hi = lo * 0.95, lo
    while hi / lo > 1 + args.reference_rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def opacus_calibrate(args, accountant):
    from opacus.accountants.utils import get_noise_multiplier

    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = get_noise_multiplier(target_epsilon=args.epsilon, target_delta=args.delta, sample_rate=args.q,
                                 steps=args.steps, accountant=accountant)
    return z, (time.perf_counter() - t0, time.process_time() - c0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--q", type=float, default=16 / 1000)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--epsilon", type=float, default=6.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--reference-discretization", type=float, default=2e-5)
    p.add_argument("--reference-rtol", type=float, default=1e-4)
    p.add_argument("--no-opacus", action="store_true", help="skip Opacus (its PRV calibration takes ~10 s)")
    args = p.parse_args()

    import dpreg_accounting  # noqa: F401  (imports outside the timings)
    import dp_accounting  # noqa: F401

    print(f"Poisson-subsampled Gaussian: q = {args.q:g}, T = {args.steps}, ε = {args.epsilon:g}, δ = {args.delta:g}\n")
    rows = []
    results = {}
    for relation in ("add_remove", "replace_one"):
        for name in ("pld", "rdp"):
            z, secs, eps, plan = ours(name, args, relation)
            results[(name, relation)] = (z, secs, plan)
            rows.append((f"dpregistry {name} ({relation.replace('_', '-')})", z, secs, eps))
    if not args.no_opacus:
        import opacus.accountants.utils  # noqa: F401  (imports outside the timings)

        for acc in ("rdp", "prv"):
            z, secs = opacus_calibrate(args, acc)
            results[(f"opacus-{acc}", "add_remove")] = (z, secs, None)
            rows.append((f"Opacus {acc.upper()} (add-remove)", z, secs, None))

    refs = {}
    for relation in ("add_remove", "replace_one"):
        z, _, plan = results[("pld", relation)]
        t0, c0 = time.perf_counter(), time.process_time()
        refs[relation] = reference(args, relation, plan, z)
        rows.append((f"PLD bisection, disc. {args.reference_discretization:g} ({relation.replace('_', '-')})",
                     refs[relation], (time.perf_counter() - t0, time.process_time() - c0), None))

    print(f"{'method':44s} {'σ':>9s} {'wall s':>7s} {'CPU s':>7s} {'ε at σ':>8s} {'σ / reference':>14s}")
    for label, z, (secs, cpu), eps in rows:
        rel = "replace_one" if "replace-one" in label else "add_remove"
        print(f"{label:44s} {z:9.4f} {secs:7.2f} {cpu:7.2f} {'' if eps is None else f'{eps:8.4f}':>8s} "
              f"{z / refs[rel]:14.4f}")

    print("\nratios (one run, this machine):")
    zp, (tp, _), _ = results[("pld", "add_remove")]
    zr, (tr, _), _ = results[("rdp", "add_remove")]
    print(f"  our pld σ / fine PLD bisection σ (add-remove):  {zp / refs['add_remove']:.4f}  (target: within 0.5%)")
    zp1, (tp1, _), _ = results[("pld", "replace_one")]
    print(f"  our pld σ / fine PLD bisection σ (replace-one): {zp1 / refs['replace_one']:.4f}")
    print(f"  our pld wall seconds: {tp:.2f} (add-remove), {tp1:.2f} (replace-one)  (target: under 1 s; "
          f"the machine's load inflates wall time: compare the CPU column and the ratios to Opacus)")
    if not args.no_opacus:
        zo_r, (to_r, _), _ = results[("opacus-rdp", "add_remove")]
        zo_p, (to_p, _), _ = results[("opacus-prv", "add_remove")]
        print(f"  our pld σ / Opacus PRV σ:  {zp / zo_p:.4f}   time {tp / to_p:.3f}× Opacus PRV's")
        print(f"  our pld σ / Opacus RDP σ:  {zp / zo_r:.4f}   time {tp / to_r:.2f}× Opacus RDP's")
        print(f"  our rdp σ / Opacus RDP σ:  {zr / zo_r:.4f}   time {tr / to_r:.2f}× Opacus RDP's")


if __name__ == "__main__":
    main()
