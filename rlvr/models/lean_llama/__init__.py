"""The lean Llama forward: a stock ``LlamaForCausalLM``'s own weights with transformers' glue replaced
(and Mistral's, Qwen 2's, Qwen 3's, Gemma 1 / 2 / 3's, Phi-3's: the same layers, Qwen 2 with q/k/v
biases, Qwen 3 with per-head q/k norms, the Gemmas with (1 + w) norms, Gemma 2 / 3 with norms around
the attention and the MLP, Phi-3 with fused projections; ``lean_families``).

``lean_forward`` calls the model's weight-holding submodules (embeddings, norms, q/k/v/o
projections, MLPs, head; so peft LoRA layers and ``disable_adapter()`` act as usual) but replaces
transformers' glue (mask building, DynamicCache, rotary module, output capture) with a few tensor
ops, a ``RopeTable`` and a ``LeanCache``: the same logits to float rounding (tested at 1e-5 against
the transformers forward), with much less per-call overhead on small models.

``lean_llama_unsupported(model)`` / ``peft_unsupported(model)`` say why a model cannot take this
path (None = it can): it needs a plain ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, a Gemma 1 / 2 / 3 or a ``Phi3ForCausalLM`` (static RoPE
over the full head dim: ``STATIC_ROPE``, no attention dropout) and, under peft, LoRA adapters only.

The package, one job a module:

- ``forward``: ``lean_forward`` and ``lean_forward_shared``, layer by layer.
- ``layers``: a decoder layer's pieces (norms, q/k/v and rotation, o_proj, MLP, residuals, head).
- ``attention``: masks, explicit and SDPA attention, grouped attention over a grouped cache.
- ``cache``: ``LeanCache``. ``rope``: ``RopeTable``. ``families``: which models run here.
- ``modules``: which of a layer's modules the lean path computes itself (plain Linear / LoRA).
- CPU products: ``products`` (row-major, under bf16 autocast from ``bf16_copies``' copies and
  ``packs``' oneDNN packs) and ``weight_major`` (``W @ x.T`` for decode steps).
- ``compiled_layers``: a layer's per-token parts for model.compile.
- ``limits``: the thresholds between two ways of computing the same numbers.

Every name the single module ``rlvr.models.lean_llama`` had is importable from the package. Setting
one on the package (tests' ``monkeypatch.setattr``) sets it in every module of the package that
holds the same object, so a patched threshold or function acts wherever it is used, as it did in
the one module.
"""

from __future__ import annotations

import sys
import types

from rlvr.compiled import compile_available, compiled_call  # noqa: F401

from .limits import CACHE_GROW, GROUP_ATTENTION_FLOPS, GROUP_SCORES, HEAD_CHUNK, HEAD_ROWS, KEYS_ROW_MAJOR, LIVE_ROWS, PACK_ROWS, SMALL_ATTENTION  # noqa: F401
from .cache import grouped_layout, init_rows, LeanCache, repeat_rows  # noqa: F401
from .families import (_FAMILIES, layer_windows, lean_families, lean_llama_unsupported, peft_unsupported,
                       sliding_window, STATIC_ROPE)  # noqa: F401
from .rope import _inv_freq, _inv_freq_buffer, layer_rope_types, _rope_tables, RopeTable  # noqa: F401
from .attention import (_additive, _attend_mask, _attend_parts, _attention, _attention_masks, _explicit_attention,
                        _group_addmask, _group_attend_mask, _group_chunks, _grouped_attention, _layer_masks, _scores,
                        _softcap)  # noqa: F401
from .modules import (_act, _gate_up_mods, _hooked, _lora_linear_type, _MLP_TYPES, _plain_lora, _qkv_mods, _sandwich,
                      _stock_mlp)  # noqa: F401
from .bf16_copies import (_adapter_state, _bf16_copy, bf16_weights, _Bf16Weights, _Copies, _cpu_bf16_autocast,
                          drop_kept_copies, _KEPT, _plan_parts, _plan_state, _SCOPE, _stamp)  # noqa: F401
from .packs import _pack_ok, _PACK_OK_AT, _packed_linear, _packed_linear_ok, _PACKED_OK  # noqa: F401
from .weight_major import (_add_lora_bf16, linear_t, _linear_t_bf16, _mlp_t, _mm_bias, _stack_plan, _stacked_t_bf16,
                           _weight_major, _weight_major_bf16_ok, _WM_BF16_OK)  # noqa: F401
from .products import decode_reads_packs, linear, _linear_plan, _packed_head, _stacked_linear, _stacked_plan  # noqa: F401
from .layers import (_attn_residual, _head_norm_t, _layer_out, _mlp, _mlp_norm, _mlp_residual, _out_rest, _out_rest_t,
                     output_head, _prestack, _project_qkv, _qkv_in, rms_norm, _shared_attention, _shared_out)  # noqa: F401
from .compiled_layers import (_compiled_out, compiled_plan, _compiled_qkv,
                              _compiled_shared_layer, _is_silu, _lin, _out_block, _proj, _qkv_block,
                              _shared_layer_block)  # noqa: F401
from .forward import (_all_rows, _checkpointed_layer, _layer, lean_forward, lean_forward_shared, _live_rows, _logits,
                      _Pass)  # noqa: F401

__all__ = [
    "CACHE_GROW", "GROUP_ATTENTION_FLOPS", "GROUP_SCORES", "HEAD_CHUNK", "HEAD_ROWS", "KEYS_ROW_MAJOR", "LIVE_ROWS", "LeanCache", "PACK_ROWS",
    "RopeTable", "SMALL_ATTENTION", "STATIC_ROPE", "bf16_weights", "compiled_plan", "decode_reads_packs",
    "drop_kept_copies", "grouped_layout", "init_rows", "layer_rope_types", "layer_windows", "lean_families", "lean_forward",
    "lean_forward_shared", "lean_llama_unsupported", "linear", "linear_t", "output_head", "peft_unsupported",
    "repeat_rows", "rms_norm", "sliding_window",
]

_MISSING = object()


class _Package(types.ModuleType):
    """The package's module type: ``setattr`` on the package also rebinds the name in each of its
    submodules that holds the same object as the package (the module that defines it and those
    that imported it), as one module's global would be rebound."""

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get(name, _MISSING)
        if old is not _MISSING and not isinstance(old, types.ModuleType):
            prefix = self.__name__ + "."
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.startswith(prefix) and mod is not None and mod.__dict__.get(name, _MISSING) is old:
                    mod.__dict__[name] = value
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
