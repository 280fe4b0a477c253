"""Tool calls inside a response: sampling stops at a stop string, the task's tool answers, its text
is inserted into the response, and sampling continues.

This is the tool loop of Search-R1, ReTool or ToRL (and of TRL's and verl's tool rollouts), and,
with ``sampling.tool_on_end``, a multi-turn environment (the tool is also called when a response
ends at eos, and returns the next user turn or None to end the episode): the policy writes a call that ends with one of ``sampling.stop`` (``</calc>``), the
task's ``tool(prompt, response_so_far, answer)`` returns the text to insert (``<result>42</result>``)
or None to end the response there, and the policy goes on writing after the inserted text, up to
``sampling.max_tool_calls`` calls. Row b of the resulting ``Rollout``::

    [left-padded prompt | sampled ... </calc> | inserted | sampled ... </calc> | inserted | sampled ... eos | pad]

* ``mask`` is 1 on the sampled tokens only. The inserted tokens are attended to
  (``attention_mask`` is 1 over the whole response) but are not the policy's actions: they carry
  ``logp`` 0 and no loss, KL or entropy term, and the learner's recomputed log-probs at their
  positions are masked out like padding.
* The sampler's ``logp`` of a token after an insertion is taken with the inserted text in its
  context, as the learner's forward computes it.
* The whole response, inserted text included, stays within ``max_new_tokens``: the price and
  the context check of a run hold as they are. A row whose inserted text does not fit is cut
  there and counts as truncated.
* The rewards and the goal see the whole response text, inserted results included (special
  tokens dropped, as decoding drops them).
* With ``sampling.tool_role`` the text is inserted as that role's chat turn
  (``HFTokenizer.turn_text``): the assistant turn's closing (often the end token), the turn, and
  the next assistant turn's opening. An end token inserted there does not end the response: only a
  sampled one does.

The calls of a round run in the reward workers (rlvr.reward_pool: in parallel, each with the
reward timeout and memory limit), or in the trainer's process without them. A tool reads model
output: parse it, never ``eval`` it. A tool that raises, times out or returns text the tokenizer
cannot encode ends its row (the failure is counted and its first message logged); the run goes on.

A task's environment (rlvr.environments) goes through the same loop (``respond_in_environment``):
every action the policy finishes is stepped, the observations are inserted as a tool's text is, and
the last action is stepped once more with its observation dropped (the closing step); each row keeps
its turns (actions and their token spans, observations, turn rewards) for the rewards' ``Episode``.

Continuations are sampled per row with a generator seeded from the call's base seed, the row's
index in the whole batch and the round, so a row's draws do not depend on how prompts are split
over calls or workers (as ``rlvr.sampling.prompt_generators`` does for first rounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rlvr import costs, sampling
from rlvr.environments import Episode, step_episode
from rlvr.rewards import call_tool

ROUND_SEED_MIX = 0x2545F4914F6CDD1D
"""Mixes the round number into the continuation seeds."""


@dataclass
class ToolStats:
    """What the tool loop of one sampling call did."""

    calls: int = 0
    """Tool calls answered (inserted text or None)."""
    errors: int = 0
    """Tool calls that raised, or whose text the tokenizer could not encode (their rows ended)."""
    inserted_tokens: int = 0
    """Tokens of inserted text (attended, never trained on)."""
    forward_tokens: int = 0
    """Token positions the continuations computed (appended to the KV cache, or prefills over the
    whole context; then decode)."""
    first_error: str = ""
    rounds: int = 0
    """Continuation rounds sampled."""
    rounds_on_cache: int = 0
    """Of those, the rounds that went on from the first round's KV cache (`_reuse_pays`)."""
    malformed: int = 0
    """Calls the task's tool found malformed (a tool with a ``malformed(response)`` check, such as
    rlvr.tool_calls.JsonTools: not JSON, an unknown tool, bad arguments); answered, not ended."""

    def add(self, other: "ToolStats") -> "ToolStats":
        return ToolStats(self.calls + other.calls, self.errors + other.errors,
                         self.inserted_tokens + other.inserted_tokens, self.forward_tokens + other.forward_tokens,
                         self.first_error or other.first_error, self.rounds + other.rounds,
                         self.rounds_on_cache + other.rounds_on_cache, self.malformed + other.malformed)


@dataclass
class _Row:
    """One response being written: its tokens so far and what each is."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    logp_full: list[float] = field(default_factory=list)
    at_eos: bool = False
    """The last sampled piece ended at eos."""
    at_stop: bool = False
    """The last sampled piece ended at a stop string (a call for the tool)."""
    done: bool = False
    """The tool answered None, or failed: the response ends here."""
    calls: int = 0
    cut: bool = False
    """The inserted text did not fit the response bound."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Each sampled piece's (start, end) offsets in `tokens`: the actions of an environment's episode."""
    observations: list[str | None] = field(default_factory=list)
    """An environment's answer to each stepped action (None where it inserted nothing)."""
    turn_rewards: list[float | None] = field(default_factory=list)
    """An environment's reward for each stepped action."""
    env_done: bool = False
    """The environment ended the episode."""

    def add_sampled(self, toks: list[int], logp: list[float], logp_full: list[float], eos_id: int | None,
                    truncated: bool) -> None:
        """Append a sampled piece and say how it ended: at eos, at a stop string (a call for the tool:
        ended, neither truncated nor at eos), or truncated."""
        self.spans.append((len(self.tokens), len(self.tokens) + len(toks)))
        self.tokens += toks
        self.sampled += [True] * len(toks)
        self.logp += logp
        self.logp_full += logp_full
        self.at_eos = eos_id is not None and len(toks) > 0 and toks[-1] == eos_id
        self.at_stop = not self.at_eos and not truncated

    def add_inserted(self, toks: list[int]) -> None:
        """Append inserted (tool) tokens: attended, never trained on (logp 0)."""
        self.tokens += toks
        self.sampled += [False] * len(toks)
        self.logp += [0.0] * len(toks)
        self.logp_full += [0.0] * len(toks)


def _rows(rollout: sampling.Rollout, eos_id: int | None) -> list[_Row]:
    """The rows of a first-round rollout, each cut to its own tokens."""
    Lp, rows = rollout.prompt_len, []
    full = rollout.tempered_logp
    for b in range(rollout.ids.size(0)):
        n = int(rollout.mask[b].sum())
        prompt = rollout.ids[b, :Lp][rollout.attention_mask[b, :Lp].bool()].tolist()
        row = _Row(prompt)
        row.add_sampled(rollout.response_ids[b, :n].tolist(), rollout.logp[b, :n].tolist(), full[b, :n].tolist(),
                        eos_id, bool(rollout.truncated[b]))
        rows.append(row)
    return rows


def _call_tools(tool: Callable, pool, prompts: list[str], texts: list[str], answers: list, tok,
                stats: ToolStats, role: str = "", after_end: list[bool] | None = None) -> list[list[int] | None]:
    """Each call's inserted tokens, or None where the row ends (the tool said so, or failed: raised,
    timed out in a worker, returned text the tokenizer cannot encode). `pool`: a
    rlvr.reward_pool.RewardPool runs the calls in its workers, in parallel and time-limited. `role`:
    the text goes in as that role's chat turn (``tok.turn_text``; ``after_end[k]``: call k's response
    ended at its end token, which already closed the assistant's turn), else as it is."""
    got = (pool.tool_calls(prompts, texts, answers) if pool is not None else
           [call_tool(tool, p, t, a) for p, t, a in zip(prompts, texts, answers)])
    check = getattr(tool, "malformed", None)        # rlvr.tool_calls.JsonTools: counted here, answered there
    stats.malformed += sum(bool(check(t)) for t in texts) if callable(check) else 0
    out = []
    for k, s in enumerate(got):
        stats.calls += 1
        ids, error = None, f"{s.status}: {s.detail}" if s.status != "ok" else ""
        if not error and s.value is not None:
            try:
                text = tok.turn_text(role, s.value, after_end=bool(after_end and after_end[k])) if role else s.value
                ids = tok.encode(text, bos=False)
            except ValueError as e:
                error = f"the tokenizer cannot encode the tool's text: {e}"
        if error:
            stats.errors += 1
            stats.first_error = stats.first_error or error
        out.append(ids)
    return out


def _episode_so_far(row: _Row, tok) -> Episode:
    """The row's episode up to its last action (what an environment step replays)."""
    return Episode(tok.decode(row.tokens), [tok.decode(row.tokens[a:b]) for a, b in row.spans])


def _step_envs(env: Callable, pool, rows: list[_Row], calling: list[int], examples: list, tok, stats: ToolStats,
               role: str, insert: list[bool]) -> list[list[int] | None]:
    """Step each calling row's environment on its last action (rlvr.environments.step_episode: in the
    `pool`'s workers, time-limited, or here) and keep its observation, reward and done on the row.
    Returns the tokens to insert per row, or None where the episode ends: the environment said done or
    answered None, the step failed (its status counted in `stats.errors`), its text cannot be encoded, or
    `insert[k]` is False (a closing step, not counted in `stats.calls`)."""
    prompts, answers = [examples[i].prompt for i in calling], [examples[i].answer for i in calling]
    episodes = [_episode_so_far(rows[i], tok) for i in calling]
    got = (pool.env_steps(prompts, episodes, answers) if pool is not None else
           [step_episode(env, p, e, a) for p, e, a in zip(prompts, episodes, answers)])
    out: list[list[int] | None] = []
    for k, (i, s) in enumerate(zip(calling, got)):
        r, error, ids = rows[i], "", None
        obs, reward, done = s.value if s.status == "ok" else (None, None, True)
        r.turn_rewards.append(reward)
        r.env_done = s.status == "ok" and done
        stats.calls += insert[k]
        if s.status != "ok":
            error = f"environment step: {s.status}: {s.detail}"
        elif insert[k] and not done and obs is not None:
            try:
                ids = tok.encode(tok.turn_text(role, obs, after_end=r.at_eos) if role else obs, bos=False)
            except ValueError as e:
                error = f"the tokenizer cannot encode the environment's text: {e}"
        if error:
            stats.errors += 1
            stats.first_error = stats.first_error or error
        r.observations.append(obs if ids is not None else None)       # what was inserted
        out.append(ids)
    return out


def _turns(row: _Row, tok) -> dict:
    """A finished row's turns, one entry per action (an unstepped last action: None, None)."""
    pad = [None] * (len(row.spans) - len(row.turn_rewards))
    return dict(actions=[tok.decode(row.tokens[a:b]) for a, b in row.spans], observations=row.observations + pad,
                turn_rewards=row.turn_rewards + pad, spans=list(row.spans), done=row.env_done)


def _continue(policy, rows: list[_Row], idx: list[int], budgets: list[int], *, first_row: int, base_seed,
              round_: int, pad_id: int, eos_id, stop, sample_kw: dict, autocast) -> int:
    """Sample the continuations of rows `idx` (one per row, G = 1), each within its budget; append
    them. Returns the token positions computed."""
    prompts = [rows[i].prompt + rows[i].tokens for i in idx]
    gens = None
    if base_seed is not None:
        seed = (base_seed + ROUND_SEED_MIX * round_) % 2 ** 63
        device = next(iter(policy.parameters())).device
        gens = [sampling.prompt_generators(seed, first_row + i, 1, device)[0] for i in idx]
    with autocast():
        r = sampling.generate(policy, prompts, samples_per_prompt=1, max_new_tokens=max(budgets), budgets=budgets,
                              eos_id=eos_id, pad_id=pad_id, generators=gens, stop=stop, **sample_kw)
    full = r.tempered_logp
    for k, i in enumerate(idx):
        n = int(r.mask[k].sum())
        rows[i].add_sampled(r.response_ids[k, :n].tolist(), r.logp[k, :n].tolist(), full[k, :n].tolist(), eos_id,
                            bool(r.truncated[k]))
    return costs.sampling_forward_tokens(len(idx), r.prompt_len, *r.mask.shape)


def _reuse_pays(rows: list[_Row], inserted: dict[int, list[int]]) -> bool:
    """Whether to continue on the KV cache this round: appending the inserted tokens (and pending
    ones) to every row of the cache, B x L positions, computes no more than prefilling the
    continuing rows' whole sequences (prompt and response so far). Both then decode the same
    tokens; the cache's rows that stopped are carried along (the lean forward's decode steps skip
    them, rlvr.models.lean_llama.LIVE_ROWS). Short contexts with few rows calling favour the
    prefill; long contexts the cache."""
    L = 1 + max(len(t) for t in inserted.values())
    return len(rows) * L <= sum(len(rows[i].prompt) + len(rows[i].tokens) for i in inserted)


def _continue_cached(policy, dec: sampling.Decoding, rows: list[_Row], inserted: dict[int, list[int]],
                     budgets: dict[int, int], *, first_row: int, base_seed, round_: int, pad_id: int, eos_id, stop,
                     sample_kw: dict, autocast) -> int:
    """`_continue` on the KV cache the first round left (`dec`, rlvr.sampling.continue_decoding):
    rows `inserted` (row -> its inserted tokens) go on within `budgets` (row -> tokens), the others
    stop; each row draws the uniforms `_continue` would give it. Returns the token positions computed."""
    B, idx = len(rows), sorted(inserted)
    T = max(budgets[i] for i in idx)
    device = dec.pending.device
    noise = None
    if base_seed is not None:
        seed = (base_seed + ROUND_SEED_MIX * round_) % 2 ** 63
        noise = torch.zeros((B, T), device=device)
        for i in idx:
            g = sampling.prompt_generators(seed, first_row + i, 1, device)[0]
            noise[i] = torch.rand((1, T), generator=g, device=g.device).to(device)[0]
    with autocast():
        r, computed = sampling.continue_decoding(
            policy, dec, [inserted.get(b) for b in range(B)], [budgets.get(b, 0) for b in range(B)], noise=noise,
            eos_id=eos_id, pad_id=pad_id, stop=stop, **sample_kw)
    full = r.tempered_logp
    for i in idx:
        n = int(r.mask[i].sum())
        rows[i].add_sampled(r.ids[i, :n].tolist(), r.logp[i, :n].tolist(), full[i, :n].tolist(), eos_id,
                            bool(r.truncated[i]))
    return computed


def _assemble(first: sampling.Rollout, rows: list[_Row], pad_id: int) -> sampling.Rollout:
    """The rows as one Rollout: the first round's left-padded prompts, then each row's tokens."""
    B, Lp = len(rows), first.prompt_len
    T = max(1, max(len(r.tokens) for r in rows))
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    att = torch.zeros((B, T), dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    logp_full = torch.zeros((B, T), dtype=torch.float32)
    for b, r in enumerate(rows):
        n = len(r.tokens)
        ids[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
        att[b, :n] = 1
        mask[b, :n] = torch.tensor(r.sampled, dtype=torch.float32)
        logp[b, :n] = torch.tensor(r.logp, dtype=torch.float32)           # 0 on inserted tokens
        logp_full[b, :n] = torch.tensor(r.logp_full, dtype=torch.float32)
    dev = first.ids.device
    truncated = torch.tensor([r.cut or not (r.at_eos or r.at_stop or r.done) for r in rows], dtype=torch.bool,
                             device=dev)
    nucleus = first.logp_full is not None
    return sampling.Rollout(
        ids=torch.cat([first.prompt_ids, ids.to(dev)], dim=1),
        attention_mask=torch.cat([first.attention_mask[:, :Lp], att.to(dev)], dim=1),
        prompt_len=Lp, mask=mask.to(dev), logp=logp.to(dev), truncated=truncated,
        temperature=first.temperature, top_p=first.top_p, top_k=first.top_k, min_p=first.min_p,
        logp_full=logp_full.to(dev) if nucleus else None)


def respond_with_tools(policy, tok, first: sampling.Rollout, examples: list, tool: Callable, *, max_new_tokens: int,
                       eos_id: int | None, stop: tuple[str, ...], max_calls: int, base_seed: int | None,
                       first_row: int, sample_kw: dict, autocast, pool=None, role: str = "",
                       on_end: bool = False, decoding: sampling.Decoding | None = None
                       ) -> tuple[sampling.Rollout, ToolStats]:
    """Answer the tool calls of the first-round `first` (row b is `examples[b]`'s response; row b
    is row `first_row + b` of the whole batch) and sample on, up to `max_calls` calls per row.

    `sample_kw`: temperature, top_p, top_k, min_p, as the first round sampled. `autocast()`: the
    sampling forwards' context. `pool`: a RewardPool whose workers run the calls (None: here, one by one).
    `role`: insert each text as that role's chat turn (sampling.tool_role), else as it is. `on_end`:
    a response that ends at eos calls the tool too (sampling.tool_on_end: the environment's next turn).
    `decoding`: where the first round's decode left off (``generate(..., keep=)``, a model with a KV
    cache): the continuations then append the inserted tokens to that cache and decode on
    (``_continue_cached``) instead of a new prefill of each row's whole sequence (``_continue``),
    in each round where that computes less (``_reuse_pays``; once a round prefills, the rest do).
    Returns the assembled rollout (module docstring) and the counts."""
    def call(rows: list[_Row], calling: list[int], closing: bool, stats: ToolStats) -> list:
        return _call_tools(tool, pool, [examples[i].prompt for i in calling],
                           [tok.decode(rows[i].tokens) for i in calling], [examples[i].answer for i in calling],
                           tok, stats, role, [rows[i].at_eos for i in calling])

    rollout, stats, _ = _respond(policy, tok, first, call, at_eos=on_end, closing_round=False,
                                 max_new_tokens=max_new_tokens, eos_id=eos_id, stop=stop, max_calls=max_calls,
                                 base_seed=base_seed, first_row=first_row, sample_kw=sample_kw, autocast=autocast,
                                 decoding=decoding)
    return rollout, stats


def respond_in_environment(policy, tok, first: sampling.Rollout, examples: list, env: Callable, *,
                           max_new_tokens: int, eos_id: int | None, stop: tuple[str, ...], max_calls: int,
                           base_seed: int | None, first_row: int, sample_kw: dict, autocast, pool=None,
                           role: str = "", on_end: bool = False, decoding: sampling.Decoding | None = None
                           ) -> tuple[sampling.Rollout, ToolStats, list[dict]]:
    """`respond_with_tools` with an environment (rlvr.environments; `env()` makes one per episode) in
    place of the tool: every action the policy finishes (at a stop string or at eos) is stepped; up to
    `max_calls` observations are inserted (after an eos only with `on_end`), and an action that ends the
    episode is stepped once more with its observation dropped (the closing step). Returns the rollout,
    the counts and each row's turns (`rlvr.environments.Episode`'s fields but the text)."""
    def call(rows: list[_Row], calling: list[int], closing: bool, stats: ToolStats) -> list:
        insert = [not closing and (rows[i].at_stop or on_end) for i in calling]
        return _step_envs(env, pool, rows, calling, examples, tok, stats, role, insert)

    rollout, stats, rows = _respond(policy, tok, first, call, at_eos=True, closing_round=True,
                                    max_new_tokens=max_new_tokens, eos_id=eos_id, stop=stop, max_calls=max_calls,
                                    base_seed=base_seed, first_row=first_row, sample_kw=sample_kw, autocast=autocast,
                                    decoding=decoding)
    return rollout, stats, [_turns(r, tok) for r in rows]


def _respond(policy, tok, first: sampling.Rollout, call: Callable, *, at_eos: bool, closing_round: bool,
             max_new_tokens: int, eos_id: int | None, stop: tuple[str, ...], max_calls: int, base_seed: int | None,
             first_row: int, sample_kw: dict, autocast, decoding: sampling.Decoding | None
             ) -> tuple[sampling.Rollout, ToolStats, list[_Row]]:
    """The loop of `respond_with_tools` and `respond_in_environment`: `call(rows, calling, closing,
    stats)` answers the rows `calling` (those ended at a stop string, or at eos with `at_eos`) with the
    tokens to insert or None (the row ends); `closing_round`: one more round of calls after
    `max_calls`, with closing = True (nothing is inserted then)."""
    stats = ToolStats()
    stopper = sampling.StopStrings(stop, tok.decode) if stop else None
    rows = _rows(first, eos_id)
    for round_ in range(1, max_calls + 1 + closing_round):
        calling = [i for i, r in enumerate(rows) if (r.at_stop or at_eos and r.at_eos) and not (r.done or r.cut)]
        answers = call(rows, calling, round_ > max_calls, stats) if calling else []
        idx, budgets, kept_by_row = _insert(rows, calling, answers, max_new_tokens, stats)
        if not idx:
            break
        kw = dict(first_row=first_row, base_seed=base_seed, round_=round_, pad_id=tok.pad_id, eos_id=eos_id,
                  stop=stopper, sample_kw=sample_kw, autocast=autocast)
        if decoding is not None and not _reuse_pays(rows, kept_by_row):
            decoding = None          # from here on every continuation prefills its row's sequence
        stats.forward_tokens += (_continue(policy, rows, idx, budgets, **kw) if decoding is None else
                                 _continue_cached(policy, decoding, rows, kept_by_row, dict(zip(idx, budgets)), **kw))
        stats.rounds += 1
        stats.rounds_on_cache += decoding is not None
    return _assemble(first, rows, tok.pad_id), stats, rows


def _insert(rows: list[_Row], calling: list[int], answers: list, max_new_tokens: int, stats: ToolStats
            ) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """Append each calling row's inserted tokens (None: the row ends; cut where they do not fit).
    Returns the rows that go on, their token budgets, and row -> the tokens inserted."""
    idx, budgets, kept_by_row = [], [], {}
    for i, inserted in zip(calling, answers):
        r = rows[i]
        r.calls += 1
        if inserted is None:
            r.done = True
            continue
        room = max_new_tokens - len(r.tokens)
        kept = inserted[:room]
        r.add_inserted(kept)
        stats.inserted_tokens += len(kept)
        if len(inserted) >= room:
            r.cut = True
            continue
        idx.append(i)
        budgets.append(room - len(inserted))
        kept_by_row[i] = kept
    return idx, budgets, kept_by_row
