"""Decode steps at fixed shapes, replayed as one CUDA graph per sampling call.

On a GPU an eager decode step of a small or mid-sized model is kernel launches, not arithmetic:
about 50 small kernels a layer issued one at a time from Python, so the GPU idles at a small
fraction of its peak (figures: docs/benchmarks.md, "On a GPU"). A CUDA graph
records one step's kernels once and replays them with a single launch. A graph replays fixed
shapes at fixed addresses, and the eager step's shapes change every step (the keys attended grow
by one column, the attention mask is rebuilt by concatenation), so ``StaticDecode`` runs a
different but equivalent step, ``decode_step``:

* the keys / values are written into the ``LeanCache``'s preallocated (B, Hkv, max_len, D)
  buffers at a column held in a device tensor (``index_copy_``), not a Python slice;
* every step attends over all ``max_len`` columns of those buffers with a boolean (B, max_len)
  mask: the columns seen so far as the eager step's mask has them (real tokens, and each row's own
  new column always), the columns not yet written masked out and zeroed first (the buffers are
  allocated uninitialised, and a masked column's zero weight times a NaN there would be NaN). A
  masked column then adds exactly zero to the attention, so the outputs are the eager step's up to
  float rounding in the attention kernel;
* positions, the column and the mask advance inside the step (each row's position by one where
  its new token is real, as ``HFPolicy.forward`` counts them).

``StaticDecode(graph=True)`` (CUDA) runs the step once eagerly for its first token (lazy
initialisation, kernel choice; its bookkeeping then rolled back), captures it into a
``torch.cuda.CUDAGraph`` and replays the graph at every step, its inputs copied into the graph's
fixed input tensors. Under CUDA autocast the step is captured with autocast's weight-cast cache
off (a cached cast would be a tensor of the capture's memory pool; the casts are replayed at each
step instead, as an eager step without gradient recomputes them). The graph reads the weights
where they are, so it is captured per sampling call (the cache buffers are new each call) and
dropped after it. ``graph=False`` runs the same step eagerly: what a CPU test compares with the
eager decode, bit for bit where the kernels agree.

It supports what the lean forward's usual CUDA decode path computes: no sliding window, no
attention logit soft-capping, a cache not in the grouped layout (a CPU layout), every layer's
buffers allocated (``supported`` says why not). ``HFPolicy.static_decoder`` returns one where
``model.cuda_graphs`` is on and these hold, else None (the eager step).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from rlvr.models.lean_llama import (LeanCache, RopeTable, _layer_out, _qkv_in, layer_rope_types, layer_windows,
                                    output_head, rms_norm)
from rlvr.models.sdpa import gpu_attention


def supported(hf_model: nn.Module, cache) -> str | None:
    """Why ``decode_step`` cannot run this model's decode over ``cache`` (None: it can)."""
    if not isinstance(cache, LeanCache):
        return "the cache is not a LeanCache (the transformers forward)"
    if cache.group > 1:
        return "the cache is in the grouped layout"
    if any(b is None for b in cache._kbuf) or any(b is None for b in cache._vbuf):
        return "the cache's buffers are not preallocated (a cache filled with gradient)"
    if any(w is not None for w in layer_windows(hf_model)):
        return "sliding-window attention"
    cfg = hf_model.config
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        return "final logit soft-capping"
    return None


def decode_step(hf_model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                col: torch.Tensor, cache: LeanCache, rope: RopeTable, block_size: int) -> torch.Tensor:
    """One decode step at shapes that do not change from step to step: logits (B, 1, V) in the head's dtype.

    ``ids`` (B, 1) the tokens fed; ``positions`` (B, 1) their positions; ``attend`` (B, max_len) bool
    the columns each row's query attends to (this step's column included); ``col`` (1,) long the
    column this step's keys / values are written to in ``cache``'s buffers (as (B, Hkv, max_len, D)
    views: ``LeanCache.key_view``);
    ``block_size`` the rotary tables' length (``RopeTable``: above every position). The layers as
    ``lean_forward``'s usual path computes them (``_qkv_in``, ``_layer_out``), with the whole
    buffers attended through ``attend``."""
    inner = hf_model.model
    cfg = hf_model.config
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    h = inner.embed_tokens(ids)                                                  # (B, 1, d)
    keys = layer_rope_types(hf_model)
    tables = {k: rope(hf_model, positions, h.dtype, block_size, k) for k in set(keys)}   # (B, 1, 1, D) each
    att = (False, None, None, None, attend[:, None, None, :])                    # SDPA's boolean (B, 1, 1, max_len)
    for li, layer in enumerate(inner.layers):
        cos, sin = tables[keys[li]]
        q, k, v = _qkv_in(layer, h, cos, sin, H, Hkv)                            # (B, 1, H, D), (B, Hkv, 1, D) x 2
        kb, vb = cache.key_view(li, cache.max_len), cache._vbuf[li]             # (B, Hkv, max_len, D)
        kb.index_copy_(2, col, k.to(kb.dtype))
        vb.index_copy_(2, col, v.to(vb.dtype))
        h = _layer_out(layer, h, q, kb, vb, att)
    return output_head(hf_model.lm_head, rms_norm(inner.norm, h))                 # no final soft-cap: supported


class StaticDecode:
    """The decode steps of one sampling call over a ``LeanCache`` (module docstring): ``step(tok,
    alive)`` feeds each row's token (B,) and whether it is real (B,) bool, and returns the float32
    logits (B, V) after it, as ``HFPolicy.forward(tok[:, None], attention_mask=alive[:, None],
    cache=cache)[:, -1]`` would; ``finish()`` leaves ``cache`` as those calls would have (its mask,
    positions and key / value views). ``graph``: capture the step as a CUDA graph at the first call
    and replay it (CUDA only); else run it eagerly."""

    def __init__(self, hf_model: nn.Module, cache: LeanCache, rope: RopeTable, block_size: int | None, *,
                 graph: bool):
        why = supported(hf_model, cache)
        if why is not None:
            raise ValueError(f"StaticDecode: {why}")
        B, M, dev = cache.batch_size, cache.max_len, cache.mask.device
        if graph and dev.type != "cuda":
            raise ValueError(f"StaticDecode(graph=True) needs a CUDA cache, not {dev}")
        self.hf_model, self.cache, self.rope, self.block_size, self.use_graph = hf_model, cache, rope, block_size, graph
        self.start = cache.length                                                 # columns before the first step
        self.steps = 0
        self.max_pos = int(cache.next_pos.max()) if B else 0                       # the first step's largest position
        # the rotary table's length, fixed: without a block size RopeTable would size it from the
        # positions' maximum, a device sync a graph capture does not allow
        self.rope_len = block_size if block_size is not None else self.max_pos + M - self.start
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)               # the graph's inputs
        self.real = torch.zeros(B, 1, dtype=torch.bool, device=dev)
        self.pos = cache.next_pos.clone().unsqueeze(1)                           # (B, 1): the step's own state
        self.col = torch.full((1,), self.start, dtype=torch.long, device=dev)
        self.attend = torch.zeros(B, M, dtype=torch.bool, device=dev)
        self.attend[:, :self.start] = cache.mask.bool()
        cache.grow(M)                                     # every column's buffer (a CPU cache's grow by steps)
        for li, vb in enumerate(cache._vbuf):             # the columns not written yet: uninitialised memory,
            cache.key_view(li, M)[:, :, self.start:].zero_()  # and a masked column's zero weight times a
            vb[:, :, self.start:].zero_()                # NaN there is NaN
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The ambient CUDA autocast without its weight-cast cache (module docstring), or nothing."""
        if self.ids.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
        return contextlib.nullcontext()

    def _body(self) -> torch.Tensor:
        """The step and its bookkeeping, all on the device: this column attended, the layers, then the
        column's mask set to whether the token is real, each position advanced where it is, the next column."""
        self.attend.index_fill_(1, self.col, True)                               # a row's own column: always
        with self._autocast(), gpu_attention(self.ids.device):
            logits = decode_step(self.hf_model, self.ids, self.pos, self.attend, self.col, self.cache, self.rope,
                                 self.rope_len)
        self.attend.index_copy_(1, self.col, self.real)
        self.pos.add_(self.real)
        self.col.add_(1)
        return logits[:, -1].float()                                              # (B, V)

    def _capture(self) -> None:
        """Run the step once eagerly on a side stream (the first use of every kernel), roll its
        bookkeeping back, and capture it (``torch.cuda.graph``). The eager run writes this step's
        keys / values, which every replay of this step writes again with the same inputs."""
        saved = (self.attend.clone(), self.pos.clone(), self.col.clone())
        side = torch.cuda.Stream(device=self.ids.device)
        side.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(side):
            self._body()
        torch.cuda.current_stream(self.ids.device).wait_stream(side)
        for t, s in zip((self.attend, self.pos, self.col), saved):
            t.copy_(s)
        g = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the run's other threads (a checkpoint copy, a reward pool's
        # thread) during the capture are theirs, not an error of this capture
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self.out = self._body()
        self.graph = g

    @torch.no_grad()
    def step(self, tok: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, V) after feeding ``tok`` (B,) long, real where ``alive`` (B,) bool. With a
        graph the tensor returned is the graph's output, overwritten by the next step."""
        if self.start + self.steps >= self.cache.max_len:
            raise ValueError(f"KV cache full: {self.start + self.steps} + 1 tokens > max_len {self.cache.max_len}")
        bs = self.block_size
        if bs is not None and self.max_pos + self.steps >= bs and int(self.pos.max()) >= bs:  # a bound first: no sync
            raise ValueError(f"position {int(self.pos.max())} >= block_size {bs} (max_position_embeddings)")
        self.ids.copy_(tok.view(-1, 1))
        self.real.copy_(alive.view(-1, 1))
        self.steps += 1
        if not self.use_graph:
            return self._body()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out

    def finish(self) -> None:
        """Leave the cache as the eager steps would have: its mask (B, S) long, each row's next
        position, and each layer's key / value views of the first S columns. The graph is dropped."""
        c, S = self.cache, self.start + self.steps
        c.mask = self.attend[:, :S].long()
        c.next_pos = self.pos.squeeze(1).clone()
        for li in range(len(c.k)):
            c.k[li], c.v[li] = c.key_view(li, S), c._vbuf[li][:, :, :S]
        self.graph = self.out = None
