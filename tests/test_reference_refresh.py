"""algorithm.ref_mixup_alpha: each reference refresh moves π_ref a fraction α of the way to π."""

from __future__ import annotations

import pytest
import torch

from rlvr import config as config_mod
from rlvr.models.tiny import TinyConfig, TinyTransformer
from rlvr.trainer import refresh_reference
from test_train import ONE_STEP, train_rows, train_run


def tiny(seed: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(TinyConfig(vocab_size=7, n_layer=1, n_embd=8, n_head=2, block_size=8))


def test_each_weight_moves_alpha_of_the_way_and_alike_weights_stay_exact():
    policy, reference = tiny(0), tiny(1)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    with torch.no_grad():
        next(reference.parameters()).copy_(next(policy.parameters()))      # one weight both hold alike
    same = next(reference.named_parameters())[0]
    refresh_reference(reference, policy, 0.25)
    for name, r in reference.named_parameters():
        p = dict(policy.named_parameters())[name]
        if name == same or torch.equal(before[name], p):                # e.g. the norms' initial ones
            assert torch.equal(r, p)                                    # lerp of equal ends: exactly that end
        else:
            torch.testing.assert_close(r, before[name] + 0.25 * (p - before[name]), rtol=1e-6, atol=1e-7)
            assert not torch.equal(r, p)
    refresh_reference(reference, policy, 1.0)                          # 1: a copy
    assert all(torch.equal(r, p) for r, p in zip(reference.state_dict().values(), policy.state_dict().values()))


def test_a_tied_weight_moves_once(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_model_dir
    from rlvr.models.hf import load_policy

    policy, _ = load_policy(make_model_dir(tmp_path / "p", tie_word_embeddings=True, seed=0))
    reference, _ = load_policy(make_model_dir(tmp_path / "r", tie_word_embeddings=True, seed=1))
    emb = reference._hf_model().get_input_embeddings().weight
    assert emb is reference._hf_model().get_output_embeddings().weight              # tied
    want = torch.lerp(emb.detach().clone(), policy._hf_model().get_input_embeddings().weight.detach(), 0.5)
    refresh_reference(reference, policy, 0.5)
    assert torch.equal(reference._hf_model().get_input_embeddings().weight, want)
    assert reference._hf_model().get_output_embeddings().weight is reference._hf_model().get_input_embeddings().weight


def test_a_soft_refresh_reaches_the_kl(tmp_path):
    """With α = 1 the step-2 KL is 0 (the reference is the policy that sampled, see test_train); with
    α = 0.5 the reference is halfway, so the KL is not."""
    rows = {}
    for alpha in (1.0, 0.5):
        out = tmp_path / f"a{alpha}"
        rc, _, stderr = train_run(out, *ONE_STEP, "--train.steps=2", "--algorithm.kl_coef=0.1",
                                  "--algorithm.ref_refresh_every=1", f"--algorithm.ref_mixup_alpha={alpha}")
        assert rc == 0, stderr
        rows[alpha] = train_rows(out)
    assert rows[1.0][1]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0.5][1]["train/kl_ref"] > 1e-7


@pytest.mark.parametrize("args, needle", [
    (["--algorithm.ref_mixup_alpha=0"], r"algorithm\.ref_mixup_alpha.*\(0, 1\]"),
    (["--algorithm.ref_mixup_alpha=1.5"], r"algorithm\.ref_mixup_alpha.*\(0, 1\]"),
    (["--algorithm.ref_mixup_alpha=0.5", "--algorithm.kl_coef=0.1"], r"ref_mixup_alpha.*no reference is refreshed"),
])
def test_bad_settings_are_refused_naming_the_key(args, needle):
    with pytest.raises(config_mod.ConfigError, match=needle):
        config_mod.load("examples/sort.toml", args)
