"""rlvr.distributed: the [distributed] section, per-prompt seeding, rollout workers on a local Ray,
the learner group (gloo + DDP), bounded staleness and its correction.

The Ray tests share one local Ray (4 logical CPUs, no dashboard) and tiny models (1 layer, d = 32,
sort-3, 4 prompts x 4 samples), 1-3 steps each: they run on a 2-core CI machine.
"""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from rlvr import build as build_mod, config as config_mod, losses, numerics as numerics_mod, sampling, setup_types
from rlvr.distributed import Distributed, learners as learners_mod, resolved_numerics, staleness
from rlvr.distributed.rollout_workers import shards
from rlvr.learn import Learner, learn, make_optimizer, make_scheduler
from rlvr.rollout import Batch, rollout
from rlvr.tokenizer import encode_example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sort.toml"
TINY = [
    # model.autocast = off: "auto" times fp32 against bf16 at each build, so two builds of one config (the
    # one-process learner and the group) could choose differently when the machine is busy
    "--model.autocast=off", "--model.init=", "--task.path=rlvr.tasks.sort:sort_task", "--task.reward=position", "--task.reward_weights={}",
    "--task.options={n = 3, heldout = 50}", "--task.reward_workers=0",
    "--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--sampling.temperature=1.0", "--sampling.top_p=1.0",
    "--algorithm.scheme=normalized", "--algorithm.kl_coef=0", "--algorithm.agg=token_mean", "--train.lr=0.01",
    "--train.steps=3", "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--train.threads=1",
    "--train.seed=0", "--train.epochs_per_batch=1", "--train.minibatches=1", "--train.lr_schedule=constant",
    "--eval.every=0", "--eval.prompts=10", "--eval.pass_k=0", "--distributed.cpus_per_worker=1",
    "--distributed.timeout_s=120",
]


def tiny_cfg(*extra: str) -> config_mod.Config:
    return config_mod.load(EXAMPLE, TINY + list(extra))


def new_learner(setup) -> Learner:
    cfg = setup.cfg
    opt = make_optimizer(setup.model.trainable_params(), cfg.train)
    gen = torch.Generator().manual_seed(cfg.train.seed + 1)
    return Learner(setup.model, opt, make_scheduler(opt, cfg.train), cfg, gen, setup.limits.max_new_tokens,
                   autocast=setup.numerics.context)   # as rlvr.trainer builds it: the run's numerics


# --------------------------------------------------------------------------- config


def test_every_distributed_key_is_in_help_and_round_trips():
    text = config_mod.help_text()
    for key in ("rollout_workers", "learners", "address", "max_staleness", "is_cap", "cpus_per_worker",
                "gpus_per_worker", "timeout_s"):
        assert f"--distributed.{key}=" in text
    cfg = tiny_cfg("--distributed.rollout_workers=2", "--distributed.learners=2", "--distributed.address=auto")
    assert (cfg.distributed.rollout_workers, cfg.distributed.learners, cfg.distributed.address) == (2, 2, "auto")


@pytest.mark.parametrize("override,needle", [
    ("--distributed.rollout_workers=-1", "distributed.rollout_workers: must be >= 0"),
    ("--distributed.learners=0", "distributed.learners: must be >= 1"),
    ("--distributed.rollout_workers=5", "exceeds the 4 prompts"),
    ("--distributed.learners=5", "exceeds the 4 groups"),
    ("--distributed.address=somewhere", "distributed.address"),
    ("--distributed.is_cap=0.5", "distributed.is_cap: must be >= 1"),
    ("--distributed.max_staleness=1", "needs distributed.rollout_workers >= 1"),
    ("--distributed.timeout_s=0", "distributed.timeout_s: must be > 0"),
])
def test_bad_distributed_values_are_refused_with_the_key(override, needle):
    with pytest.raises(config_mod.ConfigError, match=needle.replace(".", r"\.")):
        tiny_cfg(override)


def test_staleness_with_dynamic_sampling_is_refused():
    with pytest.raises(config_mod.ConfigError, match="mix versions"):
        tiny_cfg("--distributed.rollout_workers=1", "--distributed.max_staleness=1", "--algorithm.dynamic_sampling=true")


# --------------------------------------------------------------------------- per-prompt seeding


def test_inverse_cdf_sample_by_hand():
    probs = torch.tensor([[0.2, 0.0, 0.8]] * 4)            # cdf 0.2, 0.2, 1.0
    u = torch.tensor([0.1, 0.2, 0.5, 0.999999])
    # u < 0.2 -> token 0; u = 0.2 is not < 0.2 -> the first cdf above it: token 2 (token 1 has no mass)
    assert sampling.inverse_cdf_sample(probs, u).tolist() == [0, 2, 2, 2]


def test_inverse_cdf_sample_past_the_last_token_takes_the_most_likely():
    # row 0: u · total lands on the total, past the last token with mass (token 2 has none): the argmax (token 1);
    # row 1 is drawn as usual. The argmax is only computed when such a row exists.
    probs = torch.tensor([[0.25, 0.75, 0.0], [0.2, 0.0, 0.8]])
    assert sampling.inverse_cdf_sample(probs, torch.tensor([1.0, 0.1])).tolist() == [1, 0]


def test_a_prompts_rows_do_not_depend_on_the_other_prompts_of_the_call():
    setup = build_mod.build(tiny_cfg())
    prompts = [encode_example(setup.tokenizer, ex) for ex in setup.task.train[:6]]
    kw = dict(samples_per_prompt=3, max_new_tokens=setup.limits.max_new_tokens, eos_id=setup.limits.eos_id,
              pad_id=setup.tokenizer.pad_id)
    whole = sampling.generate(setup.model, prompts, generators=sampling.prompt_generators(123, 0, 6), **kw)
    tail = sampling.generate(setup.model, prompts[2:], generators=sampling.prompt_generators(123, 2, 4), **kw)
    assert torch.equal(whole.ids[6:], tail.ids)
    torch.testing.assert_close(whole.logp[6:], tail.logp, rtol=0, atol=1e-6)
    other = sampling.generate(setup.model, prompts, generators=sampling.prompt_generators(124, 0, 6), **kw)
    assert not torch.equal(whole.ids, other.ids)  # the base seed matters


def test_shards_are_contiguous_and_cover_every_prompt():
    assert shards(5, 2) == [(0, 3), (3, 2)]
    assert shards(2, 3) == [(0, 1), (1, 1)]


# --------------------------------------------------------------------------- losses: the global denominator


def test_denominator_recombines_per_rank_losses_into_the_whole_batch_loss():
    # rank 0: one row with 3 tokens of value 1; rank 1: one row with 1 token of value 5
    v0, m0 = torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0]])
    v1, m1 = torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    v, m = torch.cat([v0, v1]), torch.cat([m0, m1])
    # token_mean over the batch: (3 + 5) / 4 = 2; the mean of the per-rank means would be (1 + 5) / 2 = 3
    assert float(losses.aggregate(v, m, "token_mean")) == 2.0
    for mode in losses.AGGREGATIONS:
        d0, d1 = losses.denominator(m0, mode), losses.denominator(m1, mode)
        parts = [losses.aggregate(vv, mm, mode, max_len=3) * dd / (d0 + d1) for vv, mm, dd in ((v0, m0, d0), (v1, m1, d1))]
        torch.testing.assert_close(float(sum(parts)), float(losses.aggregate(v, m, mode, max_len=3)))
    assert float(losses.denominator(m, "token_mean")) == 4 and float(losses.denominator(m, "seq_mean_mean")) == 2


def test_a_shard_of_one_rank_is_the_one_process_update():
    a, b = build_mod.build(tiny_cfg()), build_mod.build(tiny_cfg())
    la, lb = new_learner(a), new_learner(b)
    batch = rollout(a, a.model, None, lambda: a.task.train[:4], version=0, generator=torch.Generator().manual_seed(0))
    sa = learn(la, batch)
    sb = learn(lb, batch, shard=learners_mod.Shard(0, 1, b.model))
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert sa["loss"] == sb["loss"]


# --------------------------------------------------------------------------- staleness correction


def test_truncated_is_weight_by_hand():
    logp_behav = torch.log(torch.tensor([[0.1, 0.4, 0.5]]))
    logp_old = torch.log(torch.tensor([[0.3, 0.2, 0.5]]))      # ratios 3, 0.5, 1
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, stats = staleness.truncated_is_weight(logp_old, logp_behav, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))  # 3 capped at 2; outside the mask 1
    assert stats["is_truncated_frac"] == 0.5 and stats["is_weight_max"] == 2.0
    assert math.isclose(stats["behav_ratio_max"], 3.0, rel_tol=1e-6)
    # folded into Δ: at ratio 1 the token_mean loss is -(2·Δ + 0.5·Δ) / 2 = -1.25 for Δ = 1
    delta = torch.ones(1, 1) * w
    loss, _ = losses.policy_loss(logp_old, logp_old, delta, mask, agg="token_mean")
    assert math.isclose(float(loss), -1.25, rel_tol=1e-6)


def test_a_fresh_batch_is_not_corrected_and_a_stale_one_is():
    setup = build_mod.build(tiny_cfg("--distributed.rollout_workers=1", "--distributed.max_staleness=1"))
    batch = rollout(setup, setup.model, None, lambda: setup.task.train[:4], version=3,
                    generator=torch.Generator().manual_seed(0))
    same, delta_rows, stats = staleness.correct(setup.model, batch, setup.cfg, learner_version=3)
    assert same is batch and delta_rows is None and stats["staleness"] == 0
    # one version later with unchanged weights π_old = π_behav: w = 1 up to rounding, Δ unchanged
    got, delta_rows, stats = staleness.correct(setup.model, batch, setup.cfg, learner_version=4)
    assert stats["staleness"] == 1 and delta_rows.shape == batch.rollout.mask.shape
    torch.testing.assert_close(got.logp_old, batch.logp_old, rtol=0, atol=1e-5)
    torch.testing.assert_close(delta_rows, batch.delta.reshape(-1, 1).expand_as(delta_rows), rtol=0, atol=1e-4)
    # weights moved: the stored behaviour logp stays, π_old is recomputed, w = min(π_old/π_behav, cap)
    with torch.no_grad():
        for p in setup.model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    got, delta_rows, stats = staleness.correct(setup.model, batch, setup.cfg, learner_version=4)
    w = torch.exp(got.logp_old - batch.logp_old).clamp(max=setup.cfg.distributed.is_cap) * batch.rollout.mask
    torch.testing.assert_close(delta_rows * batch.rollout.mask, batch.delta.reshape(-1, 1) * w)
    assert stats["is_weight_max"] <= 2.0 and stats["behav_ratio_max"] != 1.0


# --------------------------------------------------------------------------- on a local Ray


def _two_steps(cfg) -> list:
    """(rewards, Δ, logp_old, version) of the first two steps, a plain learn between them."""
    setup = build_mod.build(cfg)
    learner = new_learner(setup)
    gen, rng = torch.Generator().manual_seed(cfg.train.seed), iter(range(0, 40, 4))
    draw = lambda: setup.task.train[next(rng):][:4]  # noqa: E731
    out = []
    d = (Distributed(cfg, setup, learner, 0, 0, log=lambda *_: None, builder=build_mod.build)
         if cfg.distributed.rollout_workers else None)
    try:
        for v in range(2):
            batch = (d.rollout if d else rollout)(setup, setup.model, None, draw, version=v, generator=gen)
            out.append((batch.groups.rewards, batch.delta, batch.logp_old, batch.version))
            if d:
                d.learn(learner, batch)
            else:
                learn(learner, batch)
    finally:
        if d:
            d.close()
    return out


def test_zero_one_and_two_rollout_workers_draw_the_same_rows(ray_local):
    runs = {n: _two_steps(tiny_cfg(f"--distributed.rollout_workers={n}")) for n in (0, 1, 2)}
    for n in (1, 2):
        for (r0, d0, l0, v0), (r, d, lp, v) in zip(runs[0], runs[n]):
            assert torch.equal(r0, r) and torch.equal(d0, d) and v0 == v
            torch.testing.assert_close(l0, lp, rtol=0, atol=1e-6)
    assert [v for *_, v in runs[2]] == [0, 1]
    assert not torch.equal(runs[0][0][2], runs[0][1][2])  # the second step sampled with the updated weights


def test_tool_calls_draw_the_same_rows_with_and_without_rollout_workers(ray_local):
    """The tool loop's continuations are seeded per row of the whole batch: sharding keeps them."""
    calc = ["--task.path=rlvr.tasks.arith:arith_task", "--task.reward=correct",
            "--task.options={digits = 1, heldout = 10, calculator = true, max_new_tokens = 16}",
            '--sampling.stop=["a", "e", "o"]', "--sampling.max_tool_calls=2"]
    runs = {n: _two_steps(tiny_cfg(*calc, f"--distributed.rollout_workers={n}")) for n in (0, 2)}
    for (r0, d0, l0, v0), (r, d, lp, v) in zip(runs[0], runs[2]):
        assert torch.equal(r0, r) and torch.equal(d0, d) and v0 == v
        torch.testing.assert_close(l0, lp, rtol=0, atol=1e-6)


def test_a_killed_rollout_worker_is_replaced_and_its_share_sampled_again(ray_local):
    cfg = tiny_cfg("--distributed.rollout_workers=2")
    setup = build_mod.build(cfg)
    messages = []
    d = Distributed(cfg, setup, new_learner(setup), 0, 0, log=messages.append, builder=build_mod.build)
    try:
        examples = setup.task.train[:4]
        clean = d.workers.collect(d.workers.submit(examples, torch.Generator().manual_seed(7)))
        ray_local.kill(d.workers.workers[1])                  # dies; the trainer learns it when it collects
        job = d.workers.submit(examples, torch.Generator().manual_seed(7))
        got = d.workers.collect(job)
        assert torch.equal(got.rollout.ids, clean.rollout.ids) and torch.equal(got.rewards, clean.rewards)
        assert d.workers.restarts == 1
        assert any("rollout worker 1 died" in m and "sampled its 2 prompts again" in m for m in messages)
        # a job in flight while newer weights were sent (bounded staleness): the replacement samples the
        # shard with the job's weights, then takes the newer ones
        ray_local.kill(d.workers.workers[0])
        job = d.workers.submit(examples, torch.Generator().manual_seed(7))
        with torch.no_grad():
            for p in setup.model.parameters():
                p.add_(0.3)
        d.workers.sync(setup.model, 1, wait=False)
        got = d.workers.collect(job)
        assert torch.equal(got.rollout.ids, clean.rollout.ids) and d.workers.restarts == 2
        # the replacement has the latest weights: a sync then a step works on both workers
        d.workers.sync(setup.model, 1)
        again = d.workers.collect(d.workers.submit(examples, torch.Generator().manual_seed(7)))
        assert again.rewards.shape == (4, 4)
    finally:
        d.close()


def _uneven_batch(setup, lengths=(3, 1, 2, 0)):
    """A batch of 4 groups whose responses are `lengths` tokens long (3, 1, 2 and 0): however whole
    groups are split over two ranks, the ranks hold different numbers of tokens (and one may hold none)."""
    batch = rollout(setup, setup.model, None, lambda: setup.task.train[:4], version=0,
                    generator=torch.Generator().manual_seed(0))
    ro, Lp = batch.rollout, batch.rollout.prompt_len
    G = setup.cfg.train.samples_per_prompt
    assert ro.mask.shape[1] == 3
    for g, n in enumerate(lengths):
        rows = slice(g * G, (g + 1) * G)
        ro.mask[rows, n:] = 0
        ro.attention_mask[rows, Lp + n:] = 0
        ro.logp[rows, n:] = 0
    batch.logp_old = ro.logp
    batch.delta = torch.linspace(-1.5, 1.5, batch.delta.numel()).view_as(batch.delta)
    return batch


def group_as_one(one, two, l1, l2, batch, label: str = "", rtol: float = 0.0) -> tuple[dict, dict]:
    """`batch` learned by the one learner `l1` (of build `one`) and by a learner group of `two.cfg` whose
    rank 0 is `l2` (of build `two`): the same weights (atol 1e-6) and loss. Returns both statistics."""
    s1 = learn(l1, copy.deepcopy(batch))
    group = learners_mod.LearnerGroup(two.cfg, l2, build_mod.build)
    try:
        s2 = group.learn(batch)
    finally:
        group.close()
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p1, p2, rtol=rtol, atol=1e-6, msg=f"{label}{name}")
    assert math.isclose(s1["loss"], s2["loss"], rel_tol=1e-5, abs_tol=1e-6)
    return s1, s2


@pytest.mark.parametrize("agg", list(losses.AGGREGATIONS))
def test_two_learners_make_the_one_learner_update(ray_local, agg):
    cfg = tiny_cfg("--distributed.learners=2", f"--algorithm.agg={agg}", "--train.minibatches=2")
    one, two = build_mod.build(cfg), build_mod.build(cfg)
    l1, l2 = new_learner(one), new_learner(two)
    _, s2 = group_as_one(one, two, l1, l2, _uneven_batch(one), f"{agg}: ")
    assert s2["optimizer_steps"] == 2


def test_two_learners_leave_truncated_rows_out_as_one_learner_does(ray_local):
    """algorithm.mask_truncated's loss mask (Batch.train_mask) reaches each rank's loss and the group's
    loss shares (Shard.rows): the one-process update, which differs from the unmasked one."""
    from rlvr.rollout import mask_truncated

    cfg = tiny_cfg("--distributed.learners=2", "--train.minibatches=2")
    one, two, plain = build_mod.build(cfg), build_mod.build(cfg), build_mod.build(cfg)
    l1, l2 = new_learner(one), new_learner(two)
    unmasked = _uneven_batch(one)
    unmasked.rollout.truncated[::3] = True
    batch = mask_truncated(unmasked)
    assert batch.train_mask.sum() < unmasked.rollout.mask.sum()
    learn(new_learner(plain), copy.deepcopy(unmasked))
    group_as_one(one, two, l1, l2, batch)
    assert any(not torch.equal(p1, p3) for p1, p3 in zip(one.model.parameters(), plain.model.parameters()))


def micro_batches_in_a_group(extra: tuple, groups: int, rtol: float = 0.0) -> None:
    """A learner group (`extra`: its distributed keys) with train.micro_batches = 2 on a batch of `groups`
    of _uneven_batch's groups (fewer than 4: as dynamic sampling may keep) makes the one-process update
    at one part."""
    one = build_mod.build(tiny_cfg(*extra))
    two = build_mod.build(tiny_cfg(*extra, "--train.micro_batches=2", "--distributed.timeout_s=60"))
    l1, l2 = new_learner(one), new_learner(two)
    batch, G = _uneven_batch(one), one.cfg.train.samples_per_prompt
    if groups < 4:
        kept = batch.groups.select(torch.arange(groups), G)
        batch = Batch(kept, [kept], batch.delta[:groups], batch.logp_old[:groups * G], None, 0)
    group_as_one(one, two, l1, l2, batch, rtol=rtol)


@pytest.mark.parametrize("groups", [4, 3])
def test_two_learners_in_micro_batches_make_the_one_learner_update(ray_local, groups):
    """train.micro_batches = 2 on each rank of a DDP learner group (each rank's groups in parts, one part
    with no token) makes the one-process update of the whole minibatch; with 3 groups the ranks hold
    2 and 1, and still run the same number of forwards and backwards (collectives)."""
    micro_batches_in_a_group(("--distributed.learners=2",), groups)


def logp_old_from_the_group(*extra: str, rtol: float = 0.0) -> None:
    """A batch whose logp_old is the learner's own (`logp_old_pending`; the sampler's 0.1 a token
    below, so Δ carries an IS weight of e^0.1), two minibatches, two passes (the second draws the
    groups into other minibatches, on other ranks), micro_batches = 2 (3 groups: the ranks hold 2 and 1
    of a minibatch, or 1 and none): a learner group of `extra` makes the one-process update and
    reports its logp_old tokens and IS-weight figures."""
    cfg = tiny_cfg(*extra, "--train.minibatches=2", "--train.epochs_per_batch=2", "--train.micro_batches=2")
    one, two = build_mod.build(cfg), build_mod.build(cfg)
    l1, l2 = new_learner(one), new_learner(two)
    full, G = _uneven_batch(one), cfg.train.samples_per_prompt
    kept = full.groups.select(torch.arange(3), G)
    sampler = full.logp_old[:3 * G] - 0.1 * kept.rollout.mask
    batch = Batch(kept, [kept], full.delta[:3], sampler, None, 0, logp_old_pending=True)
    s1, s2 = group_as_one(one, two, l1, l2, batch, rtol=rtol)
    assert s2["optimizer_steps"] == 4 and s2["logp_old_forward_tokens"] == s1["logp_old_forward_tokens"] > 0
    assert s2["flops"] == s1["flops"]
    for key in ("sampler_is_weight_mean", "sampler_is_weight_max"):
        assert math.isclose(s2[key], s1[key], rel_tol=1e-6) and s1[key] > 1.05, key


def test_two_learners_compute_logp_old_of_their_rows_as_one_learner_does(ray_local):
    logp_old_from_the_group("--distributed.learners=2")


def test_a_learner_group_that_fails_to_start_leaves_no_process_group(ray_local, monkeypatch):
    """A rank lost during the start (here: the wait for the other ranks' join fails) ends in a RunError
    with this process's process group destroyed and the actors gone, so a later group can start."""
    import torch.distributed as dist

    from rlvr.setup_types import RunError

    cfg = tiny_cfg("--distributed.learners=2")
    setup = build_mod.build(cfg)
    started = []

    def lost(self, refs, what):
        started.append((dist.is_initialized(), len(self.actors)))
        raise RunError(f"the learner group lost a rank during the {what}")

    monkeypatch.setattr(learners_mod.LearnerGroup, "_wait", lost)
    with pytest.raises(RunError, match="during the start"):
        learners_mod.LearnerGroup(cfg, new_learner(setup), build_mod.build)
    assert started == [(True, 1)]                        # it had joined rank 0 and started one actor
    assert not dist.is_initialized()
    monkeypatch.undo()
    group = learners_mod.LearnerGroup(cfg, new_learner(build_mod.build(cfg)), build_mod.build)
    try:
        assert group.learn(_uneven_batch(setup))["optimizer_steps"] == 1
    finally:
        group.close()


def _cli_train(out: Path, *overrides: str) -> list[dict]:
    from rlvr import cli

    rc = cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, *overrides])
    assert rc == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_train_with_two_rollout_workers_and_two_learners(ray_local, tmp_path):
    # with dynamic sampling, so refill rounds go to the workers too and a batch may hold fewer groups than ranks
    rows = _cli_train(tmp_path / "run", "--distributed.rollout_workers=2", "--distributed.learners=2",
                      "--algorithm.dynamic_sampling=true")
    steps = [r for r in rows if "train/reward" in r]
    assert all(r["train/sampling_rounds"] >= 1 for r in steps)
    assert [r["train/policy_version"] for r in steps] == [0, 1, 2]
    assert all(r["train/sync_s"] > 0 for r in steps)
    assert (tmp_path / "run" / "summary.json").is_file()


def test_bounded_staleness_overlaps_and_logs_its_correction(ray_local, tmp_path):
    rows = _cli_train(tmp_path / "run", "--distributed.rollout_workers=1", "--distributed.max_staleness=1")
    steps = [r for r in rows if "train/reward" in r]
    # step 1 is sampled fresh; steps 2 and 3 were sampled while the previous step learned
    assert [r["train/staleness"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["train/policy_version"] for r in steps] == [0, 0, 1]
    for r in steps[1:]:
        assert 0 < r["train/is_weight_mean"] <= 2.0 and r["train/is_weight_max"] <= 2.0
        assert "train/is_truncated_frac" in r and "train/clip_frac" in r


def one_group_for_two_ranks(cfg) -> None:
    """One group for a two-rank learner group (dynamic sampling may keep so few): the group's update
    equals one process's, rank 1 taking part at weight 0."""
    one, two = build_mod.build(cfg), build_mod.build(cfg)
    l1, l2 = new_learner(one), new_learner(two)
    full, G = _uneven_batch(one), cfg.train.samples_per_prompt
    kept = full.groups.select(torch.tensor([0]), G)
    batch = Batch(kept, [kept], full.delta[:1], full.logp_old[:G], None, 0)
    learn(l1, copy.deepcopy(batch))
    group = learners_mod.LearnerGroup(cfg, l2, build_mod.build)
    try:
        group.learn(batch)
    finally:
        group.close()
    for p1, p2 in zip(one.model.parameters(), two.model.parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=1e-6)


def test_a_rank_without_groups_adds_nothing(ray_local):
    one_group_for_two_ranks(tiny_cfg("--distributed.learners=2"))


def test_two_batches_in_flight_make_the_staleness_two(ray_local, tmp_path):
    rows = _cli_train(tmp_path / "run", "--distributed.rollout_workers=1", "--distributed.max_staleness=2",
                      "--train.steps=4")
    steps = [r for r in rows if "train/reward" in r]
    # steps 2 and 3 were both sampled with the initial weights while step 1 learned; step 4 after update 1
    assert [r["train/policy_version"] for r in steps] == [0, 0, 0, 1]
    assert [r["train/staleness"] for r in steps] == [0.0, 1.0, 2.0, 2.0]


def test_bf16_autocast_reaches_the_rollout_workers_and_the_learners(ray_local):
    """model.autocast = bf16 with 2 rollout workers and 2 learners (each actor builds its own copy of
    the run from the config it is given): the workers sample what one process samples under bf16, and
    the learner group makes the one-process bf16 update. Both differ from fp32 by far more than the
    tolerance, so an actor that computed in fp32 (the option lost on its way) fails the test. No
    entropy bonus: the example's own adds gradient terms near zero whose rounding (two ranks' sums
    against one process's) AdamW's first step turns into moves far above the tolerance, and this
    test is about the numerics reaching the actors."""
    off_bonus = "--algorithm.entropy_coef=0"
    bf16 = tiny_cfg("--model.autocast=bf16", off_bonus)
    workers = tiny_cfg("--model.autocast=bf16", "--distributed.rollout_workers=2", "--distributed.learners=2",
                       off_bonus)
    fp32 = tiny_cfg("--model.autocast=off", off_bonus)
    got, want, off = _two_steps(workers), _two_steps(bf16), _two_steps(fp32)
    for (r0, d0, l0, v0), (r, d, lp, v) in zip(want, got):
        assert torch.equal(r0, r) and torch.equal(d0, d) and v0 == v
        torch.testing.assert_close(l0, lp, rtol=0, atol=1e-6)
    assert not torch.allclose(off[0][2], want[0][2], rtol=0, atol=1e-4)  # bf16 sampling, not fp32's
    # the second step's rows came from the weights the learner group left: its update was bf16's
    torch.testing.assert_close(got[1][2], want[1][2], rtol=0, atol=1e-6)
    assert not torch.allclose(off[1][2], want[1][2], rtol=0, atol=1e-4)


def test_the_actors_get_the_numerics_this_process_chose(monkeypatch):
    # model.autocast = auto decides once, in the trainer; the actors are told the outcome, not `auto`
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)
    cfg = tiny_cfg("--model.autocast=auto", "--distributed.rollout_workers=1")
    setup = build_mod.build(cfg, log=lambda *_: None)
    assert setup.numerics.bf16 and resolved_numerics(cfg, setup).model.autocast == "bf16"
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: False)
    setup = build_mod.build(cfg, log=lambda *_: None)
    assert not setup.numerics.bf16 and resolved_numerics(cfg, setup).model.autocast == "off"


def test_more_cpus_than_the_cluster_has_is_refused_before_any_actor(ray_local):
    cfg = tiny_cfg("--distributed.rollout_workers=2", "--distributed.cpus_per_worker=3")
    setup = build_mod.build(cfg)
    with pytest.raises(setup_types.RunError, match="has 4 CPUs; the actors ask for 6"):
        Distributed(cfg, setup, new_learner(setup), 0, 0, log=lambda *_: None, builder=build_mod.build)
    assert ray_local.is_initialized()  # a Ray this run did not start is left running


@pytest.mark.parametrize("lora,compile_layers", [(0, False), (4, False), (4, True)])
def test_two_learners_on_a_hugging_face_model(ray_local, tmp_path, lora, compile_layers, monkeypatch):
    # a Llama's shared-prompt forward (prompts and responses in one pass) goes through DDP's forward, so
    # its backward all-reduces; under LoRA only the adapter trains and the frozen weights take no part;
    # with model.compile the compiled layers' backward all-reduces too
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "configs"))
    from make_tiny_hf_model import build

    build(tmp_path / "llama", layers=1, hidden=32, heads=2, context=64)
    extra = ([f"--model.path={tmp_path / 'llama'}", "--model.init=", "--distributed.learners=2",
             "--model.share_prompt_forward=true", f"--model.compile={str(compile_layers).lower()}"]
             + ([f"--model.lora_r={lora}"] if lora else []))
    base = [x for x in TINY if not x.startswith("--model.n_")] + extra
    cfg = config_mod.load(EXAMPLE, base)
    # with model.compile the one learner takes the ranks' shares as its micro-batches (in order: no
    # length buckets), each of two groups whose longest response has 3 tokens: every forward, its and
    # the ranks', has one shape, which it compiles first and Inductor's on-disk cache then serves to
    # the ranks (at the suite's one thread per process: that cache is per thread count). Each shape of
    # their own cost a cold compile per rank, over half of the suite's longest test.
    mb = ["--train.micro_batches=2", "--train.length_buckets=false"] if compile_layers else []
    one, two = build_mod.build(config_mod.load(EXAMPLE, base + mb)), build_mod.build(cfg)
    two.model.load_state_dict(one.model.state_dict())  # peft's LoRA init is not seeded by train.seed
    assert one.model.differentiable_cache
    l1, l2 = new_learner(one), new_learner(two)
    batch = _uneven_batch(one, (3, 1, 0, 3) if compile_layers else (3, 1, 2, 0))
    from rlvr import compiled
    from rlvr.models import lean_llama

    calls = []
    monkeypatch.setattr(lean_llama, "compiled_call",
                        lambda name, *a: calls.append(name) or compiled.compiled_call(name, *a))
    learn(l1, copy.deepcopy(batch))
    assert ("layer" in calls) == compile_layers and compiled.compile_failure() is None  # the one-process learner's
    group = learners_mod.LearnerGroup(cfg, l2, build_mod.build)
    try:
        group.learn(batch)
    finally:
        group.close()
    # the gradient AdamW received (all-reduced over the ranks, clipped) is the one-process gradient to
    # float rounding. The weights are not compared: Adam's first step is lr · g / (|g| + 1e-8) per
    # entry, which turns rounding in entries with |g| ~ 1e-9 (this Llama's attention projections; a
    # fresh LoRA A, whose gradient is 0 while B is 0) into steps of up to lr
    moved = 0
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters()):
        assert (p1.grad is None) == (p2.grad is None) == (not p1.requires_grad), name
        if p1.requires_grad:
            moved += 1
            torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert moved

