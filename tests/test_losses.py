"""Tests for rlvr.losses: worked examples, loop oracles, exact enumeration, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr import advantages
from rlvr.logprobs import (
    AUTO_CHUNK,
    auto_chunk_rows,
    chunk_setting,
    entropy_from_logits,
    exp_floor,
    resolve_chunk_rows,
    token_logprobs,
)
from rlvr.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    OBJECTIVES,
    aggregate,
    entropy_bonus,
    kl_estimate,
    kl_loss,
    policy_loss,
    sequence_logprob,
)

E = math.e


def _one_token(logp, logp_old, delta, **kw):
    """policy_loss on a single generated token (B = T = 1)."""
    t = lambda x: torch.tensor([[x]], dtype=torch.float64)
    logp = t(logp).requires_grad_()
    loss, stats = policy_loss(logp, t(logp_old), torch.tensor([delta], dtype=torch.float64), torch.ones(1, 1), **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.item(), stats


# --- tier 1: worked examples (torchtune style) -----------------------------------------------


def test_ratio_e_positive_delta_is_clipped_to_1_2():
    loss, grad, stats = _one_token(1.0, 0.0, 1.0)  # ratio e > 1.2, Δ > 0: clip active
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert stats["ratio_mean"] == pytest.approx(E)
    assert stats["clip_frac_high"] == 1.0 and stats["clip_frac_low"] == 0.0 and stats["clip_frac"] == 1.0


def test_ratio_e_negative_delta_is_not_clipped():
    loss, grad, stats = _one_token(1.0, 0.0, -1.0)  # min(-e, -1.2) = -e, so loss e, gradient flows
    assert loss == pytest.approx(E)
    assert grad == pytest.approx(E)  # d(e^x)/dx at x = 1
    assert stats["clip_frac"] == 0.0


def test_ratio_below_one_minus_eps():
    # Δ < 0, ratio 1/e < 0.8: min(-1/e, -0.8) = -0.8, clip active below, no gradient
    loss, grad, stats = _one_token(-1.0, 0.0, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0
    assert stats["clip_frac_low"] == 1.0 and stats["clip_frac_high"] == 0.0
    # Δ > 0, ratio 1/e: min(1/e, 0.8) = 1/e, unclipped, gradient -1/e
    loss, grad, stats = _one_token(-1.0, 0.0, 1.0)
    assert loss == pytest.approx(-1 / E) and grad == pytest.approx(-1 / E)
    assert stats["clip_frac"] == 0.0


def test_clip_eps_high_widens_only_the_upper_band():
    loss, grad, _ = _one_token(math.log(1.25), 0.0, 1.0, clip_eps=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25)  # inside [0.8, 1.28]
    loss, _, _ = _one_token(1.0, 0.0, 1.0, clip_eps=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.28)
    loss, _, _ = _one_token(-1.0, 0.0, -1.0, clip_eps=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(0.8)  # the lower bound still uses clip_eps


def test_stats_worked_example():
    logp_old = torch.zeros(2, 3)
    logp = torch.tensor([[1.0, 0.0, -1.0], [0.1, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    delta = torch.tensor([-1.0, 1.0])
    _, s = policy_loss(logp, logp_old, delta, mask)
    # generated tokens: ratios e, 1, 1/e (Δ=-1) and e^0.1 (Δ=+1); padding (ratio e^5) is ignored
    r = [E, 1.0, 1 / E, math.exp(0.1)]
    assert s["clip_frac_low"] == pytest.approx(0.25)  # 1/e with Δ < 0
    assert s["clip_frac_high"] == 0.0  # e is above 1.2 but Δ < 0 there; e^0.1 is inside
    assert s["clip_frac"] == pytest.approx(0.25)
    assert s["ratio_max"] == pytest.approx(E) and s["ratio_min"] == pytest.approx(1 / E)
    assert s["ratio_mean"] == pytest.approx(sum(r) / 4)
    assert s["approx_kl_old"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 4)
    assert all(isinstance(v, float) for v in s.values())


def test_aggregations_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "seq_sum_mean").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(values, mask, "seq_mean_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq_sum_const", max_len=5).item() == pytest.approx((6 + 4) / 2 / 5)


def test_empty_rows_and_empty_batch_give_no_nan():
    values = torch.tensor([[1.0, 2.0], [float("nan"), float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    for mode in AGGREGATIONS:
        out = aggregate(values, mask, mode, max_len=4)
        (grad,) = torch.autograd.grad(out, values)
        assert torch.isfinite(out), mode
        assert torch.isfinite(grad).all() and (grad[1] == 0).all(), mode
    # the empty row counts as 0 in the mean over B rows
    assert aggregate(values, mask, "seq_mean_mean").item() == pytest.approx(1.5 / 2)
    none = torch.zeros(2, 2)
    for mode in AGGREGATIONS:
        assert aggregate(values, none, mode, max_len=4).item() == 0.0
    loss, stats = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2), none)
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in stats.values())


def test_padding_with_inf_logprobs_does_not_poison_loss_or_gradient():
    logp = torch.tensor([[-0.5, -float("inf")], [-1.0, -2.0]], requires_grad=True)
    logp_old = torch.tensor([[-0.4, 0.0], [-1.0, -float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    for level in ("token", "sequence"):
        loss, stats = policy_loss(logp, logp_old, torch.tensor([1.0, -1.0]), mask, level=level)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), level
        assert all(math.isfinite(v) for v in stats.values())
    for est in KL_ESTIMATORS:
        kl = kl_loss(logp, logp_old, mask, est)
        (grad,) = torch.autograd.grad(kl, logp)
        assert torch.isfinite(kl) and torch.isfinite(grad).all(), est


def test_sequence_logprob_masks_prompt_and_padding():
    logp = torch.tensor([[-1.0, -2.0, -float("inf")], [-0.5, -0.25, -4.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert torch.equal(sequence_logprob(logp, mask), torch.tensor([-3.0, -4.25]))


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]]])  # (1, 2, 4)
    ids = torch.tensor([[2, 0]])
    expected = torch.tensor([[math.log(1 / 4), math.log(3 / 6)]])
    assert torch.allclose(token_logprobs(logits, ids), expected)
    assert torch.allclose(token_logprobs(logits, ids, chunk_rows=1), expected)
    # temperature 2 on logits [2 ln 3, 0, 0, 0] is the distribution (3, 1, 1, 1)/6
    hot = torch.tensor([[[2 * math.log(3.0), 0.0, 0.0, 0.0]]])
    assert torch.allclose(token_logprobs(hot, torch.tensor([[0]]), temperature=2.0), torch.tensor([[math.log(0.5)]]))


def test_gspo_sequence_ratio_by_hand():
    # row 0: token log-ratios 0.15 and 0.05 -> s = exp(0.1) (inside the band; padding 9.0 ignored);
    # row 1: one token, log-ratio 1 -> s = e, clipped to 1.2
    logp = torch.tensor([[0.15, 0.05, 9.0], [1.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    delta = torch.tensor([1.0, 1.0])
    loss, stats = policy_loss(logp, torch.zeros(2, 3), delta, mask, level="sequence", agg="seq_mean_mean")
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(-(s + 1.2) / 2)
    assert stats["ratio_max"] == pytest.approx(E) and stats["ratio_min"] == pytest.approx(s)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3)  # the one token of row 1, of 3 tokens
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp_t of -s/2 with s = exp(mean of the two log-ratios): -s/2 * 1/2 on each token
    assert torch.allclose(grad, torch.tensor([[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]]))


# --- tier 2: loop oracles --------------------------------------------------------------------


def oracle_aggregate(values, mask, mode, max_len=None):
    B, T = len(values), len(values[0])
    sums = [sum(values[b][t] for t in range(T) if mask[b][t]) for b in range(B)]
    counts = [sum(1 for t in range(T) if mask[b][t]) for b in range(B)]
    if mode == "seq_sum_mean":
        return sum(sums) / B
    if mode == "seq_mean_mean":
        return sum(s / c if c else 0.0 for s, c in zip(sums, counts)) / B
    if mode == "token_mean":
        return sum(sums) / sum(counts) if sum(counts) else 0.0
    if mode == "seq_sum_const":
        return sum(sums) / B / max_len


def oracle_policy_per_token(logp, logp_old, delta, mask, eps_low, eps_high, level):
    B, T = len(logp), len(logp[0])
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        toks = [t for t in range(T) if mask[b][t]]
        if level == "sequence":
            seq_ratio = math.exp(sum(logp[b][t] - logp_old[b][t] for t in toks) / len(toks)) if toks else 1.0
        for t in toks:
            ratio = seq_ratio if level == "sequence" else math.exp(logp[b][t] - logp_old[b][t])
            d = delta[b][t] if isinstance(delta[b], list) else delta[b]
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            per[b][t] = -min(ratio * d, clipped * d)
    return per


def _random_batch(g, B, T):
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    mask[0] = 0  # always one empty row
    return logp, logp_old, mask


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(list(AGGREGATIONS)),
    level=st.sampled_from(["token", "sequence"]),
    per_token_delta=st.booleans(),
    eps=st.sampled_from([(0.2, None), (0.1, 0.3), (0.25, 0.25)]),
)
def test_oracle_policy_loss_and_aggregations(B, T, seed, mode, level, per_token_delta, eps):
    g = torch.Generator().manual_seed(seed)
    logp, logp_old, mask = _random_batch(g, B, T)
    delta = torch.randn((B, T) if per_token_delta else (B,), generator=g, dtype=torch.float64)
    clip_eps, clip_eps_high = eps
    max_len = T + 2
    loss, stats = policy_loss(
        logp, logp_old, delta, mask,
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, level=level, agg=mode, max_len=max_len,
    )
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    per = oracle_policy_per_token(logp.tolist(), logp_old.tolist(), delta.tolist(), mask.tolist(), clip_eps, eps_high, level)
    want = oracle_aggregate(per, mask.tolist(), mode, max_len)
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    # the aggregation alone against its oracle, on arbitrary values
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    got = aggregate(values, mask, mode, max_len=max_len).item()
    assert got == pytest.approx(oracle_aggregate(values.tolist(), mask.tolist(), mode, max_len), rel=1e-9, abs=1e-12)
    # token-level clip fractions against a loop
    if level == "token" and mask.sum() > 0:
        low = high = n = 0
        for b in range(B):
            for t in range(T):
                if mask[b, t]:
                    r = math.exp(logp[b, t] - logp_old[b, t])
                    d = delta[b, t] if per_token_delta else delta[b]
                    n += 1
                    low += d < 0 and r < 1 - clip_eps
                    high += d > 0 and r > 1 + eps_high
        assert stats["clip_frac_low"] == pytest.approx(low / n)
        assert stats["clip_frac_high"] == pytest.approx(high / n)


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
@pytest.mark.parametrize("est", list(KL_ESTIMATORS))
def test_oracle_kl_loss(mode, est):
    g = torch.Generator().manual_seed(7)
    logp, logp_ref, mask = _random_batch(g, 4, 5)
    per = [[0.0] * 5 for _ in range(4)]
    for b in range(4):
        for t in range(5):
            x = logp[b, t].item() - logp_ref[b, t].item()
            per[b][t] = {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(-x) + x - 1}[est]
    want = oracle_aggregate(per, mask.tolist(), mode, 9)
    assert kl_loss(logp, logp_ref, mask, est, mode, max_len=9).item() == pytest.approx(want, rel=1e-9)
    assert torch.allclose(kl_estimate(logp, logp_ref, est), torch.tensor(per, dtype=torch.float64))


# --- tier 3: properties ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 7, 100])
def test_chunked_logprobs_match_plain_values_and_gradients(dtype, chunk_rows):
    g = torch.Generator().manual_seed(chunk_rows)
    logits = (3 * torch.randn(3, 4, 11, generator=g)).to(dtype).requires_grad_()
    ids = torch.randint(0, 11, (3, 4), generator=g)
    weights = torch.randn(3, 4, generator=g).to(dtype)
    for temperature in (1.0, 0.7):
        plain = token_logprobs(logits, ids, temperature=temperature)
        chunked = token_logprobs(logits, ids, temperature=temperature, chunk_rows=chunk_rows)
        assert plain.dtype == chunked.dtype == dtype and chunked.shape == (3, 4)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert torch.allclose(plain, chunked, atol=tol)
        (gp,) = torch.autograd.grad((plain * weights).sum(), logits)
        (gc,) = torch.autograd.grad((chunked * weights).sum(), logits)
        assert torch.allclose(gp, gc, atol=tol)


def test_chunked_logprobs_gradcheck_and_bf16():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, temperature=0.8, chunk_rows=4), (logits,))
    # bf16 logits: float32 log-probs, gradient back in bf16, same as the plain path
    lo = torch.randn(2, 3, 50, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 50, (2, 3), generator=g)
    a = token_logprobs(lo, ids)
    b = token_logprobs(lo, ids, chunk_rows=2)
    assert a.dtype == b.dtype == torch.float32 and torch.allclose(a, b, atol=1e-5)
    (ga,) = torch.autograd.grad(a.sum(), lo)
    (gb,) = torch.autograd.grad(b.sum(), lo)
    assert gb.dtype == torch.bfloat16 and torch.allclose(ga.float(), gb.float(), atol=1e-2)


def _categorical(seed, K=6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(K, generator=g, dtype=torch.float64, requires_grad=True)
    phi = torch.randn(K, generator=g, dtype=torch.float64)  # the frozen reference's logits
    return theta, phi


@pytest.mark.parametrize("seed", range(4))
def test_kl_estimators_values_by_enumeration(seed):
    """Each outcome of a K-way categorical is one 'token'; E_π[k] = Σ_a π(a) k(a), exactly."""
    theta, phi = _categorical(seed)
    logp = torch.log_softmax(theta, 0)[None, :]  # (1, K): every outcome as a token
    logp_ref = torch.log_softmax(phi, 0)[None, :]
    pi = logp.exp()
    kl = (pi * (logp - logp_ref)).sum()  # exact KL(π || π_ref)
    mean = {est: (pi * kl_estimate(logp, logp_ref, est)).sum() for est in KL_ESTIMATORS}
    assert torch.allclose(mean["k1"], kl, atol=1e-12)
    assert torch.allclose(mean["k3"], kl, atol=1e-12)
    assert torch.allclose(mean["k2"], 0.5 * (pi * (logp - logp_ref) ** 2).sum(), atol=1e-12)
    assert mean["k2"] >= 0 and not torch.allclose(mean["k2"], kl, atol=1e-3)  # biased
    assert (kl_estimate(logp, logp_ref, "k3") >= 0).all()  # k3 is >= 0 on every sample
    assert (kl_estimate(logp, logp_ref, "k1") < 0).any()  # k1 is not


@pytest.mark.parametrize("seed", range(4))
def test_kl_estimators_gradients_by_enumeration(seed):
    """Gradient of the loss as a training loop takes it (samples fixed, π(a) not differentiated),
    in expectation: k1 -> 0, k2 -> ∇KL(π||π_ref), k3 -> ∇KL(π_ref||π)."""
    theta, phi = _categorical(seed)
    logp = torch.log_softmax(theta, 0)
    logp_ref = torch.log_softmax(phi, 0)
    pi, pi_ref = logp.exp(), logp_ref.exp()
    (grad_reverse,) = torch.autograd.grad((pi * (logp - logp_ref)).sum(), theta, retain_graph=True)
    (grad_forward,) = torch.autograd.grad((pi_ref * (logp_ref - logp)).sum(), theta, retain_graph=True)
    expected_grad = {}
    for est in KL_ESTIMATORS:
        per_outcome = kl_estimate(logp[None, :], logp_ref[None, :], est)[0]  # (K,)
        (expected_grad[est],) = torch.autograd.grad((pi.detach() * per_outcome).sum(), theta, retain_graph=True)
    assert torch.allclose(expected_grad["k1"], torch.zeros_like(theta), atol=1e-12)
    assert torch.allclose(expected_grad["k2"], grad_reverse, atol=1e-12)
    assert torch.allclose(expected_grad["k3"], grad_forward, atol=1e-12)
    assert not torch.allclose(grad_forward, grad_reverse, atol=1e-3)  # the distinction is real


def test_kl_loss_does_not_differentiate_the_reference():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_ref = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    kl_loss(logp, logp_ref, torch.ones(1, 2)).backward()
    assert logp.grad is not None and logp_ref.grad is None


@pytest.mark.parametrize("mode", ["token_mean", "seq_sum_mean", "seq_mean_mean", "seq_sum_const"])
def test_loss_is_zero_but_it_learns(mode):
    """μ = 1: logp_old = logp.detach(), so ratio = 1 and, with centered Δ over equal-length rows,
    the loss is exactly -mean Δ = 0 — yet the gradient is -Δ ∇logp, not 0."""
    P, G, T, V = 2, 4, 3, 7
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(P * G, T, V, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (P * G, T), generator=g)
    mask = torch.ones(P * G, T)
    delta = advantages.compute(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]), "centered").reshape(-1)
    logp = token_logprobs(logits, ids)
    loss, stats = policy_loss(logp, logp.detach(), delta, mask, agg=mode, max_len=T)
    assert abs(loss.item()) < 1e-6
    assert stats["ratio_mean"] == stats["ratio_min"] == stats["ratio_max"] == 1.0
    assert stats["clip_frac"] == 0.0 and stats["approx_kl_old"] == 0.0
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    # the REINFORCE loss -Σ Δ_b logp[b,t], scaled as the mode weights tokens
    scale = {"token_mean": P * G * T, "seq_sum_mean": P * G, "seq_mean_mean": P * G * T, "seq_sum_const": P * G * T}[mode]
    (want,) = torch.autograd.grad(-(delta[:, None] * logp).sum() / scale, logits)
    assert grad.abs().max() > 1e-3
    assert torch.allclose(grad, want, atol=1e-6)


def test_loss_value_at_ratio_one_by_mode():
    """The module docstring's table: Δ = (1, -1) on rows of 3 and 1 generated tokens, ratio 1."""
    logp = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    delta = torch.tensor([1.0, -1.0])  # centered: mean 0
    want = {
        "seq_mean_mean": -(1 - 1) / 2,  # -mean(Δ)
        "token_mean": -(3 * 1 + 1 * -1) / 4,  # length-weighted: -0.5
        "seq_sum_mean": -(3 * 1 + 1 * -1) / 2,
        "seq_sum_const": -(3 * 1 + 1 * -1) / 2 / 4,
    }
    for mode, value in want.items():
        loss, _ = policy_loss(logp, logp, delta, mask, agg=mode, max_len=4)
        assert loss.item() == pytest.approx(value), mode


def test_logp_old_and_delta_are_constants():
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    logp_old = torch.tensor([[-1.2, -0.4]], requires_grad=True)
    delta = torch.tensor([0.7], requires_grad=True)
    loss, _ = policy_loss(logp, logp_old, delta, torch.ones(1, 2))
    loss.backward()
    assert logp.grad is not None and logp_old.grad is None and delta.grad is None


def test_sequence_level_is_gspo_objective():
    """With agg seq_mean_mean, level='sequence' equals mean_b -min(s_b Δ_b, clip(s_b) Δ_b) with
    s_b = (π(y_b)/π_old(y_b))^(1/|y_b|) built from sequence_logprob; gradients match too."""
    g = torch.Generator().manual_seed(3)
    logp, logp_old, mask = _random_batch(g, 5, 4)
    logp.requires_grad_()
    delta = torch.randn(5, generator=g, dtype=torch.float64)
    loss, _ = policy_loss(logp, logp_old, delta, mask, level="sequence", agg="seq_mean_mean")
    n = mask.sum(-1).clamp(min=1)
    s = torch.exp((sequence_logprob(logp, mask) - sequence_logprob(logp_old, mask)) / n)
    surr = -torch.minimum(s * delta, s.clamp(0.8, 1.2) * delta)
    want = torch.where(mask.sum(-1) > 0, surr, torch.zeros_like(surr)).mean()
    assert torch.allclose(loss, want)
    (g1,) = torch.autograd.grad(loss, logp, retain_graph=True)
    (g2,) = torch.autograd.grad(want, logp)
    assert torch.allclose(g1, g2)


def test_aggregation_weighting_differs_with_length():
    """A long and a short response, both Δ = -1: seq_mean_mean pushes each token of the long one
    less; token_mean and seq_sum_* weigh every token the same."""
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    delta = torch.tensor([-1.0, -1.0])
    grads = {}
    for mode in AGGREGATIONS:
        loss, _ = policy_loss(logp, logp.detach(), delta, mask, agg=mode, max_len=4)
        (grads[mode],) = torch.autograd.grad(loss, logp)
    assert grads["seq_mean_mean"][0, 0] == pytest.approx(grads["seq_mean_mean"][1, 0] / 4)
    for mode in ("token_mean", "seq_sum_mean", "seq_sum_const"):
        assert grads[mode][0, 0] == pytest.approx(grads[mode][1, 0].item())
    assert grads["seq_sum_const"][0, 0] == pytest.approx(grads["seq_sum_mean"][0, 0].item() / 4)


# --- tier 4: errors name the argument --------------------------------------------------------


def _pl(**over):
    kw = dict(logp=torch.zeros(2, 3), logp_old=torch.zeros(2, 3), delta=torch.zeros(2), mask=torch.ones(2, 3))
    kw.update(over)
    return policy_loss(**kw)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _pl(delta=torch.zeros(3)), "delta"),
        (lambda: _pl(delta=torch.zeros(2, 4)), "delta"),
        (lambda: _pl(delta=torch.zeros(2, 3, 1)), "delta"),
        (lambda: _pl(logp_old=torch.zeros(2, 4)), "logp_old"),
        (lambda: _pl(mask=torch.ones(3, 3)), "mask"),
        (lambda: _pl(logp=torch.zeros(6), logp_old=torch.zeros(6), mask=torch.ones(6)), "logp"),
        (lambda: _pl(clip_eps=0.0), "clip_eps"),
        (lambda: _pl(clip_eps=1.5), "clip_eps"),
        (lambda: _pl(clip_eps_high=-0.1), "clip_eps_high"),
        (lambda: _pl(level="tokens"), "level"),
        (lambda: _pl(agg="mean"), "agg.*seq_sum_mean.*seq_mean_mean.*token_mean.*seq_sum_const"),
        (lambda: _pl(agg="seq_sum_const"), "max_len"),
        (lambda: _pl(agg="seq_sum_const", max_len=0), "max_len"),
        (lambda: aggregate(torch.zeros(2, 3), torch.ones(2, 2), "token_mean"), "mask"),
        (lambda: aggregate(torch.zeros(2, 3), torch.ones(2, 3), "sum"), "agg"),
        (lambda: sequence_logprob(torch.zeros(2, 3), torch.ones(2, 4)), "mask"),
        (lambda: kl_estimate(torch.zeros(2, 3), torch.zeros(2, 3), "k4"), "estimator.*k1.*k2.*k3"),
        (lambda: kl_estimate(torch.zeros(2, 3), torch.zeros(3, 2), "k1"), "logp_ref"),
        (lambda: kl_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2)), "mask"),
        (lambda: kl_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), "k3", "seq_sum_const"), "max_len"),
        (lambda: token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)), "logits"),
        (lambda: token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long)), "ids"),
        (lambda: token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0), "temperature"),
        (lambda: token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), chunk_rows=0), "chunk_rows"),
        (lambda: _pl(objective="grpo"), "objective.*ppo_clip.*cispo"),
        (lambda: _pl(dual_clip_c=1.0), "dual_clip_c"),
        (lambda: _pl(dual_clip_c=float("inf")), "dual_clip_c"),
        (lambda: _pl(objective="cispo", dual_clip_c=3.0), "dual_clip_c"),
        (lambda: entropy_from_logits(torch.zeros(2, 3)), "logits"),
        (lambda: entropy_from_logits(torch.zeros(2, 3, 4), temperature=0.0), "temperature"),
        (lambda: entropy_from_logits(torch.zeros(2, 3, 4), chunk_rows=0), "chunk_rows"),
        (lambda: entropy_bonus(torch.zeros(2, 3), torch.ones(2, 4)), "mask"),
    ],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the menu: dual clip, CISPO, entropy bonus -------------------------------------------------


def test_dual_clip_caps_negative_delta_at_c():
    # Δ = -1, ratio 4 > c = 3: plain PPO loss is -min(-4, -1.2) = 4 with gradient 4; the dual clip
    # caps it at -c·Δ = 3 and the gradient is 0
    loss, grad, stats = _one_token(math.log(4.0), 0.0, -1.0)
    assert loss == pytest.approx(4.0) and grad == pytest.approx(4.0) and stats["clip_frac_dual"] == 0.0
    loss, grad, stats = _one_token(math.log(4.0), 0.0, -1.0, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert stats["clip_frac_dual"] == 1.0 and stats["clip_frac"] == 1.0
    # ratio 2 < c: untouched, loss 2 and gradient d(2·e^x)/dx = 2
    loss, grad, stats = _one_token(math.log(2.0), 0.0, -1.0, dual_clip_c=3.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and stats["clip_frac"] == 0.0
    # Δ > 0 never sees the dual clip: ratio 4 is clipped to 1.2 as before
    loss, grad, stats = _one_token(math.log(4.0), 0.0, 1.0, dual_clip_c=3.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0 and stats["clip_frac_dual"] == 0.0
    # Δ < 0 below the band (ratio 1/e): the usual lower clip, loss 0.8, no gradient
    loss, grad, _ = _one_token(-1.0, 0.0, -1.0, dual_clip_c=3.0)
    assert loss == pytest.approx(0.8) and grad == 0.0


def test_cispo_by_hand_keeps_the_gradient_where_ppo_drops_it():
    # logp -1 against logp_old -2: ratio e, weight clipped to 1.2 and detached
    # Δ = +1: loss -1.2·1·(-1) = 1.2, gradient -1.2 (ppo_clip: loss -1.2, gradient 0)
    loss, grad, stats = _one_token(-1.0, -2.0, 1.0, objective="cispo")
    assert loss == pytest.approx(1.2) and grad == pytest.approx(-1.2)
    assert stats["clip_frac_high"] == 1.0
    assert _one_token(-1.0, -2.0, 1.0)[1] == 0.0
    # Δ = -1: weight still 1.2 (the weight is clipped whatever the sign), gradient +1.2
    loss, grad, stats = _one_token(-1.0, -2.0, -1.0, objective="cispo")
    assert loss == pytest.approx(-1.2) and grad == pytest.approx(1.2) and stats["clip_frac_high"] == 1.0
    # ratio 1: weight 1, loss -Δ·logp = -1·(-1) = 1, gradient -Δ = -1, the same gradient as ppo_clip
    loss, grad, stats = _one_token(-1.0, -1.0, 1.0, objective="cispo")
    assert loss == pytest.approx(1.0) and grad == pytest.approx(-1.0) and stats["clip_frac"] == 0.0
    assert _one_token(-1.0, -1.0, 1.0)[1] == pytest.approx(-1.0)
    # ratio 1/e < 0.8: weight 0.8, gradient -0.8·Δ
    loss, grad, stats = _one_token(-3.0, -2.0, 1.0, objective="cispo")
    assert grad == pytest.approx(-0.8) and stats["clip_frac_low"] == 1.0


def verl_vanilla_loop(logp, logp_old, adv, mask, lo, hi, c):
    """verl core_algos.compute_policy_loss_vanilla (dual clip, token-mean) as a plain loop."""
    total = n = clip_lower = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if not mask[b][t]:
                continue
            a = adv[b][t]
            ratio = math.exp(max(-20.0, min(20.0, logp[b][t] - logp_old[b][t])))
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - lo), 1 + hi)
            clip1 = max(l1, l2)
            l3 = -a * c
            clip2 = min(l3, clip1)
            total += clip2 if a < 0 else clip1
            clip_lower += (clip1 > l3) and a < 0
            n += 1
    return total / n, clip_lower / n


def verl_cispo_loop(logp, logp_old, adv, mask, lo, hi):
    """verl compute_policy_loss_cispo (token-mean): -sg(clamp(ratio, 1-lo, 1+hi)) · A · logp, and
    d/dlogp of each term, -w·A / n."""
    total, grads, n = 0.0, {}, sum(map(sum, mask))
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if mask[b][t]:
                w = min(max(math.exp(logp[b][t] - logp_old[b][t]), 1 - lo), 1 + hi)
                total += -w * adv[b][t] * logp[b][t]
                grads[b, t] = -w * adv[b][t] / n
    return total / n, grads


def trl_cispo_loop(logp, logp_old, adv, mask, eps_max):
    """TRL GRPOTrainer loss_type='cispo' (token sum over the token count): clamp(ratio, max=eps_max)."""
    total, n = 0.0, sum(map(sum, mask))
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if mask[b][t]:
                total += -min(math.exp(logp[b][t] - logp_old[b][t]), eps_max) * adv[b][t] * logp[b][t]
    return total / n


@pytest.mark.parametrize("seed", range(6))
def test_dual_clip_and_cispo_match_verl_and_trl(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 6
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_old = logp + 1.5 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios far from 1
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    mask[:, 0] = 1
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    L = lambda x: x.tolist()
    # dual clip: verl's default clip_ratio_c = 3, asymmetric band 0.2 / 0.28
    loss, stats = policy_loss(logp, logp_old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    want, lower = verl_vanilla_loop(L(logp), L(logp_old), L(adv), L(mask), 0.2, 0.28, 3.0)
    assert loss.item() == pytest.approx(want, rel=1e-10)
    assert stats["clip_frac_dual"] == pytest.approx(lower)
    assert lower > 0  # the case is exercised
    # CISPO: verl's band, values and gradients
    x = logp.clone().requires_grad_()
    loss, _ = policy_loss(x, logp_old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, objective="cispo")
    want, grads = verl_cispo_loop(L(logp), L(logp_old), L(adv), L(mask), 0.2, 0.28)
    assert loss.item() == pytest.approx(want, rel=1e-10)
    (grad,) = torch.autograd.grad(loss, x)
    for (b, t), v in grads.items():
        assert grad[b, t].item() == pytest.approx(v, rel=1e-10, abs=1e-15)
    assert grad[mask == 0].abs().max() == 0
    # TRL clamps only above, at eps_max = 1 + eps_high; with clip_eps 0.999 the lower bound is 0.001,
    # below every ratio here, and the two conventions agree
    ratio = torch.exp(logp - logp_old)[mask.bool()]
    assert ratio.min() > 1e-3
    loss, _ = policy_loss(logp, logp_old, adv, mask, clip_eps=0.999, clip_eps_high=4.0, objective="cispo")
    assert loss.item() == pytest.approx(trl_cispo_loop(L(logp), L(logp_old), L(adv), L(mask), 5.0), rel=1e-10)


def test_cispo_gradient_is_ppo_gradient_inside_the_band():
    """Where no clip is active, ∇(-ratio·Δ) = -ratio·Δ·∇logp = CISPO's gradient, token by token."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 5, generator=g, dtype=torch.float64) * 2).requires_grad_()
    logp_old = logp.detach() + 0.1 * (2 * torch.rand(4, 5, generator=g, dtype=torch.float64) - 1)  # ratios in the band
    delta = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 5)
    grads = {}
    for obj in OBJECTIVES:
        loss, stats = policy_loss(logp, logp_old, delta, mask, objective=obj)
        assert stats["clip_frac"] == 0.0
        (grads[obj],) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grads["ppo_clip"], grads["cispo"], rtol=1e-12, atol=0)


def test_cispo_and_dual_clip_ignore_padding_with_inf():
    logp = torch.tensor([[-0.5, -float("inf")], [-1.0, -2.0]], requires_grad=True)
    logp_old = torch.tensor([[-0.4, 0.0], [-1.0, -float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    for kw in (dict(objective="cispo"), dict(dual_clip_c=3.0)):
        for level in ("token", "sequence"):
            loss, stats = policy_loss(logp, logp_old, torch.tensor([1.0, -1.0]), mask, level=level, **kw)
            (grad,) = torch.autograd.grad(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), (kw, level)
            assert all(math.isfinite(v) for v in stats.values())


def test_entropy_by_hand():
    # uniform over 4: log 4; (3, 1, 1, 1)/6: -(1/2 log 1/2 + 3 · 1/6 log 1/6) = ½ log 2 + ½ log 6
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]]], dtype=torch.float64)
    want = torch.tensor([[math.log(4.0), 0.5 * math.log(2.0) + 0.5 * math.log(6.0)]], dtype=torch.float64)
    assert torch.allclose(entropy_from_logits(logits), want, rtol=0, atol=1e-12)
    assert torch.allclose(entropy_from_logits(logits, chunk_rows=1), want, rtol=0, atol=1e-12)
    # temperature 2 on logits (2 log 3, 0, 0, 0) is the distribution (3, 1, 1, 1)/6
    hot = torch.tensor([[[2 * math.log(3.0), 0.0, 0.0, 0.0]]], dtype=torch.float64)
    assert entropy_from_logits(hot, temperature=2.0).item() == pytest.approx(want[0, 1].item())
    # a point mass has entropy 0 and no NaN in the gradient
    sharp = torch.tensor([[[0.0, -1e4, -1e4]]], requires_grad=True)
    h = entropy_from_logits(sharp)
    (grad,) = torch.autograd.grad(h.sum(), sharp)
    assert h.item() == pytest.approx(0.0, abs=1e-6) and torch.isfinite(grad).all()


def test_entropy_matches_trl_and_verl_formulas_and_chunked_gradients():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 4, 11, generator=g, dtype=torch.float64)).requires_grad_()
    h = entropy_from_logits(logits, temperature=0.7)
    z = logits.detach() / 0.7
    trl = -(torch.log_softmax(z, -1).exp() * torch.log_softmax(z, -1)).sum(-1)  # TRL entropy_from_logits
    verl = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)  # verl entropy_from_logits
    assert torch.allclose(h, trl, rtol=1e-12) and torch.allclose(h, verl, rtol=1e-12)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    (g_plain,) = torch.autograd.grad((h * w).sum(), logits)
    for rows in (1, 5, 12, 100):
        hc = entropy_from_logits(logits, temperature=0.7, chunk_rows=rows)
        (g_chunk,) = torch.autograd.grad((hc * w).sum(), logits)
        assert torch.allclose(hc, h, rtol=1e-12) and torch.allclose(g_chunk, g_plain, rtol=1e-10, atol=1e-14), rows
    small = torch.randn(2, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, temperature=1.3, chunk_rows=3), (small,))
    bf = logits.detach().to(torch.bfloat16)
    assert entropy_from_logits(bf, chunk_rows=4).dtype == torch.float32


def test_entropy_bonus_aggregates_like_the_loss_and_raises_entropy():
    H = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert entropy_bonus(H, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert entropy_bonus(H, mask, "seq_mean_mean").item() == pytest.approx((2 + 4) / 2)
    # one gradient step on loss = -coef · bonus makes a peaked distribution flatter
    logits = torch.tensor([[[2.0, 0.0, -1.0]]], requires_grad=True)
    before = entropy_from_logits(logits).item()
    loss = -0.1 * entropy_bonus(entropy_from_logits(logits), torch.ones(1, 1))
    loss.backward()
    with torch.no_grad():
        after = entropy_from_logits(logits - 1.0 * logits.grad).item()
    assert after > before


def test_auto_chunk_rows_by_hand():
    # 2 MiB of float32 on a CPU: 2 * 2**20 // (4 * 49,152) = 10 rows; 2 * 2**20 // 60 = 34,952
    assert auto_chunk_rows(49152) == 10 and auto_chunk_rows(49152, "cpu") == 10
    assert auto_chunk_rows(15) == 34952
    assert auto_chunk_rows(49152, "cuda") == 256 * 2**20 // (4 * 49152) == 1365
    assert auto_chunk_rows(49152, "mps") == 1365          # other devices take the GPU size
    assert auto_chunk_rows(10**9) == 1                     # at least one row
    with pytest.raises(ValueError, match="vocab"):
        auto_chunk_rows(0)
    assert (chunk_setting(-1), chunk_setting(0), chunk_setting(7)) == (AUTO_CHUNK, None, 7)
    logits = torch.zeros(2, 3, 49152)
    assert resolve_chunk_rows(AUTO_CHUNK, logits) == 10 and resolve_chunk_rows(4, logits) == 4
    assert resolve_chunk_rows(None, logits) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_covering_every_row_is_the_plain_path(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(3, 4, 11, generator=g)).to(dtype).requires_grad_()
    ids = torch.randint(0, 11, (3, 4), generator=g)
    w = torch.randn(3, 4, generator=g)
    for fn in (lambda c: token_logprobs(logits, ids, temperature=0.7, chunk_rows=c),
               lambda c: entropy_from_logits(logits, temperature=0.7, chunk_rows=c)):
        plain = fn(None)
        (gp,) = torch.autograd.grad((plain * w).sum(), logits)
        for c in (12, 13, AUTO_CHUNK):                      # auto: 2 MiB / 44 bytes rows, all 12 at once
            got = fn(c)
            (gc,) = torch.autograd.grad((got * w).sum(), logits)
            assert torch.equal(got, plain) and torch.equal(gc, gp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 5])
def test_chunked_logprob_backward_matches_a_plain_loop_bit_for_bit(dtype, chunk_rows):
    """The in-place chunked backward against the formula row by row: d logp / d logits =
    (onehot(id) - softmax(logits / T)) * g / T, computed as -exp(max(x - lse, -87)) * g, + g at the
    id, / T, in float32 and rounded once to the logits' dtype. Some logits sit far below the rest,
    so the exponent's floor shows in their gradient (exp(-87) * g / T, not the underflowed 0)."""
    g = torch.Generator().manual_seed(chunk_rows)
    N, V, temperature = 7, 50, 0.7
    logits = 3 * torch.randn(1, N, V, generator=g)
    logits[0, :, :5] = -150.0                                             # x - lse < -87: floored
    logits = logits.to(dtype).requires_grad_()
    ids = torch.randint(5, V, (1, N), generator=g)
    w = torch.randn(1, N, generator=g)
    lp = token_logprobs(logits, ids, temperature=temperature, chunk_rows=chunk_rows)
    (got,) = torch.autograd.grad((lp * w).sum(), logits)
    x = logits.detach()[0].float() / temperature                          # (N, V)
    lse = torch.logsumexp(x, dim=-1)                                      # (N,)
    assert exp_floor(torch.float32) == -87.0 and bool((x[:, :5] - lse[:, None] < -87).all())
    for r in range(N):
        want = -torch.exp((x[r] - lse[r]).clamp_min(-87.0)) * w[0, r]
        want[ids[0, r]] += w[0, r]
        assert torch.equal(got[0, r], (want / temperature).to(dtype)), r
        assert lp[0, r].item() == (x[r, ids[0, r]] - lse[r]).item()


@pytest.mark.parametrize("chunk_rows", [None, 3, AUTO_CHUNK])
def test_bf16_logits_score_as_their_float32_copy_bit_for_bit(chunk_rows):
    """Scoring bf16 logits directly (what a bf16 forward hands over) gives the values and the bf16
    gradient that upcasting them first gives: each chunk is upcast on its own."""
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(2, 5, 40, generator=g)).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 40, (2, 5), generator=g)
    w = torch.randn(2, 5, generator=g)
    direct = token_logprobs(logits, ids, temperature=0.7, chunk_rows=chunk_rows)
    (gd,) = torch.autograd.grad((direct * w).sum(), logits)
    upcast = token_logprobs(logits.float(), ids, temperature=0.7, chunk_rows=chunk_rows)
    (gu,) = torch.autograd.grad((upcast * w).sum(), logits)
    assert direct.dtype == torch.float32 and gd.dtype == torch.bfloat16
    assert torch.equal(direct, upcast) and torch.equal(gd, gu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_logprobs_far_below_the_exponent_floor_match_the_plain_path(dtype):
    """At a low temperature many x - lse fall below exp_floor (where torch's CPU exp is slow): the
    chunked log-probs still equal the plain path's, and their gradients differ by at most the
    floor's probability (exp(-87) * |g| / T) per logit."""
    g = torch.Generator().manual_seed(11)
    temperature = 0.3
    scale = 30 if dtype == torch.float32 else 300                        # float64's floor is -708
    logits = (scale * torch.randn(4, 6, 64, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    ids = torch.randint(0, 64, (4, 6), generator=g)
    w = torch.randn(4, 6, generator=g).to(dtype)
    plain = token_logprobs(logits, ids, temperature=temperature)
    (gp,) = torch.autograd.grad((plain * w).sum(), logits)
    chunked = token_logprobs(logits, ids, temperature=temperature, chunk_rows=5)
    (gc,) = torch.autograd.grad((chunked * w).sum(), logits)
    x = logits.detach() / temperature
    below = x - torch.logsumexp(x, dim=-1, keepdim=True) < exp_floor(dtype)
    assert below.float().mean() > 0.2                                     # the floor is reached
    assert torch.allclose(chunked, plain, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    bound = math.exp(exp_floor(dtype)) * w.abs().max().item() / temperature * 1.01
    assert (gc - gp)[below].abs().max().item() <= bound
    assert torch.allclose(gc[~below], gp[~below], rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-30)


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_entropy_far_below_the_exponent_floor_stays_exact_to_float32(chunk_rows):
    """At a low temperature most log-probs fall below exp_floor (where torch's CPU exp is slow): the
    entropy, plain and chunked, reads those probabilities as exp(-87), which moves the entropy and
    its gradient by less than V * exp(-87) * (2 + |log p| + H) (about 1e-32 here), far under float32
    rounding: both stay within 1e-5 of the exact float64 values (a floor at -10 misses by over 1).
    Where nothing is below the floor the values are the unfloored formula's, bit for bit."""
    g = torch.Generator().manual_seed(12)
    temperature = 0.3
    logits = (30 * torch.randn(4, 6, 64, generator=g)).requires_grad_()
    w = torch.randn(4, 6, generator=g)
    h = entropy_from_logits(logits, temperature=temperature, chunk_rows=chunk_rows)
    (got,) = torch.autograd.grad((h * w).sum(), logits)
    z = (logits.detach().double() / temperature).requires_grad_()
    lp = torch.log_softmax(z, -1)
    exact = -(lp.exp() * lp).sum(-1)                                      # float64: nothing underflows
    (want,) = torch.autograd.grad((exact * w.double()).sum(), z)
    assert (lp.detach() < exp_floor(torch.float32)).float().mean() > 0.5  # the floor is reached
    assert torch.allclose(h.double(), exact.detach(), rtol=0, atol=1e-5)
    assert torch.allclose(got.double(), want / temperature, rtol=0, atol=1e-5)
    calm = 2 * torch.randn(3, 4, 11, generator=g)                         # T = 0.7: nothing below the floor
    lp7 = torch.log_softmax(calm / 0.7, -1)
    assert bool((lp7 > exp_floor(torch.float32)).all())
    assert torch.equal(entropy_from_logits(calm, temperature=0.7), -(lp7.exp() * lp7).sum(-1))
