"""bf16 autocast (`model.autocast`) and where logp_old comes from (`algorithm.logp_old`).

The choice of numerics (auto / bf16 / off, from timings given here, never from the machine running
the tests), that autocast reaches sampling, the training forward and evaluation while every
log-softmax stays float32, and that `recompute` makes logp_old the training forward's own, weighs Δ
by min(π_train / π_sampler, is_cap) and so changes the update.

`auto`, the default, takes `recompute` under bf16 and `sampler` in fp32. On the CPUs these tests
were written on, the bf16 sampler and the bf16 training forward agree bit for bit at these small
shapes (the per-row bf16 products and their fp32 accumulation are the same in incremental decoding
and in the full forward; not so at SmolLM2's shapes on a CPU with AMX), so a mismatch between the
two passes is simulated where a test needs one: an engine whose stored log-probs are a known amount
lower on every token.
"""

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlvr import (build as build_mod, config as config_mod, costs, losses, numerics as numerics_mod, run_price,
                  sampling, scoring, setup_types)
from rlvr.distributed import resolved_numerics, staleness
from rlvr.learn import Learner, learn, make_optimizer, make_scheduler
from rlvr.rollout import Batch, Groups, recompute_logp_old, rollout, sample_and_score
from rlvr.numerics import autocast_timings as real_autocast_timings, native_bf16 as real_native_bf16  # before conftest patches them

import pricing
from test_distributed import EXAMPLE, TINY

torch.set_num_threads(1)
CPU = torch.device("cpu")


def tiny_setup(*extra: str, time_bf16: bool = False):
    """The 3-digit sort task on a 1-layer built-in model (d = 32), P = G = 4, one thread."""
    return build_mod.build(config_mod.load(EXAMPLE, TINY + list(extra)), log=lambda *_: None, time_bf16=time_bf16)


def new_learner(setup) -> Learner:
    cfg = setup.cfg
    opt = make_optimizer(setup.model.trainable_params(), cfg.train)
    gen = torch.Generator().manual_seed(cfg.train.seed + 1)
    return Learner(setup.model, opt, make_scheduler(opt, cfg.train), cfg, gen, setup.limits.max_new_tokens,
                   autocast=setup.numerics.context)


def sample(setup, **kw) -> Batch:
    return rollout(setup, setup.model, None, lambda: list(setup.task.train[:4]), version=0,
                   generator=torch.Generator().manual_seed(0), **kw)


def training_forward_logp(setup, roll) -> torch.Tensor:
    """(B, T) log-probs of a fresh no-grad forward under the run's training numerics."""
    cfg = setup.cfg
    with torch.no_grad(), setup.numerics.context():
        return scoring.sequence_token_logprobs(
            setup.model, roll, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
            group_size=cfg.train.samples_per_prompt if cfg.model.share_prompt_forward else None)


def lower_engine(setup, shift: float):
    """A `sampler=` for rollout: samples and scores as the trainer does, then stores log-probs `shift`
    lower on every generated token (a sampling engine whose numerics differ from the trainer's)."""
    def sampler(examples: list) -> Groups:
        sc = setup.cfg.sampling
        got = sample_and_score(setup.model, setup.tokenizer, setup.task, examples, G=setup.cfg.train.samples_per_prompt,
                               limits=setup.limits, weights=setup.reward_weights, temperature=sc.temperature,
                               top_p=sc.top_p, generator=torch.Generator().manual_seed(0),
                               autocast=setup.numerics.context)
        roll = got.rollout
        return dataclasses.replace(got, rollout=dataclasses.replace(roll, logp=roll.logp - shift * roll.mask))
    return sampler


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "configs"))
    from make_tiny_hf_model import build

    return build(tmp_path_factory.mktemp("hf") / "llama", layers=1, hidden=32, heads=2, context=64)


# ----------------------------------------------------------------------------------- the choice


@pytest.mark.parametrize("native,hidden,want", [
    (True, 256, True),     # bf16 units, a model at the floor
    (True, 64, False),     # bf16 units, a model below it: not bound by its products
    (False, 1024, False),  # no bf16 units: bf16 would be emulated, slower than fp32
])
def test_auto_takes_bf16_from_the_device_and_the_size_never_from_a_timing(monkeypatch, native, hidden, want):
    """The decision reads the model's size and whether the device has bf16 units, never a timing: a
    timing that says bf16 is 10x slower (or faster) does not move it, so two starts on one machine
    decide alike whatever else runs. Timed only for a fresh run's price, and only when it runs bf16."""
    monkeypatch.setattr(numerics_mod, "AUTOCAST_MIN_HIDDEN", 256)
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: native)
    asked = []
    for fp32_s, bf16_s in ((1e-3, 1e-2), (1e-2, 1e-3)):
        monkeypatch.setattr(numerics_mod, "autocast_timings",
                            lambda device, *shape, **kw: asked.append(shape) or (fp32_s, bf16_s))
        for time_bf16 in (False, True):
            got = numerics_mod.choose_numerics("auto", CPU, (256, hidden, 4 * hidden), time_bf16=time_bf16)
            assert got.bf16 is want
            assert got.describe().startswith("bf16 autocast" if want else "fp32")
            assert (got.fp32_s, got.bf16_s) == ((fp32_s, bf16_s) if want and time_bf16 else (0.0, 0.0))
    assert asked == ([(256, hidden, 4 * hidden)] * 2 if want else [])


def test_the_price_line_says_why_auto_decided(monkeypatch):
    """The numerics line names the reason: the size floor, the device's bf16 units or their absence;
    with the timing where one was taken (a slower bf16 said so)."""
    monkeypatch.setattr(numerics_mod, "AUTOCAST_MIN_HIDDEN", 256)
    small = numerics_mod.choose_numerics("auto", CPU, (256, 64, 256), time_bf16=True)
    assert small.describe() == ("fp32 (model.autocast = auto: hidden size 64 < 256: a model this small is not "
                                "bound by its products)")
    assert small.matmul_speedup() == 1.0
    none = numerics_mod.choose_numerics("auto", CPU, (256, 576, 1536), time_bf16=True)
    assert none.describe() == "fp32 (model.autocast = auto: this CPU has no bf16 units)"
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)
    monkeypatch.setattr(numerics_mod, "autocast_timings", lambda device, *shape, **kw: (3e-3, 1e-3))
    units = numerics_mod.choose_numerics("auto", CPU, (256, 576, 1536), time_bf16=True)
    assert units.describe() == ("bf16 autocast (model.autocast = auto: this CPU computes bf16 in hardware; bf16 "
                                "3.00x fp32 here, 1 ms against 3 ms for a 256 x 576 x 1536 product)")
    monkeypatch.setattr(numerics_mod, "autocast_timings", lambda device, *shape, **kw: (1e-3, 3e-3))
    slow = numerics_mod.choose_numerics("bf16", CPU, (256, 64, 256), time_bf16=True)
    assert slow.describe().endswith("3 ms against 1 ms for a 256 x 64 x 256 product; slower than fp32 here)")


def test_native_bf16_reads_the_machine_and_is_stable():
    """The real detection (not patched here): a bool, the same on every call, False off CPU and CUDA."""
    got = {real_native_bf16(CPU) for _ in range(5)}
    assert len(got) == 1 and isinstance(got.pop(), bool)
    assert real_native_bf16(torch.device("meta")) is False


@pytest.mark.parametrize("mode,want", [("bf16", True), ("off", False)])
def test_bf16_and_off_force_the_choice_without_measuring(monkeypatch, mode, want):
    # as for a resumed run or `rlvr eval` (time_bf16 False): the decision is taken as given
    def never(*a, **kw):
        raise AssertionError("measured although model.autocast is forced")

    monkeypatch.setattr(numerics_mod, "autocast_timings", never)
    got = numerics_mod.choose_numerics(mode, CPU, (256, 32, 128))
    assert got.bf16 is want and got.describe() == f"{'bf16 autocast' if want else 'fp32'} (model.autocast = {mode})"
    with got.context():
        assert torch.is_autocast_enabled("cpu") is want


def test_build_measures_the_models_own_shape_and_the_price_records_the_choice(monkeypatch):
    asked = []
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)
    monkeypatch.setattr(numerics_mod, "autocast_timings", lambda device, *shape, **kw: asked.append(shape) or (3e-3, 1e-3))
    assert tiny_setup("--model.autocast=auto").numerics.bf16 and asked == []      # decided untimed
    setup = tiny_setup("--model.autocast=auto", time_bf16=True)
    assert asked == [(256, 32, 4 * 32)]                  # 256 token rows x hidden x MLP width of d = 32
    assert setup.numerics.bf16
    price = run_price.price_of(setup, rate=1e9)
    assert price.numerics.startswith("bf16 autocast (model.autocast = auto: this CPU computes bf16 in hardware; "
                                     "bf16 3.00x fp32 here, 1 ms against 3 ms")
    assert f"price: numerics: {price.numerics}" in price.lines()
    assert price.to_dict()["numerics"] == price.numerics
    # the wall-time estimate runs at the bf16 rate: the fp32 rate x the measured 3x
    assert price.matmul_flops_per_s == 3e9 and price.matmul_kind == "bf16 autocast"
    assert price.wall_seconds_estimate == price.flops_per_run / 3e9
    assert "at a measured bf16 autocast matmul rate of 3.0 GFLOP/s" in price.wall_line()
    forced = run_price.price_of(tiny_setup("--model.autocast=bf16", time_bf16=True), rate=1e9)   # set, timed for the price
    assert forced.matmul_flops_per_s == 3e9 and forced.numerics.startswith("bf16 autocast (model.autocast = bf16; bf16 3.00x")


def test_bf16_set_where_it_is_slower_is_kept_and_priced_at_its_rate(monkeypatch):
    """model.autocast = bf16 on a machine where bf16 products are 3x slower (a CPU without native
    bf16): the run computes in bf16 as set, its price says so and runs the wall estimate at a third of
    the fp32 rate; off is never timed."""
    monkeypatch.setattr(numerics_mod, "autocast_timings", lambda device, *shape, **kw: (1e-3, 3e-3))
    setup = tiny_setup("--model.autocast=bf16", time_bf16=True)
    assert setup.numerics.bf16 and setup.numerics.matmul_speedup() == pytest.approx(1 / 3)
    price = run_price.price_of(setup, rate=3e9)
    assert price.numerics == ("bf16 autocast (model.autocast = bf16; bf16 0.33x fp32 here, 3 ms against 1 ms for "
                              "a 256 x 32 x 128 product; slower than fp32 here)")
    assert price.matmul_flops_per_s == pytest.approx(1e9) and price.matmul_kind == "bf16 autocast"
    assert price.wall_seconds_estimate == pytest.approx(price.flops_per_run / 1e9)

    def never(*a, **kw):
        raise AssertionError("timed although model.autocast = off, or bf16 outside a fresh run's price")

    monkeypatch.setattr(numerics_mod, "autocast_timings", never)
    assert not tiny_setup("--model.autocast=off", time_bf16=True).numerics.bf16
    kept = tiny_setup("--model.autocast=bf16")           # an actor, `rlvr eval`: the decision as given
    assert kept.numerics.bf16 and kept.numerics.matmul_speedup() == 1.0


def test_the_measurement_excludes_first_call_costs(monkeypatch):
    """A product whose first call in each numerics costs 30 ms (a kernel's choice, the first cast)
    and then nothing measurable: both timings are the warm cost, not the first call's, so the ratio
    does not depend on which numerics happened to be called first."""
    monkeypatch.setattr(numerics_mod, "_AUTOCAST_TIMINGS", {})
    real, first = torch.nn.functional.linear, set()

    def linear(x, w):
        mode = torch.is_autocast_enabled("cpu")
        if mode not in first:
            first.add(mode)
            time.sleep(0.03)
        return real(x, w)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    fp32_s, bf16_s = real_autocast_timings(CPU, 16, 8, 8)
    assert first == {False, True}
    assert fp32_s < 3e-3 and bf16_s < 3e-3


def test_the_measurement_returns_both_times_once_per_process(monkeypatch):
    monkeypatch.setattr(numerics_mod, "_AUTOCAST_TIMINGS", {})
    fp32_s, bf16_s = real_autocast_timings(CPU, 16, 8, 8, budget_s=0.05)
    assert 0 < fp32_s < math.inf and 0 < bf16_s < math.inf
    assert real_autocast_timings(CPU, 16, 8, 8, budget_s=0.05) == (fp32_s, bf16_s)   # cached


def test_the_keys_are_in_help_and_bad_values_are_refused():
    text = config_mod.help_text()
    for key in ("--model.autocast='auto'", "--algorithm.logp_old='auto'", "--algorithm.is_cap=2.0"):
        assert key in text
    with pytest.raises(config_mod.ConfigError, match="model.autocast = 'fp16'.*must be one of 'auto', 'bf16', 'off'"):
        config_mod.load(EXAMPLE, ["--model.autocast=fp16"])
    with pytest.raises(config_mod.ConfigError, match="algorithm.logp_old = 'trainer'"):
        config_mod.load(EXAMPLE, ["--algorithm.logp_old=trainer"])
    with pytest.raises(config_mod.ConfigError, match=r"algorithm.is_cap: must be >= 1.*got 0.5 \(command line\)"):
        config_mod.load(EXAMPLE, ["--algorithm.is_cap=0.5"])


# ----------------------------------------------------------------------------------- autocast reaches the forwards


@pytest.mark.parametrize("family", ["builtin", "llama"])
@pytest.mark.parametrize("mode,dtype", [("bf16", torch.bfloat16), ("off", torch.float32)])
def test_autocast_reaches_sampling_and_the_training_forward(request, family, mode, dtype):
    extra = [f"--model.autocast={mode}"]
    if family == "llama":
        llama = request.getfixturevalue("llama_dir")
        extra += [f"--model.path={llama}", "--model.share_prompt_forward=true"]
    cfg = config_mod.load(EXAMPLE, [x for x in TINY if family == "builtin" or not x.startswith("--model.n_")] + extra)
    setup = build_mod.build(cfg, log=lambda *_: None)
    linear = next(m for m in setup.model.modules() if isinstance(m, torch.nn.Linear))
    seen: list[torch.dtype] = []
    linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))

    batch = sample(setup)
    assert seen and set(seen) == {dtype}                          # every sampling forward
    assert batch.rollout.logp.dtype == torch.float32              # the log-softmax in float32
    seen.clear()
    stats = learn(new_learner(setup), batch)
    assert seen and set(seen) == {dtype}                          # the training forward
    assert all(p.dtype == torch.float32 for p in setup.model.parameters())   # master weights stay fp32
    assert math.isfinite(stats["loss"])


def test_evaluation_samples_under_the_numerics_it_is_given():
    setup = tiny_setup("--model.autocast=bf16")
    from rlvr.evaluate import evaluate

    seen: list[torch.dtype] = []
    setup.model.blocks[0].mlp.c_fc.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    kw = dict(reward_weights=setup.reward_weights, limits=setup.limits, prompts=4, pass_k=2, pass_k_prompts=2)
    evaluate(setup.model, setup.tokenizer, setup.task, autocast=setup.numerics.context, **kw)
    assert seen and set(seen) == {torch.bfloat16}
    seen.clear()
    evaluate(setup.model, setup.tokenizer, setup.task, **kw)      # `rlvr eval`: fp32
    assert set(seen) == {torch.float32}


# ----------------------------------------------------------------------------------- logp_old = recompute


@pytest.mark.parametrize("family", ["builtin", "llama"])
def test_recompute_gives_the_training_forwards_logp_old_and_a_first_ratio_of_exactly_1(request, family):
    # top_entropy_quantile: the rollout stage's forward gives logp_old (Δ needs its entropies first)
    extra = ["--model.autocast=bf16", "--algorithm.logp_old=recompute", "--algorithm.top_entropy_quantile=0.5"]
    if family == "llama":
        extra += [f"--model.path={request.getfixturevalue('llama_dir')}", "--model.share_prompt_forward=true"]
    cfg = config_mod.load(EXAMPLE, [x for x in TINY if family == "builtin" or not x.startswith("--model.n_")] + extra)
    setup = build_mod.build(cfg, log=lambda *_: None)
    batch = sample(setup)
    assert torch.equal(batch.logp_old, training_forward_logp(setup, batch.rollout))    # bit for bit
    assert batch.logp_old_version == 0
    assert batch.delta_tokens.shape == batch.rollout.mask.shape
    assert "sampler_logp_absdiff" in batch.stats and "sampler_is_weight_mean" in batch.stats
    stats = learn(new_learner(setup), batch)
    assert stats["first_step_ratio_mean"] == 1.0                  # exactly, not up to rounding
    assert "sampler_logp_absdiff" not in stats                    # the rollout stage reported it


def test_recompute_runs_the_learners_forward_on_the_learners_parts(monkeypatch):
    """train.micro_batches = 2 (P = G = 4): logp_old comes from two forwards, each over one of the
    learner's parts (whole groups, in order), with gradient enabled and the policy in training mode
    as the learner's forward (a no-gradient forward takes other products; on SmolLM2 under CPU bf16
    those give other numbers), so the first ratio is exactly 1 with micro-batches too."""
    seen = []
    real = scoring.sequence_token_logprobs

    def spy(model, roll, **kw):
        seen.append((roll.ids.size(0), torch.is_grad_enabled(), model.training))
        return real(model, roll, **kw)

    setup = tiny_setup("--model.autocast=bf16", "--train.micro_batches=2",     # logp_old = auto: recompute,
                       "--algorithm.top_entropy_quantile=0.5")                  # in the rollout stage
    monkeypatch.setattr(scoring, "sequence_token_logprobs", spy)
    batch = sample(setup)
    assert seen == [(8, True, True), (8, True, True)] and batch.logp_old_version == 0
    for part in (torch.arange(8), torch.arange(8, 16)):
        torch.testing.assert_close(batch.logp_old[part], training_forward_logp(setup, batch.rollout.select(part)),
                                   rtol=0, atol=0)
    seen.clear()
    stats = learn(new_learner(setup), batch)
    assert [s[0] for s in seen] == [8, 8] and stats["first_step_ratio_mean"] == 1.0


def test_sampler_logp_absdiff_is_the_gap_between_sampler_and_trainer():
    """sampler: the first minibatch's mean |logp_sampler - logp_train| from the training forward the
    update runs anyway; recompute: the same over the batch, from its own forward."""
    sampler = ("--model.autocast=bf16", "--algorithm.logp_old=sampler")
    setup = tiny_setup(*sampler)
    plain = sample(setup)
    want = float((training_forward_logp(setup, plain.rollout) - plain.logp_old).abs()[plain.rollout.mask.bool()].mean())
    assert learn(new_learner(tiny_setup(*sampler)), plain)["sampler_logp_absdiff"] == pytest.approx(want, abs=1e-7)
    # an engine 0.25 lower on every token: the gap is 0.25 (+ whatever the two passes differ by here)
    setup = tiny_setup(*sampler)
    lowered = sample(setup, sampler=lower_engine(setup, 0.25))
    train = training_forward_logp(setup, lowered.rollout)
    want = float((train - lowered.logp_old).abs()[lowered.rollout.mask.bool()].mean())
    assert want == pytest.approx(0.25, abs=1e-3)
    assert learn(new_learner(setup), lowered)["sampler_logp_absdiff"] == pytest.approx(want, rel=1e-5)
    # recompute in the rollout stage (top_entropy_quantile), from the learner's first forward (one
    # minibatch), and from the learner's forwards before the first update (two)
    for extra in (["--algorithm.top_entropy_quantile=0.99"], ["--train.minibatches=1"], ["--train.minibatches=2"]):
        setup = tiny_setup("--model.autocast=bf16", "--algorithm.logp_old=recompute", *extra)
        again = sample(setup, sampler=lower_engine(setup, 0.25))
        in_rollout = not again.logp_old_pending
        assert in_rollout is (extra[0].startswith("--algorithm"))
        got = again.stats if in_rollout else learn(new_learner(setup), again)
        assert got["sampler_logp_absdiff"] == pytest.approx(want, rel=1e-5)
        # π_train / π_sampler = e^0.25 = 1.284 on every token, under the cap of 2
        assert got["sampler_is_weight_mean"] == pytest.approx(math.exp(0.25), rel=1e-3)
        assert got["sampler_is_truncated_frac"] == 0.0


def test_the_is_weight_folds_into_delta_by_hand(monkeypatch):
    """One row of three tokens, Δ = 1: the sampler gave them 0.1, 0.4, 0.5, the training forward gives
    0.3, 0.2, 0.5; the third is past the end of the response (mask 0). w = min(π_train / π_sampler, 2)
    = min(3, 2), 0.5: Δ per token 2, 0.5, 0; logp_old becomes the trainer's. At ratio 1 the token_mean
    loss is -(2 + 0.5) / 2 = -1.25, where the sampler's logp_old would give ratio 3 and 0.5, clipped to
    1.2 and 0.8: -(1.2 + 0.5) / 2 = -0.85."""
    sampler_p, train_p = torch.tensor([[0.1, 0.4, 0.5]]), torch.tensor([[0.3, 0.2, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    roll = sampling.Rollout(ids=torch.tensor([[5, 1, 2, 3]]), attention_mask=torch.tensor([[1, 1, 1, 0]]),
                            prompt_len=1, mask=mask, logp=sampler_p.log() * mask, truncated=torch.tensor([False]))
    groups = Groups(examples=[None], rollout=roll, responses=["ab"], rewards=torch.ones(1, 1),
                    hits=torch.zeros(1, 1, dtype=torch.bool), per_reward={}, failures=0, status_counts={}, errors=[])
    batch = Batch(groups, [groups], delta=torch.ones(1, 1), logp_old=roll.logp, logp_ref=None, version=0)
    cfg = config_mod.load(EXAMPLE, TINY + ["--algorithm.logp_old=recompute", "--algorithm.is_cap=2",
                                           "--train.samples_per_prompt=1", "--algorithm.scheme=raw"])
    calls = []

    def train_forward(model, rollout, **kw):
        calls.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled(), model.training))
        return train_p.log() * mask

    monkeypatch.setattr(scoring, "sequence_token_logprobs", train_forward)
    setup = SimpleNamespace(cfg=cfg, numerics=numerics_mod.Numerics(True, "bf16", "cpu"))
    policy = SimpleNamespace(training=False)
    policy.train = lambda mode=True: setattr(policy, "training", mode)
    got = recompute_logp_old(setup, policy, batch, policy_version=0)
    # one forward, under the training numerics, with gradient and in training mode as the learner's
    assert calls == [(True, True, True)] and not policy.training   # the mode it had, back
    torch.testing.assert_close(got.delta_tokens, torch.tensor([[2.0, 0.5, 0.0]]))
    torch.testing.assert_close(got.logp_old, train_p.log() * mask)
    assert got.stats["sampler_is_truncated_frac"] == 0.5 and got.stats["sampler_is_weight_max"] == 2.0
    assert got.stats["sampler_logp_absdiff"] == pytest.approx((math.log(3) + math.log(2)) / 2, rel=1e-6)
    assert got.stats["sampler_behav_ratio_max"] == pytest.approx(3.0, rel=1e-6)
    loss, _ = losses.policy_loss(got.logp_old, got.logp_old, got.delta_rows, mask, agg="token_mean")
    assert float(loss) == pytest.approx(-1.25, rel=1e-6)
    loss, _ = losses.policy_loss(got.logp_old, batch.logp_old, batch.delta_rows, mask, agg="token_mean")
    assert float(loss) == pytest.approx(-0.85, rel=1e-6)


def test_the_option_reaches_the_update():
    """bf16, an engine 0.25 lower on every token: with `sampler` the first ratio is e^0.25 = 1.28, past
    the clip of 1.2, so the tokens with Δ > 0 give no gradient; with `recompute` the ratio is 1 and
    every token's Δ is weighted by 1.28. One update apart, the weights differ."""
    after = {}
    for mode in ("sampler", "recompute", "auto"):     # auto: recompute, the forwards being bf16
        setup = tiny_setup("--model.autocast=bf16", f"--algorithm.logp_old={mode}")
        batch = sample(setup, sampler=lower_engine(setup, 0.25))
        stats = learn(new_learner(setup), batch)
        after[mode] = torch.cat([p.detach().reshape(-1) for p in setup.model.parameters()])
        assert stats["first_step_ratio_mean"] == (pytest.approx(math.exp(0.25), rel=1e-3) if mode == "sampler" else 1.0)
        assert (stats["clip_frac_high"] > 0) is (mode == "sampler")
    assert (after["sampler"] - after["recompute"]).abs().max() > 1e-3
    assert torch.equal(after["auto"], after["recompute"])


@pytest.mark.parametrize("asked, bf16, path, dtype, want", [
    ("auto", True, "", "fp32", "recompute"),         # bf16 autocast (set, or auto choosing it)
    ("auto", False, "", "fp32", "sampler"),          # fp32: the sampler's log-probs are the trainer's
    ("auto", False, "m", "bf16", "recompute"),       # a Hugging Face model with bf16 weights
    ("auto", False, "", "bf16", "sampler"),          # model.dtype is for Hugging Face models only
    ("sampler", True, "", "fp32", "sampler"),        # as set, whatever the numerics
    ("recompute", False, "", "fp32", "recompute"),
])
def test_auto_recomputes_logp_old_where_the_forwards_run_in_bf16(asked, bf16, path, dtype, want):
    cfg = config_mod.load(EXAMPLE, TINY + [f"--algorithm.logp_old={asked}"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path, dtype=dtype))
    numerics = numerics_mod.Numerics(bf16, "bf16" if bf16 else "off", "cpu")
    assert setup_types.logp_old_source(cfg, numerics) == want
    note = setup_types.logp_old_note(cfg, numerics)                   # the price's word on auto's choice
    if asked == "auto":
        assert note.startswith("algorithm.logp_old = auto: ") and ("bf16" in note) is (want == "recompute")
    else:
        assert note == ""


@pytest.mark.parametrize("autocast", ["bf16", "off"])
def test_the_default_logp_old_reaches_the_update_and_the_price(autocast):
    """`auto`, the default: under bf16 (train.minibatches = 1) the batch leaves the rollout stage with
    the sampler's log-probs and no extra forward, the learner's first forward gives logp_old (ratio
    exactly 1) and the sampler's gap, and the price says so; with two minibatches the learner's
    forwards before the first update give the second minibatch's rows and the price counts half a
    forward. In fp32 the sampler's own log-probs are kept."""
    setup = tiny_setup(f"--model.autocast={autocast}")
    assert setup.cfg.algorithm.logp_old == "auto"
    batch = sample(setup)
    sampled = batch.cost["forward_tokens"]
    price = run_price.price_of(setup, rate=1e9, decode_s=1e-3)
    assert torch.equal(batch.logp_old, batch.rollout.logp) and batch.logp_old_version is None
    assert batch.logp_old_pending is (autocast == "bf16") and price.forward_tokens_logp_old_per_batch == 0
    stats = learn(new_learner(setup), batch)
    assert stats["first_step_ratio_mean"] == (1.0 if autocast == "bf16" else pytest.approx(1.0, abs=1e-5))
    assert ("sampler_is_weight_mean" in stats) is (autocast == "bf16") and "sampler_logp_absdiff" in stats
    if autocast == "bf16":
        assert price.logp_old_from_learner and not price.logp_old_recomputed
        assert ("logp_old 0 (the learner's first forward, detached; algorithm.logp_old = auto: the forwards run "
                "in bf16") in price.lines()[2]
        two = tiny_setup("--model.autocast=bf16", "--train.minibatches=2")
        again, price2 = sample(two), run_price.price_of(two, rate=1e9, decode_s=1e-3)
        assert again.logp_old_pending and again.cost["forward_tokens"] == sampled    # none in the rollout stage
        full = costs.logp_forward_tokens(16, 4, price.prompt_tokens, price.max_new_tokens,
                                         shared_prompt=run_price.shares_prompt(two.cfg, two.model))
        assert price2.forward_tokens_logp_old_per_batch == full // 2 and not price2.logp_old_recomputed
        assert price2.logp_old_from_learner
        assert ("the learner's forwards at π_old, detached: the first minibatch's own, the others' over their "
                "own parts before the first update; algorithm.logp_old = auto: the forwards run in bf16") in \
            price2.lines()[2]
        got = learn(new_learner(two), again)
        assert got["logp_old_forward_tokens"] == full // 2 and got["first_step_ratio_mean"] == 1.0
    else:
        assert not price.logp_old_recomputed and not price.logp_old_from_learner
        assert "logp_old 0 (stored from the sampler; algorithm.logp_old = auto: fp32 forwards" in price.lines()[2]


@pytest.mark.parametrize("epochs", [1, 2])
def test_logp_old_from_the_learners_first_forward_is_the_rollout_stages_recompute(epochs):
    """An engine 0.25 lower on every token, recompute: logp_old and Δ·w taken from the learner's first
    forward (and kept for the second pass) make the same update, bit for bit, as the rollout stage's
    forward over the same rows (`recompute_logp_old`), with the same weight figures."""
    after, figures = [], []
    for deferred in (True, False):
        setup = tiny_setup("--model.autocast=bf16", "--algorithm.logp_old=recompute",
                           f"--train.epochs_per_batch={epochs}")
        batch = sample(setup, sampler=lower_engine(setup, 0.25))
        assert batch.logp_old_pending
        if not deferred:
            batch = recompute_logp_old(setup, setup.model, dataclasses.replace(batch, logp_old_pending=False), 0)
        stats = learn(new_learner(setup), batch)
        after.append(torch.cat([p.detach().reshape(-1) for p in setup.model.parameters()]))
        figures.append(stats if deferred else batch.stats)
        assert stats["first_step_ratio_mean"] == 1.0 and stats["optimizer_steps"] == epochs
    assert torch.equal(after[0], after[1])
    for key in ("sampler_is_weight_mean", "sampler_is_weight_max", "sampler_behav_ratio_min"):
        assert figures[0][key] == pytest.approx(figures[1][key], rel=1e-6)
    assert figures[0]["sampler_is_weight_mean"] == pytest.approx(math.exp(0.25), rel=1e-3)


@pytest.mark.parametrize("epochs", [1, 2])
def test_logp_old_of_later_minibatches_is_a_hand_made_forward_before_the_first_update(epochs):
    """train.minibatches = 2 (P = 4 groups of G = 4), an engine 0.25 lower, recompute: the learner's
    forwards give logp_old, minibatch 2's run before the first update. A plain loop makes the same
    update bit for bit: epoch 0's split drawn from a copy of the learner's generator, each
    minibatch's logp_old from a fresh training-mode forward with gradient at the initial weights,
    Δ per token = Δ · min(e^(logp_old - logp_sampler), 2) · mask, then learn on that batch."""
    after = []
    for hand in (False, True):
        setup = tiny_setup("--model.autocast=bf16", "--algorithm.logp_old=recompute", "--train.minibatches=2",
                           f"--train.epochs_per_batch={epochs}")
        batch = sample(setup, sampler=lower_engine(setup, 0.25))
        assert batch.logp_old_pending
        learner = new_learner(setup)
        if hand:
            gen = torch.Generator()
            gen.set_state(learner.generator.get_state())
            order = torch.randperm(4, generator=gen)
            logp_old, delta = batch.logp_old.clone(), torch.zeros_like(batch.logp_old)
            cfg, model = setup.cfg, setup.model
            model.train()
            for groups in order.chunk(2):
                rows = (groups[:, None] * 4 + torch.arange(4)).reshape(-1)
                with torch.enable_grad(), setup.numerics.context():
                    lp = scoring.sequence_token_logprobs(
                        model, batch.rollout.select(rows), temperature=cfg.sampling.temperature,
                        top_p=cfg.sampling.top_p,
                        group_size=cfg.train.samples_per_prompt if cfg.model.share_prompt_forward else None).detach()
                m = batch.rollout.mask[rows]
                w = torch.where(m.bool(), torch.exp(lp - batch.logp_old[rows]), torch.ones_like(lp)).clamp(max=2.0)
                logp_old[rows], delta[rows] = lp, batch.delta_rows[rows].unsqueeze(1) * w * m
            batch = dataclasses.replace(batch, logp_old=logp_old, delta_tokens=delta, logp_old_pending=False,
                                        logp_old_version=0)
        stats = learn(learner, batch)
        assert stats["optimizer_steps"] == 2 * epochs and stats["first_step_ratio_mean"] == 1.0
        assert (stats["logp_old_forward_tokens"] > 0) is not hand       # minibatch 2's forward, before any update
        after.append(torch.cat([p.detach().reshape(-1) for p in setup.model.parameters()]))
    assert torch.equal(after[0], after[1])


def _two_minibatches_at_lr_0(micro_batches: int, in_rollout: bool):
    """(setup, its sampled batch): bf16, two minibatches, lr 1e-30; logp_old left to the learner, or
    (`in_rollout`: top_entropy_quantile) computed by the rollout stage."""
    extra = ["--algorithm.top_entropy_quantile=0.999"] if in_rollout else []
    setup = tiny_setup("--model.autocast=bf16", "--train.minibatches=2", f"--train.micro_batches={micro_batches}",
                       "--train.lr=1e-30", *extra)
    batch = sample(setup)
    assert batch.logp_old_pending is not in_rollout
    return setup, batch


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_every_minibatchs_ratio_is_exactly_1_where_the_forward_depends_on_its_rows(monkeypatch, micro_batches):
    """A forward whose log-probs depend on which rows it computes together, and in what order (as
    bf16 products do on some CPUs: SmolLM2 on one with AMX gave 0.028 apart over 32 rows against
    64, and a part's padded lengths follow its rows; here a stand-in adds an offset computed from
    the rows' ids and order): with two minibatches and a learning rate too small to move a weight
    (1e-30), logp_old from each minibatch's own parts before the first update gives every
    minibatch of the first pass a ratio of exactly 1, minimum and maximum; from the rollout
    stage's forward (`top_entropy_quantile`, over the groups in order) they are off 1 unless its
    parts happen to be the learner's (single groups, with two micro-batches here)."""
    _row_count_dependent(monkeypatch)
    for in_rollout in (False, True):
        setup, batch = _two_minibatches_at_lr_0(micro_batches, in_rollout)
        stats = learn(new_learner(setup), batch)
        exact = stats["ratio_min"] == 1.0 == stats["ratio_max"]
        # two micro-batches of a 2-group minibatch are single groups, as the rollout stage's 4 parts are
        assert exact is (not in_rollout or micro_batches == 2), (in_rollout, stats["ratio_min"], stats["ratio_max"])


def _row_count_dependent(monkeypatch) -> None:
    """scoring.sequence_token_logprobs plus an offset computed from the rows' ids and order (the
    stand-in for bf16 products that depend on the rows computed together)."""
    real = scoring.sequence_token_logprobs

    def shifted(model, roll, **kw):
        out = real(model, roll, **kw)
        order = torch.arange(1, roll.ids.size(0) + 1, device=roll.ids.device)[:, None]
        shift = 1e-4 * float((roll.ids * order).sum() % 97 + 1)
        if isinstance(out, torch.Tensor):
            return out + shift
        return scoring.TokenLogprobs(out.logp + shift, None if out.logp_full is None else out.logp_full + shift,
                                      out.entropy)

    monkeypatch.setattr(scoring, "sequence_token_logprobs", shifted)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_each_ranks_minibatches_see_a_ratio_of_exactly_1_where_the_forward_depends_on_its_rows(monkeypatch,
                                                                                                micro_batches):
    """The two ranks of a learner group (Shard(r, 2), run one after the other in this process, the
    collectives standing in as each rank's own figures), two minibatches, the row-dependent stand-in
    and lr 1e-30: each rank computes logp_old of its own rows of minibatch 2 over the parts its update
    will take, so every minibatch on both ranks has a ratio of exactly 1, minimum and maximum; from
    the rollout stage's forward (top_entropy_quantile) it is off 1 unless that forward's parts are
    the ranks' (single groups, with two micro-batches here). Both ranks run as many
    forwards (they are collectives) and count the whole minibatch's tokens, as one process does."""
    from rlvr import learn as learn_mod
    from rlvr.distributed import learners as learners_mod

    monkeypatch.setattr(learners_mod, "_all_reduce", lambda x, op=None: x)
    _row_count_dependent(monkeypatch)
    real_forward, calls = learn_mod.training_forward, []
    monkeypatch.setattr(learn_mod, "training_forward", lambda *a: calls.append(1) or real_forward(*a))
    for in_rollout in (False, True):
        setup, batch = _two_minibatches_at_lr_0(micro_batches, in_rollout)
        one = learn(new_learner(setup), copy.deepcopy(batch))
        exact, forwards = [], []
        for rank in (0, 1):
            calls.clear()
            stats = learn(new_learner(setup), copy.deepcopy(batch), shard=learners_mod.Shard(rank, 2, setup.model))
            exact.append(stats["ratio_min"] == 1.0 == stats["ratio_max"])
            forwards.append(len(calls))
            assert stats["logp_old_forward_tokens"] == one["logp_old_forward_tokens"]
        assert forwards[0] == forwards[1] == 2 * micro_batches + (0 if in_rollout else micro_batches)
        # each rank's part of a minibatch is one group; the rollout stage's parts are too with two micro-batches
        assert all(exact) is (not in_rollout or micro_batches == 2), (in_rollout, exact)
        assert (one["logp_old_forward_tokens"] > 0) is not in_rollout


def test_a_rank_short_of_groups_runs_as_many_forwards_and_keeps_none_of_the_repeats(monkeypatch):
    """3 groups, two minibatches (2 and 1 groups), two ranks: rank 1 has no group of minibatch 2 and
    repeats one in its logp_old forwards without keeping it. Both ranks run as many forwards, and each
    fills only its own rows (the rows another rank owns keep the sampler's log-probs and Δ 0 until
    the ranks exchange them; here, without a group, each keeps its own)."""
    from rlvr import learn as learn_mod
    from rlvr.distributed import learners as learners_mod

    monkeypatch.setattr(learners_mod, "_all_reduce", lambda x, op=None: x)
    setup = tiny_setup("--model.autocast=bf16", "--train.minibatches=2", "--train.micro_batches=2")
    full, G = sample(setup), setup.cfg.train.samples_per_prompt
    kept = full.groups.select(torch.arange(3), G)
    delta = torch.linspace(-1.5, 1.5, 3 * G).view(3, G)   # no 0: every kept row's Δ·w is non-zero
    batch = Batch(kept, [kept], delta, full.logp_old[:3 * G], None, 0, logp_old_pending=True)
    real_prepass, seen = learn_mod.prepass_logp_old, {}

    def spy(learner, b, minibatches, delta_rows, keep, shard=None):
        n = real_prepass(learner, b, minibatches, delta_rows, keep, shard)
        seen[shard.rank] = (minibatches, keep["delta"].abs().sum(1) > 0)
        return n

    monkeypatch.setattr(learn_mod, "prepass_logp_old", spy)
    real_forward, calls = learn_mod.training_forward, []
    monkeypatch.setattr(learn_mod, "training_forward", lambda *a: calls.append(1) or real_forward(*a))
    forwards = []
    for rank in (0, 1):
        calls.clear()
        learn(new_learner(setup), copy.deepcopy(batch), shard=learners_mod.Shard(rank, 2, setup.model))
        forwards.append(len(calls))
    assert forwards[0] == forwards[1] == 2 * 2 + 2     # two minibatches' parts, then minibatch 2's logp_old
    (later,), filled = seen[0]
    assert later.numel() == G                          # minibatch 2: one group, rank 0's
    assert filled[later].any() and not seen[1][1][later].any()


@pytest.mark.parametrize("extra, want", [
    ([], True),
    (["--train.minibatches=2"], True),                       # minibatch 2's before the first update
    (["--train.minibatches=2", "--distributed.learners=2"], True),    # each rank its own rows
    (["--train.minibatches=1", "--distributed.learners=2"], True),
    (["--algorithm.top_entropy_quantile=0.5"], False),       # Δ needs the entropies before the update
    (["--algorithm.kl_coef=0.1", "--algorithm.kl_in=reward"], False),   # and the KL charged in the reward
    (["--algorithm.kl_coef=0.1"], True),
    (["--distributed.rollout_workers=1", "--distributed.max_staleness=1"], False),   # rows from older weights
    (["--train.epochs_per_batch=3", "--train.micro_batches=2"], True),
])
def test_where_the_learners_first_forward_gives_logp_old(extra, want):
    assert setup_types.logp_old_in_learn(config_mod.load(EXAMPLE, TINY + extra)) is want


def test_a_recomputed_stale_batch_is_not_corrected_twice():
    """Rows sampled ahead (version 3) and scored by the learner's weights (version 4) in the rollout
    stage: the staleness correction finds logp_old already at the learner's version and adds no
    second weight; a sampler-mode stale batch is corrected as before and reports no sampler gap."""
    setup = tiny_setup("--model.autocast=bf16", "--algorithm.logp_old=recompute")
    batch = rollout(setup, setup.model, None, lambda: list(setup.task.train[:4]), version=3,
                    generator=torch.Generator().manual_seed(0), policy_version=4)
    assert batch.logp_old_version == 4
    same, delta_rows, stats = staleness.correct(setup.model, batch, setup.cfg, 4, setup.numerics.context)
    assert same is batch and delta_rows is None and stats == {"staleness": 1.0}
    setup = tiny_setup("--model.autocast=bf16", "--algorithm.logp_old=sampler")
    batch = rollout(setup, setup.model, None, lambda: list(setup.task.train[:4]), version=3,
                    generator=torch.Generator().manual_seed(0))
    got, delta_rows, stats = staleness.correct(setup.model, batch, setup.cfg, 4, setup.numerics.context)
    assert got.logp_old_version == 4 and delta_rows is not None and stats["staleness"] == 1.0
    assert "sampler_logp_absdiff" not in learn(new_learner(setup), got, delta_rows=delta_rows)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_kl_in_reward_is_charged_on_the_recomputed_logp_under_recompute(top_p):
    """kl_in = reward, the reference = the policy itself, and a sampling engine 0.25 lower on every
    token (its nucleus and no-nucleus log-probs both): with logp_old = sampler the KL folded into Δ is
    charged on the engine's log-probs, -0.25 a token; with logp_old = recompute on the training
    forward's (the numerics logp_ref is computed in), so it is 0 exactly and Δ per token is the
    plain Δ times the IS weight e^0.25."""
    def lowered(setup):
        inner = lower_engine(setup, 0.25)

        def sampler(examples):
            got = inner(examples)
            roll = got.rollout
            if roll.logp_full is not None:
                roll = dataclasses.replace(roll, logp_full=roll.logp_full - 0.25 * roll.mask)
            return dataclasses.replace(got, rollout=roll)
        return sampler

    got = {}
    for mode in ("sampler", "recompute"):
        setup = tiny_setup("--model.autocast=bf16", "--algorithm.kl_coef=0.5", "--algorithm.kl_in=reward",
                           f"--sampling.top_p={top_p}", f"--algorithm.logp_old={mode}")
        got[mode] = rollout(setup, setup.model, setup.model, lambda: list(setup.task.train[:4]), version=0,
                            generator=torch.Generator().manual_seed(0), sampler=lowered(setup))
    smp, rec = got["sampler"], got["recompute"]
    mask = rec.rollout.mask
    assert (top_p < 1) == (rec.rollout.logp_full is not None)
    assert torch.equal(rec.rollout.ids, smp.rollout.ids)
    assert smp.stats["kl_in_reward"] == pytest.approx(-0.25 * float(mask.sum(1).mean()), rel=1e-4)
    assert rec.stats["kl_in_reward"] == 0.0
    torch.testing.assert_close(rec.delta_tokens, rec.delta.reshape(-1, 1) * math.exp(0.25) * mask, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(smp.delta_tokens, smp.delta.reshape(-1, 1) * mask)   # the KL reached Δ there


# ----------------------------------------------------------------------------------- the price and a real run


def test_the_price_counts_the_recompute_forward():
    base = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=3, prompt_tokens=4, steps=10,
                epochs_per_batch=2, minibatches=2, n_params=1000, has_reference=True,
                flops_fwd_per_token=10.0, flops_train_per_token=30.0)
    plain, again = pricing.price(**base), pricing.price(**base, recompute_logp_old=True)
    assert plain.forward_tokens_logp_old_per_batch == 0
    assert again.forward_tokens_logp_old_per_batch == 16 * (4 + 3 - 1)    # every row, prompt + response, like logp_ref
    assert again.flops_logp_old_per_batch == 96 * 10.0
    assert again.forward_tokens_per_run == plain.forward_tokens_per_run + 10 * 96
    assert again.flops_per_run == plain.flops_per_run + 10 * 96 * 10.0
    assert "logp_old 96 (960 FLOP, recomputed under the training numerics)" in again.lines()[2]
    assert "logp_old 0 (stored from the sampler)" in plain.lines()[2]


def record_eval_autocast(monkeypatch, module=None) -> list[bool]:
    """A list that gets, per sampling call through `module.sample_and_score` (default: the
    evaluation's), whether it ran under CPU autocast."""
    from rlvr import evaluate as evaluate_mod

    module = module or evaluate_mod
    seen: list[bool] = []
    original = module.sample_and_score

    def recording(*a, autocast, **kw):
        with autocast():
            seen.append(torch.is_autocast_enabled("cpu"))
        return original(*a, autocast=autocast, **kw)

    monkeypatch.setattr(module, "sample_and_score", recording)
    return seen


@pytest.mark.parametrize("minibatches", [1, 2])
def test_train_with_bf16_and_recompute_from_the_command_line(tmp_path, monkeypatch, minibatches):
    """One minibatch: the learner's first forward gives logp_old (no forward priced); two: the first
    minibatch's forward and, before the first update, the second's (half a forward, priced). Both log
    the sampler's gap and the weight."""
    from rlvr import cli

    eval_autocast = record_eval_autocast(monkeypatch)
    out = tmp_path / "run"
    rc = cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--train.steps=2", "--model.autocast=bf16",
                   "--algorithm.logp_old=recompute", f"--train.minibatches={minibatches}"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/reward" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["train/sampler_logp_absdiff"] >= 0 and r["train/sampler_is_weight_mean"] > 0
        assert r["train/first_step_ratio_mean"] == 1.0
    assert eval_autocast and all(eval_autocast)                 # evaluation sampled under bf16 too
    price = json.loads((out / "price.json").read_text())
    assert price["numerics"] == ("bf16 autocast (model.autocast = bf16; bf16 1.00x fp32 here, 1 ms against "
                                 "1 ms for a 256 x 32 x 128 product)")   # the suite's stand-in timings: equal
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cost/forward_tokens"] == summary["price"]["forward_tokens_per_run"]   # the extra forward, priced
    assert (price["forward_tokens_logp_old_per_batch"] > 0) is (minibatches == 2)
    assert price["logp_old_from_learner"] and not price["logp_old_recomputed"]


def test_the_actors_get_the_choice_not_the_question(monkeypatch):
    """Rollout workers and learner actors build their own copy of the run: under `auto` they get the
    trainer's decision, so none of them measures again and samples or learns in other numerics."""
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)
    setup = tiny_setup("--model.autocast=auto")
    assert resolved_numerics(setup.cfg, setup).model.autocast == "bf16"
    assert setup.cfg.model.autocast == "auto"                   # the run's own config is unchanged
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: False)
    setup = tiny_setup("--model.autocast=auto")
    assert resolved_numerics(setup.cfg, setup).model.autocast == "off"


def test_recompute_with_stale_rollout_workers(ray_local, tmp_path):
    """bf16 and recompute with a rollout worker sampling one step ahead: every batch is scored by the
    learner's weights in the rollout stage, so each first ratio is exactly 1 and the staleness
    correction adds no second forward or weight."""
    from rlvr import cli

    out = tmp_path / "run"
    assert cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--model.autocast=bf16",
                     "--algorithm.logp_old=recompute", "--distributed.rollout_workers=1",
                     "--distributed.max_staleness=1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/reward" in r]
    assert [r["train/staleness"] for r in steps] == [0.0, 1.0, 1.0]
    assert all(r["train/first_step_ratio_mean"] == 1.0 and "train/sampler_is_weight_mean" in r for r in steps)
    assert all("train/is_weight_mean" not in r for r in steps[1:])


def test_a_resumed_auto_run_keeps_the_numerics_it_started_with(tmp_path, monkeypatch):
    # the first start finds bf16 units and takes bf16; by the resume the run is on a machine without
    # them, yet the resumed run keeps bf16 (its price.json's decision), not a new decision
    from rlvr import cli

    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)
    out = tmp_path / "run"
    assert cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--train.steps=2", "--model.autocast=auto"]) == 0
    assert json.loads((out / "price.json").read_text())["numerics"].startswith("bf16 autocast")

    def never(*a, **kw):
        raise AssertionError("a resumed run decided or measured again")

    monkeypatch.setattr(numerics_mod, "native_bf16", never)
    monkeypatch.setattr(numerics_mod, "autocast_timings", never)
    assert cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--train.steps=3", "--model.autocast=auto",
                     "--resume"]) == 0
    assert json.loads((out / "price.json").read_text())["numerics"] == "bf16 autocast (model.autocast = bf16)"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3]


def test_rlvr_eval_samples_under_the_runs_recorded_numerics(tmp_path, monkeypatch, capsys):
    # an auto run that chose bf16 is evaluated under bf16 by `rlvr eval` without measuring again; a run
    # configured off is evaluated in fp32
    from rlvr import cli

    def never(*a, **kw):
        raise AssertionError("rlvr eval measured again")

    seen = record_eval_autocast(monkeypatch)
    for mode, want in (("auto", True), ("off", False)):
        out = tmp_path / mode
        monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)
        assert cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--train.steps=1",
                         f"--model.autocast={mode}"]) == 0
        monkeypatch.setattr(numerics_mod, "native_bf16", never)
        monkeypatch.setattr(numerics_mod, "autocast_timings", never)
        seen.clear()
        capsys.readouterr()
        assert cli.main(["eval", str(out), "--prompts", "4"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert seen and all(s == want for s in seen), mode
        assert res["eval/numerics"] == ("bf16 autocast (model.autocast = bf16)" if want else
                                        "fp32 (model.autocast = off)")


def test_rlvr_probe_samples_under_the_training_numerics(tmp_path, monkeypatch):
    """`rlvr probe` samples as training does: the initial model under model.autocast as resolved, a
    checkpoint under the decision its run recorded (as `rlvr eval`)."""
    from rlvr import groups, probe

    seen = record_eval_autocast(monkeypatch, groups)          # the probe imports it from rlvr.groups
    for mode, want in (("bf16", True), ("off", False)):
        seen.clear()
        res = probe.run_probe(config_mod.load(EXAMPLE, TINY + [f"--model.autocast={mode}"]), prompts=2, samples=2)
        assert seen == [want] and any("sampled under bf16 autocast" in n for n in res.notes) is want
    monkeypatch.setattr(numerics_mod, "native_bf16", lambda device: True)   # auto chooses bf16
    from rlvr import cli

    out = tmp_path / "run"
    assert cli.main(["train", str(EXAMPLE), "--out", str(out), *TINY, "--model.autocast=auto", "--train.steps=1",
                     "--eval.pass_k=0"]) == 0

    def never(*a, **kw):
        raise AssertionError("the probe decided again instead of reading the run's decision")

    monkeypatch.setattr(numerics_mod, "native_bf16", never)
    seen.clear()
    probe.run_probe(config_mod.load(EXAMPLE, TINY + ["--model.autocast=auto"]), prompts=2, samples=2, checkpoint=out)
    assert seen == [True]


def test_the_learners_logp_old_forwards_priced_by_hand():
    """One log-prob forward of the batch = 1,000 positions (P groups of equal size). The rollout
    stage's forward: all of it. From the learner: none with one minibatch; with M the groups after
    the first minibatch, which torch.chunk makes ceil(P / M) groups: P = 5, M = 2 -> 2 of 5 groups
    (400); P = 8, M = 3 -> 5 of 8 (625); P = 4, M = 4 -> 3 of 4 (750)."""
    f = costs.logp_old_forward_tokens
    assert f(1000, 5, 2, True, False) == 1000 and f(1000, 5, 1, False, True) == 0 and f(1000, 5, 2, False, False) == 0
    assert (f(1000, 5, 2, False, True), f(1000, 8, 3, False, True), f(1000, 4, 4, False, True)) == (400, 625, 750)
    for P, M in ((5, 2), (8, 3), (4, 4)):
        first = len(torch.arange(P).chunk(M)[0])
        assert f(1000, P, M, False, True) == 1000 * (P - first) // P
