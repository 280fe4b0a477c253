"""rlvr.distributed.fsdp: the learner group with `distributed.sharding = "fsdp2"` (torch fully_shard,
gloo on CPU) makes the one-process update, hands the trainer full weights, saves the one-process
state and resumes from it.

Same tiny models and local Ray as tests/test_distributed.py (whose helpers these tests reuse).
"""

import copy
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr import build as build_mod, config as config_mod, losses, setup_types
from rlvr.distributed import fsdp, learners as learners_mod
from rlvr.learn import learn

from test_distributed import (EXAMPLE, TINY, _cli_train, _uneven_batch, logp_old_from_the_group,  # noqa: F401
                              micro_batches_in_a_group, new_learner, one_group_for_two_ranks,
                              tiny_cfg)

FSDP = ["--distributed.learners=2", "--distributed.sharding=fsdp2"]


def tiny_llama(tmp_path: Path, *extra: str) -> config_mod.Config:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent / "configs"))
    from make_tiny_hf_model import build

    build(tmp_path / "llama", layers=2, hidden=32, heads=2, context=64)
    return config_mod.load(EXAMPLE, [x for x in TINY if not x.startswith("--model.n_")]
                           + [f"--model.path={tmp_path / 'llama'}", "--model.init=", *extra])


# --------------------------------------------------------------------------- config and structure


def test_sharding_is_in_help_and_fsdp2_needs_two_learners():
    assert "--distributed.sharding='ddp'  ('ddp'|'fsdp2')" in config_mod.help_text()
    assert tiny_cfg(*FSDP).distributed.sharding == "fsdp2"
    with pytest.raises(config_mod.ConfigError, match=r"distributed\.sharding.*needs distributed\.learners >= 2, got 1"):
        tiny_cfg("--distributed.sharding=fsdp2")
    with pytest.raises(config_mod.ConfigError, match=r"distributed\.sharding.*must be one of"):
        tiny_cfg("--distributed.sharding=zero3")


def test_the_blocks_are_the_built_in_blocks_and_the_llama_layers(tmp_path):
    tiny = build_mod.build(tiny_cfg("--model.n_layer=2")).model
    assert fsdp.blocks(tiny) == list(tiny.blocks) and len(tiny.blocks) == 2
    llama = build_mod.build(tiny_llama(tmp_path)).model
    layers = list(llama.model.model.layers)
    assert fsdp.blocks(llama) == layers and len(layers) == 2
    lora = build_mod.build(tiny_llama(tmp_path, "--model.lora_r=4")).model
    assert fsdp.blocks(lora) == list(lora.model.get_base_model().model.layers)


# --------------------------------------------------------------------------- the update


def _state_close(got: dict, want: dict, atol: float, what: str) -> None:
    """Two optimizer state dicts in the one-process format agree: the same groups, indices and keys,
    the tensors to `atol`."""
    assert got["param_groups"] == want["param_groups"], what
    assert sorted(got["state"]) == sorted(want["state"]), what
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st), what
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k].cpu(), v.cpu(), rtol=0, atol=atol, msg=f"{what}: {i}.{k}")


@pytest.mark.parametrize("agg", list(losses.AGGREGATIONS))
def test_two_fsdp2_learners_make_the_one_learner_update(ray_local, agg):
    # two minibatches (two AdamW steps), ranks holding groups of 3, 1, 2 and 0 tokens, the global-norm clip
    # active (grad_clip well below the norm): the trainer's policy gets the one-process weights, and the
    # optimizer state saving reads (gathered from both ranks' shards) is the one-process state dict
    cfg = tiny_cfg(*FSDP, f"--algorithm.agg={agg}", "--train.minibatches=2", "--model.n_layer=2", "--train.grad_clip=0.05")
    one, two = build_mod.build(cfg), build_mod.build(cfg)
    l1, l2 = new_learner(one), new_learner(two)
    batch = _uneven_batch(one)
    s1 = learn(l1, copy.deepcopy(batch))
    group = learners_mod.LearnerGroup(cfg, l2, build_mod.build)
    try:
        assert all(p.to_local().shape[0] < p.shape[0] for p in group.train.policy.blocks.parameters())  # sharded
        s2 = group.learn(batch)
        _state_close(l2.opt.state_dict(), l1.opt.state_dict(), 1e-7, agg)
    finally:
        group.close()
    assert s1["grad_norm"] > 0.05
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters()):
        assert type(p2) is torch.nn.Parameter
        # the moments agree to 1e-7 above; AdamW divides m by sqrt(v) + eps, which magnifies the reduce-scatter's
        # different summation order on an element whose gradient is near 0 (seen: seq_sum_const, 1 element of
        # 4096 off by 1.04e-6 of a weight of 0.063), hence 1e-4 of the weight beside the absolute 1e-6
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-6, msg=lambda m: f"{agg}: {name}: {m}")
    assert math.isclose(s1["loss"], s2["loss"], rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(s1["grad_norm"], s2["grad_norm"], rel_tol=1e-5)
    assert s2["optimizer_steps"] == 2 and l2.sched.last_epoch == l1.sched.last_epoch == 2
    with pytest.raises(setup_types.RunError, match="closed"):
        l2.opt.state_dict()


def test_an_fsdp2_rank_without_groups_adds_nothing(ray_local):
    # one group for two ranks (dynamic sampling may keep so few): rank 1 runs it at weight 0, since the
    # sharded forward and backward are collectives every rank must join
    one_group_for_two_ranks(tiny_cfg(*FSDP))


def test_fsdp2_ranks_in_micro_batches_make_the_one_learner_update(ray_local):
    # 3 groups over two ranks (2 and 1), train.micro_batches = 2: the rank with one group repeats it at
    # weight 0, since every sharded forward and backward is a collective both ranks must join
    micro_batches_in_a_group(tuple(FSDP), 3, rtol=1e-4)


def test_fsdp2_ranks_compute_logp_old_of_their_rows_as_one_learner_does(ray_local):
    # each rank's logp_old forwards over its own rows of minibatch 2 are sharded forwards without a
    # backward (all-gathers both ranks join), then the ranks exchange their rows for the second pass
    logp_old_from_the_group(*FSDP, rtol=1e-4)


def _fp32_moments(tmp_path: Path, args: tuple, init: dict, batch) -> dict:
    """The one-process optimizer state after learning `batch` from the weights `init` in fp32."""
    fp32 = build_mod.build(tiny_llama(tmp_path, *args, "--model.autocast=off"))
    fp32.model.load_state_dict(init)
    learner = new_learner(fp32)
    learn(learner, copy.deepcopy(batch))
    return learner.opt.state_dict()


def _bf16_moments_agree(got: dict, want: dict, fp32: dict) -> None:
    """Under bf16 autocast a weight's gradient is rounded to bf16 where its product writes it, on each
    rank for that rank's rows, so the ranks' sum rounds differently from one process's whole-batch
    gradient (measured: up to 1% of a tensor's largest entry, a few bf16 steps of 2^-8). The FSDP2
    first moments are within 2^-5 of the one-process bf16 ones, relative to each tensor's largest
    entry; and away from the fp32 ones by more than 1e-3 (fp32 FSDP2 matches fp32 to 1e-5), so the
    test fails if the learners computed in fp32."""
    far = 0.0
    for i, st in want["state"].items():
        a, b, c = got["state"][i]["exp_avg"], st["exp_avg"], fp32["state"][i]["exp_avg"]
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 2**-5 * scale, i
        far = max(far, float((a - c).abs().max()) / scale if scale else 0.0)
    assert far > 1e-3


@pytest.mark.parametrize("lora,autocast", [(0, "off"), (4, "off"), (4, "bf16")])
def test_two_fsdp2_learners_on_a_hugging_face_model(ray_local, tmp_path, lora, autocast):
    # a 2-layer Llama with the shared-prompt forward (two forwards per backward through the sharded
    # layers, in transformers' forward: the lean one bypasses the layer calls FSDP2 hooks). The weights
    # are not compared (see test_two_learners_on_a_hugging_face_model: Adam's first step turns rounding
    # in gradients of ~1e-9 into steps of up to lr); after one step AdamW's first moment is
    # (1 - β1) × the clipped gradient, gathered from both ranks: it is the one-process gradient to rounding.
    # Under LoRA the frozen weights are sharded too and only the adapter is gathered back
    args = (*FSDP, "--model.share_prompt_forward=true", f"--model.lora_r={lora}")
    cfg = tiny_llama(tmp_path, *args, f"--model.autocast={autocast}")
    one, two = build_mod.build(cfg), build_mod.build(cfg)
    init = copy.deepcopy(one.model.state_dict())
    two.model.load_state_dict(init)  # peft's LoRA init is not seeded by train.seed
    assert one.model.differentiable_cache and one.model.uses_fast_path
    l1, l2 = new_learner(one), new_learner(two)
    batch = _uneven_batch(one)
    learn(l1, copy.deepcopy(batch))
    before = {n: p.detach().clone() for n, p in two.model.named_parameters()}
    group = learners_mod.LearnerGroup(cfg, l2, build_mod.build)
    try:
        assert not group.train.policy.uses_fast_path and two.model.uses_fast_path
        group.learn(batch)
        got, want = l2.opt.state_dict(), l1.opt.state_dict()
    finally:
        group.close()
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"])
    if autocast == "off":
        for i, st in want["state"].items():
            torch.testing.assert_close(got["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-5, atol=1e-8, msg=str(i))
    else:
        _bf16_moments_agree(got, want, _fp32_moments(tmp_path, args, init, batch))
    # the trainer's copy received the update: every weight moved by at most lr (Adam's first step), as in one process
    lr = cfg.train.lr
    assert any(not torch.equal(before[n], p) for n, p in two.model.named_parameters())
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters()):
        assert float((p2.detach() - before[name]).abs().max()) <= lr * 1.001, name
        assert float((p1.detach() - p2.detach()).abs().max()) <= 2 * lr * 1.001, name



# --------------------------------------------------------------------------- a run, saved and resumed


def test_an_fsdp2_run_saves_the_one_process_state_and_resumes_in_any_layout(ray_local, tmp_path):
    # 2 steps on 2 FSDP2 learners, then step 3 resumed (a) on 2 FSDP2 learners, (b) in one process, against
    # 3 one-process steps: the same rewards at every step and the same weights to float rounding
    straight = _cli_train(tmp_path / "straight")
    _cli_train(tmp_path / "fsdp", *FSDP, "--train.steps=2")
    shutil.copytree(tmp_path / "fsdp", tmp_path / "one")
    resumed = _cli_train(tmp_path / "fsdp", *FSDP, "--resume")
    relaid = _cli_train(tmp_path / "one", "--resume")
    key = "train/reward"
    assert [r[key] for r in resumed if key in r] == [r[key] for r in straight if key in r] == \
        [r[key] for r in relaid if key in r]
    want = load_file(str(tmp_path / "straight" / "state" / "tensors.safetensors"))
    for d in ("fsdp", "one"):
        got = load_file(str(tmp_path / d / "state" / "tensors.safetensors"))
        assert got.keys() == want.keys(), d
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=f"{d}: {k}")
