"""Per-example gradients from activations and backprops, without materialising them.

Forward hooks put a *tap* on each supported layer's output: an identity that keeps the layer's
input and whose backward hands it, with the backprop g = ∂(Σ_i loss_i)/∂output, to the layer's
handler the moment autograd computes it. One backward pass to a dummy anchor (every tap feeds it) reaches all taps without
computing a single weight gradient. Because examples never interact, example i's gradient of a
linear layer is g_iᵀ a_i, and the handler keeps just what the clipped sum will need:

* the factors (a, g), when they are smaller than the per-example gradients; then each example's
  norm is ‖g_iᵀa_i‖² = Σ_{t,s} ⟨a_t, a_s⟩⟨g_t, g_s⟩ ("ghost norm", B·T² memory), or ‖g_i‖²‖a_i‖²
  when the layer sees one token per example, and the clipped sum Σ_i w_i g_iᵀ a_i = (w ⊙ g)ᵀ a
  is one product ("book-keeping");
* the per-example gradients themselves, when they are smaller than the factors (out·in ≤ T·(out+in),
  e.g. a small layer with long sequences); the activation and backprop are dropped.

Handlers may transform the factors first (DP-GRAPE keeps (g·P, a) or (g, a·P), so the projected
per-example gradient Pᵀ·g_iᵀa_i is formed directly and the full one never exists).

So a DP step costs one forward and one backward, and the largest per-example object is B·T² (or
B·out·in for a small layer), never B·d. The choice per call is the cost model below
(``keeps_per_example``, ``ghost_norm_cheaper``); ``Use.plan`` records it.

Two ways to the clipped sum (``GradSampler(passes=...)``, the estimators' ``passes`` option):

* one pass, book-keeping (the default): the handlers keep their compact state through the
  backward; the norms and then the sum read it. Each layer's backprop is held until the sum.
* two passes: the first backward takes each call's norms² the moment its backprop arrives and
  drops the state (only the inputs stay, which autograd keeps for the second pass anyway); the
  second backward, of Σ_i w_i·loss_i once the clip weights w are known, hands every layer
  backprops that already carry w_i, so its plain (masked) sum is its clipped sum. One more
  input-gradient backward of time; the backprops are never held together. A per-example gradient
  that the first backward formed (a small layer's, a bias's, a custom layer's: B·p·q at most the
  size of the layer's factors) is kept and summed with the weights w_i, as it was measured: formed
  again from the second backprop, its rounding need not scale with w_i, and where an example's
  rows cancel it is mostly rounding (a review: 4.9·C released against a clip of C). So are all the
  pieces of a handler that does not declare ``second_pass_replays`` (DP-GRAPE's projections). A
  model that differentiates anything below float32 is refused (``check_model``'s probe).

A contribution is summed once: the sum drops the kept state (and the second backward frees the graph).
Its backward runs when it is first read, not when it is made: per-layer clipping (the opt-in
``privatizer.clipping: per_layer``) hands it the clip, and each layer's clipped sum is then formed
inside that one backward as soon as the layer's backprops are in (``_LayerClip``), so a layer's
state does not outlive its own backward step (a group of layers that share a parameter, or a layer
called several times, keeps its calls' state until its last call's backprop): the memory of a
non-private backward, in one pass.

Layers: Linear, Embedding, LayerNorm and Conv1d/2d; any
other module that owns trainable parameters gets its per-example gradients of those parameters
by ``torch.func.vmap`` over the module's own forward (as Opacus does), materialised.

A tensor reached by several calls (a layer called twice, word embeddings tied to an LM head,
RoBERTa's ``lm_head.bias`` that is also ``lm_head.decoder.bias``) has per-example gradient
Σ_k G_i^(k), one term per call: its clipped sum adds each call's book-keeping sum, and its norm²
adds the cross terms 2⟨G_i^(k), G_i^(l)⟩, computed from the kept factors or rows (B·T·T') like the
ghost norm (past ``MAX_CROSS_PIECES`` calls, a cell in a loop, the per-example sum is formed). A tensor registered by a module and by one of its descendants is accounted for by the
descendant only (the parent's call contains the child's).

Activation checkpointing (non-reentrant ``torch.utils.checkpoint``; ``checkpoint_blocks`` in
:mod:`dpregistry.objectives`): each tap keeps its layer's input as a saved tensor, so a segment's
inputs are freed after the forward like its other activations, and the hooks stay registered until
no backward of ours waits, so the segment's forward, run again inside that backward, gets the same
taps and the checkpoint matches the recomputed inputs to them. With per-layer clipping no layer's
state waits for the others, so the backward then holds one segment's activations at a time. Two
passes refuse checkpointing: the second backward would recompute the segments again, and norms
from one recomputation need not bound sums from another. Reentrant checkpointing runs its segment
without grad, where no hook can see it, and is refused.

Hooks see a parameter only where its layer is called. On the first micro-batch (estimators run
it at setup, on two examples), ``GradSampler`` reads the autograd graph and refuses, naming the
parameter, a model where some use of a parameter is not inside exactly one call that accounts
for it (``F.linear(h, self.lin.weight)`` in a parent's forward), so a gradient is never silently
lost or counted twice.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import UserError
from .spaces import Aggregate, DenseAggregate, DenseContribution, acc_dtype, _mask_rows

# ------------------------------------------------------------------------------------------
# per-example products
# ------------------------------------------------------------------------------------------


def _per_row(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B, n] (a scalar parameter's per-example gradients [B] included)."""
    return x.reshape(x.shape[0], -1)


def _flat3(x: torch.Tensor) -> torch.Tensor:
    """[B, ..., F] -> [B, T, F]."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _zero_rows(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """values with the rows of weight 0 set to exactly 0 (NaN-safe), otherwise unscaled."""
    keep = (weights > 0).view((-1,) + (1,) * (values.dim() - 1))
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _scale_rows(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """values·w per example; NaN-safe masking only when some example has weight 0."""
    if bool((weights > 0).all()):
        return values * weights.to(values.dtype).view((-1,) + (1,) * (values.dim() - 1))
    return _mask_rows(values, weights)


# The cost model (Bu et al. 2022-23, "mixed ghost clipping" and book-keeping), per call of a layer
# whose per-example gradient is G_i = u_iᵀv_i (p×q) from T rows per example:
#
#                           memory held until the sum    norms                 the clipped sum
#   factors ("ghost")       B·T·(p+q)                    2·B·T²·(p+q) flops,    2·B·T·p·q (one GEMM,
#                                                        B·T² scratch           the weight gradient's)
#   per-example gradients   B·p·q                        B·p·q                  B·p·q
#
# plus 2·B·T·p·q flops to form the per-example gradients. Keeping the smaller of the two is
# ``keeps_per_example``. Where factors are kept (p·q > T·(p+q)), T < p·q/(p+q) ≤ min(p, q), so
# T² < p·q and T·(p+q) < p·q: the ghost norm is then also the cheaper norm in time and scratch,
# and nothing the size of the per-example gradients is ever formed. (Factors transformed by a
# handler, DP-GRAPE's projected ones, may not satisfy this; ``_factor_sq`` then compares T² with
# p·q, Bu et al.'s rule, to pick the smaller scratch.)


def keeps_per_example(T: int, p: int, q: int) -> bool:
    """Whether a call's per-example gradients (B·p·q numbers) take no more memory than its
    factors (B·T·(p+q)): then they are formed, and the activation and backprop are dropped."""
    return p * q <= T * (p + q)


def ghost_norm_cheaper(T: int, p: int, q: int) -> bool:
    """Whether norms from Gram products (B·T² scratch) beat forming per-example gradients (B·p·q)."""
    return T * T <= p * q


def _linear_weight_sq(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """‖g_iᵀ a_i‖²_F per example for a [B, T, in] and g [B, T, out], without forming g_iᵀa_i when
    the ghost norm is cheaper (T² ≤ in·out), in float64, with a bound on its rounding error
    (see ``_sq_bound``)."""
    B, T, fin = a.shape
    fout = g.shape[-1]
    u = _roundoff(a.dtype)
    if T == 1:  # ‖g‖²‖a‖²: no term cancels another
        sq = a.pow(2).sum((1, 2), dtype=torch.float64) * g.pow(2).sum((1, 2), dtype=torch.float64)
        return sq, 4 * u * sq
    if ghost_norm_cheaper(T, fin, fout):
        aa = torch.bmm(a, a.transpose(1, 2))
        gg = torch.bmm(g, g.transpose(1, 2))
        sq = (aa * gg).sum((1, 2), dtype=torch.float64)
        # |Σ δA∘G + A∘δG| ≤ γ_in·n_aᵀ|G|n_a + γ_out·n_gᵀ|A|n_g, |δA_ts| ≤ γ_in‖a_t‖‖a_s‖ (n_a, n_g
        # from the Grams' diagonals); the products' rounding, 2u·Σ|A∘G| ≤ 2u·n_aᵀ|G|n_a, joins
        # the first term, and the second-order one is 3γ_inγ_out·M² (M = n_a·n_g)
        na, ng = _gram_row_norms(aa), _gram_row_norms(gg)
        ga, gb = _gamma(fin, u), _gamma(fout, u)
        # |G_ts| ≤ n_g(t)n_g(s) gives the looser (γ_in + γ_out + ...)·M²: enough where it is under
        # 2⁻¹⁰ of the norm² (no cancellation), and it skips four passes over B·T² (on a CPU: a
        # GPU would wait for the test)
        M = (na * ng).sum((1, 2), dtype=torch.float64)
        loose = 1.01 * (ga + gb + 2 * u + 3 * ga * gb) * M * M
        if a.device.type == "cpu" and bool((loose * 1024 <= sq).all()):
            return sq, loose
        err = ((ga + 2 * u) * (na * torch.bmm(gg.abs_(), na)).sum((1, 2), dtype=torch.float64)
               + gb * (ng * torch.bmm(aa.abs_(), ng)).sum((1, 2), dtype=torch.float64)
               + 3 * ga * gb * M * M)
        return sq, 1.01 * err
    # the per-example gradient formed: ‖G − fl(G)‖_F ≤ γ_T·M, M = Σ_t ‖a_t‖‖g_t‖ ≥ ‖G‖
    sq = torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2), dtype=torch.float64)
    M, gt = _rows_norm_products(a, g), _gamma(T, u)
    return sq, 1.01 * (2 * gt * sq.sqrt() * M + gt * gt * M * M) + 4 * u * sq


def _gram_row_norms(gram: torch.Tensor) -> torch.Tensor:
    """‖x_t‖ from a Gram matrix's diagonal, [B, T, 1] (a rounded diagonal entry may dip below 0)."""
    return gram.diagonal(dim1=1, dim2=2).clamp(min=0).sqrt().unsqueeze(2)


def _rows_norm_products(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """M_i = Σ_t ‖u_t‖‖v_t‖ ≥ ‖u_iᵀv_i‖_F (the triangle inequality), float64."""
    return (u.norm(dim=2) * v.norm(dim=2)).sum(1, dtype=torch.float64)


def _roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _gamma(n: int, u: float) -> float:
    """γ_n = n·u/(1 − n·u): inner products of length n are off by at most γ_n·‖x‖‖y‖ (Higham 2002,
    §3.1), whatever the order of the sum; inf where n·u ≥ 1/2 (no bound: recompute in float64)."""
    return n * u / (1 - n * u) if n * u < 0.5 else math.inf


def _sum_of_products(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Σ_i u_iᵀ v_i for u [B, T, p] and v [B, T, q]: one GEMM over the B·T rows, u's transpose a
    stride (einsum copied a factor into a [p, B·T] layout first: 1.5 % of a ViT step at B = 64)."""
    return u.reshape(-1, u.shape[-1]).t().mm(v.reshape(-1, v.shape[-1]))


def _weighted_factors(u: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i u_iᵀv_i; examples of weight 0 contribute exactly 0 (NaN-safe)."""
    if bool((w > 0).all()):  # no example to drop: scale the narrower factor, no masking copies
        if u.shape[2] <= v.shape[2]:
            u = u * w.to(u.dtype).view(-1, 1, 1)
        else:
            v = v * w.to(v.dtype).view(-1, 1, 1)
        return _sum_of_products(u, v)
    # the weight goes on one factor only; the other is just masked
    return _sum_of_products(_mask_rows(u, w), _zero_rows(v, w))


class Outer:
    """Per-example products G_i = u_iᵀ v_i (p×q) of u [B, T, p] and v [B, T, q], stored as the
    factors or materialised ([B, p, q]), whichever takes less memory (``keeps_per_example``;
    ``per_example`` forces one form, for tests)."""

    __slots__ = ("u", "v", "m", "exact", "forming", "instead")

    def __init__(self, u: torch.Tensor, v: torch.Tensor, per_example: bool | None = None):
        T, p, q = u.shape[1], u.shape[2], v.shape[2]
        if keeps_per_example(T, p, q) if per_example is None else per_example:
            self.m, self.u, self.v = torch.bmm(u.transpose(1, 2), v), None, None
        else:
            self.m, self.u, self.v = None, u, v
        self.exact = None  # examples whose share of the sum is formed in float64 (``_sq_bound``)
        self.forming = None  # a bound on ‖fl(G_i) − G_i‖ where the norm must bound G_i itself (``regroup``)
        self.instead = None  # float64 factors of the ``exact`` rows to release in place of these (two passes)

    @classmethod
    def formed(cls, m: torch.Tensor, forming: torch.Tensor | None = None) -> "Outer":
        """The materialised G_i = m [B, p, q], with a bound on the error of having formed them."""
        x = cls.__new__(cls)
        x.u, x.v, x.m, x.exact, x.forming, x.instead = None, None, m, None, forming, None
        return x

    @property
    def materialised(self) -> bool:
        return self.m is not None

    def sq_norms(self) -> torch.Tensor:
        return _sq_bound([self])

    def weighted(self, w: torch.Tensor) -> torch.Tensor:
        """Σ_i w_i G_i; examples of weight 0 contribute exactly 0 (NaN-safe)."""
        if self.m is not None:
            return _scale_rows(self.m, w).sum(0)
        if self.exact is None:
            return _weighted_factors(self.u, self.v, w)
        i = self.exact.to(w.device)
        out = _weighted_factors(self.u, self.v, w.index_fill(0, i, 0))
        u, v = self.instead or (self.u[i].double(), self.v[i].double())
        return out.add_(_weighted_factors(u, v, w[i].double()).to(out.dtype))

    def per_example(self) -> torch.Tensor:
        if self.m is not None:
            return self.m
        return torch.einsum("btp,btq->bpq", self.u, self.v)


class Rows:
    """Per-example gradients of an embedding table (num_rows × d): G_i = Σ_t e_{ids_it} g_itᵀ,
    kept as the ids [B, T] and the backprops g [B, T, d]."""

    __slots__ = ("ids", "g", "num_rows", "exact", "instead")

    def __init__(self, ids: torch.Tensor, g: torch.Tensor, num_rows: int):
        self.ids, self.g, self.num_rows = ids, g, num_rows
        self.exact = None  # examples whose share of the sum is formed in float64 (``_sq_bound``)
        self.instead = None  # float64 (ids, backprops) of the ``exact`` rows to release instead (two passes)

    def sq_norms(self) -> torch.Tensor:
        return _sq_bound([self])

    def weighted(self, w: torch.Tensor) -> torch.Tensor:
        """Σ_i w_i G_i, summed in float64 on the rows the batch touches and rounded once: an fp32
        ``index_add_`` adds a row's tokens one by one, so a large running value (an example's ±w·X
        whose pieces cancel, just under the float64 recompute) rounded away every later token on
        that row (a review: 2.9·C with 256,000 tokens on one row)."""
        d = self.g.shape[-1]
        keep = w if self.exact is None else w.index_fill(0, self.exact.to(w.device), 0)
        ids, rows = [self.ids.reshape(-1)], [_scale_rows(self.g.double(), keep.double()).reshape(-1, d)]
        if self.exact is not None:  # their rows in float64 (two passes: the first backward's)
            i = self.exact.to(w.device)
            xi, xg = self.instead or (self.ids[i], self.g[i].double())
            ids.append(xi.reshape(-1))
            rows.append(_scale_rows(xg, w[i].double()).reshape(-1, d))
        touched, slot = torch.unique(torch.cat(ids), return_inverse=True)
        part = torch.zeros((len(touched), d), dtype=torch.float64, device=self.g.device)
        part.index_add_(0, slot, torch.cat(rows))
        out = torch.zeros((self.num_rows, d), dtype=self.g.dtype, device=self.g.device)
        return out.index_copy_(0, touched, part.to(out.dtype))

    def per_example(self) -> torch.Tensor:
        B, d = self.ids.shape[0], self.g.shape[-1]
        out = torch.zeros((B, self.num_rows, d), dtype=self.g.dtype, device=self.g.device)
        out.scatter_add_(1, self.ids.unsqueeze(-1).expand(-1, -1, d), self.g)
        return out


class _GroupSums:
    """A piece's group sums as ``group_norms`` formed and measured them, [n_groups, *shape]: the
    weighted sum multiplies each group's by its members' (common) weight. Summed anew from the
    members' rows among the other groups', a group whose rows cancel leaves rounding that its norm
    does not bound (a review: 3.5·C)."""

    __slots__ = ("sums", "groups")

    def __init__(self, sums: torch.Tensor, groups: torch.Tensor):
        self.sums, self.groups = sums, groups

    def weighted(self, w: torch.Tensor) -> torch.Tensor:
        groups = self.groups.to(w.device)
        per_group = torch.zeros(self.sums.shape[0], dtype=w.dtype, device=w.device).index_copy_(0, groups, w)
        return _scale_rows(self.sums, per_group.to(self.sums.device)).sum(0)


# A piece is one call's per-example gradients of one parameter: an Outer, Rows, or a dense
# [B, *shape] tensor. A parameter reached by several calls (a layer called twice, an embedding
# tied to an LM head) has the sum of its pieces as per-example gradient, so its norm² is
# Σ_k ‖piece_k‖² + 2 Σ_{k<l} ⟨piece_k, piece_l⟩; the cross terms below never materialise a piece
# that is kept as factors or rows.
Piece = Any


def _piece_weighted(x: Piece, w: torch.Tensor) -> torch.Tensor:
    return _scale_rows(x, w).sum(0) if isinstance(x, torch.Tensor) else x.weighted(w)


def _piece_per_example(x: Piece) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.per_example()


def _same_ids(x: Rows, y: Rows) -> torch.Tensor:
    """[ids_t = ids'_s], [B, T, T'], in the backprops' dtype."""
    return (x.ids.unsqueeze(2) == y.ids.unsqueeze(1)).to(x.g.dtype)


def _rows_dot_rows(x: Rows, y: Rows) -> torch.Tensor:
    """Σ_{t,s} [ids_t = ids'_s] ⟨g_t, g'_s⟩ per example."""
    return (_same_ids(x, y) * torch.bmm(x.g, y.g.transpose(1, 2))).sum((1, 2), dtype=torch.float64)


def _rows_dot_factors(x: Rows, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """⟨Σ_t e_{ids_t} g_tᵀ, uᵀv⟩ = Σ_{t,s} u_s[ids_t] ⟨v_s, g_t⟩ (u [B, S, rows], v [B, S, d])."""
    B, S, T = u.shape[0], u.shape[1], x.ids.shape[1]
    picked = u.gather(2, x.ids.unsqueeze(1).expand(B, S, T))                 # [B, S, T]
    return (picked * torch.bmm(v, x.g.transpose(1, 2))).sum((1, 2), dtype=torch.float64)


def _rows_dot_dense(x: Rows, m: torch.Tensor) -> torch.Tensor:
    """Σ_t ⟨M_i[ids_t], g_t⟩ for dense per-example gradients m [B, rows, d]."""
    d = x.g.shape[-1]
    return (m.gather(1, x.ids.unsqueeze(-1).expand(-1, -1, d)) * x.g).sum((1, 2), dtype=torch.float64)


def _factors_dot_factors(x: Outer, y: Outer) -> torch.Tensor:
    """⟨uᵀv, u'ᵀv'⟩ = Σ_{t,s} ⟨u_t, u'_s⟩⟨v_t, v'_s⟩ per example (B·T·T' memory)."""
    return (torch.bmm(x.u, y.u.transpose(1, 2)) * torch.bmm(x.v, y.v.transpose(1, 2))).sum((1, 2), dtype=torch.float64)


def _factors_dot_dense(x: Outer, m: torch.Tensor) -> torch.Tensor:
    """⟨uᵀv, M⟩ = Σ_t u_tᵀ M v_t per example."""
    return (torch.bmm(x.u, m) * x.v).sum((1, 2), dtype=torch.float64)


def _kind(x: Piece) -> int:
    """0: rows, 1: factors, 2: dense (a tensor or a materialised Outer)."""
    if isinstance(x, Rows):
        return 0
    return 1 if isinstance(x, Outer) and not x.materialised else 2


def _piece_kind(x: Piece) -> str:
    return ("rows", "ghost", "per_example")[_kind(x)]


def _formed(state: dict[str, Piece]) -> dict[str, Piece]:
    """The pieces of ``state`` held as per-example gradients (a tensor, a materialised Outer)."""
    return {k: v for k, v in state.items() if _kind(v) == 2}


def _measured(h: "LayerHandler", state: dict[str, Piece]) -> dict[str, Piece]:
    """The pieces of a call that the second of two passes releases as the first measured them:
    those formed per example, and all those of a handler whose pieces the second backward does not
    rebuild (``LayerHandler.second_pass_replays``)."""
    return _formed(state) if h.second_pass_replays else dict(state)


def _dense(x: Piece) -> torch.Tensor:
    return x.m if isinstance(x, Outer) else x


_DOTS = {
    (0, 0): _rows_dot_rows,
    (0, 1): lambda x, y: _rows_dot_factors(x, y.u, y.v),
    (0, 2): lambda x, y: _rows_dot_dense(x, _dense(y).reshape(x.ids.shape[0], x.num_rows, -1)),
    (1, 1): _factors_dot_factors,
    (1, 2): lambda x, y: _factors_dot_dense(x, _dense(y).reshape(x.u.shape[0], x.u.shape[2], x.v.shape[2])),
    (2, 2): lambda x, y: (_per_row(_dense(x)) * _per_row(_dense(y))).sum(1, dtype=torch.float64),
}


def piece_dot(x: Piece, y: Piece) -> torch.Tensor:
    """⟨x_i, y_i⟩ per example for two pieces of one parameter (see ``Piece``)."""
    if _kind(x) > _kind(y):
        x, y = y, x
    return _DOTS[_kind(x), _kind(y)](x, y)


#: beyond this many calls of one parameter (a cell called in a loop), K² cross terms cost more
#: than materialising the per-example sum once
MAX_CROSS_PIECES = 16


def regroup(x: Piece, groups: torch.Tensor, n_groups: int) -> Piece:
    """The piece of the group sums Σ_{i in g} G_i (user-level clipping): the members' factors or
    rows side by side along the token axis (the norm of a sum is a quadratic form over the
    members, which the same ghost norm then computes), or dense rows added up."""
    groups = groups.to(_piece_tensor(x).device)
    if isinstance(x, torch.Tensor) or (isinstance(x, Outer) and x.materialised):
        m = _dense(x)
        return torch.zeros((n_groups, *m.shape[1:]), dtype=m.dtype, device=m.device).index_add_(0, groups, m)
    slot = _slots(groups, n_groups)
    width = int(slot.max()) + 1 if len(slot) else 1

    def side_by_side(t: torch.Tensor, fill=0) -> torch.Tensor:
        B, T = t.shape[:2]
        out = torch.full((n_groups, width, T, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
        out[groups, slot] = t
        return out.reshape(n_groups, width * T, *t.shape[2:])

    if isinstance(x, Rows):
        return Rows(side_by_side(x.ids), side_by_side(x.g), x.num_rows)
    u, v = side_by_side(x.u), side_by_side(x.v)
    out = Outer(u, v)
    if out.materialised:  # the group's sum is formed here, but released from its members' factors
        out.forming = 1.01 * _gamma(u.shape[1], _roundoff(u.dtype)) * _rows_norm_products(u, v)
    return out


def _slots(groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Each row's position among the rows of its group (0, 1, ... in row order)."""
    order = torch.argsort(groups, stable=True)
    counts = torch.bincount(groups, minlength=n_groups)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(groups)
    slot[order] = torch.arange(len(groups), device=groups.device) - torch.repeat_interleave(starts, counts)
    return slot


def _piece_tensor(x: Piece) -> torch.Tensor:
    """The tensor that holds a piece's numbers (its device and dtype are the piece's)."""
    if isinstance(x, Rows):
        return x.g
    return x.u if isinstance(x, Outer) and not x.materialised else _dense(x)


def _sq_parts(x: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖x_i‖² as computed, in float64; a bound on the error of that computation) per example."""
    if isinstance(x, Rows):  # Σ_{t,s} [ids_t = ids_s]⟨g_t, g_s⟩: off by γ_d·Σ_{same} ‖g_t‖‖g_s‖
        gram = torch.bmm(x.g, x.g.transpose(1, 2))
        same = _same_ids(x, x)
        n = _gram_row_norms(gram)
        u = _roundoff(x.g.dtype)
        err = _gamma(x.g.shape[-1], u) * (n * torch.bmm(same, n)).sum((1, 2), dtype=torch.float64)
        prod = same * gram
        return prod.sum((1, 2), dtype=torch.float64), 1.01 * err + 2 * u * prod.abs().sum((1, 2), dtype=torch.float64)
    if isinstance(x, Outer) and not x.materialised:
        return _linear_weight_sq(x.v, x.u)
    dense = _dense(x)
    sq = _per_row(dense).pow(2).sum(1, dtype=torch.float64)  # the released tensor's own squares
    err = 4 * _roundoff(dense.dtype) * sq
    if isinstance(x, Outer) and x.forming is not None:  # ‖G‖² ≤ (‖fl(G)‖ + f)²
        f = x.forming.to(sq.device)
        err = err + 2 * sq.sqrt() * f + f * f
    return sq, err


def _magnitude(x: Piece) -> torch.Tensor:
    """M_i ≥ ‖x_i‖ (the triangle inequality over the rows), float64."""
    if isinstance(x, Rows):
        return x.g.norm(dim=2).sum(1, dtype=torch.float64)
    if isinstance(x, Outer) and not x.materialised:
        return _rows_norm_products(x.u, x.v)
    return _per_row(_dense(x)).norm(dim=1).to(torch.float64)


def _inner(x: Piece) -> int:
    """The longest inner product in the cross terms of x with another piece of its parameter."""
    if isinstance(x, Rows):
        return x.g.shape[-1]
    if isinstance(x, Outer) and not x.materialised:
        return max(x.u.shape[2] + x.v.shape[2], 2 * x.u.shape[1])
    return 2


def _sq_of_sum(pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_sq_parts`` of Σ_k piece_k: Σ_k ‖piece_k‖² + 2 Σ_{k<l} ⟨piece_k, piece_l⟩ per example; the
    cross terms' error is bounded through the pieces' magnitudes (shared parameters are rare).
    Third, Σ_k ‖piece_k‖ (float64), which ``_flag_joint`` compares with the norm of the sum."""
    if len(pieces) == 1:
        sq, err = _sq_parts(pieces[0])
        return sq, err, sq.sqrt()
    u = _roundoff(_piece_tensor(pieces[0]).dtype)
    M = sum(_magnitude(p) for p in pieces)
    err = 1.01 * _gamma(max(_inner(p) for p in pieces), u) * (2 * M * M)
    if len(pieces) > MAX_CROSS_PIECES:
        total = sum(_per_row(_piece_per_example(p)) for p in pieces)
        return total.pow(2).sum(1, dtype=torch.float64), err, sum(_sq_parts(p)[0].sqrt() for p in pieces)
    parts = [_sq_parts(p) for p in pieces]
    terms = [sq for sq, _ in parts]
    terms += [2 * piece_dot(pieces[k], pieces[l]) for k in range(len(pieces)) for l in range(k)]
    return sum(terms[1:], terms[0]), err + sum(e for _, e in parts), sum(sq.sqrt() for sq, _ in parts)


def _piece_rows64(x: Piece, idx: torch.Tensor) -> Piece:
    """The rows ``idx`` of a piece, in float64."""
    if isinstance(x, Rows):
        return Rows(x.ids[idx], x.g[idx].double(), x.num_rows)
    if isinstance(x, Outer) and not x.materialised:
        return Outer(x.u[idx].double(), x.v[idx].double(), per_example=False)
    if isinstance(x, Outer) and x.forming is not None:  # formed in its own dtype: its bound stays
        return Outer.formed(x.m[idx].double(), x.forming[idx])
    return _dense(x)[idx].double()


def _sq_bound(pieces: list[Piece]) -> torch.Tensor:
    """‖Σ_k piece_k‖² per example, rounded up past the rounding error of its computation.

    An example's clip factor comes from this norm, its share of the released sum from another
    computation (one GEMM over every example's rows). A norm from Gram products,
    Σ_{t,s}⟨u_t,u_s⟩⟨v_t,v_s⟩ (or from cross terms of a shared parameter), cancels where rows
    nearly cancel (a_1 = A + e, a_2 = −A with ‖A‖ ≫ ‖e‖): in fp32 it came out near 0 for an example
    whose gradient was large, which was then not clipped (a crafted input moved a sum by 334·C in
    a review). So each computed norm² gets a bound on its error added (``_sq_parts``: each Gram
    entry is off by at most γ_n‖x‖‖y‖, and those bounds are summed with the other Gram's entries,
    about 10⁻⁴ of the norm² for real activations); where the bound exceeds 1/64 of the value
    (cancellation) the example's norm² is recomputed in float64, where it is 2⁻²⁹ times smaller,
    and so is its share of the sum (``release_exactly``): in the fp32 GEMM over all examples,
    rows that cancel leave rounding that the norm does not bound (a review: 1.36·C released at a
    clip of C). Real examples were never near that bound (err/sq ≤ 0.0023 on ViT and RoBERTa).
    The result is in the pieces' dtype, rounded from above the true value."""
    return _sq_bound_flagged(pieces)[0]


def _sq_bound_flagged(pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``_sq_bound``, the examples it recomputed in float64 (None if none), and Σ_k ‖piece_k‖."""
    sq, err, each = _sq_of_sum(pieces)
    dtype = _piece_tensor(pieces[0]).dtype
    loose = ~(err * 64 <= sq)
    idx = None
    if dtype != torch.float64 and bool(loose.any()):
        idx = loose.nonzero().squeeze(1)
        sq64, err64, _ = _sq_of_sum([_piece_rows64(p, idx.to(_piece_tensor(p).device)) for p in pieces])
        sq, err = sq.index_copy(0, idx, sq64), err.index_copy(0, idx, err64)
        for p in pieces:
            release_exactly(p, idx)
    return (sq + 2 * err).to(dtype), idx, each


#: an example whose pieces of a shared parameter add up to less than 1/APART of the sum of their
#: norms (cancelling across the calls) is released apart, in float64 (``_flag_joint``); ordinary
#: pieces of a tied head or a reused layer are far from cancelling so (pieces of equal norm need a
#: cosine below −0.5 to reach 2)
APART = 2.0


def _apart(sq: torch.Tensor, each: torch.Tensor) -> torch.Tensor:
    """The examples (or groups) whose Σ_k ‖piece_k‖ (``each``) exceeds APART × ‖Σ_k piece_k‖."""
    return (each > APART * sq.double().sqrt().to(each.device)).nonzero().squeeze(1)


def _flag_joint(pieces: dict[str, list[Piece]], calls) -> list[torch.Tensor]:
    """The norms² of the parameters several calls reach (``pieces``: name -> their pieces), and
    where some example's pieces cancel across calls (its norm recomputed in float64), set
    ``use.joint`` for each of ``calls`` ((handler, local names, use)) that reaches one of them: the
    examples' rows of every piece of the call in float64 (``_joint_shares``). Each call's pieces
    are otherwise summed over the examples on their own, in fp32: there ±X would absorb the other
    examples' rows, and their sums, added, would not release the 0 that was measured (0.98·C at
    B = 256 in a search). Returns the norms² in the order of ``pieces``.

    The float64 recompute flags pieces that cancel by a factor of about 20 and more; the release
    flags them from ``APART`` on: below the norm's flag, one fp32 GEMM per call, which BLAS runs
    row after row for narrow layers, kept ±w·X as the running value while every later example's
    rows were added, and rounded them all away (a review: 4.7·C at B·T = 10⁶, X = 40)."""
    flagged = [_sq_bound_flagged(ps) for ps in pieces.values()]
    found = [i for _, i, _ in flagged if i is not None]
    for sq, _, each in flagged:
        apart = _apart(sq, each)
        if len(apart):
            found.append(apart)
    if found:
        idx = torch.unique(torch.cat([i.cpu() for i in found]))
        for h, local, use in calls:
            if any(local[k] in pieces for k in use.keys):
                use.joint = (idx, {k: _piece_rows64(v, idx.to(_piece_tensor(v).device))
                                   for k, v in h.pieces(use).items()})
    return [sq for sq, _, _ in flagged]


def _without_joint(w: torch.Tensor, use: "Use") -> torch.Tensor:
    """The weights w with the call's ``joint`` examples at 0: their shares come from ``_joint_shares``."""
    return w if use.joint is None else w.index_fill(0, use.joint[0].to(w.device), 0)


def _joint_shares(h: "LayerHandler", use: "Use", w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weighted sums of the call's ``joint`` examples alone, from their float64 rows, in float64
    (added up over the calls before they are rounded, once: ``_CallSums.add_shares``; {} for a call
    without them)."""
    if use.joint is None:
        return {}
    idx, rows = use.joint
    return h.weighted(Use(use.module, None, keys=use.keys, state=rows), w[idx.to(w.device)].double())


def _exact_rows(state: dict[str, Piece]) -> dict[str, tuple[torch.Tensor, Piece]]:
    """By the pieces' names, the examples ``release_exactly`` chose and their rows in float64 (two
    passes: the second backward's backprops carry the clip weights with a rounding that is not
    w_i times the first's, so those examples' shares are formed from the first's rows)."""
    return {k: (v.exact, _piece_rows64(v, v.exact)) for k, v in state.items()
            if isinstance(v, (Rows, Outer)) and _kind(v) != 2 and v.exact is not None}


def _release_instead(x: Piece, idx: torch.Tensor, first: Piece, w: torch.Tensor) -> None:
    """Release the rows ``idx`` of x as ``first`` (the first backward's, float64) scaled by the clip
    weights w of those rows."""
    release_exactly(x, idx)
    scale = torch.where(w > 0, w, torch.zeros_like(w)).to(torch.float64)
    if isinstance(first, Rows):
        x.instead = (first.ids, _scale_rows(first.g, scale))
    else:
        x.instead = (_scale_rows(first.u, scale), first.v)


def release_exactly(x: Piece, idx: torch.Tensor) -> None:
    """Form the share of the examples ``idx`` in x's weighted sum in float64 (a piece kept as factors
    or rows; a formed piece is released as measured, and only marks them for ``group_norms``)."""
    if isinstance(x, (Rows, Outer)):
        idx = idx.to(_piece_tensor(x).device)
        x.exact = idx if x.exact is None else torch.unique(torch.cat([x.exact, idx]))


# ------------------------------------------------------------------------------------------
# layer handlers: backprop -> compact state -> norms² [B], weighted sums, per-example gradients
# ------------------------------------------------------------------------------------------


@dataclass
class Use:
    """One call of a hooked module: its inputs and its (tapped) output, then the handler's state."""

    module: nn.Module
    #: the layer's input: kept by the tap (a saved tensor), here from its backprop's arrival until
    #: the handler has made its state
    inp: Any
    keys: tuple = ()  # the module's local names of the parameters this call accounts for
    #: (weak reference, version, "output" or "input") of the tensors the in-place check watches: the
    #: output's base and the kept input. Holding them would keep alive what the forward frees (a
    #: layer's output consumed by a residual sum, a checkpointed segment's activations).
    watch: tuple = ()
    g: torch.Tensor | None = None
    call: tuple | None = None  # (sequence mark before the call, the tap's node), for the use check
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    #: two passes only: the call's norms² by local name (taken in the first backward), then its
    #: weighted sums (taken in the second)
    sq: dict | None = None
    sums: dict | None = None
    #: two passes only: a sketch of the first backward's backprop (``_row_sketch``), which the
    #: second's must equal times the clip weights
    echo: torch.Tensor | None = None
    #: two passes only: by local name, the examples whose share is formed in float64 and their
    #: first backward's rows (``_exact_rows``, decided by that backward's norms)
    exact: dict = field(default_factory=dict)
    #: how each parameter's per-example gradients were kept: "ghost" (factors; norms from Gram
    #: products), "per_example" (materialised), "rows" (an embedding's ids and backprops)
    plan: dict = field(default_factory=dict)
    #: a call of a parameter that several calls reach, where some examples' pieces cancel across the
    #: calls: (those examples, their rows of each piece in float64), released apart (``_flag_joint``)
    joint: tuple | None = None

    def drop(self) -> None:
        """Forget the call's inputs, backprop and kept state (once its sum is formed)."""
        self.state, self.inp, self.g, self.args, self.kwargs = {}, None, None, (), {}
        self.echo, self.exact = None, {}


class LayerHandler:
    """Per-example norms² and weighted sums for the parameters of one module type.

    ``on_backprop(use)`` runs inside the backward pass, as soon as ``use.g`` exists: a handler
    replaces (use.inp, use.g) by ``use.state``, the compact pieces (see ``Piece``) of the call's
    per-example gradients, so that the activations and backprops of all layers are not held
    together. The other methods read those pieces; their keys are the module's local parameter
    names.

    A handler builds its state from ``use.inp`` (or ``use.args``/``use.kwargs``) and ``use.g``
    only: in the two-pass mode ``on_backprop`` runs once per backward, the first time followed by
    ``sq_norms``, the second (with the inputs restored and a backprop that carries the clip
    weights) by ``weighted``. Handlers are registered per layer type through the
    ``dpreg_register_grad_samplers`` hook (see :mod:`dpregistry.hookspecs`); a plugin can also
    substitute its own for chosen layers (``GradSampler(handler_for=...)``, as DP-GRAPE does).
    """

    types: tuple = ()
    #: whether the second of two backward passes rebuilds this handler's pieces as the first's times
    #: the clip weights, up to a rounding that the norms bound (a product of the backprop and the
    #: input: fl(w·g) is w·g to a relative u). Where it does not, the first pass's pieces are kept
    #: and summed with the weights as measured. DP-GRAPE's projection does not: fl(fl(w·g)·P) is not
    #: w·fl(g·P) once g·P is mostly rounding (g near the null space of Pᵀ; a review: 22·C). False
    #: unless a class declares it: a subclass does not inherit it (``__init_subclass__``), since one
    #: that changes the arithmetic must not replay by accident.
    second_pass_replays: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.second_pass_replays = cls.__dict__.get("second_pass_replays", False)

    def needs_input(self, keys: tuple) -> bool:
        """Whether the per-example gradients of ``keys`` (local names) need the layer's input; the
        tap keeps it only then (a layer whose weight is frozen, BitFit's biases, keeps none)."""
        return True

    def on_backprop(self, use: Use) -> None:
        """Default: keep the activation and the backprop as they are (``pieces`` computes)."""

    def pieces(self, use: Use) -> dict[str, Piece]:
        return use.state

    def sq_norms(self, use: Use) -> dict[str, torch.Tensor]:
        return {k: _sq_bound([v]) for k, v in self.pieces(use).items()}

    def weighted(self, use: Use, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: _piece_weighted(v, w) for k, v in self.pieces(use).items()}

    def per_example(self, use: Use) -> dict[str, torch.Tensor]:
        """Materialised per-example gradients (for tests and small layers)."""
        return {k: _piece_per_example(v) for k, v in self.pieces(use).items()}


class _ProductHandler(LayerHandler):
    """A layer whose weight gradient is Σ_t g_t a_tᵀ and bias gradient Σ_t g_t (Linear, Conv)."""

    def activations(self, use: Use) -> torch.Tensor:
        """[B, T, in] (for a convolution: the unfolded patches)."""
        raise NotImplementedError

    def weight_product(self, use: Use, a: torch.Tensor, g: torch.Tensor) -> Outer:
        """The per-example weight gradients as an :class:`Outer` (projected handlers override)."""
        return Outer(g, a)

    def backprops(self, use: Use) -> torch.Tensor:
        """[B, T, out]."""
        return _flat3(use.g)

    def needs_input(self, keys):
        return "weight" in keys  # the bias's gradient is the backprop's sum

    def weight_shape(self, use: Use, prod: Outer) -> tuple:
        return tuple(use.module.weight.shape)

    def on_backprop(self, use):
        m = use.module
        dt = acc_dtype(use.g.dtype)
        g = self.backprops(use).to(dt)
        st = {}
        if "weight" in use.keys:
            st["weight"] = self.weight_product(use, self.activations(use).to(dt), g)
        if "bias" in use.keys:
            st["bias"] = g.sum(1)
        use.state, use.inp, use.g = st, None, None

    def weighted(self, use, w):
        out = super().weighted(use, w)
        if "weight" in out:
            out["weight"] = out["weight"].reshape(self.weight_shape(use, use.state["weight"]))
        return out

    def per_example(self, use):
        out = super().per_example(use)
        if "weight" in out:
            out["weight"] = out["weight"].reshape((-1,) + self.weight_shape(use, use.state["weight"]))
        return out


class LinearHandler(_ProductHandler):
    types = (nn.Linear,)
    second_pass_replays = True

    def activations(self, use):
        return _flat3(use.inp)


class ConvHandler(_ProductHandler):
    """Conv1d/Conv2d through unfold: the layer is a linear map on patches."""

    types = (nn.Conv1d, nn.Conv2d)
    second_pass_replays = True

    def activations(self, use):
        m = use.module
        x = use.inp
        if isinstance(m, nn.Conv1d):
            x = x.unsqueeze(-1)
            ks, st, pd, dl = (m.kernel_size[0], 1), (m.stride[0], 1), (m.padding[0], 0), (m.dilation[0], 1)
        else:
            ks, st, pd, dl = m.kernel_size, m.stride, m.padding, m.dilation
        cols = F.unfold(x, ks, dilation=dl, padding=pd, stride=st)  # [B, C·k, L]
        return cols.transpose(1, 2)                                  # [B, L, C·k]

    def backprops(self, use):
        return use.g.flatten(2).transpose(1, 2)                      # [B, L, out]


class EmbeddingHandler(LayerHandler):
    types = (nn.Embedding,)
    second_pass_replays = True

    def on_backprop(self, use):
        ids = use.inp.reshape(use.inp.shape[0], -1)
        g = _flat3(use.g).to(acc_dtype(use.g.dtype))
        pad = use.module.padding_idx
        if pad is not None:  # torch gives the padding row no gradient
            g = torch.where((ids != pad).unsqueeze(-1), g, torch.zeros((), dtype=g.dtype, device=g.device))
        use.state, use.inp, use.g = {"weight": Rows(ids, g, use.module.num_embeddings)}, None, None


class LayerNormHandler(LayerHandler):
    types = (nn.LayerNorm,)

    def needs_input(self, keys):
        return "weight" in keys

    def on_backprop(self, use):
        m = use.module
        dt = acc_dtype(use.g.dtype)
        g = use.g.to(dt)
        dims = tuple(range(1, g.dim() - len(m.normalized_shape)))
        st = {}
        if "weight" in use.keys:
            xhat = F.layer_norm(use.inp.to(dt), m.normalized_shape, None, None, m.eps)
            st["weight"] = (g * xhat).sum(dims) if dims else g * xhat
        if "bias" in use.keys:
            st["bias"] = g.sum(dims) if dims else g
        use.state, use.inp, use.g = st, None, None


def _random_state_kept(device: torch.device):
    """Checks run extra forward passes; they must not move the run's random state (dropout)."""
    return torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type)


class FunctionalHandler(LayerHandler):
    """Any other module with trainable parameters of its own (a ViT's class token and position
    embeddings, a custom layer): per-example gradients of those parameters by vmap(grad) of
    ⟨module(params; x_i), g_i⟩ over the examples, materialised (children keep their own hooks)."""

    def pieces(self, use):
        if not use.state:  # norms and the weighted sum both need them: compute once, then free the inputs
            use.state = self._vmap(use)
            use.args, use.kwargs, use.g = (), {}, None
        return use.state

    def bypassed(self, use) -> list[str]:
        """The accounted parameters that the call reaches other than through the module's own
        attributes (a reference kept elsewhere, a module outside this one's tree): the vmap
        substitutes the attributes only, so it would miss those uses. One plain re-run of the
        call with substituted copies (the use check's, once; the random state is restored)."""
        from torch.func import functional_call

        own = dict(use.module.named_parameters(recurse=False))
        copies = {k: own[k].detach().requires_grad_() for k in use.keys}
        with _random_state_kept(next(iter(own.values())).device), torch.enable_grad():
            out = functional_call(use.module, copies, use.args, use.kwargs)
        reached = {id(v) for v in _leaves(out.grad_fn)} if isinstance(out, torch.Tensor) else set()
        return [k for k in use.keys if id(own[k]) in reached]

    def _vmap(self, use):
        from torch.func import functional_call, grad, vmap
        from torch.utils._pytree import tree_flatten, tree_unflatten

        m = use.module
        own = dict(m.named_parameters(recurse=False))
        fixed = {k: p.detach() for k, p in own.items() if k not in use.keys}
        B = use.g.shape[0]
        # every tensor whose dimension 0 is the batch is split per example, nested ones (a tuple, a
        # dict of inputs) included: one passed whole would let example i's "gradient" read the others'
        leaves, spec = tree_flatten((use.args, use.kwargs))
        batched = [isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == B for x in leaves]
        name = type(m).__name__

        def one(params, leaves_b, g):
            it = iter(leaves_b)
            args, kwargs = tree_unflatten([next(it).unsqueeze(0) if b else x for x, b in zip(leaves, batched)], spec)
            out = functional_call(m, {**fixed, **params}, tuple(args), kwargs)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, *g.shape):
                raise UserError(f"per-example gradients: layer {name} run on one example's inputs gives an output of "
                                f"shape {tuple(getattr(out, 'shape', ()))}, not one row of its output "
                                f"{(B, *g.shape)}: some input of the batch reaches it in another layout, and its "
                                "per-example gradient would read other examples")
            return (out.to(g.dtype) * g.unsqueeze(0)).sum()

        detached = {k: own[k].detach() for k in use.keys}
        leaves_b = tuple(x for x, b in zip(leaves, batched) if b)
        g = use.g.to(acc_dtype(use.g.dtype))
        with torch.enable_grad():
            grads = vmap(grad(one), in_dims=(None, 0, 0))(detached, leaves_b, g)
        return {k: v.to(acc_dtype(v.dtype)) for k, v in grads.items()}


FUNCTIONAL = FunctionalHandler()


def register_builtin_layers(register) -> None:
    """The layers dpregistry serves itself, registered through ``dpreg_register_grad_samplers``
    like a plugin's (see :mod:`dpregistry.hookspecs`)."""
    for handler in (LinearHandler(), EmbeddingHandler(), LayerNormHandler(), ConvHandler()):
        for layer in handler.types:
            register(layer, handler)


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The registered handler of a module's exact type (a subclass may change the forward)."""
    from .registry import get_registry

    return get_registry().grad_samplers().get(type(module))


def check_forward_is_pure(model: nn.Module) -> None:
    """Refuse layers whose forward pass rewrites parameters from the data it sees: an embedding
    with ``max_norm`` rescales, in place and without noise, the rows of the batch's ids, so the
    released weights would show which tokens a private batch held (trainable or frozen alike)."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise UserError(f"embedding {name or '<root>'} has max_norm, which renormalises the rows of each "
                            "batch's ids in place (a non-private release of the batch); remove max_norm")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            raise UserError(f"{type(m).__name__} {name or '<root>'} normalises with the statistics of the batch "
                            f"({'training mode' if m.training else 'track_running_stats=False'}): every example's "
                            "output then depends on the others (and, in training mode, the running statistics "
                            "record the private batch), so clipping one example's gradient would not bound its "
                            "influence. Put the model in eval mode with running statistics, or use GroupNorm or "
                            "LayerNorm")


class StateWatch:
    """Refuse a forward that writes the model's state from the data it sees (a running mean of its
    own, a "largest value seen" buffer or frozen parameter): the written values leave the run
    without noise, in the model it returns and exports. Made when the model is built, before any
    forward on private data; ``check`` runs one more forward (from the run's random state,
    restored) and compares: buffers by value; parameters, without a copy, by their version counter
    (an in-place write) and a float64 sum and norm (a write through ``.data`` leaves the counter
    alone). A lazy module's parameters and buffers, uninitialised until the first forward sets
    their shape, are not compared."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not _lazy(b)}
        self.params = {name: _fingerprint(p) for name, p in model.named_parameters() if not _lazy(p)}

    def check(self, forward: Callable[[], Any], device: torch.device) -> None:
        with _random_state_kept(device), torch.no_grad():
            forward()
        self.unchanged()

    def keep_watching(self, trained: dict[str, torch.Tensor]) -> None:
        """From here on (the run's steps) watch the buffers and the parameters the run does not train:
        a forward that writes its state only every so many calls passed the one probe forward (a
        buffer refreshed from the batch every 20th call left the run holding a training record)."""
        ids = {id(p) for p in trained.values()}
        self.params = {n: v for n, v in self.params.items() if id(self.model.get_parameter(n)) not in ids}

    def unchanged(self, values: bool = True) -> None:
        """Refuse a write since the watch began: buffers by value, parameters by their version counter
        and storage and, with ``values``, their float64 sum and norm (a write through ``.data``)."""
        for name, b in self.model.named_buffers():
            old = self.buffers.get(name, b)
            if old.shape != b.shape or old.dtype != b.dtype or not _equal_nan(old, b):
                raise _written("buffer", name)
        for name, p in self.model.named_parameters():
            if name not in self.params:
                continue
            version, ptr, summary = self.params[name]
            if (p._version, p.data_ptr()) != (version, ptr) or (values and tensor_summary(p) != summary):
                raise _written("parameter", name)


def _lazy(t: torch.Tensor) -> bool:
    return isinstance(t, nn.parameter.UninitializedTensorMixin)


def tensor_summary(t: torch.Tensor) -> tuple:
    """A tensor's values in a few numbers, without a copy: a float64 sum and norm (an integer
    tensor's sum). A write to it, by any path, changes them (a deliberate edit could keep them)."""
    with torch.no_grad():
        d = t.detach()
        if d.is_floating_point():
            return float(torch.sum(d, dtype=torch.float64)), float(torch.linalg.vector_norm(d, dtype=torch.float64))
        return (d.sum().item(),)


def _fingerprint(p: torch.Tensor) -> tuple:
    return p._version, p.data_ptr(), tensor_summary(p)


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.isclose(a, b, rtol=0, atol=0,
                                                                               equal_nan=True).all()))


def _written(kind: str, name: str) -> UserError:
    return UserError(f"the model's forward writes its {kind} {name} from the examples it sees: the written values "
                     "would leave the run without noise (in the model it returns and exports); keep the model's state "
                     "fixed in its forward (compute such statistics outside the model)", key="model")


def probe_indices(n_train: int, micro_batch_size: int | None = None, m: int = 8) -> torch.Tensor:
    """Up to ``m`` training examples spread over the data set, the first and the last included, for
    the independence probes (never more than the physical batch, nor fewer than two): neighbouring
    rows are often alike (a sorted or duplicated file), and a mix over copies of one row does not show."""
    m = min(m, max(2, micro_batch_size or m), n_train)
    return torch.tensor(sorted({round(i * (n_train - 1) / (m - 1)) for i in range(m)}) if m > 1 else [0])


def _mixing(what: str, index: int, value: str) -> UserError:
    return UserError(f"{what}: training example {index}'s {value} in two batches of other examples differ; the "
                     "forward mixes the examples of a batch (batch statistics, a sum or mean over dimension 0, "
                     "attention across the batch), so clipping one example's contribution would not bound its "
                     "influence")


def working_dtype(tensors) -> torch.dtype:
    """The least precise float dtype among ``tensors`` (the model's working precision)."""
    return max((t.dtype for t in tensors if t.is_floating_point()), key=lambda d: torch.finfo(d).eps,
               default=torch.float32)


def _tolerance(dtype: torch.dtype, floor: float) -> float:
    """Relative tolerance between an example's value alone and in a batch: padding and the batch's
    shape move the rounding, by a few units of the model's working precision."""
    return max(floor, 8 * torch.finfo(dtype).eps)


def _compare_across_batches(value_of: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, n_train: int,
                            device: torch.device, rtol: float, what: str, name: str) -> None:
    """``value_of`` (one value per example) of the first and of the last of ``idx`` in the batch
    ``idx`` against in a batch of the same size whose other examples are other records (spread over
    the data set), each evaluation from the run's random state (restored): an example whose value
    depends on the others in its batch differs, while a random forward (noise drawn in it, dropout)
    draws the same numbers for both batches. An example finite in one batch and not in the other
    depends on them too; one not finite in both is left out. Where the data set holds no other
    records, the example alone stands for the second batch (a random forward is not compared
    there). Compared alone, a batch of one made a forward's batch statistics NaN and a random
    forward differed from any random state, so both were left out and such a mix passed (8.2·C in
    a review)."""
    if len(idx) < 2:
        return

    def values(sel: torch.Tensor, moved: bool = False) -> torch.Tensor:
        with _random_state_kept(device):
            if moved:
                torch.rand(1, device=device)
            return value_of(sel).detach().reshape(-1).double().cpu()

    others = torch.ones(n_train, dtype=torch.bool)
    others[idx] = False
    others = others.nonzero().squeeze(1)
    spread = others[torch.linspace(0, len(others) - 1, len(idx) - 1).round().long()] if len(others) else others
    together = values(idx)
    for j in dict.fromkeys((0, len(idx) - 1)):
        if len(spread):
            elsewhere = values(torch.cat([spread[:j], idx[j:j + 1], spread[j:]]))[j]
        else:  # a tiny data set: the example alone, unless its value is random
            elsewhere = values(idx[j:j + 1])[0]
            if not torch.equal(elsewhere, values(idx[j:j + 1], moved=True)[0]):
                continue
        t = together[j]
        finite = (bool(torch.isfinite(t)), bool(torch.isfinite(elsewhere)))
        if finite == (False, False):
            continue
        if not (all(finite) and float((t - elsewhere).abs()) <= rtol * (1 + float(t.abs()))):
            raise _mixing(what, int(idx[j]), f"{name} ({float(t):.6g} and {float(elsewhere):.6g})")


def check_examples_independent(losses_of: Callable[[torch.Tensor], torch.Tensor], n_train: int,
                               device: torch.device, dtype: torch.dtype = torch.float32,
                               micro_batch_size: int | None = None, what: str = "per-example losses") -> None:
    """Refuse a forward in which an example's loss depends on the others in its batch: one record
    would move every other example's loss, and so its gradient or finite difference, past any
    per-example clipping. The first and the last of :func:`probe_indices` (the last catches a mix
    over the examples before it) are compared in the probe batch and in one of other records, to
    the rounding of the model's working ``dtype`` (:func:`_compare_across_batches`). A heuristic: a
    model may mix in a way these examples and these parameters do not show (a zero-initialised head
    makes every loss log K: the hooks compare gradient norms and the zeroth-order estimators probe
    again at their displaced parameters; a model that mixes only in larger batches)."""
    with torch.no_grad():
        _compare_across_batches(losses_of, probe_indices(n_train, micro_batch_size), n_train, device,
                                _tolerance(dtype, 1e-4), what, "loss")


def _check_supported(name: str, module: nn.Module) -> None:
    if isinstance(module, nn.Embedding) and type(module) is nn.Embedding and module.scale_grad_by_freq:
        raise UserError(f"per-example gradients: embedding {name} uses scale_grad_by_freq, which mixes the "
                        "examples of a batch; disable it")
    if type(module) in (nn.Conv1d, nn.Conv2d) and (isinstance(module.padding, str) or module.groups != 1
                                                    or module.padding_mode != "zeros"):
        raise UserError(f"per-example gradients: {type(module).__name__} {name} with groups, string padding or "
                        f"padding_mode other than 'zeros' is not supported")


def _accounting_layers(model: nn.Module, params: dict[str, torch.Tensor]):
    """(name, module, {local name: parameter name}) of each module that accounts for some of
    ``params``: the modules that register them, except that a parameter registered by a module
    and by one of its descendants (RoBERTa's ``lm_head.bias`` is ``lm_head.decoder.bias``) is
    accounted for by the descendant only; the parent's call contains the child's, so both would
    count the child's use. A use in the parent outside the child is refused by the use check."""
    ids = {id(p): n for n, p in params.items()}
    regs = [(mname, module, {n: ids[id(p)] for n, p in module.named_parameters(recurse=False)
                             if p.requires_grad and id(p) in ids})
            for mname, module in model.named_modules()]
    owners: dict[str, list[str]] = {}
    for mname, _, local in regs:
        for name in local.values():
            owners.setdefault(name, []).append(mname)

    def below(mname: str, name: str) -> bool:
        prefix = mname + "." if mname else ""
        return any(o != mname and o.startswith(prefix) for o in owners[name])

    for mname, module, local in regs:
        local = {k: name for k, name in local.items() if not below(mname, name)}
        if local:
            yield mname, module, local


# ------------------------------------------------------------------------------------------
# capture and the lazy contribution
# ------------------------------------------------------------------------------------------

_MARK = torch.zeros((), requires_grad=True)


def _sequence_mark() -> int:
    """Autograd numbers the nodes of a thread in the order it creates them: a node made now has a
    number below every node created later. (A view of a scalar leaf: no storage is allocated.)"""
    return _MARK.view_as(_MARK).grad_fn._sequence_nr()


def _graph_consumers(root) -> dict:
    """Every autograd node the loss reaches -> the nodes that take its output."""
    consumers: dict = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in consumers:
                consumers[nxt] = []
                stack.append(nxt)
            consumers[nxt].append(node)
    return consumers


def _leaves(root) -> list[torch.Tensor]:
    """The leaf tensors (AccumulateGrad nodes' variables) an output's graph reaches."""
    seen, stack, out = set(), [root] if root is not None else [], []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            out.append(node.variable)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return out


def _call_nodes(start: int, tap) -> set:
    """The nodes created inside one call (between its start mark and its output's tap) that its
    output depends on: the part of the graph whose parameter uses the layer's handler accounts for."""
    end = tap._sequence_nr()
    inside, stack = set(), [n for n, _ in tap.next_functions if n is not None]
    while stack:
        node = stack.pop()
        if node in inside or not start < node._sequence_nr() < end:
            continue
        inside.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return inside


class _Tap(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the backprop and the layer's input to
    ``fn(g, inp)``.

    The anchor is a dummy leaf that every tap takes as an input: a backward pass to it reaches
    each tap (and no parameter), so no weight gradient is ever computed. The input is kept as a
    saved tensor of the tap, not by the sampler: inside a segment of (non-reentrant) activation
    checkpointing, autograd then frees it after the forward and recomputes it for the backward,
    as it does the segment's own saved tensors. (An in-place change to it after the call is
    refused by ``GradSampler.contribution``, autograd's version check standing behind.) A layer
    whose per-example gradients do not need the input (a frozen weight's) keeps None.
    """

    @staticmethod
    def forward(ctx, x, anchor, inp, fn):
        ctx.fn = fn
        ctx.save_for_backward(inp)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        inp, = ctx.saved_tensors
        ctx.fn(g, inp)
        return g, None, None, None


class _SegmentWatch(TorchDispatchMode):
    """Around a forward: whether any op ran with saved-tensor hooks in force, as it does inside a
    segment of non-reentrant activation checkpointing (whose hooks drop the saved tensors for a
    recomputation), hooked layers or not."""

    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.seen and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _refuse_below_float32(dtypes) -> None:
    """The two-pass mode's norms bound fp32's rounding of the second backward; one that rounds in
    bf16 or fp16 releases more than C (a review: 1.10·C)."""
    low = sorted({str(d).removeprefix("torch.") for d in dtypes if d.is_floating_point and d.itemsize < 4})
    if low:
        raise UserError(f"passes: 2 needs a float32 model: this one differentiates {low[0]} tensors (its parameters, "
                        "autocast, a cast, a lower-precision layer, or a hook or custom autograd Function that casts "
                        "the gradient), so the second backward rounds in a precision that the first backward's norms "
                        "do not bound; use passes: 1", key="estimator.passes")


class _Dtypes:
    """Records the dtypes of the tensors that the ops run under it make (as a torch mode)."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def _record(self, func, args, kwargs, grad_only: bool):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.dtypes |= {t.dtype for t in outs if isinstance(t, torch.Tensor) and (t.requires_grad or not grad_only)}
        return out


class _ForwardDtypes(_Dtypes, TorchFunctionMode):
    """Those of a forward's tensors that autograd will differentiate through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs, grad_only=True)


class _BackwardDtypes(_Dtypes, TorchDispatchMode):
    """Those a backward's ops make (a custom Function's backward or a hook that casts the gradient,
    which the forward does not show)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs, grad_only=False)


def _ignore(g, inp) -> None:
    """The tap of a recomputed call (see ``GradSampler._hook``): its backward never runs."""


_REPLAY_ANCHOR = torch.zeros((), requires_grad=True)


def _row_sketch(t: torch.Tensor, k: int = 4) -> torch.Tensor:
    """Each output row of ``t`` ([B, ..., H]) projected onto k fixed random directions: the layout
    check keeps B·rows·k numbers per layer, not a copy of every backprop. A row that belongs to
    another example than its position says differs from the probe by a multiple of itself, so
    the check's ratio is the same in every projection."""
    rows = t.reshape(t.shape[0], -1, t.shape[-1] if t.dim() > 1 else 1).to(acc_dtype(t.dtype))
    g = torch.Generator().manual_seed(rows.shape[-1])
    R = torch.randn(rows.shape[-1], k, generator=g, dtype=rows.dtype).to(rows.device)
    return rows @ R


def check_passes(passes: int, ctx) -> None:
    """Refuse the two-pass mode in a run that clips users as one: a user's norm is that of the sum
    of their rows' gradients, which needs each layer's pieces, and the first pass drops them."""
    if passes == 2 and ctx.clips_groups:
        raise UserError("passes: 2 cannot clip a user's examples as one (privacy.unit: user); use passes: 1",
                        key="estimator.passes")


#: the estimators' ``passes`` option: the two ways to the clipped sum
PASSES_HELP = ("hooks: 1 = book-keeping (one backward; each layer keeps its activation and backprop until the "
               "clipped sum); 2 = the norms in a first backward, the clipped sum from a second, weighted "
               "backward (about one backward more time; less memory where the kept backprops outweigh what "
               "autograd frees as it goes)")


class GradSampler:
    """Hooks a module's layers that own trainable parameters; ``capture()`` wraps one forward pass.

    ``params`` maps names (those of the objective's ``params()``) to parameter tensors.
    ``handler_for(module)`` picks each layer's handler (None: the vmap fallback), so a plugin can
    substitute its own for chosen layers.
    """

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor],
                 handler_for: Callable[[nn.Module], LayerHandler | None] = handler_for, passes: int = 1):
        check_forward_is_pure(model)
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, not {passes!r}")
        if passes == 2:  # (a lazy parameter has a dtype, not an element size)
            _refuse_below_float32(p.dtype for p in params.values())
        self.model = model
        self.params = params
        #: 1: book-keeping (one backward; each layer's compact state is kept until the sum);
        #: 2: norms in a first backward, the clipped sum from a second, weighted one (less memory)
        self.passes = passes
        self._pass: _Pass | None = None
        #: (module, handler, {local name: parameter name}) of each layer that accounts for parameters
        self.layers: list[tuple[nn.Module, LayerHandler, dict[str, str]]] = []
        self._names: dict[int, str] = {}
        covered: set[str] = set()
        for mname, module, local in _accounting_layers(model, params):
            _check_supported(mname or "<root>", module)
            self.layers.append((module, handler_for(module) or FUNCTIONAL, local))
            self._names[id(module)] = mname or "<root>"
            covered.update(local.values())
        missing = set(params) - covered
        if missing:
            raise UserError(f"per-example gradients: parameters {sorted(missing)[:3]} are not in a hooked layer")
        self._handler = {id(m): h for m, h, _ in self.layers}
        self._local = {id(m): local for m, _, local in self.layers}
        #: per-layer clipping's groups: each layer, with the layers that share a parameter with it merged
        self._group_of, self.n_clip_groups = _layer_groups(self.layers)
        self._uses: dict[int, list[Use]] = {}
        self._batch_size = 0  # of the capture in progress (or, while replaying, of the backward's)
        #: the forward hooks stay from a capture until no backward waits: a checkpointed segment's
        #: forward runs again inside the backward, and must put the same taps on its outputs
        self._handles = []
        self._pre_handles = []
        #: "capture" (a forward in ``capture()``), "replay" (a backward of ours, recomputing
        #: checkpointed segments) or None (the hooks do nothing)
        self._mode: str | None = None
        self._waiting = 0  # backwards made by ``contribution`` and not yet run
        self._ungraded: list[str] = []  # hooked layers called without autograd in this capture
        self._segments = False  # the forward ran ops inside a checkpointed segment (two passes only)
        self._anchor: torch.Tensor | None = None
        #: the layout check (see ``_check_layout``): backprops of the signed probe, then its result
        self._probes: dict[int, torch.Tensor] | None = None
        self._signs: torch.Tensor | None = None
        self._layout_checked = False
        #: the use check (see ``_check_uses``): once, on the first micro-batch; the open calls'
        #: first autograd sequence numbers while it records
        self._uses_checked = False
        self._starts: dict[int, list[int]] | None = None

    def _pre_hook(self, module, args, kwargs):
        self._starts.setdefault(id(module), []).append(_sequence_mark() if torch.is_grad_enabled() else None)

    def _hook(self, module, args, kwargs, output):
        if self._mode is None:
            return None
        replay = self._mode == "replay"
        start = self._starts[id(module)].pop() if self._starts is not None and not replay else None
        if not torch.is_grad_enabled():
            if not replay:
                self._ungraded.append(self._names[id(module)])
            return None
        if not isinstance(output, torch.Tensor):
            raise UserError(f"per-example gradients: layer {self._names[id(module)]} ({type(module).__name__}) "
                            f"returns {type(output).__name__}, not a tensor; freeze its parameters")
        if not output.requires_grad:
            return None
        h = self._handler[id(module)]
        functional = h is FUNCTIONAL
        keys = tuple(self._local[id(module)])
        x = args[0] if args else next(iter(kwargs.values()), None)
        x = x if isinstance(x, torch.Tensor) else None
        inp = x.detach() if x is not None and not functional and h.needs_input(keys) else None
        B = self._batch_size
        if output.shape[0] == 1 and B > 1:
            # A layer shared by the whole batch through broadcasting (BERT's position embeddings
            # see position_ids of shape [1, T]): expand its output so that each example gets its
            # own backprop. Autograd sums the expanded gradient back, so the model is unchanged.
            output = output.expand(B, *output.shape[1:])
            if functional:
                raise UserError(f"per-example gradients: layer {self._names[id(module)]} is shared by the batch "
                                "through broadcasting; this needs a dedicated handler")
            inp = inp.expand(B, *inp.shape[1:]) if inp is not None else None
        fold = output.shape[0] // B if output.shape[0] != B and output.shape[0] % B == 0 else 1
        if fold > 1:
            # A batch-major flattened input, [B·T, F] (OPT's feed-forward reshapes [B, T, F] so):
            # example i owns rows i·T .. (i+1)·T − 1.
            if functional or x is None or x.shape[0] != output.shape[0]:
                raise UserError(f"per-example gradients: layer {self._names[id(module)]} sees a leading dimension "
                                f"{output.shape[0]} that is not the batch size {B}")
            inp = inp.reshape(B, fold, *inp.shape[1:]) if inp is not None else None
        elif output.shape[0] != B:
            raise UserError(f"per-example gradients: layer {self._names[id(module)]} sees a leading dimension "
                            f"{output.shape[0]} that is not the batch size {B}")
        if replay:
            # A checkpointed segment's forward, run again to recompute its saved tensors: the same
            # tap saves the same input in the same order, which is how the checkpoint matches them.
            return _Tap.apply(output, _REPLAY_ANCHOR, inp, _ignore)
        use = Use(module, None, keys=keys)
        if functional:
            use.args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            use.kwargs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}

        def on_backprop(g, inp, use=use, h=h, fold=fold):
            g = g.reshape(B, fold, *g.shape[1:]) if fold > 1 else g
            if self._probes is not None and self._signs is None:  # the probe pass: keep the backprop only
                self._probes[id(use)] = _row_sketch(g.detach())
                return
            if self._probes is not None:
                self._check_layout(use, g)
            use.inp, use.g = inp, g
            mode, self._mode = self._mode, None  # a handler's own calls of the layer (vmap) are not replays
            try:
                self._serve(use, h)
            finally:
                self._mode = mode

        if self._anchor is None:
            self._anchor = torch.zeros((), device=output.device, requires_grad=True)
        tapped = _Tap.apply(output, self._anchor, inp, on_backprop)
        # Views share their base's version counter, and a view keeps its base alive: while anything
        # could still modify the output (or the kept input) in place, the weak reference resolves.
        out = tapped._base if tapped._base is not None else tapped
        use.watch = ((weakref.ref(out), out._version, "output"),)
        # the kept input, or every tensor argument the vmap fallback keeps (held by the sampler, not
        # saved by autograd, so no version check of autograd's stands behind)
        kept = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)] if functional else \
            [x] if inp is not None else []
        use.watch += tuple((weakref.ref(a), a._version, "input") for a in kept)
        if start is not None:
            use.call = (start, tapped.grad_fn)
        self._uses.setdefault(id(module), []).append(use)
        return tapped

    def _serve(self, use: Use, h: LayerHandler) -> None:
        """Hand a backprop to the layer's handler, as the backward pass in progress needs it:

        * book-keeping (one pass): the handler keeps its compact state for the norms and the sum;
        * first of two passes: the norms² now, then the state is dropped (the taps keep the inputs
          for the second pass, as autograd keeps them for its own), except the pieces of
          parameters reached by several calls, whose cross terms need them all, and those formed
          per example, which the second pass sums;
        * second of two passes: the backprop is of Σ_i w_i·loss_i, so the layer's plain sum (rows
          of weight 0 masked out, NaN-safe) is its clipped sum, except for the pieces the first
          formed per example, which are summed with the weights as measured; then everything is
          dropped."""
        p = self._pass
        if p is None or p.mode == "per_layer":
            h.on_backprop(use)
            use.plan = {k: _piece_kind(v) for k, v in use.state.items()}
            if p is not None:
                p.clip.arrive(use, h)
        elif p.mode == "norms":
            kept = use.args, use.kwargs
            use.echo = _row_sketch(use.g)
            h.on_backprop(use)
            use.plan = {k: _piece_kind(v) for k, v in use.state.items()}
            use.sq = h.sq_norms(use)
            local = self._local[id(use.module)]
            # a call of a parameter several calls reach keeps all its pieces, for the cross terms
            # and the float64 rows of examples whose pieces cancel across the calls (``_flag_joint``)
            keep = set(use.keys) if any(local[k] in p.shared for k in use.keys) else set()
            pieces = h.pieces(use)
            measured = _measured(h, pieces)  # kept and released as measured (see _SecondPass)
            use.exact = _exact_rows(pieces)
            use.state = {k: v for k, v in pieces.items() if k in keep or k in measured}
            (use.args, use.kwargs), use.inp, use.g = kept, None, None
        else:
            self._check_linear(use, p.weights)
            measured, use.state = _measured(h, use.state), {}
            use.sums = {}
            if set(use.keys) - set(measured):
                h.on_backprop(use)
                for k, (idx, rows) in use.exact.items():
                    if k in use.state:
                        _release_instead(use.state[k], idx, rows, p.weights[idx.to(p.weights.device)])
                use.sums = h.weighted(use, _without_joint(p.mask, use))
            if measured:
                use.state = measured
                use.sums.update(h.weighted(use, _without_joint(p.weights, use)))
            use.drop()

    def _check_linear(self, use: Use, weights: torch.Tensor) -> None:
        """The second pass's backprop of Σ_i w_i·loss_i must be w_i times the first's, row by row:
        the norms come from the first, the sums from the second. A backward that is not linear in
        the gradient it receives (a hook that clamps a gradient, a custom autograd Function) breaks
        that, and the sums would not be bounded by the norms (a review: 51-93 × C)."""
        if use.echo is None:
            return
        got = _row_sketch(use.g)
        want = weights.to(got.dtype).view(-1, 1, 1) * use.echo
        err = torch.linalg.vector_norm(got - want, dim=-1)
        size = torch.linalg.vector_norm(want, dim=-1)
        ok = torch.isfinite(err) & torch.isfinite(size)  # a NaN/inf example has weight 0 anyway
        err, size = torch.where(ok, err, 0.0), torch.where(ok, size, 0.0)
        if bool((err > 1e-3 * size + 1e-6 * size.max()).any()):
            raise UserError(f"the second backward's backprop of layer {self._names[id(use.module)]} "
                            f"({type(use.module).__name__}) is not the first's times the clip weights; the "
                            "backward is not linear in the gradient it receives (a hook that clamps or rescales "
                            "a gradient, a custom autograd Function), so the norms of the first pass would not "
                            "bound the sums of the second. Use passes: 1", key="estimator.passes")

    @contextmanager
    def capture(self, batch_size: int):
        """Around one forward pass of ``batch_size`` examples: its hooked calls become the uses of the
        next ``contribution``."""
        self._batch_size = batch_size
        self._uses, self._anchor, self._ungraded = {}, None, []
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m, _, _ in self.layers]
        if not self._uses_checked:  # mark where each call starts, for the use check
            self._starts = {}
            self._pre_handles = [m.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
                                 for m, _, _ in self.layers]
        self._mode = "capture"
        segments = _SegmentWatch() if self.passes == 2 else None
        failed = True
        try:
            with segments if segments is not None else nullcontext():
                yield self
            failed = False
        finally:
            if segments is not None:
                self._segments = segments.seen
            self._mode = None
            for h in self._pre_handles:
                h.remove()
            self._pre_handles, self._starts = [], None
            if failed:  # no contribution will be made of this forward
                self._drop_capture()

    def _drop_capture(self) -> None:
        """Forget the captured calls (a forward that raised, or one refused): the hooks go if no
        backward waits."""
        self._uses, self._ungraded, self._anchor = {}, [], None
        self._done_waiting(0)

    @contextmanager
    def _replaying(self, batch_size: int):
        """Around a backward of ours: a checkpointed segment's forward that runs again in it gets
        the taps it had (``_hook``), for the batch size of the capture that made it."""
        saved = self._mode, self._batch_size
        self._mode, self._batch_size = "replay", batch_size
        try:
            yield
        finally:
            self._mode, self._batch_size = saved

    def _done_waiting(self, backwards: int = 1) -> None:
        """A backward of ours has run (or will not): the hooks go once none waits and no capture runs."""
        self._waiting -= backwards
        if self._waiting <= 0 and self._mode is None:
            self._waiting = 0
            for h in self._handles:
                h.remove()
            self._handles = []

    def _probe_layout(self, losses, finite, anchor) -> None:
        """First half of the layout check, once per sampler: backprop Σ_i s_i·loss_i with
        alternating signs s_i = ±1 and keep each tapped output's backprop (no handler runs)."""
        signs = 1.0 - 2.0 * (torch.arange(losses.shape[0], device=losses.device) % 2).to(losses.dtype)
        probe = torch.where(finite, losses * signs, torch.zeros((), dtype=losses.dtype, device=losses.device)).sum()
        self._probes = {}
        with self._replaying(losses.shape[0]):
            torch.autograd.grad(probe, [anchor], retain_graph=True, allow_unused=True)
        self._signs = signs
        self._layout_checked = True

    def _check_layout(self, use: Use, g: torch.Tensor) -> None:
        """Second half: in the real backward, a row of example i must have backprop s_i·(its probe
        backprop). A row that mixes examples, or belongs to another example than the one the shape
        suggests (a batch concatenated with itself, a sequence-first layout), flips sign somewhere,
        which rounding never does; clipping such "examples" would not bound a record's influence."""
        p = self._probes.get(id(use))
        if p is None:
            return
        gr, pr = _row_sketch(g), p
        s = self._signs.to(gr.dtype).view(-1, 1, 1)
        err = torch.linalg.vector_norm(s * pr - gr, dim=-1)
        size = torch.linalg.vector_norm(gr, dim=-1)
        ok = torch.isfinite(err) & torch.isfinite(size)  # a NaN/inf example is dropped anyway
        size, err = torch.where(ok, size, 0.0), torch.where(ok, err, 0.0)
        significant = size > 1e-6 * size.max()
        if bool(((err > size) & significant).any()):
            raise UserError(f"per-example gradients: the output rows of layer {self._names[id(use.module)]} "
                            f"({type(use.module).__name__}) are not one example each; dimension 0 must be the batch "
                            "(or batch-major blocks of it), not a batch concatenated with itself or a sequence-first "
                            "layout; or the forward is not a deterministic function of the batch (a checkpointed "
                            "block recomputed with other random numbers: dropout with preserve_rng_state=False)")

    def _check_uses(self, uses: list[Use], root) -> None:
        """Once, on the first micro-batch: every use of a parameter that the loss reaches must be
        accounted for by exactly one hooked call. A layer's handler accounts for the uses inside
        its call that its output depends on; anything else would escape the per-example gradients
        silently (the clipped sum would miss part of a gradient or count it twice, and clipping
        would bound the wrong norm). The check reads the autograd graph, so it sees every
        differentiable use whatever its value at this step, and costs no backward pass.

        * A use outside every call that accounts for the parameter (``F.linear(h, self.lin.weight)``
          in a parent's forward) is refused, naming the parameter.
        * A use inside two such calls (one layer calling another that holds the same tensor) is
          refused: it would count twice.
        * A value computed inside a call that leaves it other than through its output (kept in an
          attribute, say) is refused: the gradient it carries back would pass the tap unseen.
        * A vmap-fallback layer whose forward reaches its parameter other than through its own
          attribute is refused (``FunctionalHandler.bypassed``): the vmap would not see that use."""
        consumers = _graph_consumers(root)
        names = {id(p): n for n, p in self.params.items()}
        counts: dict[tuple, int] = {}  # (node, parameter name) -> the calls that account for it
        for node in consumers:
            for nxt, _ in node.next_functions:
                name = names.get(id(getattr(nxt, "variable", None)))
                if name is not None:
                    counts[node, name] = 0
        for u in uses:
            if u.call is None:
                continue
            start, tap = u.call
            h = self._handler[id(u.module)]
            for k in h.bypassed(u) if isinstance(h, FunctionalHandler) else ():
                raise UserError(f"per-example gradients: parameter {self._local[id(u.module)][k]} is reached in the "
                                f"forward of layer {self._names[id(u.module)]} ({type(u.module).__name__}) other than "
                                "through its own attribute (a reference kept elsewhere); that use would escape its "
                                "per-example gradient")
            inside = _call_nodes(start, tap)
            for node in inside:
                if any(c not in inside and c is not tap for c in consumers.get(node, ())):
                    raise UserError(f"per-example gradients: layer {self._names[id(u.module)]} "
                                    f"({type(u.module).__name__}) passes on a value other than through its output "
                                    "(kept in an attribute or returned by a side channel); the gradient through it "
                                    "would escape the per-example gradients")
                for nxt, _ in node.next_functions:
                    name = names.get(id(getattr(nxt, "variable", None)))
                    if name in self._local[id(u.module)].values() and (node, name) in counts:
                        counts[node, name] += 1
        for (node, name), n in counts.items():
            holders = [self._names[id(m)] for m, _, local in self.layers if name in local.values()]
            if n == 0:
                raise UserError(f"per-example gradients: parameter {name} is used outside the layer that holds it "
                                f"({', '.join(holders) or 'none'}), e.g. F.linear(x, layer.weight) in a parent's "
                                "forward; its per-example gradient would miss that use. Call the layer itself, or "
                                "freeze the parameter")
            if n > 1:
                raise UserError(f"per-example gradients: parameter {name} is used inside calls of several layers "
                                f"that hold it ({', '.join(holders)}, one calling another); its gradient would "
                                "count twice")
        self._uses_checked = True

    def check_model(self, losses_of: Callable[[torch.Tensor], torch.Tensor], n_train: int,
                    micro_batch_size: int | None = None) -> None:
        """Run the first micro-batch's checks (uses, layout) on the first two training examples,
        so that an estimator refuses a model the hooks cannot serve at setup, before step 1 and
        before anything is written. The random state is restored (dropout masks of the run stay
        as they were), nothing is released and no parameter gradient is formed."""
        n = min(2, n_train)
        if n == 0:
            return
        device = next(iter(self.params.values())).device
        # two passes: a forward or backward in bf16 (autocast, a cast, a frozen bf16 layer, a hook or a
        # custom Function that casts the gradient), which the parameters' dtypes do not show
        forward, backward = (_ForwardDtypes(), _BackwardDtypes()) if self.passes == 2 else (nullcontext(), nullcontext())
        with _random_state_kept(device):
            with torch.enable_grad(), self.capture(n), forward:
                losses = losses_of(torch.arange(n))
            with backward:
                self.contribution(losses).backward()
        if self.passes == 2:
            _refuse_below_float32(forward.dtypes | backward.dtypes)
        # the layout check sees backprops only: a layer that mixes examples before the first
        # hooked layer (batch statistics, say) would pass it
        dtype = working_dtype(self.params.values())
        check_examples_independent(losses_of, n_train, device, dtype, micro_batch_size, "per-example gradients")

        def norms(sel):  # where the losses cannot show a mix (a zero head makes every loss log K), the
            # head's gradient, which holds the mixed features, does
            with torch.enable_grad(), self.capture(len(sel)):
                losses = losses_of(sel)
            return self.contribution(losses).norms()

        _compare_across_batches(norms, probe_indices(n_train, micro_batch_size), n_train, device,
                                _tolerance(dtype, 1e-3), "per-example gradients", "gradient norm")

    def contribution(self, losses: torch.Tensor, cls: type | None = None, **extra) -> "HookContribution":
        """The lazy contribution of Σ_i loss_i (non-finite losses are masked out). Its backward runs
        when it is first read (``HookContribution.backward``): the per-layer clipped sum
        (``clipped_sum_per_layer``) runs it with the clip in hand, to sum each layer as it goes.

        ``cls`` (a HookContribution subclass) and ``extra`` fields let a plugin emit its own space.
        """
        uses = [u for m, _, _ in self.layers for u in self._uses.get(id(m), [])]
        try:
            self._refuse_unseen(uses, losses)
        except UserError:
            self._drop_capture()
            raise
        if losses.numel() and not losses.requires_grad:
            self._drop_capture()
            raise UserError("the per-example losses do not depend on any trainable parameter (a loss of detached "
                            "outputs, or an integer one): every gradient would be 0 and the run would release noise "
                            "alone", key="loss")
        finite = torch.isfinite(losses)
        zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
        total = torch.where(finite, losses, zero).sum()
        anchor, self._anchor = self._anchor, None
        pending = None
        if uses and total.requires_grad:
            if not self._uses_checked:
                self._check_uses(uses, total.grad_fn)
            for u in uses:
                u.call = None  # the check's references into the graph
            if not self._layout_checked and losses.shape[0] > 1:
                self._probe_layout(losses, finite, anchor)
            pending = _Backward(self, uses, losses, finite, total, anchor, (self._probes, self._signs))
            self._probes = self._signs = None
            self._waiting += 1
        self._uses = {}
        self._done_waiting(0)
        return (cls or HookContribution)(_records=self._records([]), pending=pending, n=losses.shape[0],
                                         losses=losses.detach(), finite=finite, params=self.params, **extra)

    def _refuse_unseen(self, uses: list[Use], losses: torch.Tensor) -> None:
        """Refuse a forward whose gradient would pass the hooks unseen or wrong:

        * a hooked layer that ran without autograd where a custom autograd Function reaches the
          loss: reentrant activation checkpointing (``use_reentrant=True``) runs its segment so and
          backprops it itself in the backward, so those layers would escape the per-example
          gradients (a layer run under ``torch.no_grad`` alone passes no gradient, and is fine);
        * a layer's output, or its kept input, changed in place after the layer's call;
        * two passes over a forward that ran checkpointed segments: the second backward would
          recompute them again, and norms taken from one recomputation need not bound sums taken
          from another (a segment recomputed with other random numbers: dropout with
          ``preserve_rng_state=False``, a generator of the model's own). One pass, or per-layer
          clipping, takes both from the same state."""
        if self._segments:
            self._segments = False
            raise UserError("passes: 2 cannot be used with activation checkpointing (or other saved-tensor hooks): "
                            "the second backward recomputes the checkpointed segments, and norms from one "
                            "recomputation need not bound the sums of another; use passes: 1, or "
                            "privatizer.clipping: per_layer (which frees each layer as it goes)", key="estimator.passes")
        ungraded, self._ungraded = sorted(set(self._ungraded)), []
        if ungraded and losses.grad_fn is not None and any(
                getattr(node, "_forward_cls", _Tap) is not _Tap for node in _graph_consumers(losses.grad_fn)):
            more = f" (and {len(ungraded) - 1} more)" if len(ungraded) > 1 else ""
            raise UserError(f"per-example gradients: layer {ungraded[0]}{more} ran without autograd inside a custom "
                            "autograd function that reaches the loss, as reentrant activation checkpointing "
                            "(torch.utils.checkpoint with use_reentrant=True) runs its segment; the hooks cannot see "
                            "that segment's backward, and its trainable parameters would escape the per-example "
                            "gradients. Use use_reentrant=False (Hugging Face's gradient_checkpointing_enable() and "
                            "dpregistry.checkpoint_blocks do), or freeze those parameters")
        for u in uses:
            for ref, version, what in u.watch:
                t = ref()
                if t is not None and t._version != version:
                    raise UserError(f"per-example gradients: the {what} of {type(u.module).__name__} is modified in "
                                    "place later in the forward pass (e.g. ReLU(inplace=True)); disable in-place ops")
            u.watch = ()

    def _records(self, uses: list[Use]) -> list:
        """(handler, local names, calls) of each layer, in registration order."""
        by_module: dict[int, list[Use]] = {}
        for u in uses:
            # a call whose tap saw no backprop does not reach the loss: its gradient is zero
            if u.g is not None or u.state or u.sq is not None:
                by_module.setdefault(id(u.module), []).append(u)
        return [(h, local, by_module.get(id(m), [])) for m, h, local in self.layers]


@dataclass(frozen=True)
class LayerGradients:
    """What the hook estimators offer a privatizer (``provides``): contributions that hold
    per-example gradients by layer and can be clipped per layer inside their backward
    (``HookContribution.clipped_sum_per_layer``). ``groups``: the layer groups, G."""

    groups: int


def layer_gradients(sampler: "GradSampler | None") -> LayerGradients:
    """A hook estimator's ``provide(LayerGradients)``: refused, naming the estimator setting, where
    its contributions cannot be clipped per layer."""
    if sampler is None:
        raise UserError("clipping: per_layer needs per-example gradients from the hooks (backend: hooks, an "
                        "objective with a torch module)", key="estimator.backend")
    if sampler.passes == 2:
        raise UserError("clipping: per_layer clips each layer inside one backward; passes: 2 does not apply",
                        key="estimator.passes")
    return LayerGradients(sampler.n_clip_groups)


class _Backward:
    """A hook contribution's backward of Σ_i loss_i, waiting for its first reader. Runs once."""

    def __init__(self, sampler: "GradSampler", uses, losses, finite, total, anchor, probes):
        self.sampler, self.uses, self.losses, self.finite = sampler, uses, losses, finite
        self.total, self.anchor, self.probes = total, anchor, probes
        #: the sampler's hooks wait for this backward: released once, when it has run, failed, or
        #: is dropped unrun (a contribution never read), so they never stay on the model
        self.release = weakref.finalize(self, sampler._done_waiting)

    def __call__(self, clip: "_LayerClip | None" = None):
        """(records, the second pass or None). With ``clip``, each layer's clipped sum is formed as
        its backprops arrive and its state dropped; the sampler's ``passes`` does not apply."""
        s, total, self.total = self.sampler, self.total, None
        two = s.passes == 2 and clip is None
        if clip is not None:
            s._pass = _Pass("per_layer", clip=clip)
        elif two:
            s._pass = _Pass("norms", shared=_shared_names(self.uses, s._local))
        s._probes, s._signs = self.probes
        ran = False
        try:
            with s._replaying(self.losses.shape[0]):
                torch.autograd.grad(total, [self.anchor], allow_unused=True, retain_graph=two)
            ran = True
        finally:
            s._probes = s._signs = s._pass = None
            if two and ran:  # the second pass waits now
                self.release.detach()
            else:
                self.release()
        if clip is not None:
            clip.finish()
        second = _SecondPass(s, self.losses, self.finite, self.anchor) if two else None
        return s._records(self.uses), second


def _layer_groups(layers) -> tuple[dict[int, int], int]:
    """Each layer's group for per-layer clipping (by ``id`` of its module) and the number of groups:
    one per layer, except that layers reaching a common parameter (a tied table) form one group, so
    that the groups split the coordinates and the per-group bounds add up in squares."""
    parent = list(range(len(layers)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    holder: dict[str, int] = {}
    for i, (_, _, local) in enumerate(layers):
        for name in local.values():
            j = holder.setdefault(name, i)
            parent[root(i)] = root(j)
    roots: dict[int, int] = {}
    group = {id(m): roots.setdefault(root(i), len(roots)) for i, (m, _, _) in enumerate(layers)}
    return group, len(roots)


def _pieces_by_parameter(calls) -> dict[str, list[Piece]]:
    """The pieces of each parameter over ``calls`` ((handler, local names, use) triples), in order."""
    out: dict[str, list[Piece]] = {}
    for h, local, use in calls:
        for k, v in h.pieces(use).items():
            out.setdefault(local[k], []).append(v)
    return out


def _accumulate(sums: dict[str, torch.Tensor], name: str, v: torch.Tensor) -> None:
    sums[name] = sums[name] + v if name in sums else v


def _calls_of(records) -> Counter:
    """How many calls reach each parameter, over ``records`` ((handler, local names, calls))."""
    return Counter(name for _, local, uses in records for name in set(local.values()) for _ in uses)


class _CallSums(dict):
    """Each parameter's sum over the calls that reach it. Past two calls the calls' sums are added in
    float64 and rounded once (``rounded``): added one by one in fp32, a running ±w·X (an example
    whose pieces cancel across the calls, under the float64 recompute) rounded every later call's
    sum of the other examples away (a review: 1.03·C with a cell called 10,000 times). Two calls'
    sum is one rounding either way."""

    def __init__(self, calls: Counter):
        super().__init__()
        self.calls, self.dtypes = calls, {}

    def add(self, name: str, v: torch.Tensor) -> None:
        if self.calls[name] > 2:
            self.dtypes.setdefault(name, v.dtype)
            v = v.double()
        _accumulate(self, name, v)

    def add_shares(self, shares: dict[str, torch.Tensor]) -> None:
        """Add the float64 ``shares`` of joint examples (``_joint_shares``, summed over the calls)."""
        for name, v in shares.items():
            self[name] = self[name] + v.to(self[name].dtype)

    def rounded(self) -> dict[str, torch.Tensor]:
        return {name: v.to(self.dtypes.get(name, v.dtype)) for name, v in self.items()}


class _LayerClip:
    """Per-layer clipping inside the backward (McMahan et al. 2018, §3; He et al. 2022, "group-wise
    clipping"): each group's per-example gradient is clipped to C_g = C/√G when its last call's
    backprop arrives, summed, and its state dropped. The groups split the coordinates, so example
    i's whole clipped gradient has norm² Σ_g min(‖G_i^g‖, C_g)² ≤ G·C²/G = C²: the sensitivity of
    flat clipping at C. An example whose loss is not finite is dropped; one whose norm in a group is
    not finite loses that group (weight 0, NaN-safe) and keeps the others, each still bounded."""

    def __init__(self, sampler: "GradSampler", uses: list[Use], clip: float, finite: torch.Tensor):
        self.sampler, self.finite = sampler, finite
        self.clip = clip / sampler.n_clip_groups ** 0.5
        self.expected = Counter(sampler._group_of[id(u.module)] for u in uses)
        self.arrived: dict[int, list] = {}
        self.sums = _CallSums(Counter(sampler._local[id(u.module)][k] for u in uses for k in u.keys))
        self.clipped = torch.zeros_like(finite)
        self.dropped = ~finite

    def arrive(self, use: Use, h: LayerHandler) -> None:
        g = self.sampler._group_of[id(use.module)]
        calls = self.arrived.setdefault(g, [])
        calls.append((use, h))
        if len(calls) == self.expected[g]:
            self._close(g)

    def finish(self) -> None:
        """Close the groups some of whose calls saw no backprop (they do not reach the loss)."""
        for g in list(self.arrived):
            self._close(g)

    def _close(self, g: int) -> None:
        from .clipping import clip_weights

        local = self.sampler._local
        calls = [(h, local[id(use.module)], use) for use, h in self.arrived.pop(g)]
        pieces = _pieces_by_parameter(calls)
        shared = {name: ps for name, ps in pieces.items() if len(ps) > 1}
        joint_sq = dict(zip(shared, _flag_joint(shared, calls))) if shared else {}
        sq = sum(joint_sq[name] if name in joint_sq else _sq_bound(ps) for name, ps in pieces.items())
        norms = sq.sqrt()
        finite = self.finite.to(norms.device)
        ok = finite & torch.isfinite(norms)
        w = clip_weights(norms, self.clip, ok)
        self.clipped |= (ok & (norms > self.clip)).to(self.clipped.device)
        self.dropped |= (~ok).to(self.dropped.device)
        del pieces, shared
        shares: dict[str, torch.Tensor] = {}
        for h, names, use in calls:
            for k, v in h.weighted(use, _without_joint(w, use)).items():
                self.sums.add(names[k], v)
            for k, v in _joint_shares(h, use, w).items():
                _accumulate(shares, names[k], v)
            use.joint = None
            use.drop()
        self.sums.add_shares(shares)


@dataclass
class _Pass:
    """Which backward pass is running (``GradSampler._serve``): "norms" (the first of two; the
    names of parameters that several calls reach keep their pieces), "sums" (the second;
    ``mask`` is 1 for the examples that count, 0 for those of weight 0) or "per_layer" (the one
    backward of per-layer clipping, ``clip`` sums each group as it completes)."""

    mode: str
    shared: frozenset = frozenset()
    mask: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    clip: "_LayerClip | None" = None


def _shared_names(uses: list[Use], local: dict[int, dict[str, str]]) -> frozenset:
    """Parameters that more than one call accounts for (their norms need cross terms)."""
    count: dict[str, int] = {}
    for u in uses:
        for k in u.keys:
            name = local[id(u.module)][k]
            count[name] = count.get(name, 0) + 1
    return frozenset(n for n, c in count.items() if c > 1)


class _SecondPass:
    """The second backward of the two-pass mode: backprop Σ_i w_i·loss_i through the graph the
    first pass kept, so that every layer's plain (masked) sum is its clipped sum; the pieces the
    first backward formed per example are summed with the weights instead (``_serve``). Runs once;
    then the graph is freed."""

    def __init__(self, sampler: "GradSampler", losses: torch.Tensor, finite: torch.Tensor, anchor: torch.Tensor):
        self.sampler, self.losses, self.finite, self.anchor = sampler, losses, finite, anchor
        self.release = weakref.finalize(self, sampler._done_waiting)  # as ``_Backward.release``

    def __call__(self, weights: torch.Tensor) -> None:
        losses, anchor, self.losses, self.anchor = self.losses, self.anchor, None, None
        if losses is None:
            raise RuntimeError("the second pass of a two-pass contribution runs once")
        keep = (weights > 0) & self.finite.to(weights.device)
        zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
        w = torch.where(keep, weights, torch.zeros_like(weights)).to(device=losses.device, dtype=losses.dtype)
        total = (torch.where(keep.to(losses.device), losses, zero) * w).sum()
        s = self.sampler
        s._pass = _Pass("sums", mask=keep.to(weights.dtype), weights=w)
        try:
            with s._replaying(losses.shape[0]):
                torch.autograd.grad(total, [anchor], allow_unused=True)
        finally:
            s._pass = None
            self.release()


#: ``HookContribution.pending`` of a contribution whose backward raised
_FAILED = object()


@dataclass
class HookContribution(DenseContribution):
    """Dense per-example gradients, held as compact per-layer state (see the module docstring).

    Subclasses that emit another space override ``_zero`` (the sum of a parameter no example
    reached) and ``_aggregate``.
    """

    _records: list = field(default_factory=list)
    #: the backward not yet run (see ``backward``)
    pending: "_Backward | None" = None
    n: int = 0
    finite: torch.Tensor | None = None
    params: dict = field(default_factory=dict)  # for zero sums of layers this batch did not reach
    #: the two-pass mode's second backward (None: book-keeping, the sums come from the kept state)
    second: Callable[[torch.Tensor], None] | None = None
    _sq: torch.Tensor | None = None
    _spent: bool = False

    @property
    def batch_size(self) -> int:
        return self.n

    def backward(self) -> None:
        """Run the pending backward (once): the layers' handlers keep their state for the norms and
        the sum (or take the norms², in the first of two passes)."""
        if self.pending is not None:
            self._run_backward()

    def _run_backward(self, clip: "_LayerClip | None" = None) -> None:
        """The pending backward, with per-layer clipping when ``clip`` is given. A backward that
        fails leaves the contribution unreadable, not empty."""
        if self.pending is _FAILED:
            raise RuntimeError("the backward of this contribution failed; it cannot be read")
        pending, self.pending = self.pending, _FAILED
        self._records, self.second = pending(clip)
        self.pending = None

    @property
    def records(self) -> list:
        """(handler, local names, calls) of each layer, after the backward."""
        self.backward()
        return self._records

    def clipped_sum_per_layer(self, clip: float) -> tuple[Aggregate, torch.Tensor, torch.Tensor]:
        """Per-layer clipping (``_LayerClip``): Σ_i Σ_g min(1, C_g/‖G_i^g‖)·G_i^g with C_g = C/√G over
        the sampler's G groups, each group summed and dropped as soon as its backprops are in, so no
        layer's state waits for the others (the memory of a non-private backward). Taken once,
        instead of the norms and the weighted sum. Returns the sum, which examples some group
        clipped, and which were dropped whole or in part (a loss or a group norm not finite)."""
        if self.pending is _FAILED:
            self._run_backward()  # raises: the backward failed
        if self.pending is None and (self._spent or any(uses for _, _, uses in self._records)):
            raise RuntimeError("per-layer clipping runs the contribution's backward: it is taken once, before any "
                               "norm or sum")
        self._spent = True
        finite = self.finite if self.finite is not None else torch.ones(self.n, dtype=torch.bool)
        if self.pending is None:
            clipped, dropped, sums = torch.zeros_like(finite), ~finite, {}
        else:
            layer_clip = _LayerClip(self.pending.sampler, self.pending.uses, clip, finite)
            self._run_backward(layer_clip)
            clipped, dropped, sums = layer_clip.clipped, layer_clip.dropped, layer_clip.sums.rounded()
        return self._full(sums), clipped, dropped

    def _zero(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(p.shape, dtype=acc_dtype(p.dtype), device=p.device)

    def _full(self, sums: dict[str, torch.Tensor]) -> Aggregate:
        """The aggregate of ``sums``, with zeros for the parameters no example reached."""
        return self._aggregate({name: sums[name] if name in sums else self._zero(name, p)
                                for name, p in self.params.items()})

    def _aggregate(self, tensors: dict[str, torch.Tensor]) -> Aggregate:
        return DenseAggregate(tensors)

    def _pieces_of_shared(self) -> dict[str, list[Piece]]:
        """The pieces of each parameter reached by several calls (a layer called twice, a tied weight)."""
        count = _calls_of(self.records)
        out: dict[str, list[Piece]] = {}
        for h, local, uses in self.records:
            if any(count[name] > 1 for name in local.values()):
                for u in uses:
                    for k, v in h.pieces(u).items():
                        if count[local[k]] > 1:
                            out.setdefault(local[k], []).append(v)
        return out

    def grouped(self, groups, n_groups):
        return None  # the pieces kept as factors or rows are not formed: group_norms sees to each piece

    def group_norms(self, groups, n_groups):
        """‖Σ_{i in g} G_i‖ per group, from the regrouped pieces: no per-example gradient of a layer
        kept as factors or rows is formed."""
        self.backward()
        if self.second is not None or self._spent:
            raise RuntimeError("the norms of groups need the per-example pieces, which a two-pass contribution or a "
                               "weighted sum has dropped")
        by_parameter: dict[str, list[tuple[Use, str, Piece]]] = {}
        for h, local, uses in self.records:
            for u in uses:
                for k, v in h.pieces(u).items():
                    by_parameter.setdefault(local[k], []).append((u, k, v))
        sq, cancelling = None, []
        # one parameter's regrouped copy at a time (memory of one layer, not all), but for the group
        # sums of formed rows, which are small and are what the weighted sum releases
        for calls in by_parameter.values():
            grouped = [regroup(v, groups, n_groups) for _, _, v in calls]
            term, flagged, each = _sq_bound_flagged(grouped)
            if len(calls) > 1:  # a group whose pieces cancel across the calls by APART: apart too
                # (``_flag_joint``; a review: 1.36·C)
                apart = _apart(term, each).cpu()
                flagged = apart if flagged is None else torch.unique(torch.cat([flagged.cpu(), apart]))
                if len(flagged):
                    cancelling.append(flagged)
            members = torch.isin(groups.cpu(), flagged).nonzero().squeeze(1) if flagged is not None else []
            for (u, k, v), gx in zip(calls, grouped):
                if _kind(v) == 2:  # the members' rows formed (small): the group sums as measured
                    u.state[k] = _GroupSums(_dense(gx), groups)
                elif len(members):  # a group whose rows cancel: members in float64
                    release_exactly(v, members)
            sq = term if sq is None else sq + term
            del grouped
        if cancelling:  # a group whose pieces of a shared parameter cancel across calls (``_flag_joint``)
            self._release_groups_jointly(torch.unique(torch.cat(cancelling)), groups,
                                         {name for name, calls in by_parameter.items() if len(calls) > 1})
        if sq is None:
            return torch.zeros(n_groups)
        if self.finite is not None:  # a group with a non-finite row has no finite norm
            bad = torch.zeros(n_groups, device=sq.device).index_add_(
                0, groups.to(sq.device), (~self.finite.to(sq.device)).to(torch.float32))
            sq = torch.where(bad > 0, torch.full_like(sq, float("nan")), sq)
        return sq.sqrt()

    def _release_groups_jointly(self, flagged: torch.Tensor, groups: torch.Tensor, shared: set) -> None:
        """Set ``use.joint`` on the calls of the ``shared`` parameters: the members of the ``flagged``
        groups, with their rows in float64 (their group sums as measured, for formed pieces)."""
        members = torch.isin(groups.cpu(), flagged).nonzero().squeeze(1)

        def rows64(x: Piece) -> Piece:
            if not isinstance(x, _GroupSums):
                return _piece_rows64(x, members.to(_piece_tensor(x).device))
            dev = x.sums.device
            slot = torch.searchsorted(flagged, groups.cpu()[members])
            return _GroupSums(x.sums[flagged.to(dev)].double(), slot.to(dev))

        for h, local, uses in self.records:
            for u in uses:
                if any(local[k] in shared for k in u.keys):
                    u.joint = (members, {k: rows64(v) for k, v in h.pieces(u).items()})

    def norms(self):
        if self._sq is None:
            self.backward()
            if self._spent:
                raise RuntimeError("a contribution's norms are taken before its weighted sum (the sum drops the "
                                   "per-example state)")
            shared = self._pieces_of_shared()
            # (the two-pass mode took each call's norms² in its first backward; same terms, same order)
            terms = [v for h, local, uses in self.records for u in uses
                     for k, v in (u.sq if u.sq is not None else h.sq_norms(u)).items() if local[k] not in shared]
            if shared:
                terms += _flag_joint(shared, [(h, local, u) for h, local, uses in self.records for u in uses])
            sq = sum(terms[1:], terms[0]) if terms else \
                torch.zeros(self.n, device=self.finite.device if self.finite is not None else None)
            if self.finite is not None:
                sq = torch.where(self.finite, sq, torch.full_like(sq, float("nan")))
            self._sq = sq
            if self.second is not None:  # the pieces kept for cross terms are not needed any more
                for h, _, uses in self.records:
                    for u in uses:
                        u.exact.update(_exact_rows(u.state))  # those of shared parameters' norms
                        u.sq, u.state = None, _measured(h, u.state)
        return self._sq.sqrt()

    def weighted_sum(self, weights):
        """Σ_i w_i·G_i, taken once. Each call's state is dropped as soon as its sum is formed, the
        last registered layer's first: the first layers' sums (embedding tables, the largest) are
        formed when the others' activations and backprops are gone, so the peak holds one of the
        two, not both. A parameter's sums are added in the old order (layers, then calls, as
        registered): at once within a layer, and those of a parameter that several layers reach
        (a tied table) at the end. In the two-pass mode this runs the second backward, which frees
        the graph."""
        self.backward()
        if self._spent:
            raise RuntimeError("a contribution's weighted sum is taken once (its per-example state is dropped as "
                               "the sum is formed)")
        self._spent = True
        if self.second is not None:
            second, self.second = self.second, None
            second(weights)
        layers_of: dict[str, int] = {}
        for _, local, _ in self.records:
            for name in set(local.values()):
                layers_of[name] = layers_of.get(name, 0) + 1
        out = _CallSums(_calls_of(self.records))
        shared: list[tuple[str, torch.Tensor]] = []  # terms of parameters several layers reach, last layer first
        shares: dict[str, torch.Tensor] = {}
        for h, local, uses in reversed(self.records):
            terms = []
            for u in uses:
                sums, u.sums = u.sums if u.sums is not None else h.weighted(u, _without_joint(weights, u)), None
                for k, v in _joint_shares(h, u, weights).items():
                    _accumulate(shares, local[k], v)
                u.joint = None
                u.drop()
                for k, v in sums.items():
                    if layers_of[local[k]] > 1:
                        terms.append((local[k], v))
                    else:
                        out.add(local[k], v)
            shared += terms[::-1]
        for name, v in reversed(shared):
            out.add(name, v)
        out.add_shares(shares)
        return self._full(out.rounded())
