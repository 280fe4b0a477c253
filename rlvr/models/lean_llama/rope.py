"""Rotary position tables: a Llama's RoPE cos / sin read from the model's own ``inv_freq`` buffers."""

from __future__ import annotations

import torch
import torch.nn as nn


class RopeTable:
    """cos / sin tables of a Llama's RoPE (the rotary module's ``inv_freq``: ``STATIC_ROPE``), cached
    per device / dtype / inverse-frequency buffer and grown to the longest position needed (the
    block size when the model has one)."""

    def __init__(self):
        self._tables: dict = {}

    def __call__(self, hf_model: nn.Module, positions: torch.Tensor, dtype: torch.dtype,
                 block_size: int | None, key: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, L, 1, D) in ``dtype`` for ``positions`` (B, L) (all < ``block_size``), from
        rotary table ``key`` (``layer_rope_types``; None: the model's one table).

        As transformers does: ``freqs = pos.float() * inv_freq`` in float32, ``emb = cat(freqs,
        freqs)``, cos / sin in float32, cast to the activations' dtype. ``sin`` is returned with its
        first half negated so that ``rotate_half(x) * sin == x.roll(D // 2, -1) * sin_signed``
        (exactly: negation is exact).
        """
        inv_freq = _inv_freq(hf_model, positions.device, key)
        dev = positions.device
        key = (dev, dtype, key, inv_freq.data_ptr(), inv_freq.dtype, inv_freq._version)
        tab = self._tables.get(key)
        need = block_size if block_size is not None else (int(positions.max()) + 1 if positions.numel() else 1)
        if tab is None or tab[0].size(0) < need:
            n = max(need, 64)
            f = inv_freq.to(device=dev, dtype=torch.float)
            freqs = torch.arange(n, device=dev, dtype=torch.long).float()[:, None] * f   # (n, D/2)
            cos_h, sin_h = freqs.cos(), freqs.sin()
            cos = torch.cat([cos_h, cos_h], dim=-1).to(dtype)
            sin = torch.cat([-sin_h, sin_h], dim=-1).to(dtype)
            self._tables = {k: v for k, v in self._tables.items() if k[:3] != key[:3]}  # stale
            tab = self._tables[key] = (cos, sin)
        cos, sin = tab
        return cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)


def layer_rope_types(hf_model: nn.Module) -> list[str | None]:
    """Each decoder layer's rotary table: None for all of them when the rotary module holds one
    table (``inv_freq``), else the layer's type (Gemma 3: ``sliding_attention`` layers rotate with
    base 10,000, ``full_attention`` ones with their own base and scaling: the module's
    ``{type}_inv_freq``)."""
    inner = hf_model.model
    n = len(inner.layers)
    rot = getattr(inner, "rotary_emb", None)
    if not getattr(rot, "layer_types", None):
        return [None] * n
    return list(hf_model.config.layer_types[:n])


def _inv_freq_buffer(rot: nn.Module | None, key: str | None) -> torch.Tensor | None:
    """The rotary module's inverse frequencies for table ``key`` (None: its one ``inv_freq``)."""
    return getattr(rot, "inv_freq" if key is None else f"{key}_inv_freq", None)


def _inv_freq(hf_model: nn.Module, device, key: str | None = None) -> torch.Tensor:
    """The model's rotary ``inv_freq`` buffer (D/2,) (table ``key``: ``layer_rope_types``), or the
    default-RoPE formula from its config."""
    rot = getattr(hf_model.model, "rotary_emb", None)
    inv_freq = _inv_freq_buffer(rot, key)
    if inv_freq is not None:
        return inv_freq
    cfg = hf_model.config  # pragma: no cover - stock Llama always has the buffer
    rope = getattr(cfg, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


def _rope_tables(hf_model: nn.Module, rope: RopeTable, positions: torch.Tensor, dtype: torch.dtype,
                 block_size: int | None, transposed: bool) -> tuple[list, dict]:
    """(each layer's rotary table key, ``layer_rope_types``; {key: (cos, sin)}) for ``positions``
    (n, L): each (n, L, 1, D), or ``transposed`` (D, n*L) for the weight-major products."""
    keys = layer_rope_types(hf_model)
    tables = {k: rope(hf_model, positions, dtype, block_size, k) for k in set(keys)}
    if transposed:
        tables = {k: tuple(c.reshape(-1, c.size(-1)).t() for c in t) for k, t in tables.items()}
    return keys, tables
