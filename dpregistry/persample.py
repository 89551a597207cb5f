"""Per-example gradients from activations and backprops, without materialising them.

Forward hooks keep each supported layer's input and output. One call of ``torch.autograd.grad``
with the outputs as ``inputs`` then yields the backprops g = ∂(Σ_i loss_i)/∂output, without
computing a single weight gradient. Because examples never interact, example i's gradient of a
linear layer is g_iᵀ a_i. From (a, g) we get

* each example's gradient norm: ‖g_iᵀa_i‖² = Σ_{t,s} ⟨a_t, a_s⟩⟨g_t, g_s⟩ ("ghost norm", B·T²
  memory), or ‖g_i‖²‖a_i‖² when the layer sees one token per example, or the materialised
  per-example gradient when that is smaller (out·in < T²);
* the clipped sum Σ_i w_i g_iᵀ a_i = (w ⊙ g)ᵀ a in one product ("book-keeping").

So a DP step costs one forward and one backward, and the largest per-example object is B·T² (or
B·out·in for a small layer), never B·d. Layers: Linear, Embedding, LayerNorm and Conv1d/2d; a
parameter that sits in an unsupported layer is an error naming the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UserError
from .spaces import DenseAggregate, DenseContribution, acc_dtype, _mask_rows

# ------------------------------------------------------------------------------------------
# layer handlers: (module, activation, backprop) -> norms² [B] and weighted sums
# ------------------------------------------------------------------------------------------


def _keep_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x with the rows of weight 0 set to exactly 0 (a NaN activation must not reach the sum)."""
    keep = (w > 0).view((-1,) + (1,) * (x.dim() - 1))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _flat3(x: torch.Tensor) -> torch.Tensor:
    """[B, ..., F] -> [B, T, F]."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _linear_weight_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    B, T, fin = a.shape
    fout = g.shape[-1]
    if T == 1:
        return a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))
    if T * T <= fin * fout:
        aa = torch.bmm(a, a.transpose(1, 2))
        gg = torch.bmm(g, g.transpose(1, 2))
        return (aa * gg).sum((1, 2))
    return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))


@dataclass
class Use:
    """One call of a hooked module: its input activation and its output (then the backprop)."""

    module: nn.Module
    inp: torch.Tensor
    out: torch.Tensor
    version: int
    g: torch.Tensor | None = None


class LayerHandler:
    """Per-example norms² and weighted sums for the parameters of one module type."""

    types: tuple = ()

    def params(self, module) -> dict[str, nn.Parameter]:
        return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}

    def sq_norms(self, use: Use) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def weighted(self, use: Use, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def per_example(self, use: Use) -> dict[str, torch.Tensor]:
        """Materialised per-example gradients (used when a parameter is shared between layers)."""
        raise NotImplementedError


class LinearHandler(LayerHandler):
    types = (nn.Linear,)

    def _ag(self, use):
        dt = acc_dtype(use.inp.dtype)
        return _flat3(use.inp).to(dt), _flat3(use.g).to(dt)

    def sq_norms(self, use):
        a, g = self._ag(use)
        out = {}
        if use.module.weight.requires_grad:
            out["weight"] = _linear_weight_sq(a, g)
        if use.module.bias is not None and use.module.bias.requires_grad:
            out["bias"] = g.sum(1).pow(2).sum(1)
        return out

    def weighted(self, use, w):
        a, g = self._ag(use)
        gw, a = _mask_rows(g, w), _keep_rows(a, w)
        out = {}
        if use.module.weight.requires_grad:
            out["weight"] = torch.einsum("bto,bti->oi", gw, a)
        if use.module.bias is not None and use.module.bias.requires_grad:
            out["bias"] = gw.sum((0, 1))
        return out

    def per_example(self, use):
        a, g = self._ag(use)
        out = {}
        if use.module.weight.requires_grad:
            out["weight"] = torch.einsum("bto,bti->boi", g, a)
        if use.module.bias is not None and use.module.bias.requires_grad:
            out["bias"] = g.sum(1)
        return out


class EmbeddingHandler(LayerHandler):
    types = (nn.Embedding,)

    def _ids_g(self, use):
        ids = use.inp.reshape(use.inp.shape[0], -1)
        g = _flat3(use.g).to(acc_dtype(use.g.dtype))
        pad = use.module.padding_idx
        if pad is not None:  # torch gives the padding row no gradient
            g = g * (ids != pad).unsqueeze(-1).to(g.dtype)
        return ids, g

    def sq_norms(self, use):
        ids, g = self._ids_g(use)
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g.dtype)  # [B, T, T]
        return {"weight": (same * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))}

    def weighted(self, use, w):
        ids, g = self._ids_g(use)
        gw = _mask_rows(g, w)
        W = use.module.weight
        out = torch.zeros(W.shape, dtype=gw.dtype, device=gw.device)
        out.index_add_(0, ids.reshape(-1), gw.reshape(-1, gw.shape[-1]))
        return {"weight": out}

    def per_example(self, use):
        ids, g = self._ids_g(use)
        B = ids.shape[0]
        W = use.module.weight
        out = torch.zeros((B,) + tuple(W.shape), dtype=g.dtype, device=g.device)
        out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, g.shape[-1]), g)
        return {"weight": out}


class LayerNormHandler(LayerHandler):
    types = (nn.LayerNorm,)

    def per_example(self, use):
        m = use.module
        dt = acc_dtype(use.inp.dtype)
        x = use.inp.to(dt)
        xhat = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
        g = use.g.to(dt)
        dims = tuple(range(1, x.dim() - len(m.normalized_shape)))
        out = {}
        if m.weight is not None and m.weight.requires_grad:
            out["weight"] = (g * xhat).sum(dims) if dims else g * xhat
        if m.bias is not None and m.bias.requires_grad:
            out["bias"] = g.sum(dims) if dims else g
        return out

    def sq_norms(self, use):
        return {k: v.flatten(1).pow(2).sum(1) for k, v in self.per_example(use).items()}

    def weighted(self, use, w):
        return {k: _mask_rows(v, w).sum(0) for k, v in self.per_example(use).items()}


class ConvHandler(LayerHandler):
    """Conv1d/Conv2d through unfold: the layer is a linear map on patches."""

    types = (nn.Conv1d, nn.Conv2d)

    def _ag(self, use):
        m = use.module
        dt = acc_dtype(use.inp.dtype)
        x = use.inp.to(dt)
        if isinstance(m, nn.Conv1d):
            x = x.unsqueeze(-1)
            ks, st, pd, dl = (m.kernel_size[0], 1), (m.stride[0], 1), (m.padding[0], 0), (m.dilation[0], 1)
        else:
            ks, st, pd, dl = m.kernel_size, m.stride, m.padding, m.dilation
        if isinstance(pd, str) or m.groups != 1:
            raise UserError(f"per-example gradients: {type(m).__name__} with groups or string padding is not supported")
        cols = F.unfold(x, ks, dilation=dl, padding=pd, stride=st)  # [B, C·k, L]
        a = cols.transpose(1, 2)                                     # [B, L, C·k]
        g = use.g.to(dt).flatten(2).transpose(1, 2)                  # [B, L, out]
        return a, g

    def _shape(self, use, W2d):
        return W2d.reshape(use.module.weight.shape)

    def sq_norms(self, use):
        a, g = self._ag(use)
        out = {}
        if use.module.weight.requires_grad:
            out["weight"] = _linear_weight_sq(a, g)
        if use.module.bias is not None and use.module.bias.requires_grad:
            out["bias"] = g.sum(1).pow(2).sum(1)
        return out

    def weighted(self, use, w):
        a, g = self._ag(use)
        gw, a = _mask_rows(g, w), _keep_rows(a, w)
        out = {}
        if use.module.weight.requires_grad:
            out["weight"] = self._shape(use, torch.einsum("bto,bti->oi", gw, a))
        if use.module.bias is not None and use.module.bias.requires_grad:
            out["bias"] = gw.sum((0, 1))
        return out

    def per_example(self, use):
        a, g = self._ag(use)
        out = {}
        if use.module.weight.requires_grad:
            out["weight"] = torch.einsum("bto,bti->boi", g, a).reshape((a.shape[0],) + tuple(use.module.weight.shape))
        if use.module.bias is not None and use.module.bias.requires_grad:
            out["bias"] = g.sum(1)
        return out


HANDLERS: list[LayerHandler] = [LinearHandler(), EmbeddingHandler(), LayerNormHandler(), ConvHandler()]


def handler_for(module: nn.Module) -> LayerHandler | None:
    for h in HANDLERS:
        if type(module) in h.types:
            return h
    return None


# ------------------------------------------------------------------------------------------
# capture and the lazy contribution
# ------------------------------------------------------------------------------------------


class GradSampler:
    """Hooks a module's supported layers; ``capture()`` wraps one forward pass.

    ``names`` maps parameter objects to their names in the objective's ``params()``.
    """

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor],
                 handler_for: Callable[[nn.Module], LayerHandler | None] = handler_for):
        self.model = model
        self.params = params
        ids = {id(p): n for n, p in params.items()}
        self.layers: list[tuple[nn.Module, LayerHandler, dict[str, str]]] = []
        covered: set[str] = set()
        for mname, module in model.named_modules():
            own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad and id(p) in ids}
            if not own:
                continue
            h = handler_for(module)
            if h is None:
                raise UserError(f"per-example gradients: layer {mname or '<root>'} ({type(module).__name__}) has "
                                f"trainable parameters but no per-example rule; freeze it or use backend: functorch")
            local = {n: ids[id(p)] for n, p in own.items()}
            self.layers.append((module, h, local))
            covered.update(local.values())
        missing = set(params) - covered
        if missing:
            raise UserError(f"per-example gradients: parameters {sorted(missing)[:3]} are not in a hooked layer")
        counts: dict[str, int] = {}
        for _, _, local in self.layers:
            for n in local.values():
                counts[n] = counts.get(n, 0) + 1
        #: parameters reached through more than one layer (tied weights): materialised
        self.shared = {n for n, c in counts.items() if c > 1}
        self._uses: dict[int, list[Use]] = {}
        self._handles = []

    def _hook(self, module, inputs, output):
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return None
        inp = inputs[0].detach()
        B = self._batch_size
        if output.shape[0] == 1 and B > 1:
            # A layer shared by the whole batch through broadcasting (BERT's position embeddings
            # see position_ids of shape [1, T]): expand its output so that each example gets its
            # own backprop. Autograd sums the expanded gradient back, so the model is unchanged.
            output = output.expand(B, *output.shape[1:])
            inp = inp.expand(B, *inp.shape[1:])
        self._uses.setdefault(id(module), []).append(Use(module, inp, output, output._version))
        return output

    def capture(self, batch_size: int):
        sampler = self

        class _Ctx:
            def __enter__(self_):
                sampler._batch_size = batch_size
                sampler._uses = {}
                sampler._handles = [m.register_forward_hook(sampler._hook) for m, _, _ in sampler.layers]
                return sampler

            def __exit__(self_, *exc):
                for h in sampler._handles:
                    h.remove()
                sampler._handles = []

        return _Ctx()

    def contribution(self, losses: torch.Tensor) -> "HookContribution":
        """Backprops of Σ_i loss_i (non-finite losses are masked out) and the lazy contribution."""
        uses = [u for m, _, _ in self.layers for u in self._uses.get(id(m), [])]
        for u in uses:
            if u.out._version != u.version:
                raise UserError(f"per-example gradients: the output of {type(u.module).__name__} is modified in "
                                "place later in the forward pass (e.g. ReLU(inplace=True)); disable in-place ops")
        finite = torch.isfinite(losses)
        total = torch.where(finite, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)).sum()
        if uses:
            grads = torch.autograd.grad(total, [u.out for u in uses], allow_unused=True)
            for u, g in zip(uses, grads):
                u.g = torch.zeros_like(u.out) if g is None else g.detach()
                u.out = None  # free the graph reference
        self._uses = {}
        by_module = {}
        for u in uses:
            by_module.setdefault(id(u.module), []).append(u)
        records = [(h, local, by_module.get(id(m), [])) for m, h, local in self.layers]
        return HookContribution(records=records, shared=self.shared, n=losses.shape[0],
                                losses=losses.detach(), finite=finite, params=self.params)


@dataclass
class HookContribution(DenseContribution):
    """Dense per-example gradients, held as (activation, backprop) pairs per layer."""

    records: list = field(default_factory=list)
    shared: set = field(default_factory=set)
    n: int = 0
    finite: torch.Tensor | None = None
    params: dict = field(default_factory=dict)  # for zero sums of layers this batch did not reach
    _sq: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.n

    def _materialised_shared(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for h, local, uses in self.records:
            if not self.shared.intersection(local.values()):
                continue
            for u in uses:
                for k, v in h.per_example(u).items():
                    name = local[k]
                    if name in self.shared:
                        out[name] = out[name] + v if name in out else v
        return out

    def norms(self):
        if self._sq is None:
            sq = None
            for h, local, uses in self.records:
                if len(uses) > 1:  # a module called twice: its gradient is the sum over calls
                    pe: dict[str, torch.Tensor] = {}
                    for u in uses:
                        for k, v in h.per_example(u).items():
                            if local[k] not in self.shared:
                                pe[k] = pe[k] + v if k in pe else v
                    parts = [v.flatten(1).pow(2).sum(1) for v in pe.values()]
                else:
                    parts = [v for k, v in h.sq_norms(uses[0]).items() if local[k] not in self.shared] if uses else []
                for p in parts:
                    sq = p if sq is None else sq + p
            for v in self._materialised_shared().values():
                s = v.flatten(1).pow(2).sum(1)
                sq = s if sq is None else sq + s
            if sq is None:
                sq = torch.zeros(self.n, device=self.finite.device if self.finite is not None else None)
            if self.finite is not None:
                sq = torch.where(self.finite, sq, torch.full_like(sq, float("nan")))
            self._sq = sq
        return self._sq.sqrt()

    def weighted_sum(self, weights):
        out: dict[str, torch.Tensor] = {}
        for h, local, uses in self.records:
            for u in uses:
                for k, v in h.weighted(u, weights).items():
                    name = local[k]
                    if name in self.shared:
                        continue
                    out[name] = out[name] + v if name in out else v
        for name, v in self._materialised_shared().items():
            out[name] = _mask_rows(v, weights).sum(0)
        for name, p in self.params.items():
            if name not in out:
                out[name] = torch.zeros(p.shape, dtype=acc_dtype(p.dtype), device=p.device)
        return DenseAggregate({name: out[name] for name in self.params})
