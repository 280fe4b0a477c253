"""rlvr.tasks.reward_model: a tiny local sequence-classification RM as a reward (no downloads)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from rlvr.rewards import score  # noqa: E402
from rlvr.tasks import TaskError, load_task  # noqa: E402
from rlvr.tasks.reward_model import RewardModelReward, add_reward_model  # noqa: E402

WORDS = list("abcdefghijklmnopqrstuvwxyz0123456789+=?")


def build_rm(path, num_labels=1):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      num_labels=num_labels, pad_token_id=0)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    return RewardModelReward(build_rm(tmp_path_factory.mktemp("rm")), batch_size=2, max_length=32)


def test_scores_are_floats_deterministic_and_differ(rm):
    a = rm("what is 2+2?", "4", None)
    assert isinstance(a, float) and a == rm("what is 2+2?", "4", "ignored")
    assert rm("what is 2+2?", "5 5 5 5", None) != a


def test_batched_matches_single_with_padding(rm):
    prompts = ["abc", "what is 2+2?", "x", "hello"]
    responses = ["1", "4", "a long answer here", ""]
    batch = rm.score_batch(prompts, responses)
    single = [rm(p, r, None) for p, r in zip(prompts, responses)]
    assert batch == pytest.approx(single, abs=1e-5)


def test_truncation_keeps_the_end(rm):
    long = "a" * 100
    assert rm(long, "b", None) == pytest.approx(rm("a" * 40, "b", None), abs=1e-5)  # same last 32 tokens


def test_reward_card_and_task(rm, tmp_path):
    r = rm.reward()
    assert score(r, "p", "q", None).status == "ok"
    assert "over-optimisation" in r.card.exploit and "correctness" in r.card.ignores
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}=", "answer": str(i)}) + "\n" for i in range(10)))
    task = load_task("rlvr.tasks.reward_model:rm_task", model=rm.path, train=str(p), max_length=16)
    assert set(task.rewards) == {"exact_match", "rm"}
    ex = task.train[0]
    assert isinstance(task.rewards["rm"](ex.prompt, "5", ex.answer), float)
    with pytest.raises(TaskError, match="already has a reward named 'rm'"):
        add_reward_model(task, rm)


def test_load_errors(tmp_path):
    with pytest.raises(TaskError, match="not a local directory"):
        RewardModelReward(tmp_path / "nope")
    with pytest.raises(TaskError, match="num_labels=2"):
        RewardModelReward(build_rm(tmp_path / "two", num_labels=2))


def test_pickled_weights_are_refused_with_the_conversion(tmp_path):
    d = tmp_path / "pickled"
    build_rm(d)
    for f in d.glob("*.safetensors"):
        f.rename(d / "pytorch_model.bin")          # what an old checkpoint holds: a pickle
    with pytest.raises(TaskError, match=r"pytorch_model\*\.bin \(pickle\).*save_pretrained\(dir\)"):
        RewardModelReward(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(TaskError, match="no weights"):
        RewardModelReward(d)


def test_score_batch_uses_one_batched_call(rm, monkeypatch):
    from rlvr.rewards import score_batch

    reward = rm.reward()
    single = [rm("q", r) for r in ("a", "bb", "ccc")]
    calls = []
    real = rm.score_batch

    def spy(prompts, responses):
        calls.append(len(responses))
        return real(prompts, responses)

    monkeypatch.setattr(rm, "score_batch", spy)
    out = score_batch({reward.name: (reward, 1.0)}, ["q"] * 3, ["a", "bb", "ccc"], [None] * 3)
    assert calls == [3]
    assert out.per_reward[reward.name] == pytest.approx(single, abs=1e-5)
