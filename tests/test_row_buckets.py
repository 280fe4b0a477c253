"""Length buckets inside a forward (train.length_buckets, rlvr.scoring.length_buckets): rows of a
scoring or training forward split into buckets of similar length, each forwarded to its own longest
row, the prompts still once per group where they are shared. The cut is the exact optimum (checked
against enumeration), the log-probs and gradients are those of one forward over every row, and the
learn stage computes and counts fewer padding positions."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from rlvr import sampling, scoring
from rlvr.models.hf import load_policy
from hf_models import make_model_dir
from rlvr.learn import learn
from test_length_buckets import LENGTHS, LP, T, long_batch, one_learn, tiny_setup


def enumerated_best(ext: list[int], call: int) -> int:
    """The least cost over every split of the sorted extents into contiguous runs (2^(B-1) of them)."""
    e = sorted(max(1, x) for x in ext)
    best = None
    for cuts in itertools.product([False, True], repeat=len(e) - 1):
        cost, start = 0, 0
        for i, cut in enumerate(list(cuts) + [True]):
            if cut:
                cost += (i + 1 - start) * e[i] + call
                start = i + 1
        best = cost if best is None else min(best, cost)
    return best


def bucket_cost(ext: torch.Tensor, buckets: list[torch.Tensor], call: int) -> int:
    return sum(b.numel() * max(1, int(ext[b].max())) + call for b in buckets)


def test_length_buckets_by_hand():
    ext = torch.tensor([200, 10, 200, 10])
    # one bucket: 4 x 200 + 64 = 864; two: 2 x 10 + 64 + 2 x 200 + 64 = 548; four: 2 x 10 + 2 x 200 + 4 x 64 = 676
    got = scoring.length_buckets(ext, call_tokens=64, padding_cap=1.0)
    assert [b.tolist() for b in got] == [[1, 3], [0, 2]]
    assert [b.tolist() for b in scoring.length_buckets(ext, call_tokens=1000, padding_cap=1.0)] == [[1, 3, 0, 2]]
    assert [b.tolist() for b in scoring.length_buckets(torch.tensor([5, 0, 5]), call_tokens=0)] == [[1], [0, 2]]
    assert scoring.bucket_positions(ext, False) == (800, 800 - 420)
    assert scoring.bucket_positions(ext, True) == (20 + 400, 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("call", [0, 8, 64])
def test_length_buckets_is_the_enumerated_optimum(seed, call):
    gen = torch.Generator().manual_seed(seed)
    ext = torch.randint(0, 60, (9,), generator=gen)
    got = scoring.length_buckets(ext, call_tokens=call, padding_cap=1.0)
    assert sorted(torch.cat(got).tolist()) == list(range(9))                          # every row once
    assert all(int(ext[a].max()) <= int(ext[b].min()) for a, b in zip(got, got[1:]))   # runs of the sorted rows
    assert bucket_cost(ext, got, call) == enumerated_best(ext.tolist(), call)


def test_length_buckets_padding_cap_by_hand():
    ext = torch.tensor([200, 10, 200, 10, 180])
    # at a call cost of 1000 the DP keeps one bucket: 5 x 200 = 1000 positions, 400 of them padding
    assert [b.tolist() for b in scoring.length_buckets(ext, call_tokens=1000, padding_cap=1.0)] == [[1, 3, 4, 0, 2]]
    # 40% > 10%: halved to 500 (still one bucket), then 250: {10, 10} | {180, 200, 200}, 620 positions, 20 padding (3.2%)
    got = scoring.length_buckets(ext, call_tokens=1000, padding_cap=0.10)
    assert [b.tolist() for b in got] == [[1, 3], [4, 0, 2]]
    # a 3% cap cuts the 180 row off too (halved down to a call cost of 15: 600 positions, no padding)
    assert [b.tolist() for b in scoring.length_buckets(ext, call_tokens=1000, padding_cap=0.03)] == [[1, 3], [4], [0, 2]]


@pytest.mark.parametrize("seed", range(20))
def test_length_buckets_never_exceed_the_padding_cap(seed):
    """Long-tailed extents (geometric, some at the cap) in parts of 16 rows: the default cut keeps the
    padding at or under PADDING_CAP of the positions computed, every row once, in runs of the sorted rows."""
    gen = torch.Generator().manual_seed(seed)
    ext = torch.clamp((-torch.log(torch.rand(16, generator=gen)) * 80).long() + 1, max=256)
    got = scoring.length_buckets(ext)
    assert sorted(torch.cat(got).tolist()) == list(range(16))
    assert all(int(ext[a].max()) <= int(ext[b].min()) for a, b in zip(got, got[1:]))
    total, padding = scoring.bucket_positions(ext, True)
    assert padding <= scoring.PADDING_CAP * total
    assert total == sum(b.numel() * int(ext[b].max()) for b in got)


def scores_and_grads(policy, roll, params, **kw):
    policy.zero_grad()
    out = scoring.sequence_token_logprobs(policy, roll, return_full=True, return_entropy=True, **kw)
    w = torch.linspace(-1, 1, out.logp.numel()).view_as(out.logp)
    ((out.logp * w).sum() + (out.entropy * w).sum()).backward()
    return [x.detach() for x in out], [p.grad.clone() for p in params]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("llama"), seed=4, num_key_value_heads=2))


@pytest.mark.parametrize("group", [None, 3])
def test_bucketed_forward_equals_one_forward_on_a_llama(llama, group, monkeypatch):
    """A tiny Llama on the lean path, rows of 1 to 12 tokens: split into buckets (every distinct
    length its own, BUCKET_CALL_TOKENS = 0), the prompts once per group (group_size=3) or whole
    rows: the log-probs, no-nucleus log-probs, entropies and gradients equal one forward's; the
    forwards reach only each bucket's own width."""
    policy, tok = llama
    assert policy.uses_fast_path
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    roll = sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=12, temperature=1.0, top_p=0.9,
                             eos_id=None, pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([12, 1, 5, 3, 12, 2, 7, 7, 4])                               # rows end early
    mask = (torch.arange(12)[None, :] < lengths[:, None])
    am = roll.attention_mask.clone()
    am[:, roll.prompt_len:] = mask.long()
    roll = sampling.Rollout(ids=roll.ids.masked_fill(am == 0, tok.pad_id), attention_mask=am,
                            prompt_len=roll.prompt_len, mask=mask.float(), logp=roll.logp * mask,
                            truncated=lengths == 12, temperature=1.0, top_p=0.9)
    params = [p for p in policy.parameters() if p.requires_grad]
    want, want_g = scores_and_grads(policy, roll, params, group_size=group)
    widths = []
    real = policy.forward
    monkeypatch.setattr(policy, "forward", lambda ids, **kw: widths.append(tuple(ids.shape)) or real(ids, **kw))
    monkeypatch.setattr(scoring, "BUCKET_CALL_TOKENS", 0)
    got, got_g = scores_and_grads(policy, roll, params, group_size=group, buckets=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    Lp = roll.prompt_len
    if group:   # the 3 prompts once, then a call per distinct length > 1 over its rows' prompts
        assert widths[0] == (3, Lp) and sorted(widths[1:]) == sorted((n, w - 1) for w, n in
                                                                     ((2, 1), (3, 1), (4, 1), (5, 1), (7, 2), (12, 2)))
    else:       # each bucket's rows whole, to their own width
        assert sorted(widths) == sorted((n, Lp + w - 1) for w, n in
                                        ((1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (7, 2), (12, 2)))


def test_learn_with_row_buckets_gives_the_same_update_and_counts_less_padding(monkeypatch):
    """One learn step on the rows of LENGTHS in four parts of two groups: with every row its own
    bucket, the gradients and statistics equal the unbucketed step's, the forwards compute only each
    row's own length (plus the prompt) and train/learn_padding_frac is 0, by hand."""
    setup = tiny_setup(algorithm__kl_coef=0.1, algorithm__entropy_coef=0.01)
    batch = long_batch(setup, kl=True)
    monkeypatch.setattr(scoring, "PADDING_CAP", 1.0)          # each part one bucket (no cut pays at 32)
    want, want_stats, _ = one_learn(setup, batch, 4, True)
    monkeypatch.setattr(scoring, "BUCKET_CALL_TOKENS", 0)
    got, stats, positions = one_learn(setup, batch, 4, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for key in ("loss", "ratio_mean", "kl_ref", "policy_entropy", "grad_norm"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
    lengths = [n for pair in LENGTHS for n in pair]
    # rows of equal length share a bucket: each forward is n rows x (LP + length - 1) ids
    by_part = [sorted(lengths[i:i + 4]) for i in range(0, len(lengths), 4)]
    assert positions == sum(len([x for x in p if x == w]) * (LP + w - 1) for p in by_part for w in set(p))
    assert stats["learn_padding_frac"] == 0.0
    # the parts' own widths without row buckets (tests/test_length_buckets.py): 24, 22 | 23, 21 | 3, 2 | ...
    assert want_stats["learn_padding_frac"] == pytest.approx(1 - sum(lengths) / (4 * (24 + 22 + 3 + 2)))


def test_a_learner_group_rank_never_buckets_its_rows(monkeypatch):
    """A rank of a learner group (its forwards are collectives every rank runs equally often) forwards
    each part whole whatever train.length_buckets says: learn with a shard (a one-rank stand-in) asks
    sequence_token_logprobs for no buckets, and without one asks for them."""
    from rlvr.learn import Learner, make_optimizer, make_scheduler

    class OneRank:                      # rlvr.distributed.learners.Shard's surface, world = 1
        def __init__(self, model):
            self.model = model

        def rows(self, idx, G, mask, agg):
            return idx, None

        def mine(self, idx, G):
            return idx

        def reduce(self, stats):
            return stats

    setup = tiny_setup(train__length_buckets="true", train__micro_batches=2)
    batch = long_batch(setup)
    asked = []
    real = scoring.sequence_token_logprobs
    monkeypatch.setattr(scoring, "sequence_token_logprobs",
                        lambda *a, **kw: asked.append(kw.get("buckets")) or real(*a, **kw))
    for shard in (None, "rank"):
        policy = copy.deepcopy(setup.model)
        opt = make_optimizer(policy.trainable_params(), setup.cfg.train)
        learner = Learner(policy, opt, make_scheduler(opt, setup.cfg.train), setup.cfg, torch.Generator(), T)
        asked.clear()
        learn(learner, batch, shard=None if shard is None else OneRank(policy))
        assert asked and set(asked) == ({True} if shard is None else {False}), shard
