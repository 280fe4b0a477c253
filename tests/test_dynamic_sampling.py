"""Dynamic sampling (DAPO): agreeing groups are dropped and the batch refilled, every round paid for."""

import json
from types import SimpleNamespace

import pytest
import torch

from rlvr import cli, rollout, sampling
from rlvr.tasks import Example

G = 2


def fake_groups(rewards: list[list[float]], tag: str, prompt_len: int = 3, T: int = 2) -> rollout.Groups:
    """Groups whose rollout rows are recognisable: ids hold the group number, the prompt is `tag`."""
    P = len(rewards)
    B = P * G
    ids = torch.arange(B).repeat_interleave(prompt_len + T).view(B, prompt_len + T) // G + 3
    roll = sampling.Rollout(ids=ids, attention_mask=torch.ones_like(ids), prompt_len=prompt_len,
                            mask=torch.ones(B, T), logp=-torch.ones(B, T), truncated=torch.zeros(B, dtype=torch.bool))
    r = torch.tensor(rewards)
    return rollout.Groups(
        examples=[Example(f"{tag}{i}", "a") for i in range(P)], rollout=roll,
        responses=[f"{tag}{b // G}" for b in range(B)], rewards=r, hits=r == 1,
        per_reward={"x": r.reshape(-1).tolist()}, failures=0, status_counts={"ok": B}, errors=[],
    )


@pytest.fixture
def scripted():
    """Replace the sampler-and-scorer with scripted rounds; record how many rounds were drawn."""
    def install(rounds):
        it = iter(rounds)
        calls = []

        def fake_sample(examples):
            calls.append(examples)
            return next(it)
        return fake_sample, calls
    return install




def test_refills_until_the_batch_is_full(scripted):
    sample, calls = scripted([
        fake_groups([[1, 1], [0, 1], [0, 0]], "a"),         # one useful group (a1)
        fake_groups([[0, 0], [1, 0], [0.5, 0.5]], "b"),     # one useful (b1); 0.5/0.5 agrees too
        fake_groups([[1, 0], [0, 1], [1, 0]], "c"),         # three useful, one needed
    ])
    batch, parts = rollout.dynamic_sample(sample, lambda: ["p"] * 3, P=3, G=G, rounds=5, pad_id=0)
    assert len(calls) == 3 and len(parts) == 3
    assert [ex.prompt for ex in batch.examples] == ["a1", "b1", "c0"]
    assert batch.rewards.tolist() == [[0, 1], [1, 0], [1, 0]]
    assert batch.responses == ["a1", "a1", "b1", "b1", "c0", "c0"]
    # rows of the rollout travel with their group: ids encode the group number inside its round
    assert batch.rollout.ids[:, 0].tolist() == [4, 4, 4, 4, 3, 3]
    assert batch.per_reward["x"] == [0, 1, 1, 0, 1, 0]


def test_stops_at_the_round_limit_with_a_smaller_batch(scripted):
    sample, _ = scripted([fake_groups([[1, 1], [0, 1]], "a"), fake_groups([[0, 0], [0, 0]], "b")])
    batch, parts = rollout.dynamic_sample(sample, lambda: ["p"] * 2, P=2, G=G, rounds=2, pad_id=0)
    assert len(parts) == 2
    assert [ex.prompt for ex in batch.examples] == ["a1"]


def test_all_rounds_agree_falls_back_to_the_first(scripted):
    first = fake_groups([[1, 1], [0, 0]], "a")
    sample, _ = scripted([first, fake_groups([[1, 1], [1, 1]], "b"), fake_groups([[0, 0], [0, 0]], "c")])
    batch, parts = rollout.dynamic_sample(sample, lambda: ["p"] * 2, P=2, G=G, rounds=3, pad_id=0)
    assert batch is first and len(parts) == 3


def test_concat_pads_prompts_left_and_responses_right():
    a = fake_groups([[1, 0]], "a", prompt_len=2, T=3)
    b = fake_groups([[1, 0]], "b", prompt_len=4, T=1)
    c = sampling.concat([a.rollout, b.rollout], pad_id=0)
    assert c.prompt_len == 4 and c.ids.shape == (4, 7) and c.mask.shape == (4, 3)
    assert c.attention_mask[:2, :2].sum() == 0 and c.ids[:2, :2].sum() == 0     # a's prompts, left-padded
    assert c.mask[2:, 1:].sum() == 0 and c.logp[2:, 1:].sum() == 0              # b's responses, right-padded
    assert c.response_ids[:2].tolist() == a.rollout.response_ids.tolist()


def test_end_to_end_counts_every_round(tmp_path):
    out = tmp_path / "run"
    tiny = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.prompts_per_step=4",
            "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 50}", "--eval.prompts=20",
            "--eval.pass_k=0", "--eval.every=0", "--train.steps=3", "--algorithm.dynamic_sampling=true",
            "--algorithm.dynamic_sampling_rounds=3", "--task.reward=exact"]
    assert cli.main(["train", "examples/sort.toml", "--out", str(out), *tiny]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/reward" in r]
    # a random policy almost never sorts: exact-match groups all agree at 0, so every step uses 3 rounds
    assert [r["train/sampling_rounds"] for r in train_rows] == [3, 3, 3]
    summary = json.loads((out / "summary.json").read_text())
    price = json.loads((out / "price.json").read_text())
    assert summary["cost/sampled_tokens"] == 3 * 3 * 4 * 4 * 3      # steps x rounds x P x G x T (fixed length)
    assert summary["cost/sampled_tokens"] == price["sampled_tokens_per_run_worst"]
