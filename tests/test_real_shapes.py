"""A model with SmolLM2-135M's shapes but narrow layers: vocabulary 49,152, 30 layers, grouped-query
attention (9 query heads, 3 key/value heads), tied embedding and head, a ChatML chat template, and
the arithmetic task's real chat prompts. Toys (vocabulary 48, 2 layers) pass through none of the
size-dependent paths: the output head in vocabulary blocks, GQA's grouping at 30 layers, a tied
head in the state and the export. Hidden size 72 keeps it to ~5M parameters (seconds on a CPU)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

from rlvr import cli, sampling, scoring  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

V, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 49_152, 30, 9, 3, 8
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def smollm2_shaped(path, layers: int = LAYERS):
    """Save the model (`layers` decoder layers) and a 49,152-token tokenizer (the specials, printable
    ASCII and newline one token each, then filler tokens) to `path`."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = SPECIALS + chars + [f"<t{i}>" for i in range(V - len(SPECIALS) - len(chars))]
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    bk.add_special_tokens(SPECIALS)
    bk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = CHATML
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=HEADS * HEAD_DIM, intermediate_size=192, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return smollm2_shaped(tmp_path_factory.mktemp("smollm2_shaped"))


SHALLOW = 6
"""Decoder layers of the model the bf16 runs below train: every layer has the same shapes, so its
products take the same kernels at any depth, and what those runs check (a forward's rounding
against another's) shows at the first layer where two forwards differ; the vocabulary, the heads,
the tied head and the prompts are the ones above. Under bf16 on a CPU without bf16 units (emulated)
a run of the 30 layers took twice as long."""


@pytest.fixture(scope="module")
def shallow_dir(tmp_path_factory):
    return smollm2_shaped(tmp_path_factory.mktemp("smollm2_shallow"), layers=SHALLOW)


ARITH = ["--task.path=rlvr.tasks.arith:arith_task", "--task.reward=correct",
         "--task.options={ops = \"+\", digits = 2, heldout = 16, seed = 0, max_new_tokens = 12}",
         "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--train.steps=2", "--train.lr=1e-3",
         "--eval.prompts=8", "--eval.pass_k=0", "--eval.every=0", "--task.reward_workers=0"]


def test_sampler_logprobs_equal_the_training_forward_at_real_shapes(model_dir):
    """The lean decode (KV cache written in place, GQA grouping, the head in vocabulary blocks) and the
    training forward (shared prompt, chunked log-softmax) give the same log-probs, and the first
    decode logits equal transformers' own forward."""
    from rlvr.models.hf import load_policy
    from rlvr.tasks.arith import arith_task
    from rlvr.tokenizer import encode_example

    policy, tok = load_policy(model_dir)
    assert policy.uses_fast_path and policy.hf_config.vocab_size == V
    hf = policy._hf_model()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight                  # tied
    task = arith_task(ops="+", digits=2, heldout=16)
    prompts = [encode_example(tok, ex) for ex in task.heldout[:4]]
    assert min(map(len, prompts)) > 30                                        # chat prompts, not a few tokens
    policy.eval()
    with torch.no_grad():
        ro = sampling.generate(policy, prompts, samples_per_prompt=4, max_new_tokens=12, temperature=1.0,
                               eos_id=None, pad_id=tok.pad_id,
                               generators=sampling.prompt_generators(7, 0, len(prompts)))
        again = scoring.sequence_token_logprobs(policy, ro, temperature=1.0, group_size=4)
        again = again if isinstance(again, torch.Tensor) else again.logp
    m = ro.mask.bool()
    assert ro.mask.shape == (16, 12) and m.all()
    torch.testing.assert_close(again[m], ro.logp[m], atol=2e-5, rtol=0)
    ids, am = ro.ids[:1, :ro.prompt_len + 3], ro.attention_mask[:1, :ro.prompt_len + 3]
    with torch.no_grad():
        lean = policy(ids, attention_mask=am)
        policy.fast_path = False
        try:
            ref = policy(ids, attention_mask=am)
        finally:
            policy.fast_path = True
    torch.testing.assert_close(lean[am.bool()], ref[am.bool()], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lora", [True, False])
def test_trains_saves_and_exports_the_tied_model(tmp_path, model_dir, lora, capsys):
    """Two steps through the real command, LoRA (reference = adapter off) or full fine-tuning with a
    KL reference (the price shows the copy); the state and hf/ hold the tied weight once and hf/
    reloads with plain transformers, tied."""
    out = tmp_path / "run"
    extra = ["--algorithm.kl_coef=0.01"] + (["--model.lora_r=4"] if lora else [])
    assert cli.main(["train", "examples/sort.toml", "--out", str(out), f"--model.path={model_dir}",
                     *ARITH, *extra]) == 0
    stdout = capsys.readouterr().out
    price = json.loads((out / "price.json").read_text())
    assert price["prompt_tokens"] > 30 and price["max_new_tokens"] == 12
    if lora:
        assert "reference = the policy with its LoRA adapter disabled (no copy)" in stdout
    else:
        assert price["reference_bytes"] == price["policy_bytes"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval0/goal" in summary and "eval/goal" in summary
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(out / "hf" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys   # the tied weight once
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == V and model.config.num_hidden_layers == LAYERS
    assert cli.main(["train", "examples/sort.toml", "--out", str(out), f"--model.path={model_dir}", *ARITH,
                     *extra, "--train.steps=3", "--train.price_probes=false", "--resume"]) == 0  # the state resumes
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("extra, in_rollout", [
    ([], False), (["--train.micro_batches=2"], False), (["--algorithm.top_entropy_quantile=0.5"], True),
    (["--algorithm.top_entropy_quantile=0.5", "--train.micro_batches=2"], True),
    (["--train.minibatches=2", "--train.lr=1e-30"], False),
    (["--train.minibatches=2", "--train.micro_batches=2", "--train.lr=1e-30"], False),
])
def test_under_bf16_the_first_ratio_is_exactly_1_at_real_shapes(tmp_path, shallow_dir, extra, in_rollout):
    """bf16 autocast with LoRA at these shapes (SHALLOW layers of them), `algorithm.logp_old` left at
    auto: logp_old is the learner's own forward, so the first minibatch's ratio is 1 to the last bit,
    with one micro-batch and with two: the learner's first forward itself, or (where Δ needs it
    first: top_entropy_quantile) the rollout stage's run as the learner's (gradient enabled, its
    parts; a no-gradient forward gives the sampler's numbers here, not the learner's). With two
    minibatches the second's logp_old comes from its own parts before the first update: at a
    learning rate too small to move a weight (1e-30) every minibatch's ratio is exactly 1, its
    minimum and maximum included (a forward over other rows rounds differently here). The sampler's
    gap is logged; the price counts every forward logp_old takes."""
    out = tmp_path / "run"
    # no evaluation at step 0, one held-out prompt at the end and no price probes (the runs above time
    # them at these shapes; their decode and learn parts are the longest part of a run here): only the
    # steps' figures and the price's counts are read here
    assert cli.main(["train", "examples/sort.toml", "--out", str(out), f"--model.path={shallow_dir}", *ARITH,
                     "--model.lora_r=4", "--model.autocast=bf16", "--eval.at_start=false", "--eval.prompts=1",
                     "--train.price_probes=false", *extra]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/reward" in r]
    assert len(steps) == 2
    assert all(r["train/first_step_ratio_mean"] == 1.0 and r["train/sampler_logp_absdiff"] >= 0 for r in steps)
    price = json.loads((out / "price.json").read_text())
    assert price["logp_old_recomputed"] is in_rollout and price["logp_old_from_learner"] is not in_rollout
    two = "--train.minibatches=2" in extra
    assert (price["forward_tokens_logp_old_per_batch"] > 0) is (in_rollout or two)
    if two:
        assert all(r["train/ratio_min"] == 1.0 == r["train/ratio_max"] and r["train/clip_frac"] == 0.0
                   for r in steps)
