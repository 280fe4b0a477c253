"""Tool calls inside a response (rlvr.tools): layout by hand on a scripted model, the learner's
log-probs against the sampler's with inserted text in the context (built-in and Hugging Face
policies), chunking, the arith task's calculator, the config checks and a short training run."""

from __future__ import annotations

import contextlib
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest
import torch

from rlvr import build as build_mod, config as config_mod, setup_types, tools
from rlvr.rollout import sample_and_score
from rlvr.sampling import StopStrings, generate
from rlvr.scoring import sequence_token_logprobs
from rlvr.tasks.arith import Calculator, arith_task, calculate, calculator_tool
from test_sampling import BOS, EOS, PAD, MarkovMock

PIECES = {3: "<c>", 4: "7", 5: "</c>", 6: "<r>", 7: "9", 8: "</r>", 9: "!"}


class PieceTokenizer:
    """Whole pieces: encode takes the longest known piece at each position."""

    pad_id, eos_id = PAD, EOS

    def decode(self, ids, stop_at_eos=False):
        return "".join(PIECES.get(i, "") for i in ids)

    def encode(self, text, bos=False):
        ids, i = [], 0
        while i < len(text):
            k = max((k for k, p in PIECES.items() if text.startswith(p, i)), key=lambda k: len(PIECES[k]),
                    default=None)
            if k is None:
                raise ValueError(f"cannot encode {text[i:]!r}")
            ids.append(k)
            i += len(PIECES[k])
        return ids


def table(nxt: dict[int, int], V: int = 10) -> torch.Tensor:
    t = torch.zeros(V, V)
    for a in range(V):
        t[a, nxt.get(a, EOS)] = 50.0
    return t


def respond(model, prompts, tool, *, max_new_tokens=12, max_calls=1):
    tok = PieceTokenizer()
    first = generate(model, prompts, samples_per_prompt=1, max_new_tokens=max_new_tokens, eos_id=EOS, pad_id=PAD,
                     generator=None, stop=StopStrings(["</c>"], tok.decode))
    examples = [SimpleNamespace(prompt=f"p{i}", answer=i) for i in range(len(prompts))]
    return tools.respond_with_tools(model, tok, first, examples, tool, max_new_tokens=max_new_tokens, eos_id=EOS,
                                    stop=("</c>",), max_calls=max_calls, base_seed=None, first_row=0,
                                    sample_kw=dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
                                    autocast=contextlib.nullcontext)


def test_the_tool_text_is_inserted_attended_and_never_trained_on():
    seen = []

    def tool(prompt, text, answer):
        seen.append((prompt, text, answer))
        return "<r>9</r>"

    m = MarkovMock(table({3: 4, 4: 5, 8: 9}))             # "<c>" "7" "</c>" ... "</r>" -> "!" -> eos
    r, stats = respond(m, [[BOS, 3], [BOS, 9]], tool)
    assert seen == [("p0", "7</c>", 0)]                        # row 1 ended at eos: no call
    assert r.response_ids.tolist() == [[4, 5, 6, 7, 8, 9, EOS], [EOS] + [PAD] * 6]
    assert r.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0]]
    assert r.attention_mask[:, r.prompt_len:].tolist() == [[1] * 7, [1] + [0] * 6]
    assert (r.logp[r.mask == 0] == 0).all() and (r.logp[r.mask == 1].abs() < 1e-6).all()
    assert r.truncated.tolist() == [False, False]
    assert (stats.calls, stats.errors, stats.inserted_tokens) == (1, 0, 3)
    # the continuation's prefill ran over the whole context: prompt, sampled call, inserted result;
    # then it drew 2 tokens, feeding back the first (the last drawn is never fed to a forward)
    assert stats.forward_tokens == 7 + (2 - 1)


@pytest.mark.parametrize("empty", [False, True])
def test_continuations_on_the_kv_cache_draw_what_a_new_prefill_draws(monkeypatch, empty):
    """The built-in model's tool continuations reuse the first round's cache (rlvr.sampling.continue_decoding):
    the same rows as re-running each row's whole sequence, log-probs to float rounding. `empty`: the
    tool inserts nothing, so a row that stopped before the round's last step has no token to feed and
    goes on from the logits after its last one."""
    setup = calc_setup(stop='["a", "<"]')
    if empty:
        setup.task.tool = lambda p, r, a: ""
    examples = list(setup.task.train[:6])
    kw = dict(G=4, limits=setup.limits, weights={"correct": 1.0}, temperature=1.0, top_p=0.9)

    def sample():
        return sample_and_score(setup.model, setup.tokenizer, setup.task, examples,
                                generator=torch.Generator().manual_seed(0), **kw)
    monkeypatch.setattr(tools, "_reuse_pays", lambda *a: True)   # every round on the cache (short contexts here)
    cached = sample()
    real = tools.respond_with_tools
    monkeypatch.setattr(tools, "respond_with_tools", lambda *a, **k: real(*a, **{**k, "decoding": None}))
    plain = sample()
    assert cached.tools.calls == plain.tools.calls > 0 and cached.responses == plain.responses
    assert cached.tools.rounds_on_cache == cached.tools.rounds == plain.tools.rounds > 0 == plain.tools.rounds_on_cache
    assert torch.equal(cached.rollout.ids, plain.rollout.ids) and torch.equal(cached.rollout.mask, plain.rollout.mask)
    assert torch.allclose(cached.rollout.logp, plain.rollout.logp, atol=1e-5)
    lp = sequence_token_logprobs(setup.model, cached.rollout, top_p=0.9)
    assert torch.allclose(lp * cached.rollout.mask, cached.rollout.logp, atol=1e-5)


def test_the_cache_is_reused_where_appending_computes_less_than_a_new_prefill():
    rows = [tools._Row([1] * 40, [2] * 10) for _ in range(8)]            # 8 rows, 50 tokens each so far
    # two rows call, inserting 5 tokens: 8 x 6 = 48 appended positions against 2 x 50 prefilled
    assert tools._reuse_pays(rows, {0: [3] * 5, 5: [3] * 5})
    # one row calls, inserting 60: 8 x 61 against 50
    assert not tools._reuse_pays(rows, {0: [3] * 60})


def test_calls_stop_at_max_calls_and_the_bound_cuts_the_response():
    m = MarkovMock(table({3: 4, 4: 5, 8: 3}))             # after "</r>" it calls again, forever
    r, stats = respond(m, [[BOS, 3]], lambda p, t, a: "<r>9</r>", max_calls=1)
    assert r.response_ids.tolist() == [[4, 5, 6, 7, 8, 3, 4, 5]]
    assert r.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1, 1]] and not r.truncated.any()  # ended at its stop string
    r, stats = respond(m, [[BOS, 3]], lambda p, t, a: "<r>9</r>", max_calls=5)
    assert r.response_ids.tolist() == [[4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3]]     # 12 = max_new_tokens
    assert r.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1]] and r.truncated.all()
    assert stats.calls == 2
    # an inserted text longer than the room left is cut there, and the row is truncated
    r, stats = respond(m, [[BOS, 3]], lambda p, t, a: "<r>9</r>", max_new_tokens=4)
    assert r.response_ids.tolist() == [[4, 5, 6, 7]] and r.mask.tolist() == [[1, 1, 0, 0]] and r.truncated.all()
    assert stats.inserted_tokens == 2


@pytest.mark.parametrize("tool,errors", [(lambda p, t, a: None, 0), (lambda p, t, a: 1 / 0, 1),
                                         (lambda p, t, a: 42, 1), (lambda p, t, a: "<r>unknown</r>", 1)])
def test_a_tool_that_answers_none_or_fails_ends_its_row(tool, errors):
    m = MarkovMock(table({3: 4, 4: 5, 8: 9}))
    r, stats = respond(m, [[BOS, 3]], tool)
    assert r.response_ids.tolist() == [[4, 5]] and r.mask.tolist() == [[1, 1]] and not r.truncated.any()
    assert (stats.calls, stats.errors) == (1, errors)
    assert bool(stats.first_error) == bool(errors)


def test_calculator():
    assert calculate("23 * 45") == 1035 and calculate("(1 + 2) * -3") == -9 and calculate(" 7 ") == 7
    for bad in ["2 ** 3", "__import__('os')", "1 / 2", "1.5 + 1", "x + 1", "", "1 +", "9" * 65, "True + 1"]:
        assert calculate(bad) is None, bad
    assert calculator_tool("", "let me see <calc>2*3</calc>", 6) == "<result>6</result>"
    assert calculator_tool("", "<calc>1</calc> then <calc>4-9</calc>", 0) == "<result>-5</result>"
    assert calculator_tool("", "<calc>2**99</calc>", 0) == "<result>?</result>"
    assert calculator_tool("", "no call </calc>", 0) == "<result>?</result>"
    task = arith_task(digits=1, heldout=5, calculator=True)
    assert task.environment is Calculator and task.tool is None and "<calc>" in task.train[0].prompt
    assert arith_task(digits=1, heldout=5).environment is None


def calc_setup(stop='["</calc>"]'):
    """The calculator task with its tool (`calculator_tool`, called at every stop string) in place of its
    environment (which answers only actions ending in </calc>): stop strings a random policy writes make
    it call often."""
    options = "{digits = 1, heldout = 5, calculator = true, max_new_tokens = 24}"
    cfg = config_mod.load(None, ["--task.path=rlvr.tasks.arith:arith_task", f"--task.options={options}",
                                 "--task.reward=correct", f"--sampling.stop={stop}", "--sampling.max_tool_calls=2",
                                 "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2"])
    setup = build_mod.build(cfg, log=lambda *a: None)
    setup.task.tool, setup.task.environment = calculator_tool, None
    return setup


def calculator_tool_task(tmp_path) -> str:
    """A task file: the calculator task with its tool instead of its environment (see `calc_setup`)."""
    (tmp_path / "calc_tool.py").write_text(
        "import dataclasses\nfrom rlvr.tasks.arith import arith_task, calculator_tool\n\n"
        "def make():\n    return dataclasses.replace(arith_task(digits=1, heldout=10, calculator=True, max_new_tokens=24),"
        " environment=None, tool=calculator_tool)\n")
    return f"{tmp_path / 'calc_tool.py'}:make"


def test_the_learner_scores_sampled_tokens_as_the_sampler_did_with_results_in_context():
    setup = calc_setup(stop='["a", "<"]')       # characters a random policy writes: it calls often
    tok, task = setup.tokenizer, setup.task
    examples = list(task.train[:6])
    groups = sample_and_score(setup.model, tok, task, examples, G=4, limits=setup.limits,
                              weights={"correct": 1.0}, temperature=1.0, top_p=1.0,
                              generator=torch.Generator().manual_seed(0))
    r = groups.rollout
    inserted = (r.attention_mask[:, r.prompt_len:] == 1) & (r.mask == 0)
    assert groups.tools.calls > 0 and inserted.any()          # the random policy does call the tool
    lp = sequence_token_logprobs(setup.model, r)
    assert torch.allclose(lp * r.mask, r.logp, atol=1e-5)      # ratio 1 at the first pass
    called = torch.nonzero(inserted.any(1)).view(-1).tolist()
    for b in called:  # the rewards see the inserted results (cut short when the row hit the bound)
        assert "<result>?</result>" in groups.responses[b] or (r.truncated[b] and "<r" in groups.responses[b])
    assert any("<result>?</result>" in groups.responses[b] for b in called)
    # chunked sampling draws the same rows (continuations are seeded per row of the whole batch)
    again = sample_and_score(setup.model, tok, task, examples, G=4, limits=setup.limits, weights={"correct": 1.0},
                             temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(0), chunk_prompts=4)
    assert again.responses == groups.responses and torch.equal(again.rollout.mask, r.mask[:, :again.rollout.mask.size(1)])


def test_tool_calls_need_stop_strings_and_a_task_tool():
    with pytest.raises(config_mod.ConfigError, match="sampling.max_tool_calls.*sampling.stop"):
        config_mod.load(None, ["--sampling.max_tool_calls=1"])
    with pytest.raises(config_mod.ConfigError, match="sampling.max_tool_calls"):
        config_mod.load(None, ["--sampling.max_tool_calls=-1", '--sampling.stop=["x"]'])
    cfg = config_mod.load(None, ["--task.path=rlvr.tasks.arith:arith_task", "--task.options={digits = 1, heldout = 5}",
                                 "--task.reward=correct", '--sampling.stop=["</calc>"]', "--sampling.max_tool_calls=1"])
    with pytest.raises(setup_types.RunError, match="no tool"):
        build_mod.build(cfg, log=lambda *a: None)


def test_a_training_run_with_the_calculator(tmp_path):
    from rlvr.cli import main

    config = tmp_path / "calc.toml"
    config.write_text(f'[task]\npath = "{calculator_tool_task(tmp_path)}"\nreward = "correct"\n'
                      '[sampling]\nstop = ["a", "e", "o"]\nmax_tool_calls = 2\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(config), "--out", str(tmp_path / "run"), "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--train.steps=2",
                   "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--eval.every=0",
                   "--eval.pass_k=0", "--log.rollouts_per_step=4", "--task.reward_workers=1"])  # the tool in a worker
    assert rc == 0, err.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward" in r]
    assert len(train) == 2 and all("train/tool_calls_per_response" in r for r in train)
    assert all(r["train/tool_errors"] == 0 and 0 <= r["train/tool_rounds_on_cache_frac"] <= 1 for r in train)
    assert sum(r["train/tool_calls_per_response"] for r in train) > 0       # "a", "e", "o" are written by chance
    evals = [r for r in rows if "eval/goal" in r]                           # step 0 and the end
    assert len(evals) == 2 and all(r["eval/tool_errors"] == 0 and r["eval/tool_calls_per_response"] >= 0
                                   for r in evals)
    responses = [x for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
                 for x in json.loads(line)["responses"]]
    assert any("<result>?</result>" in x for x in responses)
    # the price bounds the sampling forwards with every row calling every time; the run stays within it
    price = json.loads((tmp_path / "run" / "price.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert price["tool_calls"] == 2 and "price: tool calls:" in out.getvalue()
    rows, Lp, T = 16, price["prompt_tokens"], 24
    assert price["forward_tokens_sampling_per_batch"] == 4 * Lp + rows * (T - 1) + 2 * rows * (Lp + 2 * T)
    assert summary["cost/forward_tokens"] <= price["forward_tokens_per_run"]


@pytest.mark.parametrize("dtype, kind", [("fp32", "llama"), ("bf16", "llama"), ("fp32", "gpt2")])
def test_a_hugging_face_policy_scores_its_tool_rollouts_as_it_sampled_them(tmp_path, dtype, kind, monkeypatch):
    """The lean forward (GPT-2: transformers' forward and DynamicCache): the first round's grouped
    cache, continuations over the whole context or on that cache (the same rows, log-probs to float
    rounding), and the learner's forward with each prompt shared by its group, inserted text attended
    in between."""
    pytest.importorskip("transformers")
    from hf_models import make_model_dir
    from rlvr.models.hf import load_policy
    from rlvr.sampling import prompt_generators

    shape = {} if kind == "gpt2" else dict(num_key_value_heads=2, tie_word_embeddings=True)   # gpt2: transformers' forward
    policy, tok = load_policy(make_model_dir(tmp_path, kind, **shape), dtype=dtype)
    prompts = [tok.encode("ab, c"), tok.encode("x"), tok.encode("12 3:")]
    G, stop = 4, ("a", "7")
    kw = dict(temperature=1.0, top_p=0.95, top_k=0, min_p=0.0)
    examples = [SimpleNamespace(prompt=str(p), answer=0) for p in prompts for _ in range(G)]
    got = {}
    monkeypatch.setattr(tools, "_reuse_pays", lambda *a: True)   # every round on the cache (short contexts here)
    for cached in (False, True):   # continuations over a new prefill, then on the first round's KV cache
        keep = []
        first = generate(policy, prompts, samples_per_prompt=G, max_new_tokens=20, eos_id=tok.eos_id,
                         pad_id=tok.pad_id, generators=prompt_generators(3, 0, 3), stop=StopStrings(stop, tok.decode),
                         keep=keep, reserve=2 * 20 * 3, **kw)
        got[cached] = tools.respond_with_tools(
            policy, tok, first, examples, lambda p, t, a: " ok:", max_new_tokens=20, eos_id=tok.eos_id, stop=stop,
            max_calls=3, base_seed=3, first_row=0, sample_kw=kw, autocast=contextlib.nullcontext,
            decoding=keep[0] if cached else None)
    (plain, plain_stats), (r, stats) = got[False], got[True]
    assert torch.equal(plain.ids, r.ids) and torch.equal(plain.mask, r.mask) and plain_stats.calls == stats.calls
    assert torch.allclose(plain.logp, r.logp, atol=1e-5) and torch.allclose(plain.logp_full, r.logp_full, atol=1e-5)
    inserted = (r.attention_mask[:, r.prompt_len:] == 1) & (r.mask == 0)
    assert stats.calls > 0 and inserted.sum() == stats.inserted_tokens
    continued = inserted.flip(1).cummax(1).values.flip(1) & ~inserted & (r.mask == 1)  # sampled before an insertion
    after = (r.mask == 1) & inserted.cummax(1).values                                  # sampled after one
    assert continued.any() and after.any()
    for group_size in (None, G):
        out = sequence_token_logprobs(policy, r, group_size=group_size, return_full=True)
        assert torch.allclose(out.logp * r.mask, r.logp, atol=1e-5), (out.logp * r.mask - r.logp).abs().max()
        assert torch.allclose(out.logp_full * r.mask, r.logp_full, atol=1e-5)   # the KL's side, without the nucleus


def test_a_failing_tool_is_counted_and_warned_about_and_the_run_goes_on(tmp_path):
    from rlvr.cli import main

    (tmp_path / "boom.py").write_text(
        "import dataclasses\nfrom rlvr.tasks.arith import arith_task\n\n"
        "def boom(prompt, response, answer):\n    raise RuntimeError('no calculator today')\n\n"
        "def make():\n    return dataclasses.replace(arith_task(digits=1, heldout=5, calculator=True), tool=boom, environment=None)\n")
    config = tmp_path / "boom.toml"
    config.write_text(f'[task]\npath = "{tmp_path / "boom.py"}:make"\nreward = "correct"\n'
                      '[sampling]\nstop = ["a", "e", "o"]\nmax_tool_calls = 1\nmax_new_tokens = 12\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(config), "--out", str(tmp_path / "run"), "--model.n_layer=1", "--model.n_embd=32",
                   "--model.n_head=2", "--train.steps=1", "--train.prompts_per_step=4",
                   "--train.samples_per_prompt=4", "--eval.every=0", "--eval.at_start=false", "--eval.pass_k=0",
                   "--task.reward_workers=0"])
    assert rc == 0, err.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "train/reward" in r)
    assert step["train/tool_errors"] == step["train/tool_calls_per_response"] * 16 > 0
    warning = next(r["warning"] for r in rows if "warning" in r and "tool calls failed" in r["warning"])
    assert "error: RuntimeError: no calculator today" in warning


EOS_CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_turn_text_is_what_the_chat_template_adds_after_the_assistant(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_model_dir
    from rlvr.models.hf import load_policy

    _, tok = load_policy(make_model_dir(tmp_path, chat=True))
    assert tok.turn_text("tool", "42") == " <bos>tool: 42 assistant:"       # the tests' template, by hand
    tok.tok.chat_template = EOS_CHAT
    assert tok.turn_text("user", "ok") == "<eos>user: ok<eos>assistant:"
    tok.tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                             "{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(Exception, match="no tools"):
        tok.turn_text("tool", "42")
    tok.tok.chat_template = "{% for m in messages[-1:] %}{{ m['content'] }}{% endfor %}"   # drops earlier turns
    with pytest.raises(ValueError, match="continuation"):
        tok.turn_text("tool", "42")


def chat_tool_rollout(tmp_path, tool, reward, *, max_new_tokens: int, seed: int, **limits):
    """(policy, tokenizer, Groups): a tiny Hugging Face chat model whose template ends every turn with
    eos (``EOS_CHAT``) samples 4 responses to each of 2 prompts with ``tool`` and ``Limits(**limits)``,
    scored by ``reward``."""
    pytest.importorskip("transformers")
    from hf_models import make_model_dir
    from rlvr.models.hf import load_policy
    from rlvr.rewards import Reward, RewardCard
    from rlvr.setup_types import Limits
    from rlvr.tasks import Example, Task

    policy, tok = load_policy(make_model_dir(tmp_path, chat=True))
    tok.tok.chat_template = EOS_CHAT
    card = RewardCard(pays_for="a test's count", ignores="all", exploit="none")
    task = Task(name="t", train=[Example("ab", 0)], heldout=[Example("cd", 0)],
                rewards={"n": Reward("n", reward, card)}, goal=lambda p, r, a: False,
                max_new_tokens=max_new_tokens, tool=tool)
    groups = sample_and_score(policy, tok, task, [Example("ab", 0), Example("x", 0)], G=4,
                              limits=Limits(max_new_tokens, tok.eos_id, 4, tool_calls=2, **limits),
                              weights={"n": 1.0}, temperature=1.0, top_p=1.0,
                              generator=torch.Generator().manual_seed(seed), pool=None)
    return policy, tok, groups


def test_a_tool_turn_through_the_chat_template_holds_eos_and_the_response_goes_on(tmp_path):
    """The inserted turn closes the assistant's turn with eos; the row is not ended by it, the learner
    scores the sampled tokens as the sampler did, and the rewards see the text on both sides."""
    seen = []
    policy, tok, groups = chat_tool_rollout(tmp_path, lambda p, r, a: "42", lambda p, r, a: seen.append(r) or 0.0,
                                            max_new_tokens=24, seed=1, stop=("a", "b", "c"), tool_role="tool")
    r = groups.rollout
    turn = tok.encode(tok.turn_text("tool", "42"), bos=False)
    assert turn[0] == tok.eos_id and groups.tools.calls > 0
    resp = r.response_ids.tolist()
    rows = [b for b in range(len(resp)) if any(resp[b][t:t + len(turn)] == turn for t in range(len(resp[b])))]
    assert rows and groups.tools.inserted_tokens >= len(turn)
    for b in rows:  # after the inserted eos, the row goes on: sampled tokens follow the turn
        t = next(t for t in range(len(resp[b])) if resp[b][t:t + len(turn)] == turn)
        assert r.mask[b, t:t + len(turn)].sum() == 0 and r.attention_mask[b, r.prompt_len + t + len(turn) - 1] == 1
        assert "tool: 42" in seen[b] and "assistant:" in seen[b]
    continued = [b for b in rows if r.mask[b].nonzero().max() > r.mask[b].nonzero().min() + len(turn)]
    assert continued
    lp = sequence_token_logprobs(policy, r, group_size=4)
    assert torch.allclose(lp * r.mask, r.logp, atol=1e-5)


def test_a_tool_role_needs_a_chat_template_that_renders_it():
    cfg = config_mod.load(None, ["--task.path=rlvr.tasks.arith:arith_task",
                                 "--task.options={digits = 1, heldout = 5, calculator = true}", "--task.reward=correct",
                                 '--sampling.stop=["</calc>"]', "--sampling.max_tool_calls=1",
                                 "--sampling.tool_role=tool"])
    with pytest.raises(setup_types.RunError, match="sampling.tool_role = 'tool' needs a chat template.*has no chat template"):
        build_mod.build(cfg, log=lambda *a: None)


def test_the_probe_says_how_often_the_tool_was_called(tmp_path):
    from rlvr.cli import main

    config = tmp_path / "calc.toml"
    config.write_text(f'[task]\npath = "{calculator_tool_task(tmp_path)}"\nreward = "correct"\nreward_workers = 0\n'
                      '[sampling]\nstop = ["a", "e", "o"]\nmax_tool_calls = 2\n'
                      '[model]\nn_layer = 1\nn_embd = 32\nn_head = 2\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["probe", str(config), "--prompts", "4", "--samples", "4", "--json"])
    assert rc == 0, err.getvalue()
    notes = json.loads(out.getvalue())["notes"]
    note = next(n for n in notes if n.startswith("tool calls: "))
    assert float(note.split()[2]) > 0 and "tokens inserted" in note


def respond_on_end(model, prompts, tool, *, max_calls=1, max_new_tokens=12):
    tok = PieceTokenizer()
    first = generate(model, prompts, samples_per_prompt=1, max_new_tokens=max_new_tokens, eos_id=EOS, pad_id=PAD,
                     generator=None)
    examples = [SimpleNamespace(prompt=f"p{i}", answer=i) for i in range(len(prompts))]
    return tools.respond_with_tools(model, tok, first, examples, tool, max_new_tokens=max_new_tokens, eos_id=EOS,
                                    stop=(), max_calls=max_calls, base_seed=None, first_row=0,
                                    sample_kw=dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
                                    autocast=contextlib.nullcontext, on_end=True)


def test_tool_on_end_gives_the_next_turn_after_the_sampled_end_token():
    seen = []

    def env(prompt, text, answer):
        seen.append(text)
        return "<r>" if len(seen) == 1 else None                # feedback once, then the episode ends

    m = MarkovMock(table({3: 4, 6: 9}))                          # "<c>" -> "7" -> eos; "<r>" -> "!" -> eos
    r, stats = respond_on_end(m, [[BOS, 3]], env, max_calls=3)
    assert r.response_ids.tolist() == [[4, EOS, 6, 9, EOS]]     # the sampled eos stays, the turn follows it
    assert r.mask.tolist() == [[1, 1, 0, 1, 1]] and not r.truncated.any()
    assert seen == ["7", "7<r>!"] and stats.calls == 2          # the second call answered None: done
    r, _ = respond_on_end(m, [[BOS, 3]], lambda p, t, a: "<r>", max_calls=1)
    assert r.response_ids.tolist() == [[4, EOS, 6, 9, EOS]] and not r.truncated.any()   # calls used up: ended


def test_a_chat_turn_after_a_sampled_end_token_starts_after_it(tmp_path):
    policy, tok, groups = chat_tool_rollout(tmp_path, lambda p, r, a: "no", lambda p, r, a: 0.0, max_new_tokens=40,
                                            seed=2, tool_role="user", tool_on_end=True)
    assert tok.turn_text("user", "no", after_end=True) == "user: no<eos>assistant:"
    assert tok.turn_text("user", "no") == "<eos>user: no<eos>assistant:"
    r = groups.rollout
    turn = tok.encode(tok.turn_text("user", "no", after_end=True), bos=False)
    resp, found = r.response_ids.tolist(), 0
    for b, row in enumerate(resp):
        for t in range(1, len(row) - len(turn) + 1):
            if row[t:t + len(turn)] == turn:
                found += 1
                assert row[t - 1] == tok.eos_id and r.mask[b, t - 1] == 1   # the policy's own end token, trained on
                assert r.mask[b, t:t + len(turn)].sum() == 0
    assert found > 0 and groups.tools.calls > 0
    lp = sequence_token_logprobs(policy, r, group_size=4)
    assert torch.allclose(lp * r.mask, r.logp, atol=1e-5)


def test_tool_on_end_needs_tool_calls_and_an_end_token():
    with pytest.raises(config_mod.ConfigError, match="sampling.tool_on_end.*max_tool_calls"):
        config_mod.load(None, ["--sampling.tool_on_end=true"])
    cfg = config_mod.load(None, ["--sampling.tool_on_end=true", "--sampling.max_tool_calls=1"])   # no stop needed
    with pytest.raises(setup_types.RunError, match="tool_on_end.*fixed length"):
        build_mod.build(cfg, log=lambda *a: None)                                    # the sort task has no end token


# the chat templates of real model families, as their tokenizers ship them (SmolLM2's ChatML with its
# default system turn; Llama 3's headers; Gemma's "model" role and its alternation rule)
SMOLLM2_CHAT = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_CHAT = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
              "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
              "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


@pytest.mark.parametrize("family, template, eos, role, want", [
    ("smollm2", SMOLLM2_CHAT, "<|im_end|>", "user", "\n<|im_start|>user\n42<|im_end|>\n<|im_start|>assistant\n"),
    ("smollm2", SMOLLM2_CHAT, "<|im_end|>", "tool", "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", LLAMA3_CHAT, "<|eot_id|>", "user",
     "<|start_header_id|>user<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("gemma", GEMMA_CHAT, "<end_of_turn>", "user", "\n<start_of_turn>user\n42<end_of_turn>\n<start_of_turn>model\n"),
])
def test_turn_text_on_real_chat_templates(family, template, eos, role, want):
    """What follows the assistant's words when a turn comes next, on the templates real chat models
    ship: the assistant turn's closing (its end token, cut when the model sampled it), the new turn,
    and the next assistant turn's opening; a template that refuses the role (Gemma's alternation
    rule: no "tool" turn) raises, which the run turns into a clear error before any compute."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from rlvr.models.hf_tokenizer import HFTokenizer

    specials = ["<pad>", "<bos>", eos]
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + list("0123456789abc"))}, merges=[]))
    bk.add_special_tokens(specials)
    tok = HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<bos>", eos_token=eos,
                                              pad_token="<pad>"))
    tok.tok.chat_template = template
    assert tok.turn_text(role, "42") == eos + want
    assert tok.turn_text(role, "42", after_end=True) == want          # the sampled end token is not repeated
    if family == "gemma":
        with pytest.raises(Exception, match="roles must alternate"):
            tok.turn_text("tool", "42")


@pytest.mark.parametrize("family, template, specials, eos", [
    ("smollm2", SMOLLM2_CHAT, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    ("llama3", LLAMA3_CHAT, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
])
def test_sampler_and_learner_logprobs_agree_across_tool_turns_on_real_templates(tmp_path, family, template,
                                                                                specials, eos):
    """A tiny Llama whose tokenizer has a real family's special tokens and ships its chat template:
    the calculator-style tool answers in the template's tool turn (its end token, header, the
    assistant's reopening, all inserted and masked), the rows go on after it, and the learner's
    log-probs of the sampled tokens equal the sampler's across the turns."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from hf_models import make_model_dir
    from rlvr.models.hf import load_policy
    from rlvr.rewards import Reward, RewardCard
    from rlvr.setup_types import Limits
    from rlvr.tasks import Example, Task

    vocab = ["<pad>", "<bos>", *specials] + list("0123456789abcdefghijklmnopqrstuvwxyz ,:\n")
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    bk.add_special_tokens(["<pad>", "<bos>", *specials])
    bk.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<bos>", eos_token=eos, pad_token="<pad>")
    hf_tok.chat_template = template
    d = make_model_dir(tmp_path / family, tokenizer=False, eos_token_id=vocab.index(eos), max_position_embeddings=256)
    hf_tok.save_pretrained(d)
    policy, tok = load_policy(d)
    assert tok.eos_id == vocab.index(eos)
    card = RewardCard(pays_for="nothing", ignores="all", exploit="none")
    task = Task(name="t", train=[Example("ab", 0)], heldout=[Example("cd", 0)],
                rewards={"n": Reward("n", lambda p, r, a: 0.0, card)}, goal=lambda p, r, a: False,
                max_new_tokens=64, tool=lambda p, r, a: "42")
    groups = sample_and_score(policy, tok, task, [Example("ab", 0), Example("x", 0)], G=4,
                              limits=Limits(64, tok.eos_id, 4, tool_calls=2, stop=("a", "b", "c"), tool_role="tool"),
                              weights={"n": 1.0}, temperature=1.0, top_p=1.0,
                              generator=torch.Generator().manual_seed(1), pool=None)
    r = groups.rollout
    turn = tok.encode(tok.turn_text("tool", "42"), bos=False)
    assert turn[0] == tok.eos_id and vocab.index(specials[0]) in turn and groups.tools.calls > 0
    resp = r.response_ids.tolist()
    at = {b: t for b in range(len(resp)) for t in range(len(resp[b])) if resp[b][t:t + len(turn)] == turn}
    assert at and all(r.mask[b, t:t + len(turn)].sum() == 0 for b, t in at.items())
    assert any(r.mask[b, t + len(turn):].sum() > 0 for b, t in at.items())              # sampled tokens after a turn
    lp = sequence_token_logprobs(policy, r, group_size=4)
    torch.testing.assert_close(lp * r.mask, r.logp, rtol=0, atol=1e-5)
