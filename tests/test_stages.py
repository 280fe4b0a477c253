"""The two stages of a step, tested with hand-derived numbers (torchtune style).

`learn` runs on a fixed batch built here, against a table policy whose logits are free parameters
Z[row, position] (zero: uniform over V tokens), so every gradient is a number derived by hand:
d loss / d Z[row, t, sampled token] = -Δ_row · w(row, t) · (1 - 1/V), with w the aggregation
weight of the token. Every option of the learn stage (aggregation, ratio level, clip bounds, KL
estimator and coefficient, minibatches, epochs, lr and its schedule, grad clip) changes one of
these numbers, so hard-wiring any of them at the learn stage fails a test here.
"""

import contextlib
import math

import pytest
import torch
from torch import nn

from rlvr import advantages, build as build_mod, config as config_mod, sampling, scoring
from rlvr.learn import Learner, learn, lr_at, make_optimizer, make_scheduler
from rlvr.rollout import Batch, Groups, rollout
from rlvr.tasks import Example

V = 2  # vocabulary of the table policy: d logp / d Z[sampled] = 1 - 1/V = 0.5


class TablePolicy(nn.Module):
    """Logits Z[tag, position] with tag = the row's first (prompt) token; meets rlvr.policy.Policy."""

    differentiable_cache = False
    has_adapter = False

    def __init__(self, rows: int, length: int):
        super().__init__()
        self.Z = nn.Parameter(torch.zeros(rows, length, V))
        self.config = type("C", (), {"block_size": None})()
        self.seen: list[list[int]] = []

    def forward(self, ids, *, attention_mask=None, cache=None, logits_to_keep=0):
        self.seen.append(ids[:, 0].tolist())
        logits = self.Z[ids[:, 0], :ids.size(1)]                     # (rows, L, V): one position per input token
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    def trainable_params(self):
        return [self.Z]

    def num_params(self):
        return self.Z.numel()

    def flops_per_token(self, seq_len=None, *, training=True):
        return 6 if training else 2

    def adapter_disabled(self):
        return contextlib.nullcontext()

    def new_cache(self, batch_size, max_len):
        raise NotImplementedError


def make_batch(lengths: list[int], delta: list[list[float]], *, T: int | None = None, shift=None, ref_shift=None):
    """Rows b = 0..B-1 with prompt [b] (one token) and `lengths[b]` response tokens (token 1 at even
    positions, 0 at odd); logp_old = log(1/V) - shift[b][t] (so ratio = exp(shift)), logp_ref =
    log(1/V) - ref_shift[b][t]."""
    B, T = len(lengths), T or max(lengths)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths])          # (B, T)
    resp = torch.tensor([[(t + 1) % 2 for t in range(T)] for _ in lengths]) * mask.long()
    ids = torch.cat([torch.arange(B)[:, None], resp], dim=1)                                   # (B, 1 + T)
    am = torch.cat([torch.ones(B, 1, dtype=torch.long), mask.long()], dim=1)
    base = torch.full((B, T), math.log(1 / V)) * mask
    s = torch.tensor(shift, dtype=torch.float32) if shift is not None else torch.zeros(B, T)
    logp_old = (base - s) * mask
    roll = sampling.Rollout(ids=ids, attention_mask=am, prompt_len=1, mask=mask, logp=logp_old,
                            truncated=torch.zeros(B, dtype=torch.bool))
    d = torch.tensor(delta)
    P, G = d.shape
    groups = Groups([Example(f"p{i}", "a") for i in range(P)], roll, [""] * B, torch.zeros(P, G),
                    torch.zeros(P, G, dtype=torch.bool), {}, 0, {"ok": B}, [])
    logp_ref = None
    if ref_shift is not None:
        logp_ref = (base - torch.tensor(ref_shift, dtype=torch.float32)) * mask
    return Batch(groups, [groups], d, logp_old, logp_ref, version=0)


def make_learner(batch: Batch, *, G: int, **overrides) -> tuple[Learner, TablePolicy]:
    cfg = config_mod.Config()
    cfg.train.samples_per_prompt = G
    cfg.train.grad_clip = 0.0
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    B, L = batch.rollout.ids.shape
    policy = TablePolicy(B, L)
    opt = make_optimizer(policy.trainable_params(), cfg.train)
    gen = torch.Generator().manual_seed(0)
    return Learner(policy, opt, make_scheduler(opt, cfg.train), cfg, gen, batch.rollout.mask.shape[1]), policy


def sampled_grad(policy: TablePolicy, batch: Batch) -> torch.Tensor:
    """(B, T) gradient left on Z at each response token's own logit (0 off the mask)."""
    ids, Lp = batch.rollout.ids, batch.rollout.prompt_len
    B, T = batch.rollout.mask.shape
    g = policy.Z.grad                                                      # (B, L, V)
    out = torch.stack([g[b, Lp - 1 + torch.arange(T), ids[b, Lp:]] for b in range(B)])
    return out * batch.rollout.mask


# Two rows of one group, 3 tokens and 1 token (4 tokens in all); Δ = +1 and -1.
LENGTHS, DELTA = [3, 1], [[1.0, -1.0]]
WEIGHTS = {  # aggregation weight of each token of row 0 and of row 1, derived by hand
    "token_mean": (1 / 4, 1 / 4),        # every token over the 4 tokens of the batch
    "seq_mean_mean": (1 / 6, 1 / 2),     # 1 / (B · len): the 3-token row's tokens weigh a third of the other's
    "seq_sum_mean": (1 / 2, 1 / 2),      # 1 / B
    "seq_sum_const": (1 / 6, 1 / 6),     # 1 / (B · max_len), max_len = 3
}


@pytest.mark.parametrize("agg", sorted(WEIGHTS))
def test_each_aggregation_gives_its_hand_derived_gradient(agg):
    batch = make_batch(LENGTHS, DELTA)
    learner, policy = make_learner(batch, G=2, algorithm__agg=agg)
    stats = learn(learner, batch)
    w0, w1 = WEIGHTS[agg]
    expect = torch.tensor([[-1 * w0 * 0.5] * 3, [+1 * w1 * 0.5, 0, 0]])
    torch.testing.assert_close(sampled_grad(policy, batch), expect)
    assert stats["first_step_ratio_mean"] == pytest.approx(1.0)


def test_sequence_ratio_level_gives_the_gspo_value():
    # row 0: log-ratios 0.1, 0, -0.04 (mean 0.02); row 1: 0.05. All inside the clip band.
    shift = [[0.1, 0.0, -0.04], [0.05, 0.0, 0.0]]
    batch = make_batch(LENGTHS, DELTA, shift=shift)
    seq = -(math.exp(0.02) * 1 - math.exp(0.05)) / 2                                   # seq_mean_mean
    tok = -((math.exp(0.1) + 1 + math.exp(-0.04)) / 3 - math.exp(0.05)) / 2
    for level, want in (("sequence", seq), ("token", tok)):
        learner, _ = make_learner(batch, G=2, algorithm__ratio_level=level, algorithm__agg="seq_mean_mean")
        assert learn(learner, batch)["loss"] == pytest.approx(want, rel=1e-5), level


@pytest.mark.parametrize("eps, eps_high, want", [(0.2, 0.0, -1.2), (0.5, 0.0, -1.5), (0.2, 0.28, -1.28)])
def test_clip_bounds_reach_the_loss(eps, eps_high, want):
    # raise logp by 1 against logp_old: the ratio is e, clipped to 1 + eps_high (or 1 + eps); Δ = +1
    batch = make_batch([1, 1], [[1.0, 1.0]], shift=[[1.0], [1.0]])
    learner, policy = make_learner(batch, G=2, algorithm__clip_eps=eps, algorithm__clip_eps_high=eps_high)
    stats = learn(learner, batch)
    assert stats["loss"] == pytest.approx(want, rel=1e-6)
    assert stats["clip_frac_high"] == 1.0
    assert policy.Z.grad.abs().sum() == 0  # clipped: no gradient


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_mean"])
@pytest.mark.parametrize("estimator, per_token", [
    ("k1", lambda u: u), ("k2", lambda u: 0.5 * u * u), ("k3", lambda u: math.exp(-u) + u - 1)])
def test_each_kl_estimator_changes_the_loss_as_its_formula_says(estimator, per_token, agg):
    # logp - logp_ref = u per token; Δ = 0 so the loss is β · agg(kl)
    u = [[0.3, -0.2, 0.5], [0.4, 0.0, 0.0]]
    batch = make_batch(LENGTHS, [[0.0, 0.0]], ref_shift=u)
    k = [per_token(0.3), per_token(-0.2), per_token(0.5), per_token(0.4)]
    kl = sum(k) / 4 if agg == "token_mean" else (sum(k[:3]) / 3 + k[3]) / 2
    learner, _ = make_learner(batch, G=2, algorithm__kl_estimator=estimator, algorithm__kl_coef=0.5,
                              algorithm__agg=agg)
    stats = learn(learner, batch)
    assert stats["kl_ref"] == pytest.approx(kl, rel=1e-5)
    assert stats["loss"] == pytest.approx(0.5 * kl, rel=1e-5)


def test_minibatches_visit_every_group_once_per_epoch():
    P, G = 4, 2
    batch = make_batch([2] * (P * G), [[1.0, -1.0]] * P)
    learner, policy = make_learner(batch, G=G, train__minibatches=2, train__epochs_per_batch=3)
    stats = learn(learner, batch)
    assert stats["optimizer_steps"] == 6 and learner.sched.last_epoch == 6
    assert len(policy.seen) == 6
    for epoch in range(3):
        a, b = policy.seen[2 * epoch], policy.seen[2 * epoch + 1]
        assert sorted(a + b) == list(range(P * G))             # every row once
        for rows in (a, b):                                      # whole groups
            assert len(rows) == 4 and all(r // G == rows[i - i % G] // G for i, r in enumerate(rows))
    assert policy.seen[0] != sorted(policy.seen[0]) or policy.seen[2] != policy.seen[0]  # shuffled


def test_lr_and_warmup_reach_the_update():
    # AdamW's first step moves each parameter with a non-zero gradient by lr · g / (|g| + eps) ≈ lr
    for warmup, mult in ((0, 1.0), (4, 0.25)):
        batch = make_batch(LENGTHS, DELTA)
        learner, policy = make_learner(batch, G=2, train__lr=0.01, train__warmup_steps=warmup)
        before = policy.Z.detach().clone()
        learn(learner, batch)
        moved = (policy.Z.detach() - before).abs()
        nz = policy.Z.grad != 0
        torch.testing.assert_close(moved[nz], torch.full_like(moved[nz], 0.01 * mult), rtol=1e-4, atol=0)


def test_grad_clip_reaches_the_update():
    batch = make_batch(LENGTHS, DELTA)
    learner, policy = make_learner(batch, G=2, train__grad_clip=1e-3)
    stats = learn(learner, batch)
    assert stats["grad_norm"] > 1e-2                       # the norm before clipping is reported
    assert float(policy.Z.grad.norm()) == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize("schedule, values", [
    ("constant", {0: 0.1, 9: 1.0, 10: 1.0, 60: 1.0, 110: 1.0}),
    ("cosine", {0: 0.1, 9: 1.0, 10: 1.0, 60: 0.55, 110: 0.1}),
    ("linear", {0: 0.1, 9: 1.0, 10: 1.0, 60: 0.55, 110: 0.1}),
])
def test_lr_at_known_values(schedule, values):
    # 10 warm-up steps of 110: (s + 1) / 10, then the decay over the remaining 100 steps to 10%
    tc = config_mod.TrainConfig(lr_schedule=schedule, warmup_steps=10)
    for s, want in values.items():
        assert lr_at(tc, s, 110) == pytest.approx(want), (schedule, s)


# ----------------------------------------------------------------------------------- rollout stage

def sort_setup(**overrides):
    cfg = config_mod.load(None, [f"--{k.replace('__', '.')}={v}" for k, v in overrides.items()] + [
        "--task.options={n = 3, heldout = 20}", "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=2",
        "--train.prompts_per_step=4", "--train.samples_per_prompt=4"])
    return build_mod.build(cfg, log=lambda *_: None)


@pytest.mark.parametrize("scheme", ["raw", "centered", "normalized", "loo", "batch_normalized"])
def test_scheme_and_top_k_reach_delta(scheme):
    for top_k in (0, 2):
        setup = sort_setup(algorithm__scheme=scheme, algorithm__top_k=top_k)
        gen = torch.Generator().manual_seed(0)
        task = setup.task
        batch = rollout(setup, setup.model, None, lambda: list(task.train[:4]), version=7, generator=gen)
        want = advantages.compute(batch.groups.rewards, scheme, top_k=top_k or None)
        torch.testing.assert_close(batch.delta, want)
        assert batch.version == 7 and batch.logp_ref is None
        assert batch.cost["sampled_tokens"] == int(batch.rollout.mask.sum()) == 4 * 4 * 3


def test_temperature_reaches_logp_old_and_kl_builds_a_reference():
    setup = sort_setup(sampling__temperature=0.5, algorithm__kl_coef=0.1)
    gen = torch.Generator().manual_seed(0)
    batch = rollout(setup, setup.model, setup.model, lambda: list(setup.task.train[:4]), version=0, generator=gen)
    assert batch.rollout.temperature == 0.5
    again = scoring.sequence_token_logprobs(setup.model, batch.rollout, temperature=0.5, top_p=1.0)
    torch.testing.assert_close(batch.logp_old, again.detach(), atol=1e-5, rtol=0)
    # the reference here is the policy itself, scored at the same temperature: logp_ref = logp_old
    torch.testing.assert_close(batch.logp_ref, batch.logp_old, atol=1e-5, rtol=0)
