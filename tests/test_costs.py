"""rlvr.costs.price: the price of a run, by hand (exact tier) and against its own identities (oracle tier)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr import costs

import pricing

BASE = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=3, prompt_tokens=4, steps=10,
            epochs_per_batch=2, minibatches=2, n_params=1000, has_reference=False)


def test_price_by_hand():
    p = pricing.price(**BASE)
    assert p.sampled_tokens_per_batch == 48            # P*G*T = 4*4*3
    assert p.grad_steps_per_batch == 4                 # μ * minibatches = 2*2
    assert p.sampled_tokens_per_grad_step == 12        # 48 / 4
    assert p.sampled_tokens_per_run == 480             # steps * 48
    assert p.policy_bytes == 4000                      # fp32 weights
    assert p.optimizer_bytes == 8000                   # AdamW: two fp32 moments
    assert p.reference_bytes == 0                      # no KL term, no reference copy
    assert p.logp_old_bytes == 48 * 4                  # one fp32 logp per sampled token
    assert (p.prompts_per_step, p.samples_per_prompt, p.max_new_tokens, p.prompt_tokens, p.steps,
            p.n_params, p.has_reference) == (4, 4, 3, 4, 10, 1000, False)


def test_price_by_hand_uneven_numbers():
    p = pricing.price(**{**BASE, "prompts_per_step": 3, "samples_per_prompt": 5, "max_new_tokens": 7,
                       "epochs_per_batch": 3, "minibatches": 1, "steps": 2})
    assert p.sampled_tokens_per_batch == 105
    assert p.sampled_tokens_per_grad_step == pytest.approx(35.0)
    assert p.sampled_tokens_per_run == 210
    p = pricing.price(**{**BASE, "epochs_per_batch": 1, "minibatches": 5, "max_new_tokens": 2})
    assert p.sampled_tokens_per_grad_step == pytest.approx(32 / 5)  # not rounded


def test_reference_costs_one_policy_copy():
    p = pricing.price(**{**BASE, "has_reference": True})
    assert p.has_reference and p.reference_bytes == p.policy_bytes == 4000
    half = pricing.price(**{**BASE, "has_reference": True, "bytes_per_param": 2})
    assert half.policy_bytes == half.reference_bytes == 2000


def test_price_lines():
    p = pricing.price(**{**BASE, "n_params": 2**18, "has_reference": True})  # 1 MiB of fp32 weights
    text = "\n".join(p.lines())
    assert len(p.lines()) == 5
    assert "forward tokens per batch: sampling 48 " in text       # P*Lp + P*G*(T-1) = 16 + 32
    assert "logp_ref 96 " in text and "trained tokens 192 " in text
    assert p.lines()[0].startswith("price: sampled tokens per gradient step = 12 ")
    assert "(P=4 x G=4 x T<=3 / 4 gradient steps per batch)" in text
    assert "sampled tokens per batch = 48; per run (10 steps) = 480" in text
    assert "policy 1.00 MiB" in text and "AdamW state 2.00 MiB" in text and "reference 1.00 MiB" in text
    assert "parameters 262,144" in text
    assert "no reference" not in text
    assert "no reference (kl_coef = 0)" in "\n".join(pricing.price(**BASE).lines())


def test_thousands_separators():
    p = pricing.price(**{**BASE, "prompts_per_step": 64, "samples_per_prompt": 8, "max_new_tokens": 5,
                       "epochs_per_batch": 1, "minibatches": 1, "steps": 800})
    assert "= 2,560 (P=64 x G=8 x T<=5 / 1 gradient steps per batch)" in p.lines()[0]
    assert "per run (800 steps) = 2,048,000" in p.lines()[1]


def test_to_dict_is_json_ready():
    d = pricing.price(**BASE).to_dict()
    assert d["sampled_tokens_per_grad_step"] == 12 and d["reference_bytes"] == 0
    assert all(isinstance(v, (int, float, bool, str)) for v in d.values())


@pytest.mark.parametrize("value", [0, None, -3, 2.5])
def test_refuses_an_unknown_response_bound(value):
    with pytest.raises(ValueError, match="max_new_tokens"):
        pricing.price(**{**BASE, "max_new_tokens": value})


@pytest.mark.parametrize("name", ["n_params", "prompts_per_step", "samples_per_prompt"])
@pytest.mark.parametrize("value", [0, None])
def test_refuses_other_missing_numbers(name, value):
    with pytest.raises(ValueError, match=name):
        pricing.price(**{**BASE, name: value})


@pytest.mark.parametrize("name,value", [("epochs_per_batch", 0), ("minibatches", 0), ("steps", None)])
def test_refuses_missing_loop_counts(name, value):
    with pytest.raises(ValueError, match=name):
        pricing.price(**{**BASE, name: value})


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 64), G=st.integers(1, 16), T=st.integers(1, 256), steps=st.integers(1, 1000),
       mu=st.integers(1, 4), mb=st.integers(1, 8), n=st.integers(1, 10**8), ref=st.booleans())
def test_price_identities(P, G, T, steps, mu, mb, n, ref):
    p = pricing.price(prompts_per_step=P, samples_per_prompt=G, max_new_tokens=T, prompt_tokens=1, steps=steps,
                    epochs_per_batch=mu, minibatches=mb, n_params=n, has_reference=ref)
    # a naive count: every row of every prompt samples at most T tokens
    naive = 0
    for _prompt in range(P):
        for _sample in range(G):
            naive += T
    assert p.sampled_tokens_per_batch == naive
    assert p.sampled_tokens_per_grad_step * mu * mb == pytest.approx(naive)
    assert p.sampled_tokens_per_run == steps * naive
    assert p.reference_bytes == (p.policy_bytes if ref else 0)
    assert p.optimizer_bytes == 2 * p.policy_bytes


def test_forward_trained_tokens_and_flops_by_hand():
    p = pricing.price(**{**BASE, "has_reference": True}, flops_fwd_per_token=10.0, flops_train_per_token=30.0)
    # the last response token is never fed to a forward: sampling never feeds back the token it drew
    # last, and a log-prob forward runs without it (it predicts nothing scored)
    assert p.forward_tokens_sampling_per_batch == 4 * 4 + 4 * 4 * (3 - 1)  # prefill once per prompt + decode
    assert p.forward_tokens_logp_old_per_batch == 0                      # stored from the sampler
    assert p.forward_tokens_logp_ref_per_batch == 16 * (4 + 3 - 1)       # every row, prompt + response
    assert p.trained_tokens_per_batch == 2 * 16 * (4 + 3 - 1)            # μ passes over every row
    assert p.forward_tokens_per_run == 10 * (48 + 96)
    assert p.trained_tokens_per_run == 10 * 192
    assert p.flops_sampling_per_batch == 48 * 10.0 and p.flops_logp_ref_per_batch == 96 * 10.0
    assert p.flops_train_per_batch == 192 * 30.0
    assert p.flops_per_run == 10 * (48 * 10.0 + 96 * 10.0 + 192 * 30.0)
    no_ref = pricing.price(**BASE)
    assert no_ref.forward_tokens_logp_ref_per_batch == 0
    assert no_ref.flops_train_per_batch == 192 * 6 * 1000                # the 6N rule when no figure is given


def test_dynamic_sampling_worst_case():
    p = pricing.price(**BASE, sampling_rounds=3)
    assert p.sampled_tokens_per_run == 480 and p.sampled_tokens_per_run_worst == 3 * 480
    assert "worst case with dynamic sampling (3 rounds) 1,440" in "\n".join(p.lines())
    with pytest.raises(ValueError, match="sampling_rounds"):
        pricing.price(**BASE, sampling_rounds=0)


def test_shared_prompt_forward_counts_each_prompt_once():
    p = pricing.price(**{**BASE, "has_reference": True}, shared_prompt=True)
    assert p.forward_tokens_logp_ref_per_batch == 4 * 4 + 16 * 2          # P*Lp + P*G*(T-1)
    assert p.trained_tokens_per_batch == 2 * (4 * 4 + 16 * 2)             # μ passes


def test_attention_flops_use_the_keys_a_token_really_attends_to():
    """Causal attention: token t attends t + 1 keys, so over Lp + T tokens the mean is (Lp + T + 1) / 2."""
    import torch

    from rlvr.models.tiny import TinyConfig, TinyTransformer

    assert costs.attended_keys(4, 3) == 4.0                              # (1 + 2 + ... + 7) / 7
    assert costs.attended_keys(47, 16) == 32.0                           # SmolLM2's chat prompt + 16 new tokens
    assert costs.attended_keys(0, 1) == 1.0
    with pytest.raises(ValueError, match="prompt_tokens"):
        costs.attended_keys(-1, 3)
    torch.manual_seed(0)
    C, layers = 32, 2
    m = TinyTransformer(TinyConfig(vocab_size=10, n_layer=layers, n_head=4, n_embd=C, block_size=8192))
    n = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear)) + 10 * C   # tied head
    fwd, train = costs.model_flops_per_token(m, 4, 3)
    assert fwd == 2 * n + 4 * layers * C * 4                             # 4 keys, not the 8192 of block_size
    assert train == 6 * n + 12 * layers * C * 4
    assert m.flops_per_token(training=False) == 2 * n + 4 * layers * C * 8192
    half = costs.model_flops_per_token(m, 4, 4)                          # 4.5 keys: rounded to a whole FLOP count
    assert half == (2 * n + 4 * layers * C * 4.5, 6 * n + 12 * layers * C * 4.5) and isinstance(half[0], int)
    p = pricing.price(**{**BASE, "has_reference": True}, flops_fwd_per_token=fwd, flops_train_per_token=train)
    assert p.flops_sampling_per_batch == 48 * (2 * n + 4 * layers * C * 4)


def test_hf_attention_flops_at_the_run_length_not_the_context(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_model_dir

    from rlvr.models.hf import load_policy

    policy, _ = load_policy(make_model_dir(tmp_path / "m", max_position_embeddings=8192))
    n, _ = policy._matmul_params()
    fwd, train = costs.model_flops_per_token(policy, 47, 16)            # 32 keys on average
    assert fwd == 2 * n + 4 * 2 * 64 * 32                                # 2 layers, hidden 64
    assert train == 6 * n + 12 * 2 * 64 * 32                             # full fine-tuning: 4N + 2N
    assert policy.flops_per_token(training=False) == 2 * n + 4 * 2 * 64 * 8192
