"""Kornowski, Liu and Talwar: improved sample complexity for private nonsmooth nonconvex optimization.

Algorithms ``klt_sp_zo`` (Alg. 2 + 3, Thm 3.1), ``klt_mp_zo_erm`` (Alg. 2 + 4, Thm 4.1) and
``klt_sp_fo`` (Alg. 2 + 5, Thm 6.1), built on the shared stages of ``dpreg_nonsmooth``; the
theorems' parameter settings are in ``.theory``.

Depends on dpregistry and on ``dpreg_nonsmooth``'s public library API (its ``__all__``: the O2NC
algorithm base and the O2NC schedule), and on nothing else of it.
"""

from dpregistry import StagePlugin

# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "algorithm": {
        "klt_mp_fo_erm": "dpreg_klt.algorithms:KLTMultiPassFO",
        "klt_mp_zo_erm": "dpreg_klt.algorithms:KLTMultiPass",
        "klt_sp_fo": "dpreg_klt.algorithms:KLTFirstOrder",
        "klt_sp_zo": "dpreg_klt.algorithms:KLTSinglePass",
    },
})
