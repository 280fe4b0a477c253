"""train.length_buckets and the forwards that stop at a part's own longest row (issue 51, learning
that does not pay for padding): the update is unchanged under every aggregation, fewer positions
are computed, and rows never move to another minibatch."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch

from rlvr import build as build_mod, config as config_mod, sampling, scoring
from rlvr.learn import Learner, learn, make_optimizer, make_scheduler, padding_positions, part_rows
from rlvr.rollout import Batch, length_sorted, micro_rows, training_logprobs
from test_stage_options import sort_setup

G = 2
LP, T = 3, 24
# each group's two lengths: long and short groups interleaved, so parts of groups in order all run long
LENGTHS = [(24, 20), (1, 2), (23, 5), (3, 1), (22, 21), (1, 1), (20, 2), (2, 3)]


def tiny_setup(**overrides):
    """The built-in model (1 layer, d = 16, tests/test_stage_options.sort_setup) in fp32, P = 8, G = 2."""
    keys = dict(model__autocast="off", sampling__max_new_tokens=LP + T, train__prompts_per_step=len(LENGTHS),
                train__samples_per_prompt=G, train__grad_clip=0)
    return sort_setup(**{**keys, **overrides})


def long_batch(setup, kl: bool = False) -> Batch:
    """Rows of LENGTHS (1 to T tokens), left-padded prompts of 1 to LP tokens, random ids; logp_old
    the model's own (ratio 1), Δ = ±1 alternating, logp_ref logp_old + 0.1 with `kl`."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor(LENGTHS).view(-1)                                               # (B,)
    B, V, pad = lengths.numel(), setup.model.config.vocab_size, setup.tokenizer.pad_id
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()                          # (B, T)
    prompt_am = (torch.arange(LP)[None, :] >= (torch.arange(B) % LP)[:, None]).long()     # (B, LP)
    am = torch.cat([prompt_am, mask.long()], dim=1)                                        # (B, LP + T)
    ids = torch.randint(0, V, (B, LP + T), generator=gen).masked_fill(am == 0, pad)
    ro = sampling.Rollout(ids=ids, attention_mask=am, prompt_len=LP, mask=mask, logp=torch.zeros(B, T),
                          truncated=lengths == T)
    with torch.no_grad():
        logp_old = scoring.sequence_token_logprobs(setup.model, ro)                       # (B, T)
    ro = dataclasses.replace(ro, logp=logp_old)
    delta = (torch.arange(B) % 2 * 2 - 1).float().view(-1, G)                               # (P, G) ±1
    return Batch(groups=types.SimpleNamespace(rollout=ro, examples=[None] * (B // G)), parts=[], delta=delta,
                 logp_old=logp_old.clone(), logp_ref=(logp_old + 0.1) * mask if kl else None, version=0)


def one_learn(setup, batch: Batch, micro_batches: int, buckets: bool, minibatches: int = 1):
    """(gradients after one learn call, its statistics, the positions its forwards computed) on a
    copy of the setup's model."""
    cfg = copy.deepcopy(setup.cfg)
    cfg.train.micro_batches, cfg.train.length_buckets, cfg.train.minibatches = micro_batches, buckets, minibatches
    policy = copy.deepcopy(setup.model)
    positions = []
    real = policy.forward
    policy.forward = lambda ids, **kw: positions.append(ids.numel()) or real(ids, **kw)
    opt = make_optimizer(policy.trainable_params(), cfg.train)
    learner = Learner(policy, opt, make_scheduler(opt, cfg.train), cfg, torch.Generator().manual_seed(1), T)
    stats = learn(learner, batch)
    return [p.grad.clone() for p in policy.trainable_params()], stats, sum(positions)


@pytest.mark.parametrize("agg", ["token_mean", "seq_sum_mean", "seq_mean_mean", "seq_sum_const"])
def test_trimmed_and_bucketed_parts_give_the_whole_batch_gradient(agg):
    """One learn step on rows of 1 to 24 tokens: in one part at the batch's width, in four parts each
    stopping at its own longest row, and in four length-bucketed parts: the same gradient and
    statistics (to float rounding) under every aggregation, with the KL and entropy terms on."""
    setup = tiny_setup(algorithm__agg=agg, algorithm__kl_coef=0.1, algorithm__entropy_coef=0.01)
    batch = long_batch(setup, kl=True)
    want, want_stats, _ = one_learn(setup, batch, 1, False)
    assert any(g.abs().sum() > 0 for g in want)
    for k, buckets in ((4, False), (4, True), (2, True)):
        got, stats, _ = one_learn(setup, batch, k, buckets)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        for key in ("loss", "ratio_mean", "kl_ref", "policy_entropy", "grad_norm"):
            assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), (k, buckets, key)


def test_buckets_compute_fewer_positions_and_count_them(monkeypatch):
    """The forwards' positions (rows × columns of each call, counted on the model): every part stops at
    its own longest row, and sorting the groups by length first puts the long groups together.
    learn_padding_frac is the share of the response positions past their row's end, by hand. (Row
    buckets inside a part never pay here, BUCKET_CALL_TOKENS set too high for a cut: the parts'
    sorting alone, PADDING_CAP lifted; tests/test_row_buckets.py counts the row buckets.)"""
    monkeypatch.setattr(scoring, "BUCKET_CALL_TOKENS", 10 ** 6)
    monkeypatch.setattr(scoring, "PADDING_CAP", 1.0)
    setup = tiny_setup()
    batch = long_batch(setup)
    B = batch.rollout.ids.size(0)
    _, one, full = one_learn(setup, batch, 1, False)
    _, plain, in_order = one_learn(setup, batch, 4, False)
    _, sorted_, bucketed = one_learn(setup, batch, 4, True)
    # the forward takes ids[:, :-1] up to the part's longest row: Lp + width - 1 columns
    assert full == B * (LP + T - 1)
    assert in_order == 4 * (LP - 1) * B // 4 + B // 4 * (24 + 23 + 22 + 20)                 # parts of 2 groups in order
    assert bucketed == 4 * (LP - 1) * B // 4 + B // 4 * (24 + 22 + 3 + 2)                   # widths 24, 22 | 23, 21 ...
    assert bucketed < in_order < full
    real = sum(sum(pair) for pair in LENGTHS)
    assert one["learn_padding_frac"] == pytest.approx(1 - real / (B * T))
    assert plain["learn_padding_frac"] == pytest.approx(1 - real / (4 * (24 + 23 + 22 + 20)))
    assert sorted_["learn_padding_frac"] == pytest.approx(1 - real / (4 * (24 + 22 + 3 + 2)))


def test_length_sorted_moves_whole_groups_longest_first():
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS).view(-1)[:, None]).float()
    rows = torch.arange(mask.size(0))
    got = length_sorted(rows, G, mask)
    assert got.view(-1, G)[:, 0].div(G, rounding_mode="floor").tolist() == [0, 2, 4, 6, 3, 7, 1, 5]
    assert (got.view(-1, G)[:, 1] - got.view(-1, G)[:, 0]).eq(1).all()                  # a group's rows stay together
    assert micro_rows(rows, G, 1, mask)[0].tolist() == rows.tolist()                      # one part: nothing moves
    assert [p.tolist() for p in micro_rows(rows, G, 4)] == [p.tolist() for p in rows.view(4, -1)]


def test_buckets_never_move_rows_to_another_minibatch(monkeypatch):
    """With two minibatches (two optimizer steps) the minibatches hold the same rows with the option
    on and off: it only reorders the groups inside one minibatch's accumulation."""
    import rlvr.learn

    setup = tiny_setup()
    batch = long_batch(setup)
    seen = []
    real = rlvr.learn.accumulate
    monkeypatch.setattr(rlvr.learn, "accumulate", lambda lrn, b, rows, *a, **kw: seen.append(
        (sorted(rows.tolist()), [p.tolist() for p in part_rows(lrn, b, rows)])) or real(lrn, b, rows, *a, **kw))
    one_learn(setup, batch, 2, False, minibatches=2)
    off, seen[:] = list(seen), []
    one_learn(setup, batch, 2, True, minibatches=2)
    assert [rows for rows, _ in seen] == [rows for rows, _ in off]
    assert [parts for _, parts in seen] != [parts for _, parts in off]                    # the option reached the parts


def test_training_logprobs_keep_the_row_order_with_buckets():
    """The rollout stage's logp_old forward (algorithm.logp_old = recompute) takes the learner's
    bucketed parts and hands the log-probs back in the batch's row order."""
    setup = tiny_setup(train__micro_batches=4)
    batch = long_batch(setup)
    want = training_logprobs(setup.model, batch.rollout, setup.cfg).logp
    on = copy.deepcopy(setup.cfg)
    on.train.length_buckets = True
    got = training_logprobs(setup.model, batch.rollout, on).logp
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_first_ratio_is_exactly_1_with_buckets_where_the_forward_depends_on_its_rows(monkeypatch):
    """Under bf16 with a forward whose numbers depend on the rows computed together (the stand-in of
    tests/test_autocast.py) and a learning rate too small to move a weight: logp_old from the rollout
    stage's forward (rlvr.rollout.training_logprobs) over the learner's bucketed parts gives a first
    ratio of exactly 1; over the parts in order (the option not reaching that forward) it does not."""
    from test_autocast import _row_count_dependent

    setup = tiny_setup(model__autocast="bf16", train__micro_batches=2, train__length_buckets="true",
                       train__lr=1e-30)
    batch = long_batch(setup)
    _row_count_dependent(monkeypatch)
    in_order = copy.deepcopy(setup.cfg)
    in_order.train.length_buckets = False
    exact = []
    for cfg in (setup.cfg, in_order):
        logp_old = training_logprobs(setup.model, batch.rollout, cfg, autocast=setup.numerics.context).logp
        b = dataclasses.replace(batch, logp_old=logp_old, logp_old_version=0)
        policy = copy.deepcopy(setup.model)
        opt = make_optimizer(policy.trainable_params(), setup.cfg.train)
        learner = Learner(policy, opt, make_scheduler(opt, setup.cfg.train), setup.cfg,
                          torch.Generator().manual_seed(1), T, autocast=setup.numerics.context)
        stats = learn(learner, b)
        exact.append(stats["ratio_min"] == 1.0 == stats["ratio_max"])
    assert exact == [True, False]
