"""Finished rows leave a lean cache in the grouped layout (rlvr.models.cache_rows: whole groups, then
``ungroup``) on a tiny locally built Llama: the same rows as with every row computed."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from rlvr import sampling  # noqa: E402
from rlvr.models import cache_rows  # noqa: E402
from rlvr.models.hf import load_policy  # noqa: E402

from hf_models import make_model_dir  # noqa: E402

PROMPTS = ["ab 12", "x", "hello, wor", "9,8"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("llama"), chat=True))


class EndBiased(torch.nn.Module):
    """A policy whose end token's logit is raised by ``bias``: geometric response lengths, spread
    inside each group (one row of a group runs long while the others end)."""

    def __init__(self, policy, eos: int, bias: float):
        super().__init__()
        self.policy, self.eos, self.bias, self.config = policy, eos, bias, policy.config

    def forward(self, ids, **kw):
        logits = self.policy(ids, **kw)                                   # (B, L, V)
        logits[..., self.eos] += self.bias
        return logits

    def new_cache(self, batch_size: int, max_len: int):
        return self.policy.new_cache(batch_size, max_len)


def _grouped_cache(policy, tok, G: int, steps: int):
    """A cache of the prompts repeated G times in the grouped layout, after ``steps`` decode steps of
    every row (fixed tokens), and the (B,) tokens to feed next."""
    prompts = [tok.encode(s) for s in PROMPTS]
    Lp = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_id] * (Lp - len(p)) + p for p in prompts])
    am = (torch.arange(Lp)[None] >= torch.tensor([Lp - len(p) for p in prompts])[:, None]).long()
    cache = policy.new_cache(len(prompts), Lp + 24)
    policy(ids, attention_mask=am, cache=cache, logits_to_keep=1)
    cache.repeat_interleave(G)
    B = len(prompts) * G
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ones = torch.ones(B, 1, dtype=torch.long)
        policy(torch.randint(3, 20, (B, 1), generator=g), attention_mask=ones, cache=cache)
    return cache, torch.randint(3, 20, (B, 1), generator=g)


def test_ungroup_gives_the_kept_rows_logits(llama):
    """cache_rows.ungroup: the kept rows (one of a group, two of another) leave the grouped layout,
    each with its own copy of its prompt's columns, and the next steps over them give those rows'
    logits of the full grouped batch."""
    policy, tok = llama
    G = 3
    with torch.no_grad():
        full, nxt = _grouped_cache(policy, tok, G, steps=3)
        cache, _ = _grouped_cache(policy, tok, G, steps=3)
        assert cache.group == G
        rows = torch.tensor([1, 6, 8])
        assert cache_rows.rows_copied(cache, rows) == 3
        assert cache_rows.keep_rows(cache, rows, exact=True).tolist() == rows.tolist()
        assert cache.group == 1 and cache.batch_size == 3 and cache.length == full.length
        B = nxt.size(0)
        for _ in range(2):
            want = policy(nxt, attention_mask=torch.ones(B, 1, dtype=torch.long), cache=full)[rows]
            got = policy(nxt[rows], attention_mask=torch.ones(3, 1, dtype=torch.long), cache=cache)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            nxt = nxt.flip(0)


def test_whole_groups_fill_holes(llama):
    """Without ``exact`` a grouped cache keeps the groups that hold a kept row, the last ones moved
    into the dropped groups' places (cache_rows.fill_holes), and the next step gives their logits."""
    policy, tok = llama
    G = 2
    with torch.no_grad():
        full, nxt = _grouped_cache(policy, tok, G, steps=2)
        cache, _ = _grouped_cache(policy, tok, G, steps=2)
        keep = torch.tensor([1, 2, 6])                                    # groups 0, 1 and 3 of 4
        assert cache_rows.rows_copied(cache, torch.tensor([0, 1, 6, 7])) == 2    # group 3 into group 1's place
        kept = cache_rows.keep_rows(cache, keep)
        assert kept.tolist() == [0, 1, 2, 3, 6, 7] and cache.group == G
        B = nxt.size(0)
        want = policy(nxt, attention_mask=torch.ones(B, 1, dtype=torch.long), cache=full)[kept]
        got = policy(nxt[kept], attention_mask=torch.ones(6, 1, dtype=torch.long), cache=cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_long_row_in_a_group_does_not_keep_its_finished_rows(llama, monkeypatch):
    """Rows of geometric lengths in groups of 4 on the grouped layout: with the default rule the
    cache leaves the grouped layout once the finished rows kept in live groups have cost a copy, so
    under a tenth of the decode rows are spent on finished rows (whole groups only, the former
    rule: more), and every row gets the same tokens and log-probs (to float rounding) as with every
    row computed to the end."""
    policy, tok = llama
    model = EndBiased(policy, tok.eos_id, 2.5)
    prompts = [tok.encode(s) for s in PROMPTS]
    calls = []
    real = cache_rows.keep_rows
    monkeypatch.setattr(cache_rows, "keep_rows",
                        lambda c, r, **kw: calls.append((c.group, kw.get("exact", False))) or real(c, r, **kw))

    def roll(compact):
        monkeypatch.setattr(sampling, "COMPACT_FINISHED", compact)
        return sampling.generate(model, prompts, samples_per_prompt=4, max_new_tokens=20, temperature=1.0,
                                 eos_id=tok.eos_id, pad_id=tok.pad_id,
                                 generators=sampling.prompt_generators(11, 0, len(prompts)))

    default = sampling.COMPACT_FINISHED
    every, dropped = roll(None), roll(default)
    assert (4, True) in calls, "the grouped layout was never left"            # the rule reached the loop
    lengths = every.response_lengths.view(4, 4).float()
    assert (lengths.max(1).values - lengths.min(1).values).max() >= 8         # a group's rows do spread
    assert torch.equal(every.ids, dropped.ids) and torch.equal(every.mask, dropped.mask)
    assert torch.equal(every.truncated, dropped.truncated)
    torch.testing.assert_close(dropped.logp, every.logp, atol=1e-5, rtol=0)
    assert dropped.finished_row_frac < 0.1 < every.finished_row_frac
    monkeypatch.setattr(cache_rows, "ungroup", lambda c, r: cache_rows._lean_keep_rows(c, r))   # whole groups only
    groups_only = roll(default)
    assert torch.equal(groups_only.ids, every.ids)
    assert dropped.finished_row_frac < groups_only.finished_row_frac


@pytest.mark.parametrize("grouped", [False, True])
def test_the_plain_caches_spare_columns_grow_without_changing_a_row(llama, monkeypatch, grouped):
    """The plain layout's buffers start CACHE_GROW columns past the prompt and grow by as many when
    full, every call attending over their whole width with the spare columns masked
    (LeanCache.attend_width): with 1 or 3 spare columns (a growth every step or every third, rows
    dropping out between, and from the grouped layout by ungroup) each row gets the tokens and
    log-probs (to float rounding) it gets with every column allocated up front."""
    from rlvr.models import lean_llama

    policy, tok = llama
    model = EndBiased(policy, tok.eos_id, 2.0)
    prompts = [tok.encode(s) for s in PROMPTS]
    monkeypatch.setattr(lean_llama, "GROUP_ATTENTION_FLOPS", 100.0 if grouped else 0.0)
    widths = []
    real = lean_llama.LeanCache.attend_width
    monkeypatch.setattr(lean_llama.LeanCache, "attend_width",
                        lambda self, S: widths.append((S, real(self, S))) or widths[-1][1])

    def roll(grow):
        monkeypatch.setattr(lean_llama, "CACHE_GROW", grow)
        widths.clear()
        out = sampling.generate(model, prompts, samples_per_prompt=4, max_new_tokens=20, temperature=1.0,
                                eos_id=tok.eos_id, pad_id=tok.pad_id,
                                generators=sampling.prompt_generators(5, 0, len(prompts)))
        return out, list(widths)

    whole, _ = roll(10**6)
    lengths = whole.response_lengths.float()
    assert lengths.max() - lengths.min() >= 8                               # rows end at different steps
    for grow in (1, 3):
        got, seen = roll(grow)
        plain = [(S, W) for S, W in seen if W != S]
        assert plain and all(S < W <= S + grow for S, W in plain)           # spare columns, at most `grow`
        assert torch.equal(got.ids, whole.ids) and torch.equal(got.mask, whole.mask)
        torch.testing.assert_close(got.logp, whole.logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("row_major", [None, "until grown"])
def test_an_append_past_the_buffers_width_grows_them_without_attend_width(row_major, monkeypatch):
    """A no-gradient append that did not ask ``attend_width`` first (every lean forward asks; a direct
    caller need not) and runs past the buffers' CACHE_GROW spare columns: the buffers grow, and the
    cache holds every column appended, in order, whatever the growth. The keys row-major at these
    widths (below KEYS_ROW_MAJOR); with KEYS_ROW_MAJOR at the first buffer's width, row-major until
    the growth passes it, then transposed (the filled columns copied across)."""
    import rlvr.models.lean_llama as lean
    from rlvr.models.lean_llama import LeanCache
    from rlvr.models.lean_llama.limits import CACHE_GROW

    g = torch.Generator().manual_seed(0)
    B, H, D, L0, steps = 2, 3, 4, 5, CACHE_GROW + 7
    if row_major:
        monkeypatch.setattr(lean, "KEYS_ROW_MAJOR", L0 + CACHE_GROW)
    cache = LeanCache(1, B, L0 + steps, "cpu")
    assert cache.spare_cols
    ks = [torch.randn(B, H, L0, D, generator=g)] + [torch.randn(B, H, 1, D, generator=g) for _ in range(steps)]
    vs = [torch.randn(B, H, k.size(2), D, generator=g) for k in ks]
    with torch.no_grad():
        cache.append(0, ks[0], vs[0])                                   # the prefill: L0 + CACHE_GROW columns
        assert cache._kbuf[0].shape == (B, H, L0 + CACHE_GROW, D) == cache._vbuf[0].shape   # row-major keys
        for k, v in zip(ks[1:], vs[1:]):
            keys, values = cache.append(0, k, v)
    assert cache._vbuf[0].size(2) == L0 + steps                      # grown, to max_len at most
    assert cache._kbuf[0].shape == ((B, H, D, L0 + steps) if row_major else (B, H, L0 + steps, D))
    assert torch.equal(keys, torch.cat(ks, dim=2)) and torch.equal(values, torch.cat(vs, dim=2))
