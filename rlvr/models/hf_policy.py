"""``HFPolicy``: a transformers causal LM (optionally under a peft LoRA wrapper) with the rlvr policy surface.

``HFPolicy`` has the surface ``rlvr.sampling`` uses: ``forward(ids, *, attention_mask,
positions, cache, logits_to_keep) -> float32 logits``, ``new_cache(batch_size, max_len)``,
``config.block_size``, ``num_params()``, ``flops_per_token()``, ``save_pretrained()``. So
``sampling.generate`` and ``scoring.sequence_token_logprobs`` work unchanged, and the logp
stored at sampling time equals the trainer's recomputation (to float rounding; tested at 1e-5).

A plain ``LlamaForCausalLM`` (or Mistral, Qwen 2, Qwen 3: ``lean_families``) runs through the
lean forward of ``rlvr.models.lean_llama`` (same logits, a fraction of transformers' per-call
overhead); ``fast=False`` or ``policy.fast_path = False`` force the transformers forward, and
``policy.fast_unsupported`` says why a model cannot take the lean one (None = it can). Conventions (left padding, positions, dropout off) are in
``rlvr.models.hf``. ``transformers`` is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from pathlib import Path

import torch
import torch.nn as nn

from rlvr.models.lean_llama import (LeanCache, RopeTable, init_rows, lean_forward, lean_forward_shared,
                                    lean_llama_unsupported, peft_unsupported, repeat_rows, sliding_window)
from rlvr.models.hf_source import no_progress_bars
from rlvr.models.sdpa import gpu_attention


# ---------------------------------------------------------------------- cache
class HFCache:
    """transformers' ``DynamicCache`` plus the running attention mask and each row's next position.

    ``mask`` (B, length) long is the attention mask of every column seen so far (HF needs the full
    mask on each call); ``next_pos`` (B,) is each row's count of real tokens; ``max_len`` is the
    column budget (the DynamicCache grows, but a call past ``max_len`` raises like ``KVCache``).
    """

    def __init__(self, dynamic_cache, batch_size: int, max_len: int, device):
        init_rows(self, batch_size, max_len, device)
        self.dc = dynamic_cache

    length = property(lambda self: self.mask.size(1))
    batch_size = property(lambda self: self.mask.size(0))

    def repeat_interleave(self, repeats: int) -> "HFCache":
        """Row b becomes rows b*repeats ... b*repeats+repeats-1. IN PLACE (DynamicCache repeats in
        place); returns ``self`` so it can be used like ``KVCache.repeat_interleave``."""
        self.dc.batch_repeat_interleave(repeats)
        repeat_rows(self, repeats)
        return self

    def keep_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Keep only ``rows`` (n,) long, ascending, as rows 0 ... n-1 (in place; DynamicCache
        selects its rows in place); returns ``rows`` (``rlvr.models.cache_rows``)."""
        self.dc.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]
        return rows


class _BlockConfig:
    """The bit of config ``rlvr.sampling`` reads (``block_size``), plus the HF config."""

    def __init__(self, hf_config, block_size: int | None):
        self.hf = hf_config
        self.block_size = block_size
        self.vocab_size = getattr(hf_config, "vocab_size", None)


def _block_size(cfg) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


# ---------------------------------------------------------------------- policy
def _layers_sharded(hf_model: nn.Module) -> bool:
    """True when the decoder layers are wrapped with FSDP2's `fully_shard` (a learner group's training copy)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False  # no process group, no sharding
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(layer, FSDPModule) for layer in hf_model.model.layers[:1])


class HFPolicy(nn.Module):
    """A ``transformers`` causal LM (optionally a peft LoRA model) with the rlvr policy surface."""

    differentiable_cache = True
    """Its KV cache (``LeanCache`` or DynamicCache, both grown with torch.cat) carries gradients, so
    the trainer may run a group's shared prompt once (``rlvr.scoring.sequence_token_logprobs(group_size=G)``)."""

    takes_float_logits = True
    """``forward`` takes ``float_logits`` (False: the head's own dtype, upcast later by the caller)."""

    def __init__(self, model: nn.Module, *, source: str | None = None, load_note: str = "", fast: bool = True):
        super().__init__()
        self.model = model
        self.source = source
        self.load_note = load_note
        hf_cfg = model.config
        self.config = _BlockConfig(hf_cfg, _block_size(hf_cfg))
        fwd = self._hf_model().forward
        params = inspect.signature(fwd).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        # transformers >= 5.2x renamed past_key_values -> cache (the old name warns)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.fast_path = bool(fast)
        """Use the lean Llama forward when the model supports it (``fast_unsupported`` is None).
        Set False to force the transformers forward (an escape hatch; also what the tests compare to)."""
        self.fast_unsupported: str | None = (lean_llama_unsupported(self._hf_model())
                                             or peft_unsupported(self.model))
        """Why the lean Llama forward cannot be used for this model (None = it can)."""
        self.sliding_window: int | None = sliding_window(self._hf_model())
        """The model's narrowest sliding attention window (None: none); the lean forward masks each
        layer's as transformers does."""
        self._rope = RopeTable()
        self.checkpoint_layers = False
        """Training forwards with gradient run the lean forward's layers checkpointed
        (``enable_gradient_checkpointing``)."""
        self.cuda_graphs = False
        """Decode steps over a lean cache on a CUDA device replay one CUDA graph per sampling call
        (``static_decoder``; model.cuda_graphs). False: every step runs eagerly."""
        self.compile_layers = False
        """The lean forward's calls of more than one token a row (prefills, training and scoring
        forwards) run each Llama-type decoder layer compiled (``torch.compile``; model.compile), and
        ``rlvr.scoring.sequence_token_logprobs`` the token log-probs."""
        self.static_decode_off_gpu = False
        """Run ``static_decoder``'s fixed-shape step eagerly off a GPU too (for tests: the step a
        graph captures, compared with the eager decode on a CPU)."""

    # ------------------------------------------------------------------ structure
    @property
    def has_adapter(self) -> bool:
        return hasattr(self.model, "disable_adapter") and hasattr(self.model, "peft_config")

    def _hf_model(self) -> nn.Module:
        """The transformers model (under the peft wrapper when there is one)."""
        return self.model.get_base_model() if self.has_adapter else self.model

    @property
    def hf_config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: HFCache | None = None,
                logits_to_keep: int | None = None, float_logits: bool = True,
                shared_prompt: tuple[int, int] | None = None) -> torch.Tensor:
        """Float32 logits (B, L, V), or (B, logits_to_keep, V) for the last positions only;
        ``float_logits=False`` leaves them in the dtype the head computed (bf16 under autocast), for
        a caller that upcasts them a chunk at a time (rlvr.scoring.sequence_token_logprobs: the
        same log-probs and gradients, without a float32 copy of every logit and of its gradient).

        ``attention_mask`` (B, L) marks real tokens (None = all real). With ``cache`` the mask
        columns are appended to ``cache.mask`` and positions continue from ``cache.next_pos``.
        ``positions`` (B, L) overrides the computed position ids. ``shared_prompt`` = (prompt_len,
        group_size): ``shared_prompt_logits``'s pair instead (how a wrapper whose forward must run,
        DistributedDataParallel's, asks for it).
        """
        if shared_prompt is not None:
            return self.shared_prompt_logits(ids, attention_mask, *shared_prompt, float_logits=float_logits)
        B, L = ids.shape
        am = (torch.ones_like(ids, dtype=torch.long) if attention_mask is None
              else attention_mask.to(device=ids.device, dtype=torch.long))                  # (B, L)
        if cache is not None:
            if cache.length + L > cache.max_len:
                raise ValueError(f"KV cache full: {cache.length} + {L} tokens > max_len {cache.max_len}")
            full_am = torch.cat([cache.mask, am], dim=1)                                    # (B, S)
        else:
            full_am = am
        if positions is None:
            positions = self._positions(am, None if cache is None else cache.next_pos)   # (B, L)
        self._check_positions(positions)

        if isinstance(cache, LeanCache) or (cache is None and self._lean_active()):
            with gpu_attention(ids.device):
                logits = lean_forward(self._hf_model(), ids, full_am, positions, cache, logits_to_keep,
                                      self._rope, self.config.block_size,
                                      checkpoint=self.checkpoint_layers and self.training,
                                      compiled=self.compile_layers)
            if cache is not None:
                cache.mask = full_am
                cache.next_pos = cache.next_pos + am.sum(1)
            return logits.float() if float_logits else logits

        kwargs = dict(input_ids=ids, attention_mask=full_am, position_ids=positions,
                      use_cache=cache is not None, return_dict=True)
        if cache is not None:
            kwargs[self._cache_kw] = cache.dc
        if logits_to_keep is not None and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = int(logits_to_keep)
        with gpu_attention(ids.device):
            out = self.model(**kwargs)
        logits = out.logits
        if logits_to_keep is not None and logits.size(1) != logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        if cache is not None:
            cache.mask = full_am
            cache.next_pos = cache.next_pos + am.sum(1)
            new_dc = out.get("cache") if "cache" in out else out.get("past_key_values")
            if new_dc is not None and new_dc is not cache.dc:
                cache.dc = new_dc
        return logits.float() if float_logits else logits

    @staticmethod
    def _positions(am: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
        """Position ids (B, L) of tokens with mask ``am`` (B, L): each real token's count of real
        tokens before it in this call (pads take 0, or the next real one's), plus ``start`` (B,),
        the next position of each row's cache (None: 0)."""
        positions = (am.cumsum(1) - 1).clamp_min(0)
        return positions if start is None else positions + start.unsqueeze(1)

    def _check_positions(self, positions: torch.Tensor) -> None:
        """A clear error for a position beyond the model's ``max_position_embeddings``."""
        bs = self.config.block_size
        if bs is not None and positions.numel() and int(positions.max()) >= bs:
            raise ValueError(f"position {int(positions.max())} >= block_size {bs} (max_position_embeddings)")

    @property
    def one_pass_shared_prompt(self) -> bool:
        """Whether ``shared_prompt_logits`` runs a group's prompt and responses in one pass now (the
        lean forward is active)."""
        return self._lean_active()

    def shared_prompt_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, group_size: int,
                             float_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A group's prompt run once for its ``group_size`` rows, prompt and responses in one pass
        over the layers (``lean_forward_shared``): for ``ids`` / ``attention_mask`` (B, Lp + T) whose
        rows b*G ... b*G+G-1 share their first ``prompt_len`` columns, the logits (P, 1, V) of each
        prompt's last position and (B, T - 1, V) of the responses' first T - 1 tokens, what a
        forward of the prompts into a cache and one of the responses over it give, to float
        rounding (its layers checkpointed as ``forward``'s are). None where the lean forward does not
        run now (``one_pass_shared_prompt``; the caller then makes those two calls) or no response
        has a token to score past its first (T < 2: the prompts' call alone)."""
        if not self.one_pass_shared_prompt or ids.size(1) - prompt_len < 2:
            return None
        G, Lp = group_size, prompt_len
        am = attention_mask.to(device=ids.device, dtype=torch.long)
        am_p, am_r = am[::G, :Lp], am[:, Lp:-1]                       # the prompts' (P, Lp), the responses' (B, T-1)
        pos_p = self._positions(am_p, None)
        pos_r = self._positions(am_r, am_p.sum(1).repeat_interleave(G))  # continuing each row's prompt
        self._check_positions(pos_r)
        with gpu_attention(ids.device):
            first, resp = lean_forward_shared(self._hf_model(), ids[::G, :Lp], am_p, pos_p, ids[:, Lp:-1], am_r, pos_r,
                                              self._rope, self.config.block_size,
                                              checkpoint=self.checkpoint_layers and self.training,
                                              compiled=self.compile_layers)
        return (first.float(), resp.float()) if float_logits else (first, resp)

    def new_cache(self, batch_size: int, max_len: int) -> HFCache | LeanCache:
        """An empty cache for ``batch_size`` rows: a ``LeanCache`` when the lean Llama forward is in
        use, else an ``HFCache`` (DynamicCache built from the model config). ``forward`` picks the
        path from the cache's type, so a cache keeps its path even if ``fast_path`` changes."""
        if self._lean_active():
            return LeanCache(self._hf_model().config.num_hidden_layers, batch_size, max_len,
                             next(self.model.parameters()).device)
        from transformers import DynamicCache

        try:
            dc = DynamicCache(config=self._hf_model().config)
        except TypeError:  # older transformers
            dc = DynamicCache()
        return HFCache(dc, batch_size, max_len, next(self.model.parameters()).device)

    def static_decoder(self, cache) -> "StaticDecode | None":
        """The decode steps of one sampling call over ``cache`` at fixed shapes (rlvr.models.decode_graph):
        replayed as a CUDA graph on a CUDA device with ``cuda_graphs`` on; run eagerly elsewhere where
        ``static_decode_off_gpu`` is set; None otherwise, or where the model or cache is not supported
        (``decode_graph.supported``): the caller then calls ``forward`` per step."""
        from rlvr.models import decode_graph

        cuda = cache.mask.device.type == "cuda" if isinstance(cache, LeanCache) else False
        if not (cuda and self.cuda_graphs) and not self.static_decode_off_gpu:
            return None
        if torch.is_grad_enabled() or decode_graph.supported(self._hf_model(), cache) is not None:
            return None
        return decode_graph.StaticDecode(self._hf_model(), cache, self._rope, self.config.block_size,
                                         graph=cuda and self.cuda_graphs)

    # ------------------------------------------------------------------ lean Llama forward
    @property
    def uses_fast_path(self) -> bool:
        """True when a call without a cache would take the lean Llama forward now."""
        return self._lean_active()

    def _lean_active(self) -> bool:
        """Whether a forward takes the lean forward now."""
        if not self.fast_path or self.fast_unsupported is not None:
            return False
        # gradient checkpointing lives in transformers' layer call; honour it by falling back
        if self.training and getattr(self._hf_model().model, "gradient_checkpointing", False):
            return False
        # so does FSDP2's gathering of a sharded layer's weights (rlvr.distributed.fsdp): the lean
        # forward calls a layer's parts, never the layer, so its hooks would not run
        return not _layers_sharded(self._hf_model())

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer in the backward of a training forward: the lean forward's
        checkpointed halves (``lean_forward(checkpoint=True)``: the shared prompt's cache still works),
        or for a model outside the lean forward transformers' own (non-reentrant, so LoRA's frozen
        inputs need no gradient hook), which runs a layer without a cache, so the training forward then
        covers whole rows (``differentiable_cache`` False)."""
        if self.fast_unsupported is None:
            self.checkpoint_layers = True
            return
        hf = self._hf_model()
        if hasattr(hf, "activation_checkpointing_enable"):      # transformers >= 5.2x's name
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.differentiable_cache = False

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether a training forward recomputes its layers in the backward (``enable_gradient_checkpointing``)."""
        # transformers' own flag, on whichever modules carry it (GPT-2's live under .transformer)
        return self.checkpoint_layers or any(getattr(m, "gradient_checkpointing", False) is True
                                             for m in self._hf_model().modules())

    # ------------------------------------------------------------------ LoRA reference
    @contextlib.contextmanager
    def adapter_disabled(self):
        """Run the base model (adapter off) inside the block: the reference policy without a copy.

        ``with torch.no_grad(), policy.adapter_disabled(): logp_ref = sequence_token_logprobs(policy, ...)``.
        Raises ``ValueError`` for a policy without a LoRA adapter (deep-copy it for a reference).
        """
        if not self.has_adapter:
            raise ValueError("adapter_disabled(): this policy has no LoRA adapter; use a frozen copy as reference")
        with self.model.disable_adapter():
            yield self

    reference = adapter_disabled

    # ------------------------------------------------------------------ accounting
    def num_params(self) -> int:
        """Distinct parameters (tied weights once; LoRA adapter weights included)."""
        return sum(p.numel() for p in self.model.parameters())

    def trainable_params(self) -> list[nn.Parameter]:
        """The parameters with ``requires_grad`` (the adapter only under LoRA): give these to the optimizer."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _matmul_params(self) -> tuple[int, int]:
        """(all, trainable) weight elements of Linear / GPT-2 Conv1D layers, the output head included."""
        n = n_train = 0
        for m in self.model.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor) and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
                n += w.numel()
                n_train += w.numel() if w.requires_grad else 0
        return n, n_train

    def flops_per_token(self, seq_len: float | None = None, *, training: bool = True) -> int:
        """FLOPs per token: forward ``2 N + 4 n_layer d_att seq_len``; training adds the backward.

        N = weights of every Linear (and GPT-2 Conv1D), output head included, input embedding
        excluded (a lookup); LoRA A/B matrices count as Linear layers. The backward costs 2 N for
        input gradients plus 2 N_trainable for weight gradients, so training is
        ``4 N + 2 N_trainable + 12 n_layer d_att seq_len`` — the usual 6 N for full fine-tuning,
        nearer 4 N under LoRA. ``d_att`` = query heads x head dim (the hidden size, except where the
        config sets a wider head_dim: Qwen 3). ``seq_len`` is the mean number of keys a token attends
        to: pass the run's ``rlvr.costs.attended_keys(prompt_tokens, response_tokens)`` (``rlvr.costs.
        model_flops_per_token`` does); the default, ``block_size`` (the model's maximum context, 8,192
        for SmolLM2), is only a loose upper bound. With gradient checkpointing training adds the decoder
        layers' forward once more (``2 (N - N_head) + 4 n_layer d_att seq_len``; the head is not recomputed).
        """
        cfg = self._hf_model().config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        n_layer = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
        d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
        heads, head_dim = getattr(cfg, "num_attention_heads", None), getattr(cfg, "head_dim", None)
        d = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else d   # d_att
        T = (self.config.block_size or 0) if seq_len is None else seq_len
        n, n_train = self._matmul_params()
        if training:
            head = self._hf_model().get_output_embeddings()
            recompute = (2 * (n - head.weight.numel()) + 4 * n_layer * d * T) if self.gradient_checkpointing else 0
            return round(4 * n + 2 * n_train + 12 * n_layer * d * T + recompute)
        return round(2 * n + 4 * n_layer * d * T)

    # ------------------------------------------------------------------ save
    def merged_model(self) -> nn.Module:
        """A plain transformers model with the adapter merged in (a copy; the live model is untouched).

        Without an adapter, the wrapped model itself.
        """
        if not self.has_adapter:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()

    def save_pretrained(self, directory: str | Path) -> None:
        """HF format into ``directory``: ``model.safetensors`` (sharded when large) + ``config.json``.

        With LoRA the weights are merged (on a copy) and the adapter alone goes to ``directory/adapter``.
        Tokenizer files are written by ``HFTokenizer.save`` (``export_hf`` does both).
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        with no_progress_bars():
            merged = self.merged_model()
            merged.save_pretrained(str(d), safe_serialization=True)
            if self.has_adapter:
                self.model.save_pretrained(str(d / "adapter"), safe_serialization=True)

