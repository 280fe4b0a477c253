"""What the lean forward may compute itself of a layer's modules: plain ``nn.Linear`` and plain peft
LoRA ``Linear`` layers without hooks (``_plain_lora``), the fused projections of Phi-3, the stock
gated MLP of a supported family, and Gemma's norms around the attention and the MLP."""

from __future__ import annotations

import torch
import torch.nn as nn

from .families import lean_families


def _lora_linear_type():
    """peft's LoRA ``Linear`` class, or None without peft."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - peft is in the hf extra
        return None
    return Linear


def _hooked(m: nn.Module) -> bool:
    """Whether calling ``m`` would run forward hooks (its own or global ones): then it is called."""
    g = nn.modules.module
    return bool(m._forward_hooks or m._forward_pre_hooks or g._global_forward_hooks
                or g._global_forward_pre_hooks)


def _plain_lora(m: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, list] | None:
    """(base weight (N, K), base bias (N,) or None, [(lora_A weight (r, K), lora_B weight (N, r),
    scaling), ...]) of a peft LoRA ``Linear`` that computes exactly ``base(x) + sum over active
    adapters of lora_B(lora_A(x)) * scaling`` here: not merged, adapters enabled, nn.Linear base (its
    bias, if any, in ``dtype``) and bias-free factors in ``dtype``, no DoRA or other variant, no
    dropout acting, no forward hooks. None for anything else (the caller then runs the module)."""
    lora_t = _lora_linear_type()
    if lora_t is None or type(m) is not lora_t or m.disable_adapters or m.merged or _hooked(m):
        return None
    base = m.base_layer
    if (type(base) is not nn.Linear or base.weight.dtype != dtype or _hooked(base)
            or (base.bias is not None and base.bias.dtype != dtype)):
        return None
    adapters = []
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        if name in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(name, False):
            return None
        A, B, drop = m.lora_A[name], m.lora_B[name], m.lora_dropout[name]
        if (type(A) is not nn.Linear or type(B) is not nn.Linear or A.bias is not None or B.bias is not None
                or A.weight.dtype != dtype or B.weight.dtype != dtype or _hooked(A) or _hooked(B)
                or not (type(drop) is nn.Identity or not drop.training)):
            return None
        adapters.append((A.weight, B.weight, m.scaling[name]))
    return base.weight, base.bias, adapters


def _qkv_mods(attn: nn.Module) -> tuple[nn.Module, ...]:
    """An attention's q/k/v projections: (q_proj, k_proj, v_proj), or Phi-3's fused (qkv_proj,), whose
    output rows are q's, then k's, then v's."""
    return (attn.qkv_proj,) if "qkv_proj" in attn._modules else (attn.q_proj, attn.k_proj, attn.v_proj)


def _gate_up_mods(mlp: nn.Module) -> tuple[nn.Module, ...]:
    """A gated MLP's gate and up projections: (gate_proj, up_proj), or Phi-3's fused (gate_up_proj,),
    whose output rows are the gate's, then up's."""
    return (mlp.gate_up_proj,) if "gate_up_proj" in mlp._modules else (mlp.gate_proj, mlp.up_proj)


def _act(mlp: nn.Module) -> nn.Module:
    """A gated MLP's activation module (``act_fn``; Phi-3's ``activation_fn``)."""
    return mlp.act_fn if "act_fn" in mlp._modules else mlp.activation_fn


_MLP_TYPES: list[type] = []


def _stock_mlp(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a stock MLP of a ``lean_families`` model (``down(act(gate(x)) * up(x))``)."""
    if not _MLP_TYPES:
        _MLP_TYPES.extend(fam[3] for fam in lean_families().values())
    return type(mlp) in _MLP_TYPES


def _sandwich(layer: nn.Module) -> bool:
    """Whether a decoder layer normalizes its attention's and its MLP's outputs before their residual
    adds (Gemma 3: ``post_attention_layernorm`` on the attention's output, ``pre_feedforward_layernorm``
    before the MLP, ``post_feedforward_layernorm`` after it); a Llama layer's ``post_attention_layernorm``
    is its MLP's input norm."""
    return layer._modules.get("pre_feedforward_layernorm") is not None      # a dict lookup: called per layer and step
