"""algorithm.mask_truncated (DAPO's overlong filtering) and algorithm.top_entropy_quantile (training
only the batch's highest-entropy tokens): what each keeps, by hand, and that each reaches the update."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlvr import cli, config as config_mod
from rlvr.rollout import Batch, entropy_threshold, high_entropy_delta, mask_truncated

ARITH = ["--task.path=rlvr.tasks.arith:arith_task", "--task.options={digits = 1, heldout = 10}",
         "--task.reward=correct", "--sampling.max_new_tokens=6"]
SORT = ["examples/sort.toml", "--task.options={n = 3, heldout = 10}"]
TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--train.steps=1",
        "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--eval.every=0", "--eval.at_start=false",
        "--eval.pass_k=0", "--eval.prompts=4", "--task.reward_workers=0", "--train.lr=0.05",
        "--algorithm.scheme=centered", "--model.autocast=off"]
"""`--model.autocast=off`: under auto each run times bf16 against fp32 itself, and runs compared with each other
must not fall on either side of its threshold on a busy machine."""


def batch(mask, delta, truncated=None) -> Batch:
    mask = torch.tensor(mask, dtype=torch.float32)
    rollout = SimpleNamespace(mask=mask, truncated=torch.tensor(truncated or [False] * mask.size(0)))
    return Batch(groups=SimpleNamespace(rollout=rollout), parts=[], delta=torch.tensor(delta),
                 logp_old=torch.zeros_like(mask), logp_ref=None, version=0)


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
@pytest.mark.parametrize("frac", [0.2, 0.5, 0.999, 1.0])
def test_the_threshold_is_the_quantile_torch_and_trl_take(n, frac):
    v = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert torch.allclose(entropy_threshold(v, frac), torch.quantile(v, 1.0 - frac), atol=1e-6)


def test_high_entropy_tokens_keep_their_delta_the_others_get_zero():
    b = batch([[1, 1, 1, 0], [1, 1, 0, 0]], [[2.0], [-1.0]])
    entropy = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.7, 9.0, 9.0]])   # 9.0: off the mask, never counted
    # generated tokens' entropies sorted: 0.1 0.3 0.5 0.7 0.9; the 0.6 quantile is 0.5 + 0.4 x 0.2 = 0.58
    out = high_entropy_delta(b, entropy, 0.4)
    assert out.delta_tokens.tolist() == [[0.0, 2.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]]
    assert out.stats["high_entropy_frac"] == pytest.approx(0.4) and out.stats["entropy_threshold"] == pytest.approx(0.58)
    assert out.train_mask is b.rollout.mask                                 # the denominators are untouched
    # a per-token Δ (process rewards, the IS weight of logp_old = recompute) is masked the same way
    per_token = Batch(**{**b.__dict__, "delta_tokens": torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])})
    assert high_entropy_delta(per_token, entropy, 0.4).delta_tokens.tolist() == [[0, 2, 0, 0], [0, 5, 0, 0]]
    assert high_entropy_delta(b, entropy, 1.0).delta_tokens.tolist() == [[2, 2, 2, 0], [-1, -1, 0, 0]]


def test_a_truncated_row_leaves_the_loss_mask():
    b = batch([[1, 1, 1], [1, 1, 0], [1, 1, 1]], [[1.0], [0.5], [-1.0]], truncated=[True, False, True])
    out = mask_truncated(b)
    assert out.train_mask.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert out.rollout.mask.tolist() == b.rollout.mask.tolist()            # the rollout itself is kept
    assert out.stats["masked_truncated_frac"] == pytest.approx(2 / 3)
    assert b.train_mask is b.rollout.mask


def train(out: Path, *extra: str) -> tuple[dict, list[dict], dict]:
    """(the final weights, the metrics rows, price.json) of a 1-step run."""
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        rc = cli.main(["train", *extra[:1], "--out", str(out), *TINY, *extra[1:]])
    assert rc == 0, err.getvalue()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return (load_file(str(out / "checkpoint" / "model.safetensors")), rows,
            json.loads((out / "price.json").read_text()))


def differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_mask_truncated_reaches_the_update(tmp_path):
    cfg = str(Path(__file__).resolve().parents[1] / "examples" / "sort.toml")
    plain, _, _ = train(tmp_path / "plain", cfg, *ARITH)
    masked, rows, _ = train(tmp_path / "masked", cfg, *ARITH, "--algorithm.mask_truncated=true")
    step = next(r for r in rows if "train/reward" in r)
    assert 0 < step["train/masked_truncated_frac"] <= 1       # a random model rarely ends within 6 tokens
    assert differ(plain, masked)


def test_top_entropy_quantile_reaches_the_update_and_is_priced(tmp_path):
    plain, _, price0 = train(tmp_path / "plain", *SORT)
    picked, rows, price = train(tmp_path / "picked", *SORT, "--algorithm.top_entropy_quantile=0.2")
    step = next(r for r in rows if "train/reward" in r)
    assert 0.2 <= step["train/high_entropy_frac"] < 0.3      # ties at the threshold may add a few
    assert differ(plain, picked)
    # one no-gradient training forward a batch gives the entropies: priced, and counted
    assert price["forward_tokens_logp_old_per_batch"] == price["trained_tokens_per_batch"] > 0
    assert price0["forward_tokens_logp_old_per_batch"] == 0
    summary = json.loads((tmp_path / "picked" / "summary.json").read_text())
    assert summary["cost/forward_tokens"] == price["forward_tokens_per_run"]


def test_the_tokens_chosen_do_not_depend_on_micro_batches(tmp_path):
    """The threshold is taken over the whole batch at the rollout stage, so splitting the minibatch
    into parts changes nothing but float rounding: here at most ~1e-5 after AdamW's first step (which
    maps a near-zero gradient's rounding to a larger move; 1.9e-6 without the option), where one
    token chosen differently moves weights by about the learning rate, 0.05. No entropy bonus: the
    example's own adds gradient terms whose rounding AdamW's first step amplifies the same way, and
    this test is about which tokens the quantile picks."""
    picked = ["--algorithm.top_entropy_quantile=0.5", "--algorithm.entropy_coef=0"]
    one, _, _ = train(tmp_path / "one", *SORT, *picked)
    two, _, _ = train(tmp_path / "two", *SORT, *picked, "--train.micro_batches=2")
    assert all(torch.allclose(one[k], two[k], atol=1e-4, rtol=0) for k in one)


def test_bad_settings_are_refused_naming_the_key(tmp_path, capsys):
    for v in ("0", "1.5"):
        with pytest.raises(config_mod.ConfigError, match=r"algorithm\.top_entropy_quantile.*\(0, 1\]"):
            config_mod.load("examples/sort.toml", [f"--algorithm.top_entropy_quantile={v}"])
    assert cli.main(["train", *SORT, "--out", str(tmp_path / "run"), *TINY, "--algorithm.mask_truncated=true"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.mask_truncated" in err and "fixed-length task" in err
