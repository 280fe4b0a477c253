"""Batched generation that returns a ``Rollout``; the trainer's recomputation of its log-probs is
rlvr.scoring.

How the sampling distribution enters ``logp`` (the same helper serves sampler and trainer):

1. Temperature: ``z = logits / temperature`` (logits in float32).
2. Truncation (the "nucleus"; ``nucleus_mask``), in transformers' order: ``top_k`` keeps the k most
   probable tokens (0 = all); ``top_p`` then sorts ``softmax(z)`` descending and keeps the
   smallest prefix whose mass, renormalized over the top-k tokens, reaches ``top_p`` (a token is
   kept when the mass strictly before it is < top_p, so the top token is always kept; ties are
   broken by a stable sort); ``min_p`` then keeps the tokens whose probability is at least min_p
   times the top token's (0 = all). Tokens outside are set to -inf.
3. ``logp = log_softmax(z_nucleus)``: the log of the *renormalized* nucleus probability, i.e. the
   distribution ``torch.multinomial`` actually draws from.

``Rollout.logp`` stores that value for each sampled token, so when the weights are unchanged (the
first minibatch pass) ``sequence_token_logprobs`` recomputes it to float rounding and the PPO ratio
starts at exactly 1 (a sampler and a trainer that compute different log-probs for the same token,
a known source of spurious ratios when generation runs in a separate engine, cannot disagree here).
On later passes the nucleus is recomputed from the *current* logits: the trainer's logp is the log-prob under the
current policy's nucleus. A sampled token that has dropped out of the current nucleus has true
log-prob -inf; it is reported as ``OUTSIDE_NUCLEUS_LOGP`` (-30, finite, no gradient) so the ratio is
~0, the clipped objective gives it no gradient, and differences such as ``logp - logp_ref`` stay
finite (no -inf - -inf = NaN).

The KL to a reference is scored under ONE distribution on both sides: the tempered distribution
without the nucleus (as TRL does). ``Rollout.logp_full`` keeps the sampler's log-prob of each token
under it (when top_p, top_k or min_p truncate it; it equals ``logp`` otherwise), and ``sequence_token_logprobs(...,
return_full=True)`` gives the learner's from the same forward (the nucleus log-prob is derived from
it: log p_nucleus = log p_full - log(mass of the nucleus)), so KL = 0 when π = π_ref whatever the truncation,
and a token that left the nucleus keeps its finite tempered log-prob in the KL.

Greedy decoding is ``temperature == 0`` (top_p ignored): the argmax is taken and ``logp`` is the
log-prob under the temperature-1 full softmax. That number is only for evaluation; a greedy
rollout is not a sample and must not be trained on with a ratio.

Rows: prompt ``p`` is repeated ``G`` times consecutively, so row ``b`` is prompt ``b // G``,
sample ``b % G`` and ``rewards.view(P, G)`` groups correctly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlvr.draws import (  # noqa: F401  (draw_base_seed, prompt_generators: the callers' names)
    check_sampling_args,
    draw_base_seed,
    inverse_cdf_sample,
    prompt_generators,
    sample_tempered,
    sampling_logprobs,
    truncates,
)
from rlvr.models import cache_rows
from rlvr.rollout_data import Rollout, concat  # noqa: F401  (concat: the callers' name)

# ---------------------------------------------------------------------- a decode step's draw
def _prompt_noise(generators: list[torch.Generator] | None, P: int, G: int, T: int, device) -> torch.Tensor | None:
    """(B, T) uniforms, prompt p's G rows drawn from generators[p]; None without generators."""
    if generators is None:
        return None
    if len(generators) != P:
        raise ValueError(f"generators: {len(generators)} given for {P} prompts")
    return torch.cat([torch.rand((G, T), generator=g, device=g.device).to(device) for g in generators])


def _next_tokens(logprobs: torch.Tensor, temperature: float, generator, noise_t: torch.Tensor | None,
                 rows: torch.Tensor | None = None, batch: int = 0) -> torch.Tensor:
    """(n, V) log-probs -> (n,) tokens: argmax (greedy), inverse CDF of the per-prompt uniforms, or multinomial.

    ``rows`` (n,) (the decode loop's rows still computed, of ``batch`` rows in all) or None (all):
    the multinomial draw is then taken over all ``batch`` rows, the others given a one-token
    distribution, so it consumes ``generator`` as a draw over every row does and each row gets the
    token it would get with every row computed (torch's draw for one sample per row does not depend
    on the other rows' probabilities, only on how many rows there are)."""
    if temperature == 0:
        return logprobs.argmax(-1)
    if noise_t is not None:
        return inverse_cdf_sample(logprobs.exp(), noise_t)
    if rows is None or rows.numel() == batch:
        return torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
    probs = logprobs.new_zeros(batch, logprobs.size(1))                       # (batch, V)
    probs[:, 0] = 1.0                                                         # the rows not computed draw token 0
    probs[rows] = logprobs.exp()
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)[rows]  # (n,)


# ---------------------------------------------------------------------- generation
class StopStrings:
    """``generate``'s ``stop``: a row ends at the token whose text completes one of ``strings``
    (vLLM's ``stop``, transformers' ``stop_strings``).

    Called after each step with the tokens so far ``(B, t)`` and the rows to check ``(B,)`` bool;
    returns ``(B,)`` bool, the checked rows whose text now contains a stop string. Only a row's
    last tokens are decoded: as many as the longest stop string has UTF-8 bytes (every token
    decodes to at least one byte), plus one before them, so that a tokenizer that drops the
    leading space of a decoded piece cannot hide a stop string that starts with one. A stop string
    that was complete earlier would have ended the row then, so any hit is completed by the
    newest token. ``decode``: token ids (list) -> text, the tokenizer's (special tokens dropped).
    """

    def __init__(self, strings, decode):
        strings = tuple(strings)
        if not strings or not all(isinstance(x, str) and x for x in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
        self.strings = strings
        self.decode = decode
        self.window = max(len(x.encode("utf-8")) for x in strings) + 1

    def __call__(self, out: torch.Tensor, check: torch.Tensor) -> torch.Tensor:
        cols = out[:, max(0, out.shape[1] - self.window):].tolist()     # (B, <= window)
        hit = [False] * len(cols)
        for b in torch.nonzero(check).view(-1).tolist():
            text = self.decode(cols[b])
            hit[b] = any(x in text for x in self.strings)
        return torch.tensor(hit, dtype=torch.bool, device=out.device)


def _check_generate_args(model, prompts, samples_per_prompt: int, max_new_tokens: int, temperature: float,
                         top_p: float, top_k: int = 0, min_p: float = 0.0, budgets=None) -> torch.device:
    """ValueError on arguments `generate` cannot sample from; else the device of the model."""
    check_sampling_args(temperature, top_p, top_k, min_p)
    if samples_per_prompt < 1 or max_new_tokens < 1:
        raise ValueError("samples_per_prompt and max_new_tokens must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and every prompt needs at least one token")
    if budgets is not None and (len(budgets) != len(prompts) or not all(1 <= b <= max_new_tokens for b in budgets)):
        raise ValueError(f"budgets must give each of the {len(prompts)} prompts 1 to max_new_tokens "
                         f"({max_new_tokens}) tokens, got {list(budgets)}")
    block_size = model.config.block_size
    need = [len(p) + (max_new_tokens if budgets is None else b) for p, b in zip(prompts, budgets or prompts)]
    if block_size is not None and max(need) > block_size:
        longest = len(prompts[need.index(max(need))])
        raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({max(need) - longest}) "
                         f"exceeds the model's block_size ({block_size})")
    first_param = next(iter(model.parameters()), None)
    return first_param.device if first_param is not None else torch.device("cpu")


def _ended(ended, alive, tok, out, eos_id, stop):
    """(B,) rows that ended at eos or at a stop string, after the step that sampled `tok` (B,);
    `out` (B, t) the tokens so far, `alive` the rows that sampled a real token."""
    if eos_id is not None:
        ended = ended | (alive & (tok == eos_id))
    if stop is not None:
        ended = ended | stop(out, alive & ~ended)
    return ended


def _prefill(model, prompt_ids: torch.Tensor, prompt_am: torch.Tensor, G: int, max_len: int):
    """The prompts' forward: ((P, V) logits at the last column, the cache repeated G times or None)."""
    cache = model.new_cache(prompt_ids.shape[0], max_len)
    if cache is None:
        return model(prompt_ids, attention_mask=prompt_am)[:, -1], None
    logits = model(prompt_ids, attention_mask=prompt_am, cache=cache, logits_to_keep=1)[:, -1]
    return logits, cache.repeat_interleave(G) if G > 1 else cache


@torch.no_grad()
def generate(model, prompts: list[list[int]], *, samples_per_prompt: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, eos_id: int | None, pad_id: int,
             generator: torch.Generator | None = None,
             generators: list[torch.Generator] | None = None, top_k: int = 0, min_p: float = 0.0,
             stop: StopStrings | None = None, budgets: list[int] | None = None, reserve: int = 0,
             keep: list | None = None, step_times: list[float] | None = None) -> Rollout:
    """Sample ``samples_per_prompt`` responses per prompt; row b = prompt b // G, sample b % G.

    One prefill forward over the P left-padded prompts, whose KV cache is then repeated G times, then
    one forward per new token. A row ends at ``eos_id`` or at the token completing a ``stop`` string
    (kept, like eos), until every row has ended; with neither, exactly ``max_new_tokens`` steps run and
    nothing is truncated. ``budgets[p]`` (<= ``max_new_tokens``) cuts prompt p's rows after that many.

    ``model`` meets ``rlvr.policy.Policy``: ``model(ids, attention_mask=, cache=, logits_to_keep=)
    -> logits``; ``model.new_cache(batch_size, max_len)`` returns an object with
    ``repeat_interleave(G)`` to decode incrementally, or None to re-run the whole sequence each step
    (slow; for test oracles and foreign models); ``model.config.block_size`` bounds the context.
    Draws use ``torch.multinomial(generator=)``, so a seeded generator reproduces the rollout (on the
    same device and thread count). ``top_p``, ``top_k``, ``min_p``: the nucleus drawn from (module
    docstring; ``logp`` is under it).

    ``generators`` (one per prompt, see ``prompt_generators``) replaces ``generator``: prompt p's G
    rows draw their (G, max_new_tokens) uniforms from ``generators[p]`` up front and each token is
    drawn by inverse CDF (``sample_tempered`` without a nucleus, else ``inverse_cdf_sample``), so a
    row depends only on its prompt's generator and the weights, not on the other prompts of the call
    (what lets rollout workers shard prompts and still draw the same rows).

    ``keep`` (a list): a model with a KV cache appends the ``Decoding`` to continue these rows from
    (``continue_decoding``: tool calls, rlvr.tools), its cache made ``reserve`` columns longer.

    ``step_times`` (a list): the clock (``time.perf_counter``) read at each step t, once its tokens
    are known (the loop's end-of-decode check has read them, so a GPU has caught up), appended: from
    the reading at step a to the one at step b, b - a forwards and draws (rlvr.probes times decode
    steps so, inside one call).
    """
    device = _check_generate_args(model, prompts, samples_per_prompt, max_new_tokens, temperature, top_p, top_k, min_p,
                                  budgets)
    G, T, P = samples_per_prompt, max_new_tokens, len(prompts)
    Lp = max(len(p) for p in prompts)
    B = P * G
    prompt_ids = torch.tensor([[pad_id] * (Lp - len(p)) + list(p) for p in prompts], device=device)  # (P, Lp)
    prompt_am = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in prompts], device=device)   # (P, Lp)

    logits, cache = _prefill(model, prompt_ids, prompt_am, G, Lp + T + reserve)                # (P, V)
    prompt_ids = prompt_ids.repeat_interleave(G, dim=0)             # (B, Lp)
    prompt_am = prompt_am.repeat_interleave(G, dim=0)               # (B, Lp)
    logits = logits.repeat_interleave(G, dim=0)                     # (B, V)

    noise = _prompt_noise(generators, P, G, T, device)             # (B, T) or None
    cap = None if budgets is None else torch.tensor(budgets, device=device).repeat_interleave(G)  # (B,)
    d = _decode(model, logits, cache, T=T, noise=noise, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=min_p, generator=generator, eos_id=eos_id, pad_id=pad_id, stop=stop, cap=cap,
                finished=torch.zeros(B, dtype=torch.bool, device=device), prompt_ids=prompt_ids,
                prompt_am=prompt_am, track=keep is not None and cache is not None, step_times=step_times)
    if keep is not None and cache is not None:
        keep.append(d.decoding)
    resp_mask = d.alive[:, :d.steps]
    return Rollout(
        ids=torch.cat([prompt_ids, d.out[:, :d.steps]], dim=1),
        attention_mask=torch.cat([prompt_am, resp_mask.long()], dim=1),
        prompt_len=Lp,
        mask=resp_mask.float(),
        logp=d.logp[:, :d.steps].contiguous(),
        truncated=(~d.ended if eos_id is not None or stop is not None
                   else torch.zeros(B, dtype=torch.bool, device=device)),
        temperature=float(temperature),
        top_p=float(top_p),
        logp_full=d.logp_full[:, :d.steps].contiguous() if d.logp_full is not None else None, top_k=int(top_k),
        min_p=float(min_p), decode_rows=d.row_steps, decode_finished_rows=d.finished_row_steps,
    )


@dataclass
class Decoding:
    """Where a decode left off, to continue its rows (``continue_decoding``): the KV cache after the
    last forward; each row's ``pending`` token (B,), sampled at the last step and not yet in the cache
    where ``pending_real`` (B,) says it is real; ``logits`` (B, V), each row's logits after its last
    real token in the cache (what a row with nothing to feed samples from next)."""

    cache: object
    pending: torch.Tensor
    pending_real: torch.Tensor
    logits: torch.Tensor


@dataclass
class _Decoded:
    """``_decode``'s result: tokens, which are real, log-probs (tempered without the nucleus too, or
    None), the rows ended at eos / a stop string, the steps run, and (``track``) the ``Decoding``."""

    out: torch.Tensor
    alive: torch.Tensor
    logp: torch.Tensor
    logp_full: torch.Tensor | None
    ended: torch.Tensor
    steps: int
    decoding: Decoding | None
    row_steps: int = 0
    """Rows computed, summed over the decode forwards (the prefill not counted)."""
    finished_row_steps: int = 0
    """Of those, rows that had already finished (their forward's logits are never sampled from)."""


COMPACT_FINISHED: float | None = 0.0
"""The decode loop drops the finished rows from the batch (the KV cache narrowed to the rows still
sampling, ``rlvr.models.cache_rows``) once at least this share of the rows it computes has finished
and ``WASTE_PER_COPY`` says the drop pays; None: never (every row computed until the last one ends).
0: ``WASTE_PER_COPY`` alone decides (``rlvr.costs`` reads this share as the one a drop waits for)."""

WASTE_PER_COPY = 1.0
"""The rent-or-buy rule a drop waits for: the finished rows computed since the last drop (summed over
the decode forwards, the coming one included) reach this many times the rows whose cache columns the
drop copies (``cache_rows.rows_copied``).

A finished row computed for one more step and a row's columns copied cost about the same (each
reads the row's cache once; the step also runs the row through the layers), so at 1 the waste
before a drop is at most about the drop's copy, whatever the rows' lengths. The caches that fill
holes (the lean cache's plain layout, the built-in model's) copy at most the rows dropped, so
their rows leave as soon as they finish; a cache that copies every kept row (transformers') waits
until that much was wasted; a lean cache in the grouped layout drops its wholly finished groups at
once (a hole fill) and leaves the grouped layout (``cache_rows.ungroup``, a copy of every kept
row) when the rows finished inside live groups have cost as much."""


def _decode(model, logits, cache, *, T: int, noise, temperature, top_p, top_k, min_p, generator, eos_id, pad_id,
            stop, cap, finished, prompt_ids=None, prompt_am=None, track: bool = False,
            step_times: list[float] | None = None) -> _Decoded:
    """The decode loop from (B, V) ``logits``: up to T tokens per row, one forward per step through
    ``cache`` (or, without one, the whole sequence again from ``prompt_ids`` / ``prompt_am``). Rows
    already ``finished`` (B,) sample nothing; ``cap`` (B,) or None bounds each row's tokens.
    ``track``: also keep the ``Decoding`` to continue from (each forward's logits kept per row whose
    fed token was real). ``step_times``: the clock read after each step's end check (``generate``).

    Finished rows leave the batch (``COMPACT_FINISHED``, ``WASTE_PER_COPY``; with a cache that can
    drop rows, not with a static decoder nor with ``track``, whose continuation needs every row's
    cache): the loop then computes the n rows ``rows`` (n,) only (in the cache's order, which a
    drop may change), and writes their tokens into the (B, T) results. A row's
    tokens are the same either way: its uniforms are its own row of ``noise``, and a multinomial draw
    is taken over all B rows (``_next_tokens``); its logits differ by float rounding at most."""
    B, device = logits.size(0), logits.device
    out = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    alive_cols = torch.zeros((B, T), dtype=torch.bool, device=device)
    logp = torch.zeros((B, T), dtype=torch.float32, device=device)
    nucleus = temperature > 0 and truncates(top_p, top_k, min_p)
    logp_full = torch.zeros((B, T), dtype=torch.float32, device=device) if nucleus else None
    ended = torch.zeros(B, dtype=torch.bool, device=device)         # at eos or a stop string
    last_logits = logits.clone() if track else None
    # fixed-shape steps (a CUDA graph on a GPU; rlvr.models.decode_graph) where the model offers them;
    # not where the decode is continued later (track): that needs the eager cache after every step
    make_static = getattr(model, "static_decoder", None) if cache is not None and not track and T > 1 else None
    static = make_static(cache) if make_static is not None else None
    compact = COMPACT_FINISHED is not None and cache is not None and static is None and not track
    rows = torch.arange(B, device=device)                          # (n,) the rows computed, the cache's order
    row_steps = finished_row_steps = steps = 0
    wasted = 0                              # finished rows computed since the last drop that left none
    for t in range(T):
        at = slice(None) if rows.numel() == B else rows             # the rows computed, as an index
        u = None if noise is None else noise[at, t]                                           # (n,)
        if noise is not None and temperature > 0 and not nucleus:  # per-prompt uniforms, no nucleus
            tok, tok_logp = sample_tempered(logits, temperature, u)                           # (n,), (n,)
        else:
            logprobs = sampling_logprobs(logits, temperature, top_p, top_k, min_p)   # (n, V)
            tok = _next_tokens(logprobs, temperature, generator, u, rows, B)          # (n,)
            tok_logp = logprobs.gather(1, tok.unsqueeze(1)).squeeze(1)
        done = finished[at]                                         # (n,)
        tok = tok.masked_fill(done, pad_id)
        out[at, t] = tok
        alive_cols[at, t] = ~done                                    # this token is real
        logp[at, t] = tok_logp.masked_fill(done, 0.0)
        if nucleus:  # the same token under the tempered distribution without the nucleus (the KL's)
            full = F.log_softmax(logits.float() / temperature, dim=-1)                      # (n, V)
            logp_full[at, t] = full.gather(1, tok.unsqueeze(1)).squeeze(1).masked_fill(done, 0.0)
        alive = alive_cols[:, t]                                    # (B,)
        steps = t + 1
        ended = _ended(ended, alive, out[:, t], out[:, :t + 1], eos_id, stop)
        finished = ended if cap is None else ended | (cap <= t + 1)
        last = bool(finished.all()) or t == T - 1                   # reads the tokens: a GPU caught up
        if step_times is not None:
            step_times.append(time.perf_counter())
        if last:
            break
        if compact:
            rows, tok, wasted = _drop_finished(cache, rows, tok, finished, wasted)          # (n',), (n',)
        fed_real = alive[rows]                                      # (n,) the fed token is real
        row_steps += rows.numel()
        n_finished = int(finished[rows].sum())
        finished_row_steps += n_finished
        wasted += n_finished
        if static is not None:
            logits = static.step(tok, alive)                                              # (B, V)
        elif cache is not None:
            logits = model(tok.unsqueeze(1), attention_mask=fed_real.long().unsqueeze(1), cache=cache)[:, -1]
            if track:
                last_logits = torch.where(alive.unsqueeze(1), logits, last_logits)
        else:
            ids_so_far = torch.cat([prompt_ids, out[:, :t + 1]], dim=1)
            am_so_far = torch.cat([prompt_am, alive_cols[:, :t + 1].long()], dim=1)
            logits = model(ids_so_far, attention_mask=am_so_far)[:, -1]
    if static is not None:
        static.finish()
    decoding = None
    if track:
        decoding = Decoding(cache, out[:, steps - 1].clone(), alive.clone(), last_logits)  # T >= 1: the loop ran
    return _Decoded(out, alive_cols, logp, logp_full, ended, steps, decoding, row_steps, finished_row_steps)


def _drop_finished(cache, rows: torch.Tensor, tok: torch.Tensor, finished: torch.Tensor,
                   wasted: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows (n',), tok (n',), wasted): the computed ``rows`` (n,) and their sampled ``tok`` (n,)
    narrowed to the rows not ``finished`` (B,), with the cache, where ``COMPACT_FINISHED`` and
    ``WASTE_PER_COPY`` say so (``wasted``: the finished rows computed since the last drop that left
    none; 0 after one); unchanged otherwise or where the cache cannot drop rows. Short of that rule
    a grouped cache still drops its wholly finished groups (``cache_rows.keep_rows`` without
    ``exact``: a hole fill, at most the rows dropped copied). The cache may keep more rows than asked (whole
    groups) and reorder them (``rlvr.models.cache_rows``); ``rows`` follows it."""
    live = ~finished[rows]                                                       # (n,)
    n_done = rows.numel() - int(live.sum())
    if n_done == 0:
        return rows, tok, 0
    if n_done < COMPACT_FINISHED * rows.numel():
        return rows, tok, wasted
    keep = live.nonzero().squeeze(1)                                             # (n - n_done,) positions in rows
    if wasted + n_done >= WASTE_PER_COPY * cache_rows.rows_copied(cache, keep):
        kept, wasted = cache_rows.keep_rows(cache, keep, exact=True), 0          # (n',) positions in rows
    elif cache_rows.drops_groups(cache):
        kept = cache_rows.keep_rows(cache, keep)
    else:
        return rows, tok, wasted
    if kept is None or kept.numel() == rows.numel():
        return rows, tok, wasted
    return rows[kept], tok[kept], wasted


@torch.no_grad()
def continue_decoding(model, dec: Decoding, inserted: list[list[int] | None], budgets: list[int], *,
                      noise: torch.Tensor | None, temperature: float, top_p: float = 1.0, top_k: int = 0,
                      min_p: float = 0.0, eos_id: int | None, pad_id: int, stop: StopStrings | None = None,
                      generator: torch.Generator | None = None) -> tuple[Rollout, int]:
    """Continue the rows of ``dec`` (a ``generate(..., keep=)`` or an earlier continuation) after
    inserting ``inserted[b]`` into row b's sequence (None: row b stops here), with the KV cache
    reused instead of a new prefill of the whole sequence: one forward appends each row's pending
    token and its inserted tokens (right-aligned, the padding before them masked, so the last column
    is every continuing row's last token and positions count real tokens only), then the decode
    loop samples up to ``budgets[b]`` tokens for row b, from ``noise`` (B, max budget) uniforms where
    given. Returns (a ``Rollout`` of the new tokens, prompt width 0, one row per row of ``dec``, and
    the token positions computed); ``dec`` is updated in place to continue again."""
    B, device = len(inserted), dec.pending.device
    rows = [b for b in range(B) if inserted[b] is not None]
    seqs = [([int(dec.pending[b])] if bool(dec.pending_real[b]) else []) + (inserted[b] or []) for b in range(B)]
    L = max(1, max(len(seqs[b]) for b in rows))
    ids = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    am = torch.zeros((B, L), dtype=torch.long, device=device)
    for b in range(B):
        if seqs[b]:
            ids[b, L - len(seqs[b]):] = torch.tensor(seqs[b], dtype=torch.long, device=device)
            am[b, L - len(seqs[b]):] = 1
    cache = dec.cache
    logits = model(ids, attention_mask=am, cache=cache, logits_to_keep=1)[:, -1]                   # (B, V)
    fed = am[:, -1].bool()                                                        # the last column is real
    logits = torch.where(fed.unsqueeze(1), logits, dec.logits)
    T = max(budgets[b] for b in rows)
    cap = torch.tensor([budgets[b] if inserted[b] is not None else 0 for b in range(B)], device=device)
    finished = torch.tensor([inserted[b] is None for b in range(B)], device=device)
    d = _decode(model, logits, cache, T=T, noise=noise, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=min_p, generator=generator, eos_id=eos_id, pad_id=pad_id, stop=stop, cap=cap,
                finished=finished, track=True)
    dec.cache, dec.pending, dec.pending_real, dec.logits = d.decoding.cache, d.decoding.pending, \
        d.decoding.pending_real, d.decoding.logits
    mask = d.alive[:, :d.steps]
    r = Rollout(ids=d.out[:, :d.steps], attention_mask=mask.long(), prompt_len=0, mask=mask.float(),
                logp=d.logp[:, :d.steps].contiguous(), truncated=~d.ended, temperature=float(temperature),
                top_p=float(top_p), top_k=int(top_k), min_p=float(min_p),
                logp_full=None if d.logp_full is None else d.logp_full[:, :d.steps].contiguous(),
                decode_rows=d.row_steps, decode_finished_rows=d.finished_row_steps)
    return r, B * (L + d.steps)
