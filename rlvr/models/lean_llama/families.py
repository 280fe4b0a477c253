"""Which models the lean forward runs: the supported families (``lean_families``), why a model is
refused (``lean_llama_unsupported``, ``peft_unsupported``) and each layer's sliding window.

``transformers`` is imported inside the functions only.
"""

from __future__ import annotations

import torch.nn as nn

from .rope import _inv_freq_buffer, layer_rope_types


STATIC_ROPE = ("default", "linear", "llama3")
"""RoPE types whose frequencies transformers computes once, into the rotary module's ``inv_freq``
buffer, with no attention scaling: the lean forward's ``RopeTable`` reads that buffer, so it rotates
as transformers does (Llama 3.1 / 3.2 use ``llama3``). Dynamic ones (``dynamic``, ``longrope``)
change the frequencies with the length, and ``yarn`` scales the attention: those take transformers'
forward."""


_FAMILIES: dict = {}


def lean_families() -> dict[type, tuple[type, type, type, type]]:
    """The causal-LM classes the lean forward runs, each with its (model, decoder layer, attention,
    MLP) classes: Llama, Mistral, Qwen 2, Qwen 3 and Gemma 1, 2 and 3 (text), whose layers compute
    the same function (RMSNorm, rotary q/k, grouped-query attention, gated MLP); Qwen 2's q/k/v
    projections carry biases, which the products here add as its Linear layers do, and Qwen 3 and
    Gemma 3 normalize each query and key head before the rotation (``q_norm`` / ``k_norm``,
    ``_head_norm_t``). The Gemmas scale their embeddings (their embedding modules do), compute
    RMSNorm as x * (1 + w) (their norm modules are called) and gate with tanh-GELU (their
    ``act_fn``); Gemma 2 and 3 also normalize the attention's and the MLP's outputs before their
    residual adds (``_sandwich``), Gemma 2 soft-caps its attention scores and logits
    (``_softcap``), Gemma 3 has a rotary table per layer type (``layer_rope_types``). Phi-3 fuses
    q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (``_qkv_mods``,
    ``_gate_up_mods``: the same rows, as the stacked products already compute them). Those
    transformers lacks are left out."""
    if not _FAMILIES:
        import importlib

        for mod, prefix, inner in (("llama", "Llama", "Model"), ("mistral", "Mistral", "Model"),
                                   ("qwen2", "Qwen2", "Model"), ("qwen3", "Qwen3", "Model"),
                                   ("gemma", "Gemma", "Model"), ("gemma2", "Gemma2", "Model"),
                                   ("phi3", "Phi3", "Model"),
                                   ("gemma3", "Gemma3", "TextModel")):
            try:
                m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
                _FAMILIES[getattr(m, f"{prefix}ForCausalLM")] = tuple(
                    getattr(m, f"{prefix}{part}") for part in (inner, "DecoderLayer", "Attention", "MLP"))
            except (ImportError, AttributeError):  # pragma: no cover - an older transformers
                continue
    return _FAMILIES


def lean_llama_unsupported(hf_model: nn.Module) -> str | None:
    """Why the lean Llama forward cannot run ``hf_model`` (None = it can).

    The lean path needs a plain ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` or
    ``Phi3ForCausalLM`` (exact class, its own model, layer and attention classes: ``lean_families``;
    another MLP module is called as it is), static RoPE (``STATIC_ROPE``; each table's, where there
    is one per layer type: ``layer_rope_types``) over the full head dim, no attention or residual
    dropout and causal attention. Sliding windows are masked as transformers masks them
    (``layer_windows``), soft-capped scores and logits capped as it caps them (``_softcap``).
    """
    families = lean_families()
    if type(hf_model) not in families:
        names = ", ".join(sorted(c.__name__ for c in families))
        return f"{type(hf_model).__name__} is not one of {names}"
    model_t, layer_t, attn_t, _ = families[type(hf_model)]
    cfg = hf_model.config
    inner = getattr(hf_model, "model", None)
    if type(inner) is not model_t:
        return f"inner model is not {model_t.__name__}"
    layers = list(inner.layers)
    if len(layers) != cfg.num_hidden_layers:
        return "layer count differs from config.num_hidden_layers"
    for layer in layers:
        if type(layer) is not layer_t or type(layer.self_attn) is not attn_t:
            return f"a decoder layer is not the stock {layer_t.__name__} / {attn_t.__name__}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return f"unsupported rope parameters {rope!r}"
    rot = getattr(inner, "rotary_emb", None)
    keys = sorted({t for t in layer_rope_types(hf_model) if t is not None})
    for key in keys or [None]:          # Gemma 3: one table per layer type, each with its own parameters
        params = rope if key is None else rope.get(key) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE:
            return f"rope_type {rope_type!r} (the lean forward takes {', '.join(repr(t) for t in STATIC_ROPE)})"
        if params.get("partial_rotary_factor", 1.0) not in (None, 1.0):
            return "partial rotary embedding"
        scaling = getattr(rot, "attention_scaling" if key is None else f"{key}_attention_scaling", 1.0)
        if rot is not None and float(scaling if scaling is not None else 1.0) != 1.0:
            return "rotary attention_scaling != 1"
        if (rope_type != "default" or key is not None) and _inv_freq_buffer(rot, key) is None:
            # RopeTable's own formula is the default single table's
            return f"rope_type {rope_type!r} without the rotary module's inv_freq buffer"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    for layer in layers:
        if float(getattr(layer.self_attn, "attention_dropout", 0.0) or 0.0) != 0.0:
            return "attention dropout > 0"
        if any(getattr(layer._modules.get(n), "p", 0.0) for n in ("resid_attn_dropout", "resid_mlp_dropout")):
            return "residual dropout > 0"                                          # Phi-3's
    return None


def layer_windows(hf_model: nn.Module) -> list[int | None]:
    """Each decoder layer's sliding attention window, or None where the layer attends to every earlier
    column: the attention module's own ``sliding_window`` where it has one (Qwen 2 / 3 and Gemma 3
    give it to their ``sliding_attention`` layers only), else the config's (Mistral: every layer).

    transformers masks key column ``kv`` from query column ``q`` when ``kv <= q - window``, columns
    counted in the row's padded sequence (left padding included); the lean forward's masks do the
    same (``_attend_mask``, ``_group_attend_mask``)."""
    inner = hf_model.model
    cfg_window = getattr(hf_model.config, "sliding_window", None)
    windows = []
    for layer in inner.layers:
        attn = layer.self_attn
        w = attn.sliding_window if "sliding_window" in vars(attn) else cfg_window
        windows.append(None if w is None else int(w))
    return windows


def sliding_window(hf_model: nn.Module) -> int | None:
    """The narrowest sliding attention window of ``hf_model``'s layers (``layer_windows``), or None
    when every layer attends to every earlier column. Mistral 7B v0.1 and its fine-tunes have 4,096,
    Gemma 3's local layers 512; Qwen 2 has one only with ``use_sliding_window``."""
    windows = [w for w in layer_windows(hf_model) if w is not None] if hasattr(hf_model, "model") else []
    return min(windows) if windows else None


def peft_unsupported(model: nn.Module) -> str | None:
    """Only plain LoRA adapters act inside the wrapped modules; other peft types (prompt / prefix
    tuning) change the forward itself."""
    for name, cfg in getattr(model, "peft_config", {}).items():
        kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
        if kind.upper() != "LORA":
            return f"peft adapter {name!r} is {kind}, not LoRA"
    return None
