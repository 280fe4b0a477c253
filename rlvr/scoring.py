"""The trainer's side of the sampling distribution: the log-probs of a rollout's tokens recomputed
with gradient (``sequence_token_logprobs``), under the distribution rlvr.sampling drew them from
(its module docstring: temperature, the nucleus, the KL's untruncated side), and the scoring
forwards' length buckets (``length_buckets``: each bucket of rows forwarded to its own longest row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlvr.draws import check_sampling_args, nucleus_mask, truncates
from rlvr.logprobs import AUTO_CHUNK, entropy_from_logits, resolve_chunk_rows, token_logprobs
from rlvr.models import cache_rows
from rlvr.rollout_data import Rollout

OUTSIDE_NUCLEUS_LOGP = -30.0
"""Finite stand-in for log(0): the recomputed logp of a token outside the current nucleus."""


class TokenLogprobs(NamedTuple):
    """What ``sequence_token_logprobs(..., return_full=, return_entropy=)`` returns, each (B, T) with
    gradient and 0 off the response mask; a field not asked for is None."""

    logp: torch.Tensor
    """Under the sampling distribution (tempered nucleus): the ratio's numerator."""
    logp_full: torch.Tensor | None
    """Under the tempered distribution without the nucleus: the KL's side (``logp`` without truncation)."""
    entropy: torch.Tensor | None
    """Entropy of the tempered distribution without the nucleus (rlvr.logprobs.entropy_from_logits)."""


def _nucleus_token_logprobs(logits, ids, *, temperature, top_p, top_k=0, min_p=0.0, chunk_rows=None):
    """(nucleus, full) log-probs at ids from one log-softmax; chunked over rows.

    full = log_softmax(logits / temperature) at ids; nucleus = full - logsumexp(full over the
    nucleus) inside the nucleus (log of the renormalised nucleus probability, ``sampling_logprobs``
    to float rounding), ``OUTSIDE_NUCLEUS_LOGP`` outside it (no gradient there)."""
    B, T = logits.shape[:2]
    if chunk_rows == AUTO_CHUNK:                                   # auto_chunk_rows counts (row, position) pairs
        chunk_rows = max(1, resolve_chunk_rows(chunk_rows, logits) // max(1, T))
    step = B if not chunk_rows else chunk_rows
    nuc_parts, full_parts = [], []
    for s in range(0, B, step):
        z = logits[s:s + step].float() / temperature                             # (b, T, V)
        full = F.log_softmax(z, dim=-1)                                          # (b, T, V)
        tok = ids[s:s + step].unsqueeze(-1)                                      # (b, T, 1)
        lp_full = full.gather(-1, tok).squeeze(-1)                               # (b, T)
        keep = nucleus_mask(z, top_p, top_k, min_p)                              # (b, T, V)
        log_mass = torch.logsumexp(full.masked_fill(~keep, float("-inf")), dim=-1)  # (b, T) <= 0
        inside = keep.gather(-1, tok).squeeze(-1)                                # (b, T)
        nuc_parts.append(torch.where(inside, lp_full - log_mass, torch.full_like(lp_full, OUTSIDE_NUCLEUS_LOGP)))
        full_parts.append(lp_full)
    cat = (lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=0))
    return cat(nuc_parts), cat(full_parts)


def response_extent(mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: for each row of a (B, T) response mask, 1 + the last column where it is non-zero
    (0 for an empty row): the columns a scoring forward must reach for that row."""
    cols = torch.arange(1, mask.size(1) + 1, device=mask.device)                  # (T,)
    return ((mask != 0).long() * cols).amax(dim=1) if mask.size(1) else mask.new_zeros(mask.size(0), dtype=torch.long)


BUCKET_CALL_TOKENS = 32
"""What one more forward costs, in response positions, as ``length_buckets`` weighs a cut: a
forward's fixed cost (a pass over the layers, its launches and Python) against the padding a cut
saves. Larger: fewer, wider buckets; 0: a bucket per distinct length. Set at the low end of the
fixed cost measured on a small chat model (docs/benchmarks.md): at chain-of-thought length spreads
the step's total is flat across that range, and the low end computes the least padding."""


PADDING_CAP = 0.10
"""The most padding ``length_buckets`` leaves in a forward, as a fraction of the response positions
it computes: where the cuts that ``BUCKET_CALL_TOKENS`` weighs leave more (a few long rows among
short ones in a small part), the rows are cut again with half the call cost, down to a bucket per
distinct length (no padding). A forward's padding is computed and thrown away; a bound on it holds
at every step, where the call cost alone only balances it on average."""


def _bucket_cuts(e: list[int], call_tokens: int) -> tuple[list[tuple[int, int]], int]:
    """The cuts [(first, end)] of sorted extents ``e`` that minimize the positions computed plus
    ``call_tokens`` a bucket, and those positions (``length_buckets``' dynamic programme)."""
    B = len(e)
    best, start = [0] + [0] * B, [0] * (B + 1)
    for j in range(1, B + 1):
        best[j], start[j] = min((best[i - 1] + (j - i + 1) * e[j - 1] + call_tokens, i) for i in range(1, j + 1))
    cuts, j = [], B
    while j > 0:
        cuts.append((start[j] - 1, j))
        j = start[j] - 1
    cuts.reverse()
    return cuts, sum((b - a) * e[b - 1] for a, b in cuts)


def length_buckets(ext: torch.Tensor, call_tokens: int | None = None,
                   padding_cap: float | None = None) -> list[torch.Tensor]:
    """The rows of a scoring forward split into length buckets, each forwarded to its own longest
    row: the rows sorted by their response extent ``ext`` (B,) long (``response_extent``; at least
    1 counted a row), cut into runs that minimize the positions computed, sum over buckets of
    rows x longest extent, plus ``call_tokens`` a bucket (None: ``BUCKET_CALL_TOKENS``). Exact, by
    dynamic programming over the sorted extents (the best cost of the first j rows = min over the
    last bucket's start i of the best of the first i - 1 rows + its rows x e_j + call_tokens).
    Where that leaves more than ``padding_cap`` (None: ``PADDING_CAP``; 1 for no bound) of the
    positions on padding, the call cost is halved and the cut made again until it does not (0: a
    bucket per distinct length, no padding). Returns each bucket's rows (n_b,) long, in ascending
    extent (ties in row order)."""
    call_tokens = BUCKET_CALL_TOKENS if call_tokens is None else call_tokens
    cap = PADDING_CAP if padding_cap is None else padding_cap
    order = torch.argsort(ext.cpu(), stable=True)                                        # (B,)
    e = [max(1, int(x)) for x in ext.cpu()[order]]
    real = sum(e)
    while True:
        cuts, positions = _bucket_cuts(e, call_tokens)
        if call_tokens <= 0 or positions - real <= cap * positions:
            break
        call_tokens //= 2
    return [order[a:b].to(ext.device) for a, b in cuts]


def bucket_positions(ext: torch.Tensor, buckets: bool) -> tuple[int, int]:
    """(response positions the scoring forward of rows with extents ``ext`` (B,) computes, of them
    padding): every row to the longest row (at least one column), or with ``buckets`` each
    ``length_buckets`` bucket to its own longest."""
    if not ext.numel():
        return 0, 0
    groups = length_buckets(ext) if buckets else [torch.arange(ext.numel(), device=ext.device)]
    total = sum(max(1, int(ext[g].max())) * g.numel() for g in groups)
    return total, total - int(ext.sum())


def _bucketed_scores(model, ids, am, Lp, G, buckets, score) -> list | None:
    """``score``'s (logp, logp_full, entropy) of each bucket's rows ``buckets`` [(n_b,)], each forwarded
    to its own longest row: with ``G`` > 1 on a model with a differentiable cache, every prompt once
    into a cache and each bucket's responses over its rows' prompts (``cache_rows.take_rows``; None
    where the cache cannot give rows: the caller forwards as one batch); otherwise each bucket's
    rows whole."""
    kw = {"float_logits": False} if getattr(model, "takes_float_logits", False) else {}
    shared = G > 1 and model.differentiable_cache
    if shared:
        T = ids.size(1) - Lp
        cache = model.new_cache(ids.size(0) // G, Lp + T)
        if not cache_rows.takes_rows(cache):
            return None
        first = model(ids[::G, :Lp], attention_mask=am[::G, :Lp], cache=cache, logits_to_keep=1, **kw)   # (P, 1, V)
    out = []
    for rows in buckets:
        w = max(1, int(response_extent(am[rows, Lp:]).max()))
        sub_ids, sub_am = ids[rows, :Lp + w], am[rows, :Lp + w]
        if not shared:
            blocks = [model(sub_ids[:, :-1], attention_mask=sub_am[:, :-1], logits_to_keep=w, **kw)]      # (n, w, V)
        else:
            prompts = torch.div(rows, G, rounding_mode="floor")                                         # (n,)
            blocks = [first[prompts]]                                                                   # (n, 1, V)
            if w > 1:
                sub = cache_rows.take_rows(cache, prompts)
                blocks.append(model(sub_ids[:, Lp:-1], attention_mask=sub_am[:, Lp:-1], cache=sub, **kw))  # (n, w-1, V)
        out.append(_score_blocks(blocks, sub_ids, sub_am, Lp, score))
    return out


def _score_blocks(blocks, ids, am, Lp, score) -> tuple:
    """``score``'s (logp, logp_full, entropy) of logits ``blocks`` [(B, w, V)] that predict the response
    columns of ``ids`` / ``am`` from ``Lp`` on, in column order, each block scored on its own columns
    and the results joined (B, sum of w)."""
    scored, c = [], Lp
    for logits in blocks:
        w = logits.size(1)
        scored.append(score(logits, ids[:, c:c + w], am[:, c:c + w] == 0))
        c += w
    return tuple(None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
                 for parts in zip(*scored))


def _response_logits(model, ids, am, Lp, T, G):
    """The logits predicting the T response tokens, as a list of (B, w, V) blocks whose widths sum
    to T, in column order: one forward's (B, T, V), or (G > 1 on a model with a differentiable cache)
    each prompt once with its G responses attending to the shared keys/values: the prompt's last
    position repeated over its group (B, 1, V), then the responses' (B, T - 1, V). Kept apart: every
    scorer below is per position, so scoring the blocks one by one gives the joined block's numbers
    without a copy of all the logits (and of their gradient). In the dtype the head computed them
    (bf16 under autocast; ``float_logits=False`` where the model takes it): the scorers upcast to
    float32 themselves, a chunk at a time when chunked."""
    kw = {"float_logits": False} if getattr(model, "takes_float_logits", False) else {}
    if G > 1 and model.differentiable_cache:
        B = ids.size(0)
        if B % G:
            raise ValueError(f"group_size {G} does not divide the {B} rows")
        one_pass = getattr(model, "shared_prompt_logits", None)        # None where the model has none (or T < 2)
        joined = one_pass(ids, am, Lp, G, **kw) if one_pass is not None else None
        if joined is not None:                                                  # one pass over the layers
            return [joined[0].repeat_interleave(G, dim=0), joined[1]]
        cache = model.new_cache(B // G, Lp + T)
        first = model(ids[::G, :Lp], attention_mask=am[::G, :Lp], cache=cache, logits_to_keep=1, **kw)  # (P, 1, V)
        cache.repeat_interleave(G)
        parts = [first.repeat_interleave(G, dim=0)]                                                 # (B, 1, V)
        if T > 1:
            parts.append(model(ids[:, Lp:-1], attention_mask=am[:, Lp:-1], cache=cache, **kw))      # (B, T-1, V)
        return parts
    # the last token predicts nothing scored: forwarded without it, the T kept logits are contiguous
    return [model(ids[:, :-1], attention_mask=am[:, :-1], logits_to_keep=T, **kw)]                 # (B, T, V)


def _score(logits, targets, off, *, temperature, top_p, top_k, min_p, chunk_rows, entropy: bool,
           compiled: bool = False):
    """(logp, logp_full, entropy or None) of `targets` (b, w) under `logits` (b, w, V), 0 where `off`;
    `compiled` (model.compile): the untruncated log-probs through compiled passes (rlvr.logprobs.token_logprobs)."""
    if not truncates(top_p, top_k, min_p):
        lp = lp_full = token_logprobs(logits, targets, temperature=temperature, chunk_rows=chunk_rows,
                                      compiled=compiled)
    else:
        lp, lp_full = _nucleus_token_logprobs(logits, targets, temperature=temperature, top_p=top_p, top_k=top_k,
                                              min_p=min_p, chunk_rows=chunk_rows)
    ent = (entropy_from_logits(logits, temperature=temperature, chunk_rows=chunk_rows).masked_fill(off, 0.0)
           if entropy else None)
    return lp.float().masked_fill(off, 0.0), lp_full.float().masked_fill(off, 0.0), ent


def sequence_token_logprobs(model, rollout: Rollout | tuple, *, temperature: float | None = None,
                            top_p: float | None = None, chunk_rows: int | str | None = None,
                            group_size: int | None = None, return_full: bool = False,
                            return_entropy: bool = False, top_k: int | None = None,
                            min_p: float | None = None, buckets: bool = False) -> torch.Tensor | TokenLogprobs:
    """(B, T) log-probs of the generated tokens under the sampling distribution, WITH gradient.

    ``rollout`` is a ``Rollout`` or a tuple ``(ids, attention_mask, prompt_len)``. One forward
    over ``ids`` with ``attention_mask``; the logits at positions Lp-1 ... Lp+T-2 predict the T
    response tokens. ``temperature`` / ``top_p`` / ``top_k`` / ``min_p`` default to the rollout's own
    (temperature and top_p required with a tuple, where top_k and min_p default to off);
    ``temperature == 0`` scores under the temperature-1 softmax as ``generate`` does. The result is 0
    where the response mask (``attention_mask[:, Lp:]``) is 0. ``chunk_rows`` bounds the rows whose
    (rows, T, V) log-softmax is materialized at once (large vocabularies); ``AUTO_CHUNK`` sizes
    them to the vocabulary and device (``rlvr.logprobs.auto_chunk_rows``).

    ``group_size=G`` (rows grouped by prompt: row b = prompt b // G, the G rows of a group carry
    the same prompt) on a model whose KV cache is differentiable (``model.differentiable_cache``,
    Hugging Face models) runs each prompt ONCE and lets its G responses attend to the shared keys
    and values: the same logits and gradients as the full forward (tested), with the prompt's
    (G - 1) / G share of the work removed. Other models take the full forward.

    Columns past every row's last real token are not forwarded (the result is 0 there; a minibatch
    of rows that all ended early is scored over its own width).

    ``return_full`` / ``return_entropy``: return a ``TokenLogprobs`` that also holds, from the SAME
    forward, the log-probs under the tempered distribution without the nucleus (what the KL to the
    reference compares; with a nucleus (``truncates``) the nucleus log-prob is derived from it at the cost of one
    logsumexp, so both come from one log-softmax) and/or the per-token entropy of that distribution
    (rlvr.logprobs.entropy_from_logits: one more softmax pass).

    ``buckets`` (train.length_buckets): the rows split into ``length_buckets``, each forwarded to its
    own longest row (the prompts still once, where ``group_size`` shares them and the cache can
    give a bucket its rows' prompts: ``cache_rows.take_rows``), so a long row does not make every row of the
    batch compute its length; the same numbers per row to float rounding (tested), the positions
    computed ``bucket_positions``.

    A model with ``compile_layers`` on (model.compile) scores the untruncated log-probs through
    compiled passes (rlvr.logprobs.token_logprobs ``compiled``), the same numbers to float rounding.
    """
    if isinstance(rollout, Rollout):
        ids, am, Lp = rollout.ids, rollout.attention_mask, rollout.prompt_len
        temperature = rollout.temperature if temperature is None else temperature
        top_p = rollout.top_p if top_p is None else top_p
        top_k = rollout.top_k if top_k is None else top_k
        min_p = rollout.min_p if min_p is None else min_p
    else:
        ids, am, Lp = rollout
        if temperature is None or top_p is None:
            raise ValueError("pass temperature= and top_p= when giving (ids, attention_mask, prompt_len)")
        top_k, min_p = top_k or 0, min_p or 0.0
    check_sampling_args(temperature, top_p, top_k, min_p)
    T = T_out = ids.size(1) - Lp
    if T < 1 or Lp < 1:
        raise ValueError(f"need a prompt and at least one response column, got Lp={Lp}, T={T}")
    T_real = max(1, int(response_extent(am[:, Lp:]).max()))  # columns past every row's end score nothing
    if T_real < T:
        ids, am, T = ids[:, :Lp + T_real], am[:, :Lp + T_real], T_real
    if temperature == 0:
        temperature, top_p, top_k, min_p = 1.0, 1.0, 0, 0.0
    compiled = bool(getattr(model, "compile_layers", False))        # model.compile: the log-probs' passes too

    def score(logits, targets, off):
        return _score(logits, targets, off, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                      chunk_rows=chunk_rows, entropy=return_entropy, compiled=compiled)

    groups = length_buckets(response_extent(am[:, Lp:])) if buckets and ids.size(0) > 1 else []
    by_bucket = (_bucketed_scores(model, ids, am, Lp, group_size or 1, groups, score) if len(groups) > 1
                 else None)
    if by_bucket is not None:           # each bucket's (n_b, w_b) padded to T, then back in row order
        back = torch.argsort(torch.cat(groups))                                              # (B,)
        joined = (None if parts[0] is None else torch.cat([F.pad(x, (0, T - x.size(1))) for x in parts])[back]
                  for parts in zip(*by_bucket))
    else:                               # (B, T)
        joined = _score_blocks(_response_logits(model, ids, am, Lp, T, group_size or 1), ids, am, Lp, score)
    lp, lp_full, entropy = (x if x is None or T == T_out else F.pad(x, (0, T_out - T))          # (B, T_out)
                            for x in joined)
    if not (return_full or return_entropy):
        return lp
    return TokenLogprobs(lp, lp_full if return_full else None, entropy)
