"""The sampling distribution and its draws: truncation to a nucleus (top-k, top-p, min-p, in
transformers' order: rlvr.sampling's docstring), the log-probs sampled from, per-prompt seeding,
and the inverse-CDF draws a decode step takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------- the sampling distribution
def truncates(top_p: float, top_k: int = 0, min_p: float = 0.0) -> bool:
    """Whether these settings cut the tempered distribution down to a nucleus (``nucleus_mask``)."""
    return top_p < 1.0 or top_k > 0 or min_p > 0.0


def nucleus_mask(z: torch.Tensor, top_p: float, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Bool mask (..., V), True on the nucleus of ``softmax(z)``: the ``top_k`` most probable tokens
    (0: all), of those the smallest prefix whose mass renormalized over them reaches ``top_p``, of
    those the tokens with at least ``min_p`` times the top token's probability (module docstring;
    no gradient)."""
    with torch.no_grad():
        probs = torch.softmax(z.float(), dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p                      # mass before each token
        if top_k > 0:
            in_k = torch.arange(sorted_p.size(-1), device=z.device) < top_k
            mass_k = sorted_p[..., :top_k].sum(-1, keepdim=True)    # top_p over the top-k, renormalized
            keep_sorted = in_k & (before < top_p * mass_k) if top_p < 1.0 else in_k.expand_as(sorted_p)
        else:
            keep_sorted = before < top_p
        if min_p > 0.0:
            keep_sorted = keep_sorted & (sorted_p >= min_p * sorted_p[..., :1])
        return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sampling_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      min_p: float = 0.0) -> torch.Tensor:
    """log-probs (..., V) of the distribution sampled from: log_softmax of the tempered nucleus.

    -inf outside the nucleus. ``temperature == 0`` means greedy: the temperature-1 full softmax.
    """
    if temperature == 0:
        return F.log_softmax(logits.float(), dim=-1)
    z = logits.float() / temperature
    if truncates(top_p, top_k, min_p):
        z = z.masked_fill(~nucleus_mask(z, top_p, top_k, min_p), float("-inf"))
    return F.log_softmax(z, dim=-1)


def check_sampling_args(temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0 or int(top_k) != top_k:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1) (0 = off), got {min_p}")


# ---------------------------------------------------------------------- per-prompt seeding
_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive prompt indices over the seed space


def draw_base_seed(generator: torch.Generator) -> int:
    """One 62-bit number from `generator`: the seed of one sampling call (a step's round of prompts).
    The per-prompt generators derive from it, so a sharded call draws the same rows."""
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device).item())


def prompt_generators(base_seed: int, first: int, n: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """Generators of the prompts `first`, ..., `first + n - 1` of a sampling call seeded with
    `base_seed`: prompt i's seed is a function of (base_seed, i) only, so its G responses do not
    depend on which other prompts are sampled with it (sharding over rollout workers, chunking)."""
    return [torch.Generator(device=device).manual_seed((base_seed + _MIX * (first + i + 1)) % 2 ** 63)
            for i in range(n)]


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities (rows may sum to 1 ± rounding), (B,) uniforms in [0, 1) -> (B,) token ids:
    the first token whose cumulative mass exceeds u · total. Zero-probability tokens (outside the
    nucleus) are never drawn: their cumulative mass equals their predecessor's."""
    cdf = probs.float().cumsum(-1)                                            # (B, V)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)  # (B,)
    tok = tok.clamp(max=probs.size(1) - 1)
    # u · total rounding up to the total lands past the last token: take the most likely one instead
    drawn = probs.gather(1, tok.unsqueeze(1)).squeeze(1) > 0                 # (B,)
    if probs.device.type == "cpu" and bool(drawn.all()):  # the usual case: skip the argmax pass over (B, V)
        return tok
    return torch.where(drawn, tok, probs.argmax(-1))


SAMPLE_BLOCK = 1024
"""Vocabulary block of ``sample_tempered``: the cumulative mass is taken over blocks first, then
inside the one block the draw lands in, instead of one running sum over the whole vocabulary."""


def sample_tempered(logits: torch.Tensor, temperature: float, u: torch.Tensor,
                    block: int = SAMPLE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits, temperature > 0, (B,) uniforms in [0, 1) -> (B,) tokens and (B,) their log-probs
    under ``softmax(logits / temperature)``: the draw of ``inverse_cdf_sample`` (the first token whose
    cumulative mass exceeds u · total; rounding that puts it past the end takes the last token, or
    the most likely one where that token has no mass) and the log-prob of ``sampling_logprobs`` at
    top_p = 1, each equal up to float rounding, in fewer passes over (B, V): a decode step's sampling.

    ``p = softmax(z)`` in one fused pass; the mass is summed per ``block`` tokens, the block where
    the cumulative mass passes u · total is found, and only that block's running sum is taken (a
    running sum over all of V is a sequential pass, the slowest of the old ones). A block or token
    without mass is never chosen: its cumulative mass equals its predecessor's. log p(token) =
    (z_token - max z) + log(p at the argmax), since p at the argmax is 1 / sum exp(z - max z): no
    logarithm of a tiny probability."""
    B, V = logits.shape
    z = logits.float() / temperature                                          # (B, V)
    p = torch.softmax(z, dim=-1)                                              # (B, V)
    full = V // block * block
    sums = p[:, :full].view(B, -1, block).sum(-1)                             # (B, V // block)
    if full < V:
        sums = torch.cat([sums, p[:, full:].sum(-1, keepdim=True)], dim=1)   # (B, nb)
    cum = sums.cumsum(-1)                                                     # (B, nb)
    thr = u.to(cum.dtype) * cum[:, -1]                                        # (B,)
    b = torch.searchsorted(cum, thr[:, None], right=True).squeeze(1).clamp(max=cum.size(1) - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    idx = b[:, None] * block + torch.arange(block, device=p.device)          # (B, block)
    w = p.gather(1, idx.clamp(max=V - 1)).masked_fill_(idx >= V, 0.0)         # (B, block) the block's p
    j = torch.searchsorted(w.cumsum(-1), (thr - before)[:, None], right=True).squeeze(1)  # (B,)
    tok = (b * block + j.clamp(max=block - 1)).clamp(max=V - 1)               # (B,)
    drawn = p.gather(1, tok[:, None]).squeeze(1) > 0
    if p.device.type != "cpu" or not bool(drawn.all()):  # the usual CPU case skips the argmax pass
        tok = torch.where(drawn, tok, p.argmax(-1))
    logp = (z.gather(1, tok[:, None]).squeeze(1) - z.amax(-1)) + torch.log(p.amax(-1))
    return tok, logp
