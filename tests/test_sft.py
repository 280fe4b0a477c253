"""`rlvr sft` (rlvr.sft): the loss mask by hand, the demonstrations' layout and errors, and a warm start
that `rlvr train --model.init` starts RL from."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from rlvr import config as config_mod
from rlvr.cli import main
from rlvr.tasks import Example
from rlvr.models.tiny import TinyConfig, TinyTransformer
from rlvr.sft import (Demo, SftError, collate, encode_turns, load_demos, masked_nll, read_jsonl, sft_loss)
from rlvr.tasks import load_task
from rlvr.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
SORT = ROOT / "examples" / "sort.toml"
SORT3 = ["--task.options.n=3", "--task.options.heldout=200", "--task.reward_workers=0", "--train.threads=1",
         "--eval.prompts=100", "--eval.pass_k=0"]


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


class PositionLogits(torch.nn.Module):
    """A stub policy whose logits depend on the position only (a (L, V) table), never on the tokens:
    changing a token changes only its own target's term of the loss, never another's context."""

    differentiable_cache = False

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, ids, *, attention_mask=None, cache=None, logits_to_keep=0):
        out = self.table[: ids.size(1)].expand(ids.size(0), -1, -1)                  # (B, L, V)
        return out[:, -logits_to_keep:] if logits_to_keep else out


# a demonstration: prompt "ab", then assistant "c", a tool result "dd" (inserted), assistant "e" + eos
TOK = CharTokenizer("abcde")
a, b, c, d, e = TOK.encode("abcde")
DEMO = Demo(prompt=[a, b], tokens=[c, d, d, e, TOK.eos_id], trained=[True, False, False, True, True], source="t")


def loss_of(model, demo: Demo) -> float:
    ids, am, Lp, mask = collate([demo], TOK.pad_id)
    return float(sft_loss(model, ids, am, Lp, mask).detach())


def test_collate_puts_the_mask_on_assistant_tokens_only():
    short = Demo(prompt=[a], tokens=[c], trained=[True], source="s")
    ids, am, Lp, mask = collate([DEMO, short], TOK.pad_id)
    assert Lp == 2 and ids.shape == (2, 7) and mask.shape == (2, 5)
    assert ids[0].tolist() == [a, b, c, d, d, e, TOK.eos_id]
    assert ids[1].tolist() == [TOK.pad_id, a, c] + [TOK.pad_id] * 4      # prompt left-padded, response right
    assert am[1].tolist() == [0, 1, 1, 0, 0, 0, 0]
    assert mask.tolist() == [[1, 0, 0, 1, 1], [1, 0, 0, 0, 0]]


def test_loss_by_hand_uniform_logits_is_log_vocab():
    """Every position predicts uniformly: each trained token costs log V, so their mean is log V."""
    model = PositionLogits(torch.zeros(8, TOK.vocab_size))
    assert loss_of(model, DEMO) == pytest.approx(math.log(TOK.vocab_size), abs=1e-6)


def test_loss_by_hand_counts_only_the_trained_targets():
    torch.manual_seed(0)
    table = torch.randn(8, TOK.vocab_size)
    model = PositionLogits(table)
    logp = torch.log_softmax(table, dim=-1)
    # response token t sits at position 2 + t and is predicted by position 1 + t; trained: t = 0, 3, 4
    want = -(logp[1, c] + logp[4, e] + logp[5, TOK.eos_id]) / 3
    assert loss_of(model, DEMO) == pytest.approx(float(want), abs=1e-6)


def test_changing_a_prompt_or_tool_target_leaves_the_loss_changing_a_response_target_moves_it():
    torch.manual_seed(1)
    model = PositionLogits(torch.randn(8, TOK.vocab_size))
    base = loss_of(model, DEMO)
    prompt_changed = Demo([a, e], DEMO.tokens, DEMO.trained, "t")                 # the prompt's 2nd token
    tool_changed = Demo(DEMO.prompt, [c, a, b, e, TOK.eos_id], DEMO.trained, "t")  # the inserted tokens
    answer_changed = Demo(DEMO.prompt, [c, d, d, a, TOK.eos_id], DEMO.trained, "t")  # an assistant token
    assert loss_of(model, prompt_changed) == pytest.approx(base, abs=1e-7)
    assert loss_of(model, tool_changed) == pytest.approx(base, abs=1e-7)
    assert abs(loss_of(model, answer_changed) - base) > 1e-3


def test_loss_by_hand_on_the_tiny_transformer():
    """The built-in model's full forward, log-softmax by hand, the trained targets picked out by hand."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=16))
    ids = torch.tensor([[a, b, c, d, d, e, TOK.eos_id]])
    logp = torch.log_softmax(model(ids), dim=-1)[0]                                   # (L, V)
    want = -(logp[1, c] + logp[4, e] + logp[5, TOK.eos_id]) / 3
    got = loss_of(model, DEMO)
    assert got == pytest.approx(float(want.detach()), abs=1e-5)
    assert float(masked_nll(torch.zeros(1, 3), torch.zeros(1, 3))) == 0.0           # nothing trained: no NaN


def test_encode_turns_eos_after_an_answer_not_after_a_call_and_inserted_turns_untrained():
    tok = CharTokenizer("<>/calresut0123456789 ")
    turns = [{"role": "assistant", "content": "<calc>1</calc>"}, {"role": "tool", "content": "<result>1</result>"},
             {"role": "assistant", "content": "1"}]
    ids, trained = encode_turns(tok, turns, stop=("</calc>",), templated=False, eos=True)
    n_call, n_res = len("<calc>1</calc>"), len("<result>1</result>")
    assert ids == tok.encode("<calc>1</calc><result>1</result>1") + [tok.eos_id]
    assert trained == [True] * n_call + [False] * n_res + [True, True]
    ids, trained = encode_turns(tok, turns[-1:], stop=(), templated=False, eos=False)   # fixed-length task
    assert ids == tok.encode("1") and trained == [True]


# --------------------------------------------------------------------------- demonstrations and their errors


def sort_cfg(*overrides: str) -> config_mod.Config:
    return config_mod.load(SORT, [*SORT3, *overrides])


@pytest.mark.parametrize("line, says", [
    ("{not json", "not valid JSON"),
    ('["a"]', 'expected an object {"messages": [...]}'),
    ('{"messages": [{"role": "user", "content": "1="}]}', "no assistant turn"),
    ('{"messages": [{"role": "assistant", "content": "1"}]}', "a prompt (a user or system turn) must come first"),
    ('{"messages": [{"role": "user", "content": "1="}, {"role": "assistant", "content": "1"}, '
     '{"role": "tool", "content": "x"}]}', "ends with the assistant's"),
    ('{"messages": [{"role": "robot", "content": "1="}]}', "has role 'robot'"),
    ('{"messages": [{"role": "user", "content": 5}]}', 'string "role" and "content"'),
])
def test_bad_lines_are_named_by_file_and_line(tmp_path, line, says):
    f = tmp_path / "demos.jsonl"
    good = '{"messages": [{"role": "user", "content": "321="}, {"role": "assistant", "content": "123"}]}'
    f.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(SftError) as e:
        read_jsonl(f)
    assert f"{f}:3: " in str(e.value) and says in str(e.value)


def test_a_character_the_model_cannot_write_is_named_by_file_and_line(tmp_path):
    cfg = sort_cfg()
    task = load_task(cfg.task.path, **cfg.task.options)
    tok = CharTokenizer("0123456789=")
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "321="}, {"role": "assistant", "content": "123"}]}\n'
                 '{"messages": [{"role": "user", "content": "321="}, {"role": "assistant", "content": "1x3"}]}\n')
    cfg.sft.data = str(f)
    with pytest.raises(SftError, match=rf"{f}:2: the model's tokenizer cannot encode it: character 'x'"):
        load_demos(cfg, task, tok, 3, eos=False)
    f.write_text('{"messages": [{"role": "user", "content": "321="}, {"role": "assistant", "content": "1234"}]}\n')
    with pytest.raises(SftError, match=rf"{f}:1: the response has 4 tokens, more than the run's max_new_tokens = 3"):
        load_demos(cfg, task, tok, 3, eos=False)


def test_jsonl_demonstrations_use_the_runs_prompt_encoding(tmp_path):
    cfg = sort_cfg()
    task = load_task(cfg.task.path, **cfg.task.options)
    tok = CharTokenizer("0123456789=")
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "321="}, {"role": "assistant", "content": "123"}]}\n')
    cfg.sft.data = str(f)
    [demo] = load_demos(cfg, task, tok, 3, eos=False)
    assert demo.prompt == tok.encode("321=") and demo.tokens == tok.encode("123") and all(demo.trained)
    assert demo.source == f"{f}:1"


def test_task_demonstrations_sort_and_the_calculator():
    cfg = sort_cfg("--sft.examples=5")
    task = load_task(cfg.task.path, **cfg.task.options)
    tok = CharTokenizer(task.alphabet)
    demos = load_demos(cfg, task, tok, task.max_new_tokens, eos=False)
    assert len(demos) == 5
    for ex, dm in zip(task.train, demos):
        assert tok.decode(dm.prompt) == ex.prompt and tok.decode(dm.tokens) == ex.answer == "".join(sorted(ex.prompt[:-1]))
    calc = load_task("rlvr.tasks.arith:arith_task", ops="*", digits=1, heldout=5, calculator=True)
    ex = calc.train[0]
    turns = calc.demonstrate(ex)
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
    env = calc.environment()
    env.reset(ex.prompt, ex.answer)
    assert env.step(turns[0]["content"]).observation == turns[1]["content"]     # what the calculator would insert
    assert calc.goal(ex.prompt, "".join(t["content"] for t in turns), ex.answer)


def test_no_data_and_no_demonstrate_is_refused():
    cfg = sort_cfg()
    task = load_task("rlvr.tasks.countdown:countdown_task", n=3, train=20, heldout=5)
    with pytest.raises(SftError, match="has no demonstrate"):
        load_demos(cfg, task, CharTokenizer("0123456789"), 8, eos=True)


def test_cli_names_the_bad_line_and_writes_nothing(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "321="}]}\n')
    rc, _, err = cli("sft", SORT, "--out", tmp_path / "run", f"--sft.data={f}", *SORT3)
    assert rc == 2 and f"{f}:1: no assistant turn" in err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "run"
    rc, stdout, err = cli("sft", SORT, "--out", out, "--sft.epochs=2", "--sft.batch_size=32", "--sft.lr=3e-3", *SORT3)
    assert rc == 0, err
    return out


def test_sft_run_directory_and_the_goal_improves(sft_run):
    for name in ("config.toml", "metrics.jsonl", "summary.json", "checkpoint/model.safetensors",
                 "checkpoint/tokenizer.json"):
        assert (sft_run / name).is_file(), name
    cfg = config_mod.load(sft_run / "config.toml")
    assert cfg.sft.lr == 3e-3 and cfg.sft.epochs == 2
    steps = [r for r in rows(sft_run) if "sft/loss" in r]
    evals = [r for r in rows(sft_run) if "eval/goal" in r]
    assert len(steps) == 2 * math.ceil(800 / 32)
    assert steps[-1]["sft/loss"] < 0.5 * steps[0]["sft/loss"]
    assert evals[0]["step"] == 0 and evals[0]["eval/goal"] < 0.05
    assert evals[-1]["eval/goal"] > 0.5                       # no RL yet: the demonstrations alone
    summary = json.loads((sft_run / "summary.json").read_text())
    assert summary["eval/goal"] == evals[-1]["eval/goal"] and summary["checkpoint"] == str(sft_run / "checkpoint")


def test_rl_starts_from_the_warm_start(sft_run, tmp_path):
    out = tmp_path / "rl"
    rc, stdout, err = cli("train", SORT, "--out", out, f"--model.init={sft_run / 'checkpoint'}", *SORT3,
                          "--train.steps=2", "--train.prompts_per_step=8", "--eval.every=0")
    assert rc == 0, err
    first = next(r for r in rows(out) if "eval/goal" in r and r["step"] == 0)
    warm = json.loads((sft_run / "summary.json").read_text())["eval/goal"]
    assert first["eval/goal"] == pytest.approx(warm)         # the same weights, the same greedy answers
