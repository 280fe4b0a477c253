"""The lean forward's KV cache (``LeanCache``) and the row bookkeeping every rlvr KV cache shares."""

from __future__ import annotations

import torch

from .limits import CACHE_GROW, GROUP_ATTENTION_FLOPS, KEYS_ROW_MAJOR


def init_rows(cache, batch_size: int, max_len: int, device) -> None:
    """The bookkeeping every rlvr KV cache shares: column budget ``max_len``, the running attention
    mask ``mask`` (B, S) long of every column seen so far, each row's next position ``next_pos`` (B,)."""
    cache.max_len = max_len
    cache.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
    cache.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)


def repeat_rows(cache, repeats: int) -> None:
    """Row b of ``mask`` / ``next_pos`` becomes rows b*repeats ... b*repeats+repeats-1."""
    cache.mask = cache.mask.repeat_interleave(repeats, dim=0)
    cache.next_pos = cache.next_pos.repeat_interleave(repeats, dim=0)


def grouped_layout(prefix: int, new: int, G: int) -> bool:
    """Whether a CPU cache of ``prefix`` columns repeated for G samples with ``new`` columns left to
    decode takes the grouped layout (``LeanCache.repeat_interleave``): letting a prompt's G rows
    attend to each other's columns costs at most ``GROUP_ATTENTION_FLOPS`` times the score FLOPs
    of each row attending to its own, (prefix + G * new) / (prefix + new)."""
    return G > 1 and (prefix + G * new) <= GROUP_ATTENTION_FLOPS * (prefix + new)


class LeanCache:
    """The lean path's KV cache: per-layer key/value tensors (B, Hkv, S, D), rotary already applied,
    plus the running attention mask and each row's next position (see ``init_rows``).

    Two ways to grow, chosen per append: with gradient enabled the tensors are grown with
    ``torch.cat`` (so gradients flow through the cache: the training forward's shared prompt);
    without gradient (sampling) the first append allocates (B, Hkv, max_len, D) buffers and every
    later one writes its columns in place, so a decode step copies one column, not the whole cache.
    ``k[li]`` / ``v[li]`` are then views of the first S columns of those buffers. On a CPU
    (``spare_cols``) those buffers are ``CACHE_GROW`` columns wider than the columns filled (grown by
    as many when full, the new columns zero), and a no-gradient call attends over their whole width
    (``attend_width``): a view of the first S columns of a wider buffer is not one contiguous tensor,
    and oneDNN's batched bf16 product copies any operand that is not. Past ``KEYS_ROW_MAJOR``
    columns the keys' buffer holds them transposed, (B, Hkv, D, cols) (``keys_transposed``), and
    ``k[li]`` is a transposed view of it, still (B, Hkv, S, D): at long widths the scores' product
    reads each (D, S) block faster as a plain matrix than through a transposed view; at short ones
    the row-major buffer's cheaper column writes win.

    Grouped layout (``group`` = G > 1, see ``repeat_interleave``): the P prompts' keys / values are
    kept once, not G times, and the G rows of a prompt append theirs after them, step by step:
    ``v[li]`` is (P, Hkv, prefix + G * n, D) with column ``prefix + s * G + g`` = row g's step s,
    and ``k[li]`` holds the keys transposed, (P, Hkv, D, prefix + G * n), as the scores' product
    reads them (a transposed view of a buffer's first columns would be copied by that product at
    every layer of every step). ``lean_forward`` then lets the G * rep query heads of a prompt's kv
    head attend to its columns as one product, each query masked to the prompt's columns and its
    own row's."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, device):
        init_rows(self, batch_size, max_len, device)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self._kbuf: list[torch.Tensor | None] = [None] * n_layers
        self._vbuf: list[torch.Tensor | None] = [None] * n_layers
        self.group = 1
        """G > 1 in the grouped layout: rows b*G ... b*G+G-1 share the first ``prefix`` columns."""
        self.prefix = 0
        """Columns stored once per group (the prompt's) in the grouped layout."""
        self.spare_cols = torch.device(device).type == "cpu"
        """Plain layout without gradient: buffers ``CACHE_GROW`` columns wider than those filled, grown
        when full and attended whole, keys transposed past ``KEYS_ROW_MAJOR`` columns (class docstring)."""
        self.width = 0
        """Columns the current no-gradient call attends over (``attend_width``); 0: those filled."""
        self._whole: list[tuple | None] = [None] * n_layers
        """Per layer (keys' buffer, values' buffer, both whole as (B, Hkv, cols, D) views): made once
        per buffer, not at every decode step (``append``)."""

    def attend_width(self, S: int) -> int:
        """Columns a no-gradient call that fills the first S columns attends over, the buffers grown
        first where they are narrower: in the plain layout with transposed keys and its buffers
        allocated, their whole width (S to max_len; class docstring); else S (a first call, the
        grouped layout, gradient, a GPU). The columns past S hold zeros or an earlier row's finite
        values; the caller masks them (``_attention_masks``' ``width``)."""
        self.width = 0
        if torch.is_grad_enabled() or self.group > 1 or not self.spare_cols or any(b is None for b in self._kbuf):
            return S
        if S > self._vbuf[0].size(2):
            self.grow(min(self.max_len, S + CACHE_GROW))
        self.width = self._vbuf[0].size(2)
        return self.width

    def grow(self, cols: int) -> None:
        """Widen every layer's plain-layout buffers (``spare_cols``) to ``cols`` columns, the filled ones
        copied (the keys transposed where ``cols`` passes ``KEYS_ROW_MAJOR``), the new ones zero;
        nothing for other buffers (they hold max_len columns)."""
        if not self.spare_cols or self.group > 1:
            return
        for li, (kb, vb) in enumerate(zip(self._kbuf, self._vbuf)):
            if kb is None or vb.size(2) >= cols:
                continue
            S = self.v[li].size(2)
            nv = vb.new_zeros(vb.size(0), vb.size(1), cols, vb.size(3))
            nk = kb.new_zeros(*nv.shape[:2], nv.size(3), cols) if self.keys_transposed(cols) else torch.zeros_like(nv)
            self._kbuf[li], self._vbuf[li] = nk, nv
            self.key_view(li, S).copy_(self.k[li])
            nv[:, :, :S] = vb[:, :, :S]
            self.k[li], self.v[li] = self.key_view(li, S), nv[:, :, :S]

    def keys_transposed(self, cols: int) -> bool:
        """Whether plain-layout key buffers ``cols`` columns wide hold the keys transposed, (B, Hkv, D,
        cols): on a CPU (``spare_cols``) past ``KEYS_ROW_MAJOR`` columns (class docstring)."""
        return self.spare_cols and cols > KEYS_ROW_MAJOR

    def key_view(self, li: int, S: int) -> torch.Tensor:
        """Layer ``li``'s first S key columns of its buffer as (B, Hkv, S, D) (plain layout)."""
        kb = self._kbuf[li]
        return kb[..., :S].transpose(2, 3) if self.keys_transposed(self._vbuf[li].size(2)) else kb[:, :, :S]

    length = property(lambda self: self.mask.size(1))
    batch_size = property(lambda self: self.mask.size(0))

    def append(self, li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``li``'s keys / values (B, Hkv, L, D) appended after its S0 cached columns; returns the
        (B, Hkv, S0 + L, D) keys and values to attend to; in the grouped layout (P, Hkv, prefix +
        G * (n + L), D) values and the keys transposed, (P, Hkv, D, prefix + G * (n + L)), after n
        steps (no gradient)."""
        if self.group > 1:
            return self._append_grouped(li, k, v)
        past = 0 if self.k[li] is None else self.k[li].size(2)
        if torch.is_grad_enabled():     # an in-place write could change a tensor backward has saved
            if self.k[li] is not None:
                k = torch.cat([self.k[li], k], dim=2)
                v = torch.cat([self.v[li], v], dim=2)
            self._kbuf[li] = self._vbuf[li] = None
        else:
            kb, vb = self._kbuf[li], self._vbuf[li]
            S = past + k.size(2)
            if kb is None:              # the first append without gradient (the forward checks max_len)
                B, Hkv, _, D = k.shape
                if self.spare_cols:     # CACHE_GROW columns to spare, zero: attended whole (class docstring)
                    cols = min(self.max_len, S + CACHE_GROW)
                    vb = v.new_zeros(B, Hkv, cols, D)
                    kb = k.new_zeros(B, Hkv, D, cols) if self.keys_transposed(cols) else torch.zeros_like(vb)
                else:
                    kb, vb = k.new_empty(B, Hkv, self.max_len, D), v.new_empty(B, Hkv, self.max_len, D)
                self._kbuf[li], self._vbuf[li] = kb, vb
                if past:
                    self.key_view(li, past).copy_(self.k[li])
                    vb[:, :, :past] = self.v[li]
            elif self.spare_cols and S > vb.size(2):   # a call that did not ask attend_width first
                self.grow(min(self.max_len, S + CACHE_GROW))
                kb, vb = self._kbuf[li], self._vbuf[li]
            self.key_view(li, S)[:, :, past:].copy_(k)
            vb[:, :, past:S] = v
            self.k[li], self.v[li] = self.key_view(li, S), vb[:, :, :S]
            if not past:        # a first call (a prefill) attends with its keys as computed: the same
                return k, self.v[li]   # values, in the layout SDPA reads without a copy
            if self.width >= S:         # attend_width: the buffers whole
                if self.width == vb.size(2):
                    return self._whole_views(li)
                return self.key_view(li, self.width), vb[:, :, :self.width]
            return self.k[li], self.v[li]
        self.k[li], self.v[li] = k, v
        return k, v

    def _whole_views(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``li``'s buffers whole, keys and values (B, Hkv, cols, D): the views made again only
        where a buffer was replaced (grown, rows dropped), so a decode step makes none."""
        kb, vb = self._kbuf[li], self._vbuf[li]
        hit = self._whole[li]
        if hit is None or hit[0] is not kb or hit[1] is not vb:
            hit = self._whole[li] = (kb, vb, self.key_view(li, vb.size(2)), vb[:, :, :vb.size(2)])
        return hit[2], hit[3]

    def _append_grouped(self, li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped layout: the G rows' L new columns of each prompt written after its n steps."""
        if torch.is_grad_enabled():
            raise RuntimeError("a LeanCache in the grouped layout is written without gradient only")
        G = self.group
        B, Hkv, L, D = k.shape
        P = B // G
        kb, vb = self._kbuf[li], self._vbuf[li]                   # (P, Hkv, D, cols), (P, Hkv, cols, D)
        past = self.v[li].size(2)
        S = past + G * L
        kb[..., past:S].view(P, Hkv, D, L, G).copy_(k.reshape(P, G, Hkv, L, D).permute(0, 2, 4, 3, 1))
        vb[:, :, past:S].view(P, Hkv, L, G, D).copy_(v.reshape(P, G, Hkv, L, D).permute(0, 2, 3, 1, 4))
        self.k[li], self.v[li] = kb[..., :S], vb[:, :, :S]
        return self.k[li], self.v[li]

    def _groupable(self, repeats: int) -> bool:
        """Whether ``repeat_interleave(repeats)`` takes the grouped layout: no gradient, CPU, every
        layer filled in place, and attending to a prompt's G rows' columns at once costs at most
        ``GROUP_ATTENTION_FLOPS`` times the score FLOPs of each row attending to its own."""
        if repeats < 2 or self.group > 1 or torch.is_grad_enabled() or self.mask.device.type != "cpu":
            return False
        if any(t is None for t in self.k) or any(b is None for b in self._kbuf):
            return False
        return grouped_layout(self.length, self.max_len - self.length, repeats)

    def repeat_interleave(self, repeats: int) -> "LeanCache":
        """Row b becomes rows b*repeats ... b*repeats+repeats-1 (out of place per tensor, so the
        autograd graph is kept); returns ``self`` like ``HFCache.repeat_interleave``.

        Without gradient on CPU, where ``_groupable`` says so, the rows are repeated in the
        bookkeeping only and the keys / values take the grouped layout (class docstring): the
        prompt's columns are not copied G times and a decode step reads them once per prompt."""
        if self._groupable(repeats):
            S0 = self.length
            cols = S0 + repeats * (self.max_len - S0)
            for li, t in enumerate(self.k):
                P, Hkv, _, D = t.shape
                self._kbuf[li] = t.new_empty(P, Hkv, D, cols)                 # keys transposed
                self._vbuf[li] = t.new_empty(P, Hkv, cols, D)
                self._kbuf[li][..., :S0] = t.transpose(2, 3)
                self._vbuf[li][:, :, :S0] = self.v[li]
                self.k[li], self.v[li] = self._kbuf[li][..., :S0], self._vbuf[li][:, :, :S0]
            self.group, self.prefix = repeats, S0
            repeat_rows(self, repeats)
            return self
        if self.group > 1:
            raise RuntimeError("a LeanCache in the grouped layout cannot be repeated again")
        for li, t in enumerate(self.k):
            if t is None:
                continue
            if self._kbuf[li] is not None:                              # keep the preallocated columns
                self._kbuf[li] = self._kbuf[li].repeat_interleave(repeats, dim=0)
                self._vbuf[li] = self._vbuf[li].repeat_interleave(repeats, dim=0)
                S = t.size(2)
                self.k[li], self.v[li] = self.key_view(li, S), self._vbuf[li][:, :, :S]
            else:
                self.k[li] = t.repeat_interleave(repeats, dim=0)
                self.v[li] = self.v[li].repeat_interleave(repeats, dim=0)
                self._kbuf[li] = self._vbuf[li] = None
        repeat_rows(self, repeats)
        return self
