"""The built-in policy: a nanoGPT-style decoder-only transformer with a preallocated KV cache.

Small enough to train from random init on a CPU in seconds, and read in one sitting.

- Pre-LayerNorm blocks, learned absolute positional embeddings, GELU MLP, no dropout (RL
  rollouts and the training forward must see the same function), no biases in Linear layers.
- Causal self-attention through ``F.scaled_dot_product_attention`` (on CPU, short sequences use
  three explicit ops instead, which are faster there; see ``attend``).
- Prompts are LEFT-padded. ``attention_mask`` (B, L) marks real tokens with 1; pad keys are never
  attended and positions are ``cumsum(attention_mask) - 1`` clamped at 0, so each row's first real
  token sits at position 0 and a padded prompt gives the same logits as the prompt alone. Pad
  *queries* attend to themselves only (so no row of the attention matrix is empty and no NaN
  appears); their outputs are garbage by design and must not be read.
- ``KVCache`` holds (n_layer, B, H, max_len, D) keys and values allocated once, plus the key mask
  and each row's next position; ``forward(..., cache=c)`` writes the new keys at ``c.length`` and
  attends over ``c[:length + L]``. Decoding token by token gives the full forward's logits.

Shapes: B rows, L tokens in this call, C = n_embd, H = n_head, D = C // H, V = vocab_size,
S = keys attended (cache.length + L with a cache, else L).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlvr.models.sdpa import gpu_attention

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class TinyConfig:
    """Shape of a ``TinyTransformer``."""

    vocab_size: int
    """Number of token ids (the tokenizer's ``vocab_size``)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    block_size: int = 64
    """Largest position + 1: real prompt tokens plus generated tokens must fit (padding does not count)."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``n_embd``."""
    tie_embeddings: bool = True
    """Use the token embedding matrix as the output head (no separate ``lm_head``)."""

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size", "mlp_ratio"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"TinyConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class KVCache:
    """Keys and values of every layer for ``batch_size`` rows and up to ``max_len`` tokens.

    ``k``, ``v``: (n_layer, B, H, max_len, D), allocated once. ``key_mask`` (B, max_len) bool is
    True on real (non-pad) tokens written so far; ``next_pos`` (B,) is each row's next position
    (its count of real tokens); ``length`` is the number of columns written.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 *, device=None, dtype=torch.float32):
        self.k = torch.zeros(n_layer, batch_size, n_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    def repeat_interleave(self, repeats: int) -> "KVCache":
        """A new cache whose row ``b`` is this cache's row ``b // repeats`` (prefill once, sample G)."""
        new = KVCache.__new__(KVCache)
        new.k = self.k.repeat_interleave(repeats, dim=1)
        new.v = self.v.repeat_interleave(repeats, dim=1)
        new.key_mask = self.key_mask.repeat_interleave(repeats, dim=0)
        new.next_pos = self.next_pos.repeat_interleave(repeats, dim=0)
        new.length = self.length
        return new

    fills_holes = True
    """``keep_rows`` moves only the kept rows that fill dropped rows' places (``rlvr.models.cache_rows``)."""

    def keep_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Keep only ``rows`` (n,) long, ascending, as rows 0 ... n-1 in place; returns the kept rows in
        their new order (row j is the old row ``order[j]``).

        The kept rows past n move into the dropped rows' places below n (``cache_rows.fill_holes``:
        a drop copies at most as many rows as it drops) in the same buffers (no new allocation of
        ``max_len`` columns), and ``k`` / ``v`` become views of the first n rows, so a later step
        computes and attends over n rows only (``rlvr.sampling``: finished rows leave)."""
        from rlvr.models.cache_rows import fill_holes

        order, dst, src = fill_holes(rows)
        n, S = rows.numel(), self.length
        if dst.numel():
            self.k[:, dst, :, :S] = self.k[:, src, :, :S]         # (n_layer, m, H, S, D); the gather copies first
            self.v[:, dst, :, :S] = self.v[:, src, :, :S]
        self.k, self.v = self.k[:, :n], self.v[:, :n]
        self.key_mask = self.key_mask[order]                      # (n, max_len)
        self.next_pos = self.next_pos[order]                      # (n,)
        return order


def attend(q, k, v, bias):
    """softmax(q k^T / sqrt(D) + bias) v: (B, H, L, D), (B, H, S, D) -> (B, H, L, D).

    ``bias`` (B or 1, 1, L, S) is 0 / -inf; ``None`` means plain causal with L == S. Off CPU this
    is ``F.scaled_dot_product_attention``. On CPU, for the short sequences this model sees, the
    three explicit ops below run forward + backward faster than SDPA's CPU flash kernel (figures:
    docs/benchmarks.md, "Figures behind the code's rules").
    """
    S = k.size(-2)
    if q.device.type != "cpu" or S > 512:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None)
    if bias is None:
        bias = torch.full((S, S), float("-inf"), device=q.device, dtype=q.dtype).triu(1)  # (L, S)
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-1, -2) + bias                        # (B, H, L, S)
    return torch.softmax(scores, dim=-1) @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x, bias, cache: KVCache | None, layer: int):
        B, L, C = x.shape
        H = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)                   # 3 x (B, L, C)
        q = q.view(B, L, H, C // H).transpose(1, 2)                 # (B, H, L, D)
        k = k.view(B, L, H, C // H).transpose(1, 2)                 # (B, H, L, D)
        v = v.view(B, L, H, C // H).transpose(1, 2)                 # (B, H, L, D)
        if cache is not None:
            s = cache.length
            cache.k[layer, :, :, s:s + L] = k
            cache.v[layer, :, :, s:s + L] = v
            k = cache.k[layer, :, :, :s + L]                        # (B, H, S, D)
            v = cache.v[layer, :, :, :s + L]                        # (B, H, S, D)
        y = attend(q, k, v, bias)                                   # (B, H, L, D)
        y = y.transpose(1, 2).reshape(B, L, C)                      # (B, L, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):                                           # (B, L, C) -> (B, L, C)
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x, bias, cache, layer):                       # (B, L, C) -> (B, L, C)
        x = x + self.attn(self.ln_1(x), bias, cache, layer)
        return x + self.mlp(self.ln_2(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer: ``forward(ids) -> logits``; see the module docstring.

    Meets ``rlvr.policy.Policy``: its KV cache is written in place (not differentiable), it has no
    adapter (a KL reference is a frozen copy), and every parameter is trained."""

    differentiable_cache = False
    has_adapter = False

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # nanoGPT init: N(0, 0.02); residual projections scaled down by sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                logits_to_keep: int | None = None) -> torch.Tensor:
        """Logits (B, L, V) for ``ids`` (B, L); (B, logits_to_keep, V) for the last positions only.

        ``attention_mask`` (B, L) of 1/0 marks real tokens (prompts are left-padded); ``None``
        means all real. ``positions`` (B, L) overrides ``cumsum(mask) - 1`` (clamped at 0; with a
        cache, offset by each row's ``cache.next_pos``). With ``cache`` the new keys/values are
        appended at ``cache.length`` and attention runs over everything cached so far.
        """
        B, L = ids.shape
        start = 0 if cache is None else cache.length
        if cache is not None and start + L > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {L} tokens > max_len {cache.max_len}")
        am = None if attention_mask is None else attention_mask.to(dtype=torch.long)  # (B, L)

        if positions is None:
            if am is None:
                positions = torch.arange(L, device=ids.device).unsqueeze(0)          # (1, L)
            else:
                positions = (am.cumsum(1) - 1).clamp_min(0)                          # (B, L)
            if cache is not None:
                positions = positions + cache.next_pos.unsqueeze(1)                  # (B, L)
        if cache is None and int(positions.max()) >= self.config.block_size:
            raise ValueError(f"position {int(positions.max())} >= block_size {self.config.block_size}")

        # bias (B or 1, 1, L, S): 0 where a query may attend, -inf elsewhere; None = plain causal
        if cache is None and am is None:
            bias = None
        else:
            if cache is not None:
                cache.key_mask[:, start:start + L] = True if am is None else am.bool()
                key_real = cache.key_mask[:, :start + L]            # (B, S)
            else:
                key_real = am.bool()                                # (B, S), S = L
            q_idx = torch.arange(start, start + L, device=ids.device).unsqueeze(1)   # (L, 1)
            k_idx = torch.arange(start + L, device=ids.device).unsqueeze(0)          # (1, S)
            allowed = ((k_idx <= q_idx) & key_real.unsqueeze(1)) | (k_idx == q_idx)  # (B, L, S)
            bias = torch.zeros(allowed.shape, device=ids.device, dtype=self.wte.weight.dtype)
            bias = bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)           # (B, 1, L, S)

        x = self.wte(ids) + self.wpe(positions)                     # (B, L, C)
        with gpu_attention(ids.device):                             # no cuDNN attention on CUDA (rlvr.models.sdpa)
            for i, block in enumerate(self.blocks):
                x = block(x, bias, cache, i)                        # (B, L, C)
        if cache is not None:
            cache.length += L
            cache.next_pos += L if am is None else am.sum(1)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:]                              # (B, K, C)
        x = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(x, self.wte.weight)                     # (B, L or K, V)
        return self.lm_head(x)                                      # (B, L or K, V)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty ``KVCache`` for ``batch_size`` rows and ``max_len`` columns (pads included)."""
        c = self.config
        w = self.wte.weight
        return KVCache(c.n_layer, batch_size, c.n_head, max_len, c.n_embd // c.n_head,
                       device=w.device, dtype=w.dtype)

    def adapter_disabled(self):
        """No adapter to disable: a reference for this model is a frozen copy (see ``has_adapter``)."""
        raise ValueError("adapter_disabled(): the built-in model has no adapter; use a frozen copy as reference")

    def trainable_params(self) -> list[nn.Parameter]:
        """The parameters with ``requires_grad``: give these to the optimizer."""
        return [p for p in self.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ accounting
    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: float | None = None, *, training: bool = True) -> int:
        """nanoGPT / PaLM estimate of FLOPs per token.

        N = parameters used in matrix multiplies (every Linear plus the output head; the position
        embedding and LayerNorms are excluded, as is an untied input embedding, which is a lookup).
        Training (forward + backward): ``6 N + 12 n_layer n_embd seq_len``; forward only:
        ``2 N + 4 n_layer n_embd seq_len``. The attention term counts QK^T and AV over all
        ``seq_len`` keys (default ``block_size``), so for causal attention over T tokens it is an
        upper bound by about 2x; ``rlvr.costs.attended_keys(prompt_tokens, response_tokens)``, the
        mean keys a token attends to, is the exact ``seq_len`` for a run.
        """
        c = self.config
        T = c.block_size if seq_len is None else seq_len
        n = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        if self.lm_head is None:
            n += self.wte.weight.numel()
        return round(6 * n + 12 * c.n_layer * c.n_embd * T) if training else round(2 * n + 4 * c.n_layer * c.n_embd * T)

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (created if missing)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(d / WEIGHTS_NAME), metadata={"format": "pt"})
        cfg = {"model_type": "rlvr-tiny", **asdict(self.config)}
        (d / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: str | torch.device = "cpu") -> "TinyTransformer":
        """Load a model written by ``save_pretrained``."""
        from safetensors.torch import load_file

        d = Path(directory)
        raw = json.loads((d / CONFIG_NAME).read_text(encoding="utf-8"))
        if raw.get("model_type", "rlvr-tiny") != "rlvr-tiny":
            raise ValueError(f"{d / CONFIG_NAME}: model_type {raw['model_type']!r} is not 'rlvr-tiny'")
        known = {f.name for f in fields(TinyConfig)}
        unknown = set(raw) - known - {"model_type"}
        if unknown:
            raise ValueError(f"{d / CONFIG_NAME}: unknown TinyConfig fields {sorted(unknown)}")
        model = cls(TinyConfig(**{k: v for k, v in raw.items() if k in known}))
        model.load_state_dict(load_file(str(d / WEIGHTS_NAME), device=str(device)), strict=True)
        return model.to(device)
