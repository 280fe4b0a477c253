"""Each algorithm option reaches the update, tested at the stage level with hand-derived numbers.

Learn stage: the table policy of tests/test_stages.py (logits Z free parameters; V = 2 tokens, so
at Z = 0 the policy is uniform and d logp / d Z[sampled] = 1 - 1/V = 0.5). Rollout stage: the real
sort task with the built-in model, Δ checked against formulas written out here. Each test fails if
its option stops reaching the update (the option is hard-wired, dropped, or computed elsewhere).
"""

import math

import pytest
import torch

from rlvr import build as build_mod, config as config_mod, losses, run_price, scoring, setup_types
from rlvr.learn import learn
from rlvr.rollout import rollout
from rlvr.value import LearnedBaseline
from test_stages import make_batch, make_learner, sampled_grad
from test_train import ONE_STEP, TINY, USER_TASK, read_jsonl, train_rows, train_run


def sort_setup(**overrides):
    """The 3-digit sort task on a 1-layer built-in model, P = G = 4 unless overridden."""
    cfg = config_mod.load(None, ["--task.options={n = 3, heldout = 20}", "--model.n_layer=1", "--model.n_embd=16",
                                 "--model.n_head=2", "--train.prompts_per_step=4", "--train.samples_per_prompt=4"]
                          + [f"--{k.replace('__', '.')}={v}" for k, v in overrides.items()])
    return build_mod.build(cfg, log=lambda *_: None)


# ----------------------------------------------------------------------------------- learn stage

def test_cispo_keeps_the_gradient_ppo_clip_drops():
    # raise logp by 1 against logp_old: ratio e, clipped to 1.2; Δ = +1, one token per row
    batch = make_batch([1, 1], [[1.0, 1.0]], shift=[[1.0], [1.0]])
    learner, policy = make_learner(batch, G=2, algorithm__objective="ppo_clip")
    assert learn(learner, batch)["loss"] == pytest.approx(-1.2, rel=1e-6)
    assert policy.Z.grad.abs().sum() == 0                       # ppo_clip: clipped, no gradient
    learner, policy = make_learner(batch, G=2, algorithm__objective="cispo")
    stats = learn(learner, batch)
    # loss = -sg(1.2) · Δ · logp = -1.2 · log(1/2) per token; token_mean over the 2 tokens
    assert stats["loss"] == pytest.approx(1.2 * math.log(2), rel=1e-6)
    # gradient -1.2 · Δ · (1 - 1/V) · (1/2 token weight) = -0.3 on each sampled logit
    torch.testing.assert_close(sampled_grad(policy, batch), torch.tensor([[-0.3], [-0.3]]))
    assert stats["clip_frac_high"] == 1.0


def test_mask_truncated_takes_a_cut_row_out_of_the_loss_and_its_denominator():
    # rows of 3 and 1 tokens, Δ = +1 and -1; row 0 was cut at the length bound. token_mean: without the
    # mask each of the 4 tokens weighs 1/4 (gradient -Δ · 0.5 / 4 on each sampled logit); with it row
    # 1's one token is the whole denominator (+0.5) and row 0 gets none.
    from rlvr.rollout import mask_truncated

    batch = make_batch([3, 1], [[1.0, -1.0]])
    batch.rollout.truncated[0] = True
    learner, policy = make_learner(batch, G=2)
    learn(learner, batch)
    torch.testing.assert_close(sampled_grad(policy, batch), torch.tensor([[-0.125] * 3, [0.125, 0, 0]]))
    learner, policy = make_learner(batch, G=2)
    learn(learner, mask_truncated(batch))
    torch.testing.assert_close(sampled_grad(policy, batch), torch.tensor([[0.0] * 3, [0.5, 0, 0]]))


def test_dual_clip_caps_negative_delta_tokens():
    # Δ = -1 and logp raised by 1.5: ratio e^1.5 ≈ 4.48 > c = 3
    batch = make_batch([1, 1], [[-1.0, -1.0]], shift=[[1.5], [1.5]])
    learner, policy = make_learner(batch, G=2)
    stats = learn(learner, batch)
    assert stats["loss"] == pytest.approx(math.exp(1.5), rel=1e-5)          # -min(r·Δ, clip(r)·Δ) = r
    # gradient of r·|Δ| / 2 tokens: r · 0.5 · 0.5
    torch.testing.assert_close(sampled_grad(policy, batch), torch.full((2, 1), math.exp(1.5) / 4))
    learner, policy = make_learner(batch, G=2, algorithm__dual_clip_c=3.0)
    stats = learn(learner, batch)
    assert stats["loss"] == pytest.approx(3.0, rel=1e-6)                     # capped at -c·Δ = 3
    assert stats["clip_frac_dual"] == 1.0
    assert policy.Z.grad.abs().sum() == 0


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (2.0, 1.0), (2.0, 0.6)])
def test_entropy_bonus_value_and_gradient(temperature, top_p):
    # Z[..., 1] = 1, Z[..., 0] = 0: with z = Z / temperature, p1 = sigmoid(1 / temperature). Δ = 0, so
    # the loss is -c · H (token_mean) and the gradient on Z[v] is c · p_v (log p_v + H) / (n tokens · temperature).
    # The entropy is that of the tempered distribution WITHOUT the nucleus (top_p = 0.6 keeps one token).
    batch = make_batch([2, 1], [[0.0, 0.0]])
    c = 0.01
    learner, policy = make_learner(batch, G=2, algorithm__entropy_coef=c, sampling__temperature=temperature,
                                   sampling__top_p=top_p)
    with torch.no_grad():
        policy.Z[..., 1] = 1.0
    stats = learn(learner, batch)
    p1 = 1 / (1 + math.exp(-1 / temperature))
    p = torch.tensor([1 - p1, p1], dtype=torch.float64)
    H = float(-(p * p.log()).sum())
    assert stats["policy_entropy"] == pytest.approx(H, rel=1e-5)
    assert stats["loss"] == pytest.approx(-c * H, rel=1e-5)
    want = (c * p * (p.log() + H) / (3 * temperature)).float()                # per position, (V,)
    g = policy.Z.grad                                                          # (B, L, V), prompt_len 1
    torch.testing.assert_close(g[0, 0:2], want.expand(2, 2), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(g[1, 0:1], want.expand(1, 2), rtol=1e-4, atol=1e-7)
    assert g[1, 1:].abs().sum() == 0                                           # off the mask: nothing


def test_kl_in_reward_keeps_the_kl_out_of_the_loss_but_logs_it():
    u = [[0.3, -0.2, 0.5], [0.4, 0.0, 0.0]]                                     # logp - logp_ref per token
    k3 = sum(math.exp(-x) + x - 1 for x in (0.3, -0.2, 0.5, 0.4)) / 4
    batch = make_batch([3, 1], [[0.0, 0.0]], ref_shift=u)
    learner, policy = make_learner(batch, G=2, algorithm__kl_coef=0.5, algorithm__kl_in="loss")
    stats = learn(learner, batch)
    assert stats["loss"] == pytest.approx(0.5 * k3, rel=1e-5) and policy.Z.grad.abs().sum() > 0
    learner, policy = make_learner(batch, G=2, algorithm__kl_coef=0.5, algorithm__kl_in="reward")
    stats = learn(learner, batch)
    assert stats["kl_ref"] == pytest.approx(k3, rel=1e-5)                      # logged ...
    assert stats["loss"] == 0.0 and policy.Z.grad.abs().sum() == 0            # ... not in the loss


def test_per_token_delta_reaches_the_gradient():
    # Δ (B, T): row 0 tokens +1, -2, +0.5; row 1 token +3. token_mean: weight 1/4, d logp/dZ = 0.5
    batch = make_batch([3, 1], [[0.0, 0.0]])
    batch.delta_tokens = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, 0.0]])
    learner, policy = make_learner(batch, G=2)
    learn(learner, batch)
    want = -batch.delta_tokens * 0.25 * 0.5
    torch.testing.assert_close(sampled_grad(policy, batch), want * batch.rollout.mask)


def test_k3_is_clamped_against_overflow():
    logp = torch.tensor([[-30.0, -1.0]], requires_grad=True)                   # a token that left the nucleus
    logp_ref = torch.tensor([[-5.0, -1.0]])
    kl = losses.kl_k3(logp, logp_ref)                                          # log r = 25 -> clamped to 20
    assert float(kl[0, 0].detach()) == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)
    assert float(kl[0, 1].detach()) == 0.0
    kl.sum().backward()
    assert float(logp.grad[0, 0]) == 0.0                                       # beyond the clamp: no gradient


# ------------------------------------------------------------------ the KL under one distribution

def test_nucleus_and_full_logprobs_come_from_one_forward():
    setup = sort_setup(sampling__temperature=0.7, sampling__top_p=0.8)
    gen = torch.Generator().manual_seed(0)
    batch = rollout(setup, setup.model, None, lambda: list(setup.task.train[:4]), version=0, generator=gen)
    roll = batch.rollout
    assert roll.logp_full is not None and not torch.equal(roll.logp_full, roll.logp)
    out = scoring.sequence_token_logprobs(setup.model, roll, return_full=True)
    # the nucleus log-prob, derived from the full one, is the sampler's; the full one is top_p = 1's
    torch.testing.assert_close(out.logp.detach(), roll.logp, atol=1e-5, rtol=0)
    plain = scoring.sequence_token_logprobs(setup.model, roll, top_p=1.0)
    torch.testing.assert_close(out.logp_full.detach(), plain.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(roll.logp_full, plain.detach(), atol=1e-5, rtol=0)
    # in the nucleus, log p_nucleus - log p_full = -log(nucleus mass) > 0
    m = roll.mask.bool()
    assert bool(((roll.logp - roll.logp_full)[m] >= -1e-6).all())


@pytest.mark.parametrize("nucleus", [{"sampling__top_p": 0.8}, {"sampling__top_k": 3, "sampling__min_p": 0.1}])
def test_kl_is_zero_at_the_reference_with_top_p_below_one(nucleus):
    # the issue's case, short: top_p = 0.8 (or top_k and min_p) with the KL on; π = π_ref on the first minibatch
    setup = sort_setup(sampling__temperature=0.7, algorithm__kl_coef=0.1, **nucleus)
    gen = torch.Generator().manual_seed(0)
    batch = rollout(setup, setup.model, setup.model, lambda: list(setup.task.train[:4]), version=0, generator=gen)
    r = batch.rollout                                                           # sampled from the configured nucleus
    assert (r.top_p, r.top_k, r.min_p) == (setup.cfg.sampling.top_p, setup.cfg.sampling.top_k, setup.cfg.sampling.min_p)
    from rlvr.learn import Learner, make_optimizer, make_scheduler
    opt = make_optimizer(setup.model.trainable_params(), setup.cfg.train)
    learner = Learner(setup.model, opt, make_scheduler(opt, setup.cfg.train), setup.cfg,
                      torch.Generator().manual_seed(1), setup.limits.max_new_tokens)
    stats = learn(learner, batch)
    assert abs(stats["kl_ref"]) < 1e-5                                          # 0.02 with the nucleus log-prob on the policy side


# ----------------------------------------------------------------------------------- rollout stage

def test_overlong_penalty_is_added_to_the_rewards():
    setup = sort_setup(sampling__max_new_tokens=4, algorithm__scheme="centered")
    # the same model on an eos-terminated bound: responses end early or run to 4 tokens
    setup.limits = setup_types.Limits(4, setup.tokenizer.eos_id, setup.limits.prompt_tokens)
    setup.cfg.algorithm.overlong_buffer, setup.cfg.algorithm.overlong_penalty = 2, 0.5
    gen = torch.Generator().manual_seed(0)
    batch = rollout(setup, setup.model, None, lambda: list(setup.task.train[:4]), version=0, generator=gen)
    lengths = batch.rollout.response_lengths.tolist()
    assert len(set(lengths)) > 1
    # 0 up to 4 - 2 = 2 tokens, then -0.5 · (L - 2) / 2: L = 3 -> -0.25, L = 4 -> -0.5
    want = torch.tensor([{1: 0.0, 2: 0.0, 3: -0.25, 4: -0.5}[n] for n in lengths])
    raw = torch.tensor(batch.groups.per_reward["position"])
    torch.testing.assert_close(batch.groups.rewards.view(-1), raw + want)
    torch.testing.assert_close(batch.groups.per_reward["overlong_penalty"], want.tolist())
    r = batch.groups.rewards
    torch.testing.assert_close(batch.delta, torch.where(r.amax(1, keepdim=True) == r.amin(1, keepdim=True),
                                                        torch.zeros_like(r), r - r.mean(1, keepdim=True)))


def test_overlong_penalty_is_refused_on_a_fixed_length_task():
    cfg = config_mod.load(None, ["--algorithm.overlong_buffer=2", "--task.options={n = 3, heldout = 20}"])
    with pytest.raises(config_mod.ConfigError, match="algorithm.overlong_buffer.*fixed-length"):
        build_mod.build(cfg, log=lambda *_: None)


def test_learned_baseline_is_read_before_its_update():
    setup = sort_setup(algorithm__scheme="learned", train__samples_per_prompt=1, algorithm__value_lr=0.05)
    value = LearnedBaseline(setup.tokenizer.vocab_size, lr=0.05, seed=0)
    gen = torch.Generator().manual_seed(0)
    examples = lambda: list(setup.task.train[:4])  # noqa: E731
    first = rollout(setup, setup.model, None, examples, version=0, generator=gen, value=value)
    R = first.groups.rewards                                                    # (4, 1)
    # V starts at 0 (zero output layer): Δ = R, and its loss before the step is mean(R²)
    torch.testing.assert_close(first.delta, R)
    assert first.stats["value_loss"] == pytest.approx(float((R ** 2).mean()), rel=1e-6)
    roll = first.rollout
    b = value.baseline(roll.prompt_ids, roll.attention_mask[:, :roll.prompt_len])  # V after one step
    assert float(b.abs().max()) > 0
    second = rollout(setup, setup.model, None, examples, version=1, generator=gen, value=value)
    assert second.delta.shape == (4, 1)
    torch.testing.assert_close(second.delta, second.groups.rewards - b[:, None])
    assert second.stats["baseline_mean"] == pytest.approx(float(b.mean()), rel=1e-6)


def expected_process_delta(batch, examples, tok, G, to_go=False):
    """Δ (B, T) by hand: x[b][s] = 1 where character s of the response is the answer's (the reward's
    steps; an empty response scores [0.0]); centred over the group's rows that have step s (0 when
    they agree or only one has it); token t of row b gets the step of its first character (a
    special token, which adds no text, gets 0). to_go: Σ_{s' >= s} x[b][s'] instead of x[b][s]."""
    ids = batch.rollout.response_ids.tolist()
    B, T = batch.rollout.mask.shape
    x = []
    for b, r in enumerate(batch.groups.responses):
        ans = examples[b // G].answer
        row = [1.0 if i < len(ans) and c == ans[i] else 0.0 for i, c in enumerate(r)] or [0.0]
        x.append([sum(row[s:]) for s in range(len(row))] if to_go else row)
    want = torch.zeros(B, T)
    for b in range(B):
        group = range(b - b % G, b - b % G + G)
        n = int(batch.rollout.mask[b].sum())
        for t in range(n):
            before, text = tok.decode(ids[b][:t], stop_at_eos=False), tok.decode(ids[b][t:t + 1], stop_at_eos=False)
            s = len(before)
            if not text or s >= len(x[b]):
                continue
            vals = [x[o][s] for o in group if s < len(x[o])]
            if len(vals) > 1 and max(vals) != min(vals):
                want[b, t] = x[b][s] - sum(vals) / len(vals)
    return want


@pytest.mark.parametrize("mode", ["per_step_centered", "return_to_go"])
def test_process_reward_gives_a_per_token_delta(mode):
    setup = sort_setup(task__reward="position_per_token", algorithm__process_delta=mode)
    gen = torch.Generator().manual_seed(0)
    examples = list(setup.task.train[:4])
    batch = rollout(setup, setup.model, None, lambda: examples, version=0, generator=gen)
    want = expected_process_delta(batch, examples, setup.tokenizer, 4, to_go=mode == "return_to_go")
    assert want.abs().sum() > 0
    torch.testing.assert_close(batch.delta_tokens, want)
    assert batch.delta_rows.shape == want.shape
    # only an empty response (scored [0.0], no token to hold that step) is a mismatch
    empty = sum(not r for r in batch.groups.responses) / len(batch.groups.responses)
    assert batch.stats["step_mismatch_frac"] == pytest.approx(empty)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_kl_in_reward_folds_k1_return_to_go_into_delta(top_p):
    setup = sort_setup(algorithm__kl_coef=0.1, algorithm__kl_in="reward", algorithm__scheme="centered",
                       sampling__top_p=top_p)
    reference = type(setup.model)(setup.model.config)                          # another random init: k1 ≠ 0
    gen = torch.Generator().manual_seed(0)
    batch = rollout(setup, setup.model, reference, lambda: list(setup.task.train[:4]), version=0, generator=gen)
    roll = batch.rollout
    full = roll.logp if top_p == 1.0 else roll.logp_full                        # the tempered side, no nucleus
    k1 = (full - batch.logp_ref) * roll.mask
    B, T = k1.shape
    want = torch.tensor([[batch.delta.view(-1)[b] - 0.1 * float(k1[b, t:].sum()) for t in range(T)]
                         for b in range(B)])
    torch.testing.assert_close(batch.delta_tokens, want, atol=1e-5, rtol=1e-5)
    assert batch.stats["kl_in_reward"] == pytest.approx(float(k1.sum(1).mean()), rel=1e-5)


# ------------------------------------------------------------------------- real runs of the CLI

NEW_KEYS = ("objective", "dual_clip_c", "kl_in", "entropy_coef", "overlong_buffer", "overlong_penalty",
            "process_delta", "value_lr", "mask_truncated", "top_entropy_quantile", "ref_mixup_alpha")


def test_every_new_key_is_in_train_help():
    from test_cli import cli as shell_cli  # its cli turns argparse's exit into a status
    rc, out, _ = shell_cli("train", "--help")
    assert rc == 0
    for key in NEW_KEYS:
        assert f"--algorithm.{key}=" in out, key
    assert "learned" in out


def test_the_issue_kl_case_gives_a_small_finite_kl(tmp_path):
    # the issue's reproduction, one step: top_p 0.8 with the KL in the loss, μ = 2, two minibatches
    rc, _, err = train_run(tmp_path / "kl", *ONE_STEP, "--train.prompts_per_step=8", "--algorithm.kl_coef=0.1",
                           "--sampling.temperature=0.7", "--sampling.top_p=0.8", "--train.epochs_per_batch=2",
                           "--train.minibatches=2")
    assert rc == 0, err
    (row,) = train_rows(tmp_path / "kl")
    assert math.isfinite(row["train/kl_ref"]) and 0 <= row["train/kl_ref"] < 1


def test_run_with_several_options_at_once(tmp_path):
    rc, _, err = train_run(tmp_path / "menu", *ONE_STEP, "--train.steps=2", "--algorithm.objective=cispo",
                           "--algorithm.clip_eps_high=4", "--algorithm.entropy_coef=0.01", "--algorithm.kl_in=reward",
                           "--algorithm.kl_coef=0.05", "--sampling.top_p=0.9", "--train.epochs_per_batch=2")
    assert rc == 0, err
    rows = train_rows(tmp_path / "menu")
    assert len(rows) == 2
    for row in rows:
        assert row["train/policy_entropy"] > 0
        assert math.isfinite(row["train/kl_ref"]) and math.isfinite(row["train/kl_in_reward"])
        assert row["train/clip_frac_dual"] == 0.0


def test_run_with_a_process_reward(tmp_path):
    rc, _, err = train_run(tmp_path / "proc", *ONE_STEP, "--train.steps=2", "--task.reward=position_per_token",
                           "--algorithm.process_delta=return_to_go")
    assert rc == 0, err
    rows = train_rows(tmp_path / "proc")
    assert all("train/step_mismatch_frac" in r and r["train/nonzero_delta_frac"] > 0 for r in rows)
    assert read_jsonl(tmp_path / "proc" / "rollouts.jsonl")


def test_learned_baseline_with_one_sample_resumes_exactly(tmp_path):
    args = [*TINY, "--eval.every=0", "--eval.pass_k=0", "--eval.prompts=5", "--algorithm.scheme=learned",
            "--train.samples_per_prompt=1", "--train.prompts_per_step=16", "--algorithm.value_lr=0.01"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train_run(straight, *args, "--train.steps=3")[0] == 0
    assert train_run(split, *args, "--train.steps=2")[0] == 0
    assert train_run(split, *args, "--train.steps=3", "--resume")[0] == 0
    a, b = train_rows(straight), train_rows(split)
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]  # noqa: E731
    assert drop(a) == drop(b)
    # V = 0 at first (Δ = R: non-zero only where R is); once fitted, Δ = R - V(S) is non-zero with G = 1
    assert a[0]["train/baseline_mean"] == 0.0 and a[0]["train/value_loss"] > 0
    assert a[2]["train/baseline_mean"] != 0.0 and a[2]["train/nonzero_delta_frac"] == 1.0


def test_run_with_the_overlong_penalty_on_an_eos_task(tmp_path):
    path = tmp_path / "mytask.py"
    path.write_text(USER_TASK)
    rc, _, err = train_run(tmp_path / "long", *ONE_STEP, "--train.steps=2", f"--task.path={path}:TASK",
                           "--task.reward=exact", "--task.options={}", "--algorithm.overlong_buffer=2",
                           "--algorithm.overlong_penalty=0.5", "--algorithm.scheme=centered")
    assert rc == 0, err
    for row in train_rows(tmp_path / "long"):
        # L <= 2: 0, L = 3: -0.25, L = 4 (the bound): -0.5; the mean lies in between and is in the reward
        assert -0.5 <= row["train/reward_overlong_penalty"] < 0.0     # a random policy runs into the bound
        assert row["train/reward"] == pytest.approx(row["train/reward_exact"] + row["train/reward_overlong_penalty"],
                                                    abs=1e-6)
    rollouts = read_jsonl(tmp_path / "long" / "rollouts.jsonl")
    assert rollouts and all(len(r["delta"]) == 4 for r in rollouts)


def test_a_process_reward_with_one_sample_per_prompt_stops_with_a_clear_error(tmp_path, capsys):
    # centred across a group of one, a process reward's per-token Δ is 0 everywhere: refused, not trained on
    from rlvr import cli
    from test_distributed import EXAMPLE, TINY

    out = tmp_path / "run"
    rc = cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--task.reward=position_per_token",
                   "--algorithm.scheme=learned", "--train.samples_per_prompt=1", "--train.steps=2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "position_per_token" in err and "train.samples_per_prompt = 1" in err and ">= 2" in err


# ----------------------------------------------------------------------------------- micro-batches

@pytest.mark.parametrize("agg", ["token_mean", "seq_sum_mean", "seq_mean_mean", "seq_sum_const"])
def test_micro_batches_accumulate_the_whole_minibatch_gradient(agg, monkeypatch):
    """train.micro_batches runs each minibatch's forward and backward in parts of whole groups and
    accumulates: the gradient and the statistics are the whole minibatch's, whatever the split, under
    every aggregation. Responses end at different lengths, so the parts hold different token counts
    (a part's mean weighed as much as another's would not give the token_mean gradient)."""
    import copy

    import rlvr.learn
    from rlvr.learn import Learner, make_optimizer, make_scheduler

    setup = sort_setup(sampling__max_new_tokens=4, algorithm__scheme="centered", algorithm__agg=agg,
                       algorithm__kl_coef=0.1, algorithm__entropy_coef=0.01, train__grad_clip=0)
    setup.limits = setup_types.Limits(4, setup.tokenizer.eos_id, setup.limits.prompt_tokens)
    model = setup.model
    gen = torch.Generator().manual_seed(0)
    batch = rollout(setup, model, copy.deepcopy(model), lambda: list(setup.task.train[:4]), version=0, generator=gen)
    tokens_per_group = batch.rollout.mask.view(4, 4, -1).sum((1, 2)).tolist()
    assert len(set(tokens_per_group)) > 1, tokens_per_group
    calls = []
    real = rlvr.learn.minibatch_loss
    monkeypatch.setattr(rlvr.learn, "minibatch_loss",
                        lambda lrn, b, idx, d, *keep: calls.append(len(idx)) or real(lrn, b, idx, d, *keep))
    grads, stats = {}, {}
    for k in (1, 2, 4):
        policy = copy.deepcopy(model)
        setup.cfg.train.micro_batches = k
        opt = make_optimizer(policy.trainable_params(), setup.cfg.train)
        learner = Learner(policy, opt, make_scheduler(opt, setup.cfg.train), setup.cfg,
                          torch.Generator().manual_seed(1), setup.limits.max_new_tokens)
        calls.clear()
        stats[k] = learn(learner, batch)
        assert calls == [16 // k] * k                                  # k parts of whole groups
        grads[k] = [p.grad.clone() for p in policy.trainable_params()]
    for k in (2, 4):
        for a, b in zip(grads[1], grads[k]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        for key in ("loss", "ratio_mean", "kl_ref", "policy_entropy", "grad_norm"):
            assert stats[k][key] == pytest.approx(stats[1][key], rel=1e-5, abs=1e-7), key
    assert any(g.abs().sum() > 0 for g in grads[1])


def test_micro_batches_shrink_the_predicted_training_memory_and_are_checked():
    setup = sort_setup()
    prices = {}
    for k in (1, 2):
        setup.cfg.train.micro_batches = k
        prices[k] = run_price.price_of(setup, rate=1e11, decode_s=0.01)
    one, two = prices[1], prices[2]
    assert two.memory_activation_bytes * 2 == one.memory_activation_bytes > 0     # half the rows at once
    assert two.memory_logits_bytes * 2 == one.memory_logits_bytes > 0
    assert two.grad_steps_per_batch == one.grad_steps_per_batch                     # the same updates
    with pytest.raises(config_mod.ConfigError, match=r"train.micro_batches: 3 parts of each of train.minibatches = 2 "
                                                      r"exceed the 4 groups"):
        config_mod.load(None, ["--train.prompts_per_step=4", "--train.minibatches=2", "--train.micro_batches=3"])
