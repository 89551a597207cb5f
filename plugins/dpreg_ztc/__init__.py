"""Zhang, Tran and Cutkosky (ICLR 2024): private zeroth-order nonsmooth nonconvex optimization.

Algorithms ``ztc_o2nc_tree`` (Theorem 4.9) and ``ztc_naive`` (App. E), built on the shared
stages of ``dpreg_nonsmooth``; closed forms (T rule, σ calibration, ρ_eff report) in ``.theory``.

Depends on dpregistry and on ``dpreg_nonsmooth``'s public library API (its ``__all__``: the O2NC
algorithm base, the O2NC schedule and the tree's node arithmetic), and on nothing else of it.
"""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "algorithm": {
        "ztc_naive": "dpreg_ztc.algorithms:ZTCNaive",
        "ztc_o2nc_tree": "dpreg_ztc.algorithms:ZTCTree",
    },
})
