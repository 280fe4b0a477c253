"""The price at an expected response length (sampling.expected_response_tokens): the truncated
geometric length model against exact enumeration and closed forms, and the price it gives."""

import itertools
import math

import pytest

import pricing
from rlvr import config, costs
from rlvr.config import ConfigError


def _lengths(survival):
    """{length: probability} of L in 1..cap from its survival P(L > t), t = 0..cap-1."""
    s = list(survival) + [0.0]
    return {t + 1: s[t] - s[t + 1] for t in range(len(survival))}


def test_the_length_model_has_the_given_mean_cut_at_the_cap():
    # cap 3, mean 1.75: 1 + q + q^2 = 1.75 -> q = 0.5; P(L > t) = 1, 0.5, 0.25
    assert costs.length_ratio(1.75, 3) == pytest.approx(0.5)
    assert costs.length_survival(1.75, 3) == pytest.approx([1.0, 0.5, 0.25])
    assert _lengths(costs.length_survival(1.75, 3)) == pytest.approx({1: 0.5, 2: 0.25, 3: 0.25})
    for mean, cap in ((87, 256), (90, 1024), (2, 3), (255.5, 256)):
        s = costs.length_survival(mean, cap)
        assert sum(s) == pytest.approx(mean, rel=1e-9)        # E[L] = sum_t P(L > t)
        assert sum(p * L for L, p in _lengths(s).items()) == pytest.approx(mean, rel=1e-9)
    assert costs.length_survival(256, 256) == [1.0] * 256     # at the cap: every response cut there
    assert costs.length_survival(1, 4) == [1.0, 0.0, 0.0, 0.0]  # one token each
    with pytest.raises(ValueError, match="mean length"):
        costs.length_ratio(5, 4)


def test_expected_longest_and_live_rows_against_enumeration():
    """E[longest of B rows] and the rows still decoding at each step, enumerated over every
    combination of B lengths."""
    s = costs.length_survival(1.75, 3)
    probs = _lengths(s)
    # by hand, 2 rows: P(max > 0) = 1, P(max > 1) = 1 - 0.5^2 = 0.75, P(max > 2) = 1 - 0.75^2 = 0.4375
    assert costs.expected_longest(s, 2) == pytest.approx(2.1875)
    for B in (1, 2, 3):
        combos = [(math.prod(probs[L] for L in ls), ls) for ls in itertools.product(probs, repeat=B)]
        assert costs.expected_longest(s, B) == pytest.approx(sum(p * max(ls) for p, ls in combos))
        for t in (1, 2):   # decode step t computes the rows with L > t ...
            live = sum(p * sum(L > t for L in ls) for p, ls in combos)
            running = sum(p * B * (max(ls) > t) for p, ls in combos)
            # ... dropped as soon as they end (compact = 0): B x P(L > t)
            assert costs.decode_rows_per_step(s, B, 0.0)[t - 1] == pytest.approx(live) == pytest.approx(B * s[t])
            # never dropped: all B rows while the loop still runs
            assert costs.decode_rows_per_step(s, B, None)[t - 1] == pytest.approx(running)


def test_finished_rows_wait_for_a_quarter_of_the_batch_before_they_leave():
    s = [1.0, 0.9, 0.8, 0.7, 0.5]                    # survival of some length model, cap 5
    # 100 rows: step 1 holds 100 (90 live: 10% finished), step 2 100 (20%), step 3 drops to the 70
    # live (30% >= 25%), step 4 holds 70 (50 live: 29% >= 25%) -> 50
    assert costs.decode_rows_per_step(s, 100, 0.25) == pytest.approx([100, 100, 70, 50])


def test_decode_split_is_the_line_through_two_measured_steps():
    assert costs.decode_split(0.16, 64, 0.04, 16) == pytest.approx((0.0, 0.0025))   # all per row
    assert costs.decode_split(0.16, 64, 0.10, 16) == pytest.approx((0.08, 0.00125))  # 80 ms + 1.25 ms a row
    assert costs.decode_split(0.16, 64, 0.20, 16) == pytest.approx((0.16, 0.0))      # noise: all fixed
    assert costs.decode_split(0.16, 64, 0.01, 16) == pytest.approx((0.0, 0.0025))    # never below 0 fixed
    assert costs.decode_split(0.16, 64) == (0.16, 0.0)                                # not measured: all fixed
    # at the cap every step computes all rows: the steps measured, T - 1 of them
    sec, steps, rows = costs.expected_decode_seconds([1.0] * 256, 64, 0.08, 0.00125, 0.25)
    assert (sec, steps, rows) == pytest.approx((255 * 0.16, 255, 255 * 64))


def test_learn_parts_run_to_their_longest_row_or_in_buckets_to_each_rows_length():
    s = costs.length_survival(1.75, 3)
    # 4 groups of 2 in 2 parts: each part the longest of its 4 rows, 1 + (1 - 0.5^4) + (1 - 0.75^4)
    assert costs.learn_part_widths(s, 4, 2, 2, False) == pytest.approx([1 + 0.9375 + 0.68359375] * 2)
    assert costs.learn_part_widths(s, 4, 2, 2, True) == pytest.approx([1.75, 1.75])   # buckets: the mean


BASE = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=3, prompt_tokens=4, steps=10,
            epochs_per_batch=2, minibatches=2, n_params=1000, has_reference=False, threads=2,
            matmul_flops_per_s=1e6, decode_step_s=0.5, learn_part_s=0.2, optimizer_step_s=0.05)


def test_price_at_one_token_a_response_by_hand():
    p = pricing.price(**BASE, expected_response_tokens=1)
    # every response 1 token (from the prefill): no decode step; sampling forward 4 x 4 = 16 tokens,
    # trained 2 epochs x 16 rows x (4 + 0) = 128: (16 x 2N + 128 x 6N) x 10 steps = 8,000,000 FLOP
    assert p.sampled_tokens_per_batch == 16 and p.flops_per_run == 8_000_000
    assert p.forward_tokens_sampling_per_batch == 16 and p.trained_tokens_per_batch == 128
    # the training FLOPs (7,680,000) leave the rate term (0.32 s left: the prefill); no decode;
    # 40 gradient steps x (1 part x 0.2 s x (4 + 1 - 1) / (4 + 3 - 1) + 0.05 s)
    assert p.wall_seconds_expected == pytest.approx(0.32 + 0.0 + 40 * (0.2 * 4 / 6 + 0.05))
    assert p.decode_steps_per_batch == 0 and p.learn_part_fraction == pytest.approx(4 / 6)
    assert p.logp_old_bytes == 16 * 3 * 4                                   # memory stays at the cap


def test_expected_wall_time_falls_with_the_expected_length_and_is_todays_at_the_cap():
    base = {**BASE, "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 256, "prompt_tokens": 60,
            "steps": 2, "epochs_per_batch": 1, "minibatches": 1, "micro_batches": 4, "n_params": 135_000_000,
            "matmul_flops_per_s": 1e11, "decode_step_s": 0.15, "learn_part_s": 8.0, "compact_finished": 0.25,
            "decode_small_step_s": 0.06, "decode_small_prompts": 2}
    today = pricing.price(**base)
    for same in (0, 256):
        p = pricing.price(**base, expected_response_tokens=same)
        assert p.to_dict() == today.to_dict()
    walls = [pricing.price(**base, expected_response_tokens=e).wall_seconds_expected for e in (255, 200, 87, 30, 5)]
    # a mean one token short of the cap keeps nearly every row to the cap: about today's figure
    assert walls[0] == pytest.approx(today.wall_seconds_expected, rel=1e-6) and all(a > b for a, b in zip(walls, walls[1:]))
    tokens = [pricing.price(**base, expected_response_tokens=e).sampled_tokens_per_batch for e in (200, 87)]
    assert tokens == [64 * 200, 64 * 87] and today.sampled_tokens_per_batch == 64 * 256
    # the decode by hand from its parts: 16 rows at 60 ms, 64 at 150 ms -> 30 ms + 1.875 ms a row
    p = pricing.price(**base, expected_response_tokens=87)
    s = costs.length_survival(87, 256)
    steps = costs.expected_longest(s, 64) - 1
    rows = sum(costs.decode_rows_per_step(s, 64, 0.25))
    assert (p.decode_fixed_s, p.decode_row_s) == pytest.approx((0.03, 0.001875))
    assert p.decode_steps_per_batch == pytest.approx(steps) and p.decode_rows_per_step == pytest.approx(rows / steps)
    decode_flops = 2 * 64 * 86 * p.flops_sampling_per_batch / p.forward_tokens_sampling_per_batch
    train_flops = 2 * p.flops_train_per_batch
    learn = 4 * 8.0 * (60 + costs.expected_longest(s, 16) - 1) / (60 + 255)
    assert p.wall_seconds_expected == pytest.approx(
        (p.flops_per_run - decode_flops - train_flops) / 1e11 + 2 * (0.03 * steps + 0.001875 * rows)
        + 2 * (learn + 0.05))


def test_price_lines_say_which_length_they_assume():
    cap = pricing.price(**BASE)
    assert "at the 3-token cap, with each of the 2 decode steps" in cap.wall_line()
    assert "(cap-based: at the 3-token cap)" in "\n".join(cap.lines())
    e = pricing.price(**BASE, expected_response_tokens=2)
    text = "\n".join(e.lines())
    assert "x an expected 2 tokens, sampling.expected_response_tokens, T<=3" in e.lines()[0]
    assert "(expectation-based: at an expected 2 tokens a response (sampling.expected_response_tokens; cap 3))" in text
    assert "decode steps per batch expected (until its longest response ends)" in e.wall_line()
    assert "each step, whatever its rows (no smaller step measured), at the measured 500 ms (16 rows)" in e.wall_line()
    split = pricing.price(**BASE, expected_response_tokens=2, decode_small_step_s=0.2, decode_small_prompts=1)
    # 16 rows at 500 ms, 4 at 200 ms: 100 ms + 25 ms a row
    assert ("each step at 100 ms + 25 ms a row, from the line through a step of 4 rows, 200 ms, and at the "
            "measured 500 ms (16 rows)") in split.wall_line()


def test_config_refuses_an_expected_length_beyond_the_bound(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[sampling]\nmax_new_tokens = 16\nexpected_response_tokens = 17\n")
    with pytest.raises(ConfigError, match=r"sampling\.expected_response_tokens: 17 exceeds sampling\.max_new_tokens"):
        config.load(p)
    with pytest.raises(ConfigError, match=r"sampling\.expected_response_tokens: must be >= 0"):
        config.load(None, ["--sampling.expected_response_tokens=-1"])
    assert config.load(None, ["--sampling.expected_response_tokens=16",
                              "--sampling.max_new_tokens=16"]).sampling.expected_response_tokens == 16
    # against the task's own bound (sampling.max_new_tokens = 0)
    cfg = config.load(None, ["--sampling.expected_response_tokens=9"])
    with pytest.raises(ConfigError, match=r"sampling\.expected_response_tokens: 9 exceeds the response bound of 8"):
        config.check_against_task(cfg, train_prompts=100, prompt_tokens=4, max_new_tokens=8)


def test_price_of_measures_a_smaller_decode_step_at_an_expected_length(monkeypatch):
    from test_autocast import tiny_setup
    from rlvr import probes, run_price

    setup = tiny_setup()
    T = setup.limits.max_new_tokens
    P = setup.cfg.train.prompts_per_step
    calls = []
    monkeypatch.setattr(probes, "decode_step_seconds",
                        lambda setup, prompts=None: calls.append(prompts) or (0.1 if prompts is None else 0.04))
    cap = run_price.price_of(setup, rate=1e9, learn_s=(0.5, 0.01))
    assert calls == [None] and cap.expected_response_tokens == 0
    setup.cfg.sampling.expected_response_tokens = max(1, T // 2)
    calls.clear()
    e = run_price.price_of(setup, rate=1e9, learn_s=(0.5, 0.01))
    assert calls == [None, -(-P // 4)] and e.decode_small_prompts == -(-P // 4) and e.decode_small_step_s == 0.04
    assert e.expected_response_tokens == max(1, T // 2) and e.wall_seconds_expected < cap.wall_seconds_expected


def test_expected_buckets_cut_drawn_parts_as_the_learn_stage_does(monkeypatch):
    from rlvr import scoring

    # every row at the cap, or every row one token: one bucket of rows x that length
    assert costs.expected_buckets([1.0] * 8, 16) == (1.0, 128.0)
    assert costs.expected_buckets([1.0] + [0.0] * 7, 16) == (1.0, 16.0)
    # lengths 2 or 4, each with probability 1/2 (P(L > t) = 1, 1, 1/2, 1/2); a bucket per distinct
    # length (no call cost): two buckets unless all 16 rows drew one length (2 x 0.5^16), no padding,
    # so positions are the rows' lengths, 16 x 3 on average (their sum's deviation over 64 draws ~0.5)
    monkeypatch.setattr(scoring, "BUCKET_CALL_TOKENS", 0)
    buckets, positions = costs.expected_buckets([1.0, 1.0, 0.5, 0.5], 16)
    assert 1.9 < buckets <= 2.0 and positions == pytest.approx(48, abs=2.5)
    assert costs.expected_buckets([1.0, 1.0, 0.5, 0.5], 16) == (buckets, positions)   # seeded: the same draws
    # a call cost above the padding: one bucket at the longest row (4 unless all drew 2)
    monkeypatch.setattr(scoring, "BUCKET_CALL_TOKENS", 1000)
    monkeypatch.setattr(scoring, "PADDING_CAP", 1.0)
    assert costs.expected_buckets([1.0, 1.0, 0.5, 0.5], 16) == pytest.approx((1.0, 64.0), abs=1e-3)


def test_a_part_measured_at_the_expected_lengths_prices_the_learn_stage_there():
    base = {**BASE, "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 256, "prompt_tokens": 64,
            "steps": 2, "epochs_per_batch": 1, "minibatches": 1, "micro_batches": 4, "n_params": 135_000_000,
            "matmul_flops_per_s": 1e11, "decode_step_s": 0.15, "learn_part_s": 8.0, "compact_finished": 0.25,
            "length_buckets": True, "expected_response_tokens": 87, "shared_prompt": False}
    plain, measured = pricing.price(**base), pricing.price(**base, learn_expected_part_s=3.0)
    s = costs.length_survival(87, 256)
    buckets, positions = costs.expected_buckets(s, 16)            # 2 groups of 8 a part
    assert measured.learn_buckets_per_part == pytest.approx(buckets) and buckets > 2
    assert measured.learn_part_tokens == pytest.approx(positions / 16)   # the buckets' padding counted
    # not measured: the 8 s part at T in proportion to a row's positions (its prompt + columns - 1)
    share = (64 + positions / 16 - 1) / (64 + 255)
    assert plain.learn_part_fraction == pytest.approx(4 * share) and plain.learn_expected_part_s == 0.0
    # measured: each of the 4 parts a step takes the 3 s part at the expected lengths
    assert measured.learn_part_fraction == pytest.approx(4 * 3.0 / 8.0) and measured.learn_expected_part_s == 3.0
    assert measured.wall_seconds_expected - plain.wall_seconds_expected == pytest.approx(2 * 4 * (3.0 - 8.0 * share))
    assert "(a part at the expected lengths measured at 3,000 ms)" in measured.wall_line()
    assert "expected lengths measured" not in plain.wall_line()
    # at the cap (no expected length) the measured part at T prices the learn stage as before
    at_cap = {**base, "expected_response_tokens": 0}
    assert pricing.price(**at_cap, learn_expected_part_s=3.0).wall_seconds_expected == pytest.approx(
        pricing.price(**at_cap).wall_seconds_expected)


def test_a_part_at_the_expected_lengths_spreads_its_rows_over_the_length_models_quantiles():
    # P(L > t) = 1, 1, 1/2, 1/2 (lengths 2 or 4, mean 3); 4 rows at quantiles 1/8, 3/8, 5/8, 7/8:
    # 1 + the t >= 1 with survival[t] > u: 4, 4, 2, 2; dealt to 2 groups of 2 in turn: each group 4, 2
    assert costs.part_lengths([1.0, 1.0, 0.5, 0.5], 2, 2) == [4, 2, 4, 2]
    assert costs.part_lengths([1.0, 1.0, 0.5, 0.5], 1, 4) == [4, 4, 2, 2]
    assert costs.part_lengths([1.0] * 8, 2, 4) == [8] * 8                      # at the cap: every row at T
    # the geometric model at mean 87, cap 256: 16 rows whose mean is the model's to the quantiles'
    # resolution, the longest at the cap (P(L >= 256) = q^255 > 1/32), each group's lengths descending
    rows = costs.part_lengths(costs.length_survival(87, 256), 2, 8)
    assert abs(sum(rows) / 16 - 87) < 4 and max(rows) == 256 and min(rows) >= 1
    assert rows[:8] == sorted(rows[:8], reverse=True) and rows[8:] == sorted(rows[8:], reverse=True)


def test_a_decode_steps_cost_per_cached_column_is_priced_over_the_rows_and_their_columns():
    base = {**BASE, "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 256, "prompt_tokens": 64,
            "steps": 2, "epochs_per_batch": 1, "minibatches": 1, "micro_batches": 4, "n_params": 135_000_000,
            "matmul_flops_per_s": 1e11, "decode_step_s": 0.08, "learn_part_s": 8.0, "compact_finished": 0.0}
    # at the cap: 64 rows hold 1 ... 255 columns past the prompt over the 255 steps: 64 x 255 x 256 / 2
    at_cap, grown = pricing.price(**base), pricing.price(**base, decode_cell_s=2e-6)
    assert grown.wall_seconds_expected - at_cap.wall_seconds_expected == pytest.approx(2 * 2e-6 * 64 * 255 * 256 / 2)
    assert grown.decode_cell_s == 2e-6 and "+ 2 us a row for each column it has cached" in grown.wall_line()
    # at an expected length: the rows each step computes, times the columns they hold then
    at_e = {**base, "expected_response_tokens": 87}
    s = costs.length_survival(87, 256)
    cells = sum(n * t for t, n in enumerate(costs.decode_rows_per_step(s, 64, 0.0), start=1))
    assert costs.decode_row_columns(s, 64, 0.0) == pytest.approx(cells) and cells < 64 * 255 * 256 / 2
    assert (pricing.price(**at_e, decode_cell_s=2e-6).wall_seconds_expected
            - pricing.price(**at_e).wall_seconds_expected) == pytest.approx(2 * 2e-6 * cells)
