"""sampling.stop: a response ends at the token whose text completes a stop string.

By hand on a scripted model (which token ends the row, what the rollout says about it); against a
plain oracle that decodes every prefix of every row in full, on a random model whose tokens are
one to three characters, some of them multi-byte; through the config, the run's limits and a
seconds-long `rlvr train`.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from rlvr import build as build_mod, config as config_mod, setup_types
from rlvr.sampling import StopStrings, generate, prompt_generators
from test_sampling import BOS, EOS, PAD, MarkovMock, tiny_model

COUNTDOWN = Path(__file__).resolve().parent / "configs" / "countdown.toml"


def table(nxt: dict[int, int], V: int = 10, big: float = 50.0) -> torch.Tensor:
    """Logits that force token a -> nxt[a] (eos for every other token)."""
    t = torch.zeros(V, V)
    for a in range(V):
        t[a, nxt.get(a, EOS)] = big
    return t


def join(pieces: dict[int, str]):
    """decode for the scripted vocabularies: special tokens dropped, pieces concatenated."""
    return lambda ids: "".join(pieces.get(i, "") for i in ids)


def sentencepiece_like(pieces: dict[int, str]):
    """decode as a SentencePiece tokenizer does it: '▁' is a space and the text's first space is dropped."""
    def decode(ids):
        text = "".join(pieces.get(i, "") for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text
    return decode


def test_a_row_ends_at_the_token_that_completes_a_stop_string():
    # 3 -> 4 -> 5 -> 6 -> eos reads "<", "/b", ">", "!"; 7 -> 7 reads "xy" forever; 8 -> eos
    pieces = {3: "<", 4: "/b", 5: ">", 6: "!", 7: "xy", 8: "z"}
    m = MarkovMock(table({3: 4, 4: 5, 5: 6, 7: 7}))
    prompts = [[BOS, 3], [BOS, 7], [BOS, 8]]
    stop = StopStrings(["b>", "yxyx"], join(pieces))
    r = generate(m, prompts, samples_per_prompt=1, max_new_tokens=6, eos_id=EOS, pad_id=PAD, generator=None,
                 stop=stop)
    # row 0: "/b" then ">" completes "b>" (the stop token is kept); row 1: "xy" "xy" "xy" completes
    # "yxyx" at its third token; row 2: eos first, as without stop strings
    assert r.response_ids.tolist() == [[4, 5, PAD], [7, 7, 7], [EOS, PAD, PAD]]
    assert r.mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert r.truncated.tolist() == [False, False, False]          # every row ended; T = 3 steps run
    assert r.attention_mask[:, r.prompt_len:].tolist() == r.mask.long().tolist()
    assert (r.logp[r.mask == 0] == 0).all() and (r.logp[r.mask == 1].abs() < 1e-6).all()
    # the same rows without the stop strings: row 0 runs to eos, row 1 to the bound (truncated)
    r = generate(m, prompts, samples_per_prompt=1, max_new_tokens=6, eos_id=EOS, pad_id=PAD, generator=None)
    assert r.response_ids[:2].tolist() == [[4, 5, 6, EOS, PAD, PAD], [7] * 6]
    assert r.truncated.tolist() == [False, True, False]
    # a stop string that never completes truncates as before
    r = generate(m, [[BOS, 7]], samples_per_prompt=2, max_new_tokens=4, eos_id=EOS, pad_id=PAD, generator=None,
                 stop=StopStrings(["yy"], join(pieces)))
    assert r.mask.all() and r.truncated.all()


def test_a_stop_string_that_starts_a_decoded_piece_with_a_space_is_found():
    """The stop string " bb" starts at a token three back from the newest: decoded alone from there a
    SentencePiece-like tokenizer drops its space; the one token before the window keeps it."""
    pieces = {3: "a", 4: "▁", 5: "b", 6: "b", 7: "c"}
    m = MarkovMock(table({7: 3, 3: 4, 4: 5, 5: 6}))
    stop = StopStrings([" bb"], sentencepiece_like(pieces))
    assert stop.window == 4                                       # 3 bytes + the token before them
    r = generate(m, [[BOS, 7]], samples_per_prompt=1, max_new_tokens=8, eos_id=EOS, pad_id=PAD, generator=None,
                 stop=stop)
    assert r.response_ids.tolist() == [[3, 4, 5, 6]] and not r.truncated.any()   # "a bb": ends at the last b
    assert sentencepiece_like(pieces)([4, 5, 6]) == "bb"           # what a window without that token reads


def test_stop_strings_are_checked():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([], str)
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["</a>", ""], str)
    assert StopStrings(["é!", "ab"], str).window == 4             # "é" is two UTF-8 bytes


PIECES = {i: s for i, s in enumerate(["", "", "", "a", "b", "ab", "é", "bé", "c", " ", "ca", "b c", "éé"])}


def oracle_end(row: list[int], stops: tuple[str, ...], eos: int, decode=join(PIECES)) -> tuple[int, bool]:
    """(tokens in the response, ended) by decoding every prefix in full: the first token at which
    the text contains a stop string, or eos."""
    for t in range(len(row)):
        if row[t] == eos or any(s in decode(row[:t + 1]) for s in stops):
            return t + 1, True
    return len(row), False


@pytest.mark.parametrize("stops", [("b",), ("ab", "éc"), ("é",), ("c c", "bb"), ("éb", "aa")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stop_strings_against_a_full_decode_of_every_prefix(stops, seed):
    model = tiny_model(seed=seed, V=len(PIECES))
    prompts = [[BOS, 3, 4], [BOS, 8], [BOS, 5, 6, 7], [BOS, 11]]
    kw = dict(samples_per_prompt=4, max_new_tokens=12, temperature=1.3, eos_id=EOS, pad_id=PAD)
    free = generate(model, prompts, generators=prompt_generators(seed, 0, 4), **kw)
    r = generate(model, prompts, generators=prompt_generators(seed, 0, 4), stop=StopStrings(stops, join(PIECES)),
                 **kw)
    ends = [oracle_end(row, stops, EOS) for row in free.response_ids.tolist()]
    assert r.response_ids.shape[1] == max(n for n, _ in ends)      # steps run: until every row ended
    for b, (n, ended) in enumerate(ends):
        assert r.response_ids[b, :n].tolist() == free.response_ids[b, :n].tolist()
        assert r.mask[b].sum().item() == n and r.mask[b, :n].all()
        # to rounding: rows leave the batch as they end (rlvr.sampling.COMPACT_FINISHED), and a
        # product over fewer rows may round differently
        torch.testing.assert_close(r.logp[b, :n], free.logp[b, :n], rtol=0, atol=1e-5)
        assert (r.response_ids[b, n:] == PAD).all() and (r.logp[b, n:] == 0).all()
        assert bool(r.truncated[b]) == (not ended)
    assert any(n < free.response_lengths[b] for b, (n, _) in enumerate(ends))   # the stop strings acted


def test_the_config_and_the_run_limits_carry_stop_strings(tmp_path):
    cfg = config_mod.load(None, ['--sampling.stop=["</answer>", "\\n\\n"]'])
    assert cfg.sampling.stop == ["</answer>", "\n\n"]
    with pytest.raises(config_mod.ConfigError, match="sampling.stop"):
        config_mod.load(None, ['--sampling.stop=["x", ""]'])
    bad = tmp_path / "bad.toml"
    bad.write_text('[sampling]\nstop = ["ok", 3]\n')
    with pytest.raises(config_mod.ConfigError, match=r"sampling\.stop.*bad\.toml"):
        config_mod.load(str(bad), [])
    # the sort task's responses have a fixed length: nothing to stop
    cfg = config_mod.load(None, ['--sampling.stop=["1"]'])
    with pytest.raises(setup_types.RunError, match="sampling.stop.*fixed length"):
        build_mod.build(cfg, log=lambda *a: None)
    cfg = config_mod.load(str(COUNTDOWN), ['--sampling.stop=["="]'])
    setup = build_mod.build(cfg, log=lambda *a: None)
    assert setup.limits.stop == ("=",) and setup.limits.eos_id is not None


def test_a_training_run_stops_its_responses_at_the_stop_strings(tmp_path):
    from rlvr.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(COUNTDOWN), "--out", str(tmp_path / "run"), "--model.n_embd=32", "--model.n_layer=1",
                   "--model.n_head=2", "--train.steps=2", "--train.prompts_per_step=4",
                   "--train.samples_per_prompt=4", "--eval.every=0", "--eval.prompts=10", "--eval.pass_k=0",
                   "--task.options={train = 100, heldout = 10}", "--log.rollouts_per_step=4",
                   '--sampling.stop=["1", "+"]', "--task.reward_workers=0"])
    assert rc == 0, err.getvalue()
    responses = [r for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
                 for r in json.loads(line)["responses"]]
    assert len(responses) == 2 * 4 * 4
    # one character per token: a response holds a stop string only as its last character
    assert all("1" not in r[:-1] and "+" not in r[:-1] for r in responses)
    assert sum(r.endswith(("1", "+")) for r in responses) > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_hugging_face_policy_stops_where_a_full_decode_finds_the_stop_string(tmp_path, dtype):
    """The lean forward's cached decoding (rows of a group sharing their prompt's keys, rows that
    ended dropped from the step), with the model's own tokenizer decoding."""
    pytest.importorskip("transformers")
    from hf_models import make_model_dir
    from rlvr.models.hf import load_policy

    policy, tok = load_policy(make_model_dir(tmp_path, num_key_value_heads=2, tie_word_embeddings=True), dtype=dtype)
    prompts = [tok.encode("ab, c"), tok.encode("x"), tok.encode("12 3:")]
    stops = ("a", "1 ")
    kw = dict(samples_per_prompt=4, max_new_tokens=16, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    free = generate(policy, prompts, generators=prompt_generators(5, 0, 3), **kw)
    r = generate(policy, prompts, generators=prompt_generators(5, 0, 3), stop=StopStrings(stops, tok.decode), **kw)
    stopped = 0
    for b, row in enumerate(free.response_ids.tolist()):
        n, ended = oracle_end(row, stops, tok.eos_id, decode=tok.decode)
        stopped += n < free.response_lengths[b]
        assert r.response_ids[b, :n].tolist() == row[:n] and r.mask[b].sum().item() == n
        # rows that ended leave the batch, so the products' shapes (and their last bits) differ
        assert torch.allclose(r.logp[b, :n], free.logp[b, :n], atol=1e-5) and bool(r.truncated[b]) == (not ended)
    assert stopped > 0
