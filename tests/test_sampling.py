"""Batched generation (eos, grouping, determinism, the sampled distribution) and logp recomputation.

Mock models in the style of nanochat's tests/test_engine.py: logits are a table lookup on the
input token, so they work with and without a KV cache and force eos at a known step.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlvr.models.tiny import KVCache as TinyKVCache, TinyConfig, TinyTransformer
from rlvr import sampling, scoring
from rlvr.draws import nucleus_mask
from rlvr.sampling import Rollout, concat, generate, sampling_logprobs
from rlvr.scoring import OUTSIDE_NUCLEUS_LOGP, sequence_token_logprobs

PAD, BOS, EOS = 0, 1, 2


class MarkovMock(torch.nn.Module):
    """Next-token logits depend only on the current token: ``logits[b, l] = table[ids[b, l]]``."""

    differentiable_cache = False

    def __init__(self, table: torch.Tensor, with_cache: bool = True):
        super().__init__()
        self.table = torch.nn.Parameter(table.float())
        self.config = SimpleNamespace(block_size=None)
        self.with_cache = with_cache

    def new_cache(self, batch_size, max_len):
        return _NullCache() if self.with_cache else None  # None: generate recomputes the whole sequence

    def forward(self, ids, *, attention_mask=None, positions=None, cache=None, logits_to_keep=None):
        logits = self.table[ids]                                  # (B, L, V)
        return logits if logits_to_keep is None else logits[:, -logits_to_keep:]


class _NullCache:
    def repeat_interleave(self, repeats):
        return self


def forcing_table(V=8, big=50.0):
    """3 -> 4 -> 5 -> eos, 6 -> eos, 7 -> 7 forever; everything else -> eos."""
    nxt = {3: 4, 4: 5, 5: EOS, 6: EOS, 7: 7}
    t = torch.zeros(V, V)
    for a in range(V):
        t[a, nxt.get(a, EOS)] = big
    return t


def tiny_model(seed=0, V=13):
    torch.manual_seed(seed)
    return TinyTransformer(TinyConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=32, block_size=32)).eval()


MODEL = tiny_model()
PROMPTS = [[BOS, 5, 7, 3], [BOS, 9], [BOS, 4, 4, 8, 11, 6], [BOS, 10, 3]]


def gen(model=MODEL, prompts=PROMPTS, seed=0, **kw):
    args = dict(samples_per_prompt=3, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_id=EOS, pad_id=PAD)
    args.update(kw)
    return generate(model, prompts, generator=torch.Generator().manual_seed(seed), **args)


# ---------------------------------------------------------------------- eos, masks, shapes
@pytest.mark.parametrize("with_cache", [True, False])
def test_eos_mask_pad_and_truncated(with_cache):
    m = MarkovMock(forcing_table(), with_cache=with_cache)
    r = generate(m, [[BOS, 3], [BOS, 6], [1, 1, 7]], samples_per_prompt=1, max_new_tokens=5,
                 eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(0))
    assert r.prompt_len == 3
    assert r.response_ids.tolist() == [[4, 5, EOS, PAD, PAD], [EOS, PAD, PAD, PAD, PAD], [7, 7, 7, 7, 7]]
    assert r.mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert r.truncated.tolist() == [False, False, True]
    assert r.response_lengths.tolist() == [3, 1, 5]
    assert r.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0], [1] * 8]
    assert r.mask.dtype == r.logp.dtype == torch.float32
    assert (r.logp[r.mask == 0] == 0).all() and (r.logp[r.mask == 1].abs() < 1e-6).all()


def test_stops_early_when_every_row_has_eos_and_fixed_length_without_eos():
    m = MarkovMock(forcing_table())
    r = generate(m, [[BOS, 3], [BOS, 6]], samples_per_prompt=2, max_new_tokens=10, eos_id=EOS, pad_id=PAD,
                 generator=None)
    assert r.response_ids.shape == (4, 3) and not r.truncated.any()     # T = steps actually run
    r = generate(m, [[BOS, 3], [BOS, 6]], samples_per_prompt=2, max_new_tokens=6, eos_id=None, pad_id=PAD,
                 generator=None)
    assert r.response_ids.shape == (4, 6) and r.mask.all() and not r.truncated.any()
    assert r.response_ids[0].tolist() == [4, 5, EOS, EOS, EOS, EOS]   # eos is just a token here


def test_step_times_read_the_clock_once_per_step_and_change_no_row(monkeypatch):
    """``step_times``: one clock reading per step run, in order (here until every row has ended, at
    the steps the rollout's columns say), read after the step's tokens are drawn; the rows the same
    as without it."""
    plain = gen()
    ticks = iter(range(100))
    monkeypatch.setattr(sampling.time, "perf_counter", lambda: float(next(ticks)))
    times = []
    timed = gen(step_times=times)
    assert torch.equal(timed.ids, plain.ids) and torch.equal(timed.logp, plain.logp)
    assert times == [float(t) for t in range(plain.response_ids.shape[1])]


def test_groups_stay_together():
    m = MarkovMock(forcing_table())
    prompts = [[BOS, 6], [BOS, 1, 1, 3], [7]]
    r = generate(m, prompts, samples_per_prompt=4, max_new_tokens=4, eos_id=EOS, pad_id=PAD, generator=None)
    first = {6: EOS, 3: 4, 7: 7}
    for b in range(12):
        p = prompts[b // 4]
        assert r.prompt_ids[b, -len(p):].tolist() == p
        assert r.response_ids[b, 0].item() == first[p[-1]]
    r = gen(temperature=0)                                            # real model, greedy: G copies
    assert (r.ids.view(4, 3, -1) == r.ids.view(4, 3, -1)[:, :1]).all()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        gen(max_new_tokens=30)
    with pytest.raises(ValueError, match="at least one token"):
        gen(prompts=[[BOS], []])
    with pytest.raises(ValueError, match="temperature"):
        gen(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        gen(top_p=0.0)


# ---------------------------------------------------------------------- determinism, cache, greedy
def test_seeded_generator_is_deterministic():
    a, b, c = gen(seed=7), gen(seed=7), gen(seed=8)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logp, b.logp) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.ids, c.ids)


class NoCache(torch.nn.Module):
    """The tiny model whose ``new_cache`` gives None: generate must fall back to full recomputation."""

    differentiable_cache = False

    def __init__(self, m):
        super().__init__()
        self.m, self.config = m, m.config

    def new_cache(self, batch_size, max_len):
        return None

    def forward(self, ids, *, attention_mask=None, **_):
        return self.m(ids, attention_mask=attention_mask)


def test_cached_generation_equals_uncached():
    a, b = gen(seed=3, top_p=0.9), gen(model=NoCache(MODEL), seed=3, top_p=0.9)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.attention_mask, b.attention_mask)
    torch.testing.assert_close(a.logp, b.logp, atol=1e-5, rtol=1e-5)


def test_logp_matches_per_row_unpadded_oracle():
    """The obvious loop: each row alone, unpadded, scored by a full forward."""
    r = gen(seed=1, temperature=1.0)
    with torch.no_grad():
        for b in range(r.ids.size(0)):
            prompt = PROMPTS[b // 3]
            n = int(r.response_lengths[b])
            seq = torch.tensor([prompt + r.response_ids[b, :n].tolist()])
            logits = MODEL(seq)[0, len(prompt) - 1:-1]                   # (n, V)
            want = torch.log_softmax(logits, -1).gather(1, seq[0, len(prompt):, None]).squeeze(1)
            torch.testing.assert_close(r.logp[b, :n], want, atol=1e-5, rtol=1e-5)


def test_greedy_picks_argmax_and_scores_at_temperature_one():
    r = gen(temperature=0.0, top_p=0.5)                              # top_p is ignored when greedy
    with torch.no_grad():
        logits = MODEL(r.ids, attention_mask=r.attention_mask)[:, r.prompt_len - 1:-1]   # (B, T, V)
    real = r.mask.bool()
    assert torch.equal(logits.argmax(-1)[real], r.response_ids[real])
    want = torch.log_softmax(logits, -1).gather(-1, r.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(r.logp[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sequence_token_logprobs(MODEL, r), r.logp, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- trainer recomputation
@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (0.7, 1.0), (1.0, 1.0), (1.3, 0.6)])
def test_recomputed_logp_equals_rollout_logp(temperature, top_p):
    m = tiny_model(seed=4).train()                                   # no dropout: train == eval
    r = gen(model=m, seed=2, temperature=temperature, top_p=top_p, max_new_tokens=10)
    assert r.mask.sum() < r.mask.numel()                              # some rows did stop at eos
    lp = sequence_token_logprobs(m, r)
    assert lp.requires_grad
    torch.testing.assert_close(lp, r.logp, atol=1e-5, rtol=1e-5)
    assert (lp[r.mask == 0] == 0).all()
    as_tuple = sequence_token_logprobs(m, (r.ids, r.attention_mask, r.prompt_len),
                                       temperature=temperature, top_p=top_p, chunk_rows=5)
    torch.testing.assert_close(as_tuple, lp, atol=1e-6, rtol=1e-6)
    (lp * r.mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_select_rows_for_minibatches():
    r = gen(seed=5, temperature=0.8, top_p=0.9)
    idx = torch.tensor([7, 0, 11])
    sub = r.select(idx)
    assert torch.equal(sub.ids, r.ids[idx]) and torch.equal(sub.logp, r.logp[idx])
    assert torch.equal(sub.truncated, r.truncated[idx]) and (sub.prompt_len, sub.top_p) == (r.prompt_len, 0.9)
    torch.testing.assert_close(sequence_token_logprobs(MODEL, sub), r.logp[idx], atol=1e-5, rtol=1e-5)
    assert r.select(slice(0, 3)).ids.shape[0] == 3


def test_tuple_form_needs_the_sampling_settings():
    r = gen()
    with pytest.raises(ValueError, match="temperature"):
        sequence_token_logprobs(MODEL, (r.ids, r.attention_mask, r.prompt_len))


def test_token_outside_current_nucleus_gets_finite_floor_and_no_nan_grad():
    logits = torch.tensor([0.0, 0.0, 0.0, 5.0, 4.0, -3.0])
    m = MarkovMock(logits.expand(6, 6).clone())
    ids = torch.tensor([[BOS, 3, 5], [BOS, 4, 3]])                     # token 5 is far outside p=0.9
    am = torch.ones_like(ids)
    lp = sequence_token_logprobs(m, (ids, am, 1), temperature=1.0, top_p=0.9)
    assert lp[0, 1].item() == OUTSIDE_NUCLEUS_LOGP
    nucleus = torch.softmax(logits, 0)[3:5]
    torch.testing.assert_close(lp[1], (nucleus / nucleus.sum()).log().flip(0))
    lp.sum().backward()
    assert torch.isfinite(m.table.grad).all()


# ---------------------------------------------------------------------- the sampled distribution
def assert_draws_follow(r: Rollout, q: torch.Tensor) -> None:
    """The first tokens of ``r``'s rows (one prompt, many samples) follow ``q`` (V,): none outside its
    support, a chi-square within bounds, and each row's stored logp is log q of its token."""
    counts = torch.bincount(r.response_ids[:, 0], minlength=q.numel()).float()
    assert counts[q == 0].sum() == 0
    exp = q[q > 0] * r.ids.size(0)
    chi2 = ((counts[q > 0] - exp) ** 2 / exp).sum().item()
    assert chi2 < 25.0, (chi2, counts, exp)                          # df <= 6; p(chi2 > 25) < 1e-3
    torch.testing.assert_close(r.logp[:, 0], q.log()[r.response_ids[:, 0]])


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.5, 1.0), (1.0, 0.5)])
def test_sample_frequencies_match_tempered_nucleus(temperature, top_p):
    logits = torch.tensor([-1.0, 0.5, 1.0, 2.0, 0.2, -0.4, 1.6])
    V, N = logits.numel(), 6000
    m = MarkovMock(logits.expand(V, V).clone())
    r = generate(m, [[BOS]], samples_per_prompt=N, max_new_tokens=1, temperature=temperature, top_p=top_p,
                 eos_id=None, pad_id=PAD, generator=torch.Generator().manual_seed(0))
    # expected: softmax(logits / T), restricted to the nucleus by hand, renormalized
    p = torch.softmax(logits / temperature, 0)
    order = sorted(range(V), key=lambda i: -p[i].item())
    keep, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        keep.append(i)
        mass += p[i].item()
    q = torch.zeros(V)
    q[keep] = p[keep] / p[keep].sum()
    assert nucleus_mask(logits / temperature, top_p).tolist() == [i in keep for i in range(V)]
    assert_draws_follow(r, q)
    torch.testing.assert_close(sampling_logprobs(logits, temperature, top_p).exp(), q)


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [(1.0, 1.0, 3, 0.0), (0.7, 0.8, 4, 0.0),
                                                           (1.0, 1.0, 0, 0.3), (1.3, 0.9, 5, 0.2)])
def test_top_k_and_min_p_nucleus_by_hand(temperature, top_p, top_k, min_p):
    """top_k keeps the k most probable tokens, top_p then the smallest prefix whose mass over those k
    (renormalized) reaches top_p, min_p then the tokens with at least min_p times the top one's
    probability: the set built here by hand; generate draws from that set renormalized (frequencies,
    the stored logp) and the trainer recomputes the same logp."""
    logits = torch.tensor([-1.0, 0.5, 1.0, 2.0, 0.2, -0.4, 1.6])
    V, N = logits.numel(), 6000
    p = torch.softmax(logits / temperature, 0)
    order = sorted(range(V), key=lambda i: -p[i].item())
    kept = order[:top_k] if top_k else order
    total, keep, mass = sum(p[i].item() for i in kept), [], 0.0
    for i in kept:
        if mass >= top_p * total:
            break
        keep.append(i)
        mass += p[i].item()
    keep = [i for i in keep if p[i] >= min_p * p[order[0]]]
    q = torch.zeros(V)
    q[keep] = p[keep] / p[keep].sum()
    assert nucleus_mask(logits / temperature, top_p, top_k, min_p).tolist() == [i in keep for i in range(V)]
    assert 1 <= len(keep) < V
    torch.testing.assert_close(sampling_logprobs(logits, temperature, top_p, top_k, min_p).exp(), q)
    m = MarkovMock(logits.expand(V, V).clone())
    r = generate(m, [[BOS]], samples_per_prompt=N, max_new_tokens=1, temperature=temperature, top_p=top_p,
                 top_k=top_k, min_p=min_p, eos_id=None, pad_id=PAD, generator=torch.Generator().manual_seed(0))
    assert (r.top_k, r.min_p) == (top_k, min_p) and r.select(slice(0, 2)).top_k == top_k
    assert_draws_follow(r, q)
    torch.testing.assert_close(sequence_token_logprobs(m, r), r.logp)                 # the rollout's own nucleus
    torch.testing.assert_close(r.logp_full[:, 0], torch.log(p)[r.response_ids[:, 0]])  # the KL's side: none


def test_nucleus_mask_agrees_with_transformers_warpers():
    """On random logits (no ties) the nucleus equals what transformers' TopK, TopP and MinP logits
    warpers, chained in its generation order, leave finite."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(0)
    for top_p, top_k, min_p in [(0.9, 0, 0.0), (1.0, 5, 0.0), (0.7, 8, 0.0), (1.0, 0, 0.1), (0.8, 12, 0.05)]:
        z = torch.randn(16, 40, generator=gen) * 2
        scores = z.clone()
        if top_k:
            scores = warpers.TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = warpers.TopPLogitsWarper(top_p)(None, scores)
        if min_p:
            scores = warpers.MinPLogitsWarper(min_p)(None, scores)
        assert torch.equal(nucleus_mask(z, top_p, top_k, min_p), torch.isfinite(scores)), (top_p, top_k, min_p)


def test_sampling_settings_are_checked():
    for kw, msg in [({"top_k": -1}, "top_k must be an integer >= 0"), ({"min_p": 1.0}, r"min_p must be in \[0, 1\)")]:
        with pytest.raises(ValueError, match=msg):
            generate(MODEL, [[BOS]], samples_per_prompt=1, max_new_tokens=1, eos_id=None, pad_id=PAD, **kw)
    with pytest.raises(ValueError, match="top_k"):
        concat([gen(seed=1, top_p=0.9), generate(MODEL, [[BOS]], samples_per_prompt=1, max_new_tokens=1, top_p=0.9,
                                                   top_k=2, eos_id=None, pad_id=PAD)], PAD)


# ---------------------------------------------------------------------- random shapes (oracle)
@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), G=st.integers(1, 3),
       T=st.integers(1, 6), temperature=st.sampled_from([0.0, 0.5, 1.0]),
       top_p=st.sampled_from([0.8, 1.0]), seed=st.integers(0, 10_000))
def test_rollout_invariants_random_shapes(lengths, G, T, temperature, top_p, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 13, (n,), generator=g).tolist() for n in lengths]
    r = generate(MODEL, prompts, samples_per_prompt=G, max_new_tokens=T, temperature=temperature, top_p=top_p,
                 eos_id=EOS, pad_id=PAD, generator=g)
    B, Lp, Tr = len(prompts) * G, max(lengths), r.mask.size(1)
    assert isinstance(r, Rollout) and r.ids.shape == (B, Lp + Tr) and 1 <= Tr <= T
    assert torch.equal(r.attention_mask[:, Lp:].float(), r.mask)
    for b in range(B):                                                # the loop is the oracle
        resp = r.response_ids[b].tolist()
        n = resp.index(EOS) + 1 if EOS in resp else Tr
        assert r.mask[b].tolist() == [1.0] * n + [0.0] * (Tr - n)
        assert resp[n:] == [PAD] * (Tr - n)
        assert bool(r.truncated[b]) == (EOS not in resp)
        assert r.prompt_ids[b].tolist() == [PAD] * (Lp - len(prompts[b // G])) + prompts[b // G]
    assert math.isclose(r.temperature, temperature) and math.isclose(r.top_p, top_p)
    with torch.no_grad():
        torch.testing.assert_close(sequence_token_logprobs(MODEL, r), r.logp, atol=1e-5, rtol=1e-5)


def test_response_extent_by_hand():
    assert scoring.response_extent(torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])).tolist() == [2, 3, 0]


# ---------------------------------------------------------------------- the blocked draw of a decode step
def _reference_draw(logits, temperature, u):
    """The plain draw: a running sum over the whole vocabulary (inverse_cdf_sample) and log_softmax."""
    lp = sampling_logprobs(logits, temperature, 1.0)
    tok = sampling.inverse_cdf_sample(lp.exp(), u)
    return tok, lp.gather(1, tok[:, None]).squeeze(1)


def test_sample_tempered_by_hand():
    # V = 7 in blocks of 3, the last one partial: block masses 0.625, 0, 0.375; cdf 0.125, 0.125, 0.625 | .. | 1
    p = torch.tensor([0.125, 0.0, 0.5, 0.0, 0.0, 0.0, 0.375])
    u = torch.tensor([0.05, 0.2, 0.7, 0.999, 2.0])
    # 0.05 -> token 0; 0.2 -> token 2 (token 1 has no mass); 0.7 -> block 1 has none, so block 2: token 6;
    # u = 2 stands for rounding that puts u · total past the total: the last token, which has mass
    tok, logp = sampling.sample_tempered(p.log().expand(5, 7), 1.0, u, block=3)
    assert tok.tolist() == [0, 2, 6, 6, 6]
    assert tok.tolist() == sampling.inverse_cdf_sample(p.expand(5, 7), u).tolist()
    torch.testing.assert_close(logp, p[tok].log(), atol=1e-6, rtol=0)
    # the last token without mass: past the total takes the most likely token, as inverse_cdf_sample does
    q = torch.tensor([0.125, 0.0, 0.5, 0.0, 0.0, 0.375, 0.0])
    tok, _ = sampling.sample_tempered(q.log().expand(2, 7), 1.0, torch.tensor([0.9, 2.0]), block=3)
    assert tok.tolist() == [5, 2] == sampling.inverse_cdf_sample(q.expand(2, 7), torch.tensor([0.9, 2.0])).tolist()


@pytest.mark.parametrize("block", [1, 64, 1000, 4096])
@pytest.mark.parametrize("temperature", [0.5, 1.3])
def test_sample_tempered_equals_the_running_sum_over_the_vocabulary(block, temperature):
    """Blocks of one token, blocks that do not divide V (1000 = 15 x 64 + 40), one block, a block
    wider than V: the same tokens and log-probs (to float rounding) as the plain draw."""
    gen_ = torch.Generator().manual_seed(block)
    logits = torch.randn(32, 1000, generator=gen_) * 3
    logits[:4, 100:700] = float("-inf")                       # rows with blocks that have no mass
    u = torch.rand(32, generator=gen_)
    tok, logp = sampling.sample_tempered(logits, temperature, u, block=block)
    want_tok, want_logp = _reference_draw(logits, temperature, u)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)


def test_sample_tempered_log_prob_of_a_rare_token_is_accurate():
    # p(token 0) ~ 1e-42, a float32 subnormal with few significant bits, is drawn when u = 0 (the first
    # token with mass); its log-prob comes from the logits: log of that rounded probability is 4e-6 off
    logits = torch.zeros(1, 5000)
    logits[0, 0] = -88.0
    tok, logp = sampling.sample_tempered(logits, 1.0, torch.zeros(1), block=256)
    want = torch.log_softmax(logits.double(), -1)[0, 0].item()
    p = torch.softmax(logits, -1)[0, 0]
    assert abs(p.log().item() - want) > 1e-6 * abs(want)          # what the logarithm of p would give
    assert tok.item() == 0 and logp.item() == pytest.approx(want, rel=1e-7)


def test_generate_draws_through_sample_tempered_without_a_nucleus(monkeypatch):
    """Per-prompt uniforms and top_p = 1: each step goes through the blocked draw, and the rollout is
    the plain draw's (the same tokens, log-probs to float rounding); with a nucleus it is not used."""
    table = torch.randn(13, 13, generator=torch.Generator().manual_seed(5)) * 2
    model = MarkovMock(table)
    calls = []
    real = sampling.sample_tempered
    monkeypatch.setattr(sampling, "sample_tempered", lambda *a, **k: calls.append(1) or real(*a, **k))

    def roll(top_p=1.0):
        return generate(model, PROMPTS, samples_per_prompt=3, max_new_tokens=6, temperature=0.8, top_p=top_p,
                        eos_id=EOS, pad_id=PAD, generators=sampling.prompt_generators(3, 0, len(PROMPTS)))

    fast = roll()
    assert len(calls) == fast.mask.shape[1] > 0
    monkeypatch.setattr(sampling, "sample_tempered", _reference_draw)
    plain = roll()
    assert torch.equal(fast.ids, plain.ids) and torch.equal(fast.mask, plain.mask)
    torch.testing.assert_close(fast.logp, plain.logp, atol=1e-6, rtol=0)
    calls.clear()
    monkeypatch.setattr(sampling, "sample_tempered", lambda *a, **k: calls.append(1) or real(*a, **k))
    roll(top_p=0.9)
    assert not calls


# ---------------------------------------------------------------------- finished rows leave the batch
SHORT_PROMPTS = [[BOS, 5, 7, 3], [BOS, 6], [BOS, 4, 4, 3, 6], [BOS, 7, 3]]
LETTERS = sampling.StopStrings(("f", "dd"), lambda ids: "".join(chr(ord("a") + i) for i in ids))
DRAWS = {   # how each row's tokens are drawn: the generate() keywords
    "per_prompt": lambda: dict(generators=sampling.prompt_generators(7, 0, 4)),
    "per_prompt_nucleus": lambda: dict(generators=sampling.prompt_generators(7, 0, 4), top_p=0.8, top_k=5),
    "multinomial": lambda: dict(generator=torch.Generator().manual_seed(7)),
    "multinomial_min_p": lambda: dict(generator=torch.Generator().manual_seed(7), min_p=0.1, temperature=1.3),
    "greedy": lambda: dict(temperature=0.0, budgets=[24, 3, 11, 6]),
    "stop_strings": lambda: dict(generators=sampling.prompt_generators(7, 0, 4), stop=LETTERS),
}


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_finished_rows_leave_the_batch_and_every_row_is_drawn_as_before(draw, monkeypatch):
    """With rows dropped from the batch (and the KV cache) as they end, every row gets the same
    tokens, masks and log-probs (to float rounding) as with every row computed to the end, for each
    way of drawing: per-prompt uniforms with and without a nucleus, one generator's multinomial
    draw, greedy with per-prompt budgets, stop strings; and fewer rows are computed."""
    model = tiny_model(seed=1, V=8)
    drops = []
    real = sampling.cache_rows.keep_rows
    monkeypatch.setattr(sampling.cache_rows, "keep_rows",
                        lambda c, r, **kw: drops.append(r.numel()) or real(c, r, **kw))

    def roll(compact):
        monkeypatch.setattr(sampling, "COMPACT_FINISHED", compact)
        kw = dict(samples_per_prompt=4, max_new_tokens=24, temperature=1.0, eos_id=EOS, pad_id=PAD)
        return generate(model, SHORT_PROMPTS, **{**kw, **DRAWS[draw]()})

    default = sampling.COMPACT_FINISHED
    every, dropped = roll(None), roll(default)
    assert drops, "no row left the batch"
    assert torch.equal(every.ids, dropped.ids) and torch.equal(every.attention_mask, dropped.attention_mask)
    assert torch.equal(every.mask, dropped.mask) and torch.equal(every.truncated, dropped.truncated)
    torch.testing.assert_close(dropped.logp, every.logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(dropped.tempered_logp, every.tempered_logp, atol=1e-5, rtol=0)
    lengths = every.response_lengths
    assert lengths.max() - lengths.min() >= 5                               # the lengths do spread
    B, steps = every.mask.shape
    assert every.decode_rows == B * (steps - 1)                             # every row, every decode forward
    assert dropped.decode_rows < every.decode_rows
    assert dropped.finished_row_frac < every.finished_row_frac
    # without drops a row of n tokens is computed for nothing at the steps - n forwards from its last token on
    assert every.decode_finished_rows == sum(steps - int(n) for n in lengths)


def test_rows_leave_as_they_finish_on_a_cache_that_fills_holes(monkeypatch):
    """WASTE_PER_COPY's rule on the built-in model's cache (it fills holes: a drop copies at most
    the rows it drops): a finished row is never computed, so no decode forward is spent on one
    (the former rule, a drop once a quarter of the computed rows had finished, spent some)."""
    model = tiny_model(seed=1, V=8)
    kept = []
    real = sampling.cache_rows.keep_rows
    monkeypatch.setattr(sampling.cache_rows, "keep_rows",
                        lambda c, r, **kw: kept.append((c.batch_size, r.numel())) or real(c, r, **kw))
    r = generate(model, SHORT_PROMPTS, samples_per_prompt=4, max_new_tokens=24, eos_id=EOS, pad_id=PAD,
                 generators=sampling.prompt_generators(3, 0, 4))
    assert kept and r.decode_rows > 0 and r.decode_finished_rows == 0
    assert [b for b, _ in kept[1:]] == [n for _, n in kept[:-1]]          # each drop starts from the last


def test_a_drop_that_copies_every_kept_row_waits_for_as_much_waste(monkeypatch):
    """On a cache whose drop copies every kept row (no ``fills_holes``, as transformers'), the rows
    leave once the finished rows computed since the last drop reach WASTE_PER_COPY times the rows
    kept: the waste is bounded by the copies, and fewer rows are copied than by dropping at once."""
    model = tiny_model(seed=1, V=8)
    monkeypatch.setattr(TinyKVCache, "fills_holes", False)
    seen = []
    real = sampling._drop_finished
    monkeypatch.setattr(sampling, "_drop_finished",
                        lambda c, rows, tok, fin, wasted: seen.append((int(fin[rows].sum()), rows.numel(), wasted))
                        or real(c, rows, tok, fin, wasted))
    kept = []
    real_keep = sampling.cache_rows.keep_rows
    monkeypatch.setattr(sampling.cache_rows, "keep_rows",
                        lambda c, r, **kw: kept.append(r.numel()) or real_keep(c, r, **kw))
    r = generate(model, SHORT_PROMPTS, samples_per_prompt=4, max_new_tokens=24, eos_id=EOS, pad_id=PAD,
                 generators=sampling.prompt_generators(3, 0, 4))
    assert kept and r.decode_finished_rows > 0
    rule = [done and w + done >= sampling.WASTE_PER_COPY * (n - done) for done, n, w in seen]
    assert sum(rule) == len(kept)                                          # a drop exactly where the rule says
    assert any(done and not drop for (done, _, _), drop in zip(seen, rule))  # and some waits


def test_tiny_cache_keep_rows_gives_the_kept_rows_logits():
    """KVCache.keep_rows: the kept rows past the new batch fill the dropped rows' places (rows 1, 3, 4
    of 5: row 3 moves into row 0's place, row 4 into row 2's) and the next step over them gives
    those rows' logits of the full batch."""
    model = tiny_model(seed=2, V=8)
    ids = torch.randint(1, 8, (5, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :2] = 0                                                          # a left-padded row
    with torch.no_grad():
        full_cache, cache = model.new_cache(5, 8), model.new_cache(5, 8)
        model(ids, attention_mask=am, cache=full_cache)
        model(ids, attention_mask=am, cache=cache)
        order = cache.keep_rows(torch.tensor([1, 3, 4]))
        assert order.tolist() == [3, 1, 4] and cache.batch_size == 3 and cache.length == 6
        nxt = torch.tensor([[3], [5], [6], [7], [2]])
        want = model(nxt, attention_mask=torch.ones_like(nxt), cache=full_cache)[order]
        got = model(nxt[order], attention_mask=torch.ones(3, 1, dtype=torch.long), cache=cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.next_pos.tolist() == [7, 5, 7]


def test_fill_holes_by_hand():
    order, dst, src = sampling.cache_rows.fill_holes(torch.tensor([1, 3, 4]))
    assert order.tolist() == [3, 1, 4] and dst.tolist() == [0, 2] and src.tolist() == [3, 4]
    order, dst, src = sampling.cache_rows.fill_holes(torch.tensor([0, 1, 5]))
    assert order.tolist() == [0, 1, 5] and dst.tolist() == [2] and src.tolist() == [5]
    order, dst, src = sampling.cache_rows.fill_holes(torch.tensor([0, 1, 2]))
    assert order.tolist() == [0, 1, 2] and dst.numel() == src.numel() == 0


def test_group_rows_by_hand():
    groups, rows = sampling.cache_rows.group_rows(torch.tensor([1, 2, 7]), 4)
    assert groups.tolist() == [0, 1] and rows.tolist() == list(range(8))
    groups, rows = sampling.cache_rows.group_rows(torch.tensor([5]), 2)
    assert groups.tolist() == [2] and rows.tolist() == [4, 5]


def test_concat_sums_the_decode_rows():
    a = gen(seed=1)
    b = gen(seed=2)
    c = concat([a, b], PAD)
    assert c.decode_rows == a.decode_rows + b.decode_rows > 0
    assert c.decode_finished_rows == a.decode_finished_rows + b.decode_finished_rows
