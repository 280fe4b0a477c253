"""model.compile: a decoder layer's per-token parts (norms, q/k/v, rotation, o_proj, MLP) as pure
functions of tensors (``_qkv_block``, ``_out_block``; a whole layer of the shared-prompt pass,
``_shared_layer_block``) that torch.compile turns into one kernel sequence each (rlvr.compiled).
``compiled_plan`` says which layers they cover; the others run eagerly. The same numbers as the
eager layers to float rounding (tested)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlvr.compiled import compiled_call

from .attention import _attend_parts
from .bf16_copies import _bf16_copy, _cpu_bf16_autocast
from .layers import _out_rest, _qkv_in, _shared_out
from .modules import _act, _hooked, _plain_lora, _sandwich, _stock_mlp


def _proj(m: nn.Module) -> tuple | None:
    """(weight, bias or None, ((A, B, scaling), ...)) of a plain ``nn.Linear`` or plain peft LoRA
    ``Linear`` (``_plain_lora``) for ``_lin``, weight and bias as ``linear`` reads them (the region's
    bf16 copies of weights that need no gradient here under CPU bf16 autocast); None for anything else."""
    if type(m) is nn.Linear and not _hooked(m):
        W, b, adapters = m.weight, m.bias, []
    else:
        plan = _plain_lora(m, torch.float32)
        if plan is None:
            return None
        W, b, adapters = plan
    if _cpu_bf16_autocast(W.device):
        Wb, bb = _bf16_copy(W), None if b is None else _bf16_copy(b)
        W, b = (W if Wb is None else Wb), (b if bb is None else bb)
    return W, b, tuple(adapters)


def _is_silu(act: nn.Module) -> bool:
    """Whether an MLP's activation module computes ``F.silu`` (torch's ``nn.SiLU``, transformers'
    ``SiLUActivation``), with no hooks."""
    if _hooked(act):
        return False
    if type(act) is nn.SiLU:
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover - older transformers map "silu" to nn.SiLU
        return False
    return type(act) is SiLUActivation


def compiled_plan(layer: nn.Module) -> tuple | None:
    """What ``_compiled_qkv`` / ``_compiled_out`` read of a Llama-type decoder layer (Llama, Mistral,
    Qwen 2, SmolLM: RMSNorms with ``variance_epsilon``, q/k/v with optional biases, no per-head norms,
    no norms around the attention or MLP outputs, a SiLU-gated MLP; every projection a plain Linear or
    plain LoRA Linear): (input norm weight, eps, (q, k, v) ``_proj``s, o_proj's, MLP norm weight,
    eps, gate, up, down ``_proj``s); None for any other layer, which runs eagerly."""
    attn, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer._modules.get("post_attention_layernorm")
    if (_sandwich(layer) or getattr(attn, "q_norm", None) is not None or "qkv_proj" in attn._modules
            or not _stock_mlp(mlp) or "gate_up_proj" in mlp._modules or not _is_silu(_act(mlp))
            or getattr(attn, "attn_logit_softcapping", None) is not None or n2 is None):
        return None
    norms = []
    for n in (n1, n2):
        eps = getattr(n, "variance_epsilon", None)
        if eps is None or _hooked(n) or n.weight.dtype != torch.float32:
            return None
        norms.append((n.weight, float(eps)))
    projs = [_proj(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                mlp.down_proj)]
    if any(p is None for p in projs):
        return None
    return norms[0][0], norms[0][1], tuple(projs[:3]), projs[3], norms[1][0], norms[1][1], projs[4], projs[5], projs[6]


def _lin(x: torch.Tensor, p: tuple) -> torch.Tensor:
    """``linear``'s product for ``_proj``'s p: ``x @ W.T + b``, then ``+ lora_B(lora_A(x)) * scaling``
    per adapter, peft's order (casts to bf16 by autocast where it is on)."""
    W, b, adapters = p
    y = F.linear(x, W, b)
    for A, B, scaling in adapters:
        y = y + F.linear(F.linear(x, A), B) * scaling
    return y


def _qkv_block(h: torch.Tensor, nw: torch.Tensor, eps: float, projs: tuple, cos: torch.Tensor, sin: torch.Tensor,
               H: int, Hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's first half as ``_qkv_in`` computes it: h (B, L, d) -> rotated q (B, L, H, D), k and
    v (B, Hkv, L, D); cos / sin (B, L, 1, D)."""
    x = F.rms_norm(h, (h.size(-1),), nw, eps)
    q, k, v = (_lin(x, p) for p in projs)
    B, L = h.shape[:2]
    D = cos.size(-1)
    q, k = q.view(B, L, H, D), k.view(B, L, Hkv, D)
    v = v.view(B, L, Hkv, D).transpose(1, 2)
    q = q * cos + q.roll(D // 2, dims=-1) * sin
    k = (k * cos + k.roll(D // 2, dims=-1) * sin).transpose(1, 2)
    return q, k, v


def _out_block(h: torch.Tensor, o: torch.Tensor, po: tuple, nw: torch.Tensor, eps: float, pg: tuple, pu: tuple,
               pd: tuple) -> torch.Tensor:
    """A layer's second half after its attention output o (B, L, H * D): o_proj and the residual, the
    MLP's norm, ``down(silu(gate(x)) * up(x))`` and the residual -> (B, L, d)."""
    h = h + _lin(o, po)
    x = F.rms_norm(h, (h.size(-1),), nw, eps)
    return h + _lin(F.silu(_lin(x, pg)) * _lin(x, pu), pd)


def _shared_layer_block(h: torch.Tensor, plan: tuple, cos: torch.Tensor, sin: torch.Tensor, H: int, Hkv: int,
                        P: int, Lp: int, G: int, scaling: float, cap: float | None, att_p: tuple,
                        att_r: tuple) -> torch.Tensor:
    """A whole decoder layer of ``lean_forward_shared``'s one pass as one function to compile:
    ``_qkv_block``, ``_attend_parts``, ``_out_block`` (``compiled_plan``'s ``plan``)."""
    q, k, v = _qkv_block(h, plan[0], plan[1], plan[2], cos, sin, H, Hkv)
    o = _attend_parts(q, k, v, P, Lp, G, scaling, cap, att_p, att_r)
    return _out_block(h, o, *plan[3:])


def _compiled_qkv(layer: nn.Module, h: torch.Tensor, plan: tuple, cos: torch.Tensor, sin: torch.Tensor,
                  H: int, Hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_qkv_in`` through the compiled ``_qkv_block`` (``compiled_plan``'s ``plan``)."""
    return compiled_call("qkv", _qkv_block, (h, plan[0], plan[1], plan[2], cos, sin, H, Hkv), ((0, 1), (4, 1), (5, 1)),
                          lambda: _qkv_in(layer, h, cos, sin, H, Hkv))


def _compiled_out(layer: nn.Module, h: torch.Tensor, o: torch.Tensor, plan: tuple) -> torch.Tensor:
    """``_out_rest`` through the compiled ``_out_block``."""
    return compiled_call("out", _out_block, (h, o) + plan[3:], ((0, 1), (1, 1)), lambda: _out_rest(layer, h, o))


def _compiled_shared_layer(layer: nn.Module, h: torch.Tensor, plan: tuple, cos: torch.Tensor, sin: torch.Tensor,
                           H: int, Hkv: int, P: int, Lp: int, G: int, att_p: tuple, att_r: tuple) -> torch.Tensor:
    """A whole layer of ``lean_forward_shared``'s one pass through the compiled ``_shared_layer_block``."""
    attn = layer.self_attn
    args = (h, plan, cos, sin, H, Hkv, P, Lp, G, attn.scaling, getattr(attn, "attn_logit_softcapping", None),
            att_p, att_r)
    return compiled_call("layer", _shared_layer_block, args, ((0, 1), (2, 1), (3, 1)),
                         lambda: _shared_out(layer, h, *_qkv_in(layer, h, cos, sin, H, Hkv), P, Lp, G, att_p, att_r))
