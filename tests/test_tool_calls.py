"""JSON tool calls (rlvr.tool_calls): parsed, malformed ones answered and counted, several tools in one task,
schemas through the chat template or a system message, and an episode's ids kept as sampled under a template
that rewrites earlier turns (the learner's log-probs equal the sampler's across the tool turns)."""

from __future__ import annotations

import contextlib
import string

import pytest
import torch

from rlvr import tools
from rlvr.tokenizer import CharTokenizer
from rlvr.tool_calls import JsonTools, ToolSpec, call_text, takes_tools, with_tools
from test_tools import SMOLLM2_CHAT

ADD = ToolSpec("add", "Add two integers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                           "b": {"type": "integer"}},
                                             "required": ["a", "b"]}, lambda a, b: a + b)
UPPER = ToolSpec("upper", "Upper-case a word.", {"type": "object", "properties": {"word": {"type": "string"}},
                                                 "required": ["word"]}, lambda word: {"upper": word.upper()})


def call(body: str) -> str:
    return f"I will compute. <tool_call>{body}</tool_call>"


def test_json_calls_are_parsed_and_answered_by_the_named_tool_of_two():
    t = JsonTools([ADD, UPPER])
    assert t("p", call('{"name": "add", "arguments": {"a": 2, "b": 40}}'), None) == "42"
    assert t("p", call('{"name": "upper", "arguments": {"word": "hi"}}'), None) == '{"upper": "HI"}'
    # OpenAI-style arguments as a JSON string; only the last call of the response counts
    earlier = call('{"name": "add", "arguments": {"a": 1, "b": 1}}') + "<result>2</result> "
    assert t("p", earlier + call('{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 5}"}'), None) == "10"
    assert not t.malformed(call('{"name": "add", "arguments": {"a": 2, "b": 40}}'))
    assert [s["function"]["name"] for s in t.schemas()] == ["add", "upper"]


@pytest.mark.parametrize("body, says", [
    ('{"name": "add", "arguments": {"a": 2, "b": 40}', "not valid JSON"),
    ("add(2, 40)", "not valid JSON"),
    ('["add", 2, 40]', 'a tool call is a JSON object {"name": ..., "arguments": {...}}'),
    ('{"name": "mul", "arguments": {"a": 2, "b": 40}}', "no tool named 'mul'; the tools are add, upper"),
    ('{"name": "add", "arguments": {"a": 2}}', "add needs the argument(s) b"),
    ('{"name": "add", "arguments": {"a": 2, "b": "40"}}', "argument 'b' must be a JSON integer"),
    ('{"name": "add", "arguments": {"a": true, "b": 1}}', "argument 'a' must be a JSON integer"),
    ('{"name": "add", "arguments": {"a": 2, "b": 4, "c": 1}}', "add takes no argument 'c'"),
    ('{"name": "add", "arguments": [2, 40]}', "the arguments must be a JSON object"),
])
def test_malformed_calls_are_answered_with_an_error_the_model_sees(body, says):
    t = JsonTools([ADD, UPPER])
    got = t("p", call(body), None)
    assert got.startswith("error: ") and says in got
    assert t.malformed(call(body))


def test_a_tool_that_raises_is_answered_not_crashed():
    boom = ToolSpec("boom", "Fails.", {"type": "object", "properties": {}}, lambda: 1 // 0)
    got = JsonTools([boom])("p", call('{"name": "boom", "arguments": {}}'), None)
    assert got == "error: boom raised ZeroDivisionError: integer division or modulo by zero"


def test_no_call_ends_the_response_and_bare_json_without_markers():
    t = JsonTools([ADD])
    assert t("p", "the answer is 4", None) is None and not t.malformed("the answer is 4")
    bare = JsonTools([ADD], markers=None)
    assert bare("p", 'call {"name": "add", "arguments": {"a": 1, "b": 2}} now', None) == "3"
    assert call_text('x {"a": {"b": 1}} y {bad', None) == '{"a": {"b": 1}}'


def test_the_tool_loop_counts_malformed_calls_and_inserts_every_answer():
    tok = CharTokenizer("".join(c for c in string.printable if c == " " or not c.isspace()))
    t = JsonTools([ADD, UPPER])
    texts = [call('{"name": "add", "arguments": {"a": 2, "b": 3}}'), call('{"name": "add", "arguments": {"a": 2}}'),
             call("{oops"), "no call"]
    stats = tools.ToolStats()
    got = tools._call_tools(t, None, ["p"] * 4, texts, [None] * 4, tok, stats)
    assert tok.decode(got[0]) == "5"
    assert tok.decode(got[1]).startswith("error: add needs") and tok.decode(got[2]).startswith("error: the tool call")
    assert got[3] is None                                   # no call: the response ends there
    assert (stats.calls, stats.malformed, stats.errors) == (4, 2, 0)
    assert stats.add(stats).malformed == 4


TOOLS_CHAT = ("{% if tools %}<bos>system: tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
              "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")


def test_schemas_reach_a_template_that_renders_tools_else_a_system_message():
    pytest.importorskip("transformers")
    from hf_models import make_tokenizer

    from rlvr.models.hf_tokenizer import HFTokenizer

    plain = HFTokenizer(make_tokenizer(chat=True))                    # its template ignores tools=
    assert not takes_tools(plain) and not takes_tools(CharTokenizer("ab"))
    hf = make_tokenizer(chat=True)
    hf.chat_template = TOOLS_CHAT
    assert takes_tools(HFTokenizer(hf))
    t = JsonTools([ADD, UPPER])
    turns = with_tools([{"role": "user", "content": "2+3"}], t)
    assert turns[0]["role"] == "system" and '"name": "add"' in turns[0]["content"] and "<tool_call>" in turns[0]["content"]
    joined = with_tools([{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}], t)
    assert len(joined) == 2 and joined[0]["content"].startswith("be brief\n\nYou may call these tools:")


# A template in the manner of Qwen's and DeepSeek-R1's: the tools in the system turn, a tool result as a
# user turn wrapped in <tool_response>, and every assistant turn rendered without its reasoning (the text
# up to the last </think>): re-rendering an episode from its messages changes the earlier turns.
REWRITING_CHAT = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% endif %}{{ '# Tools\\n<tools>' }}{% for t in tools %}"
    "{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WHOLE_CALLS = [f"<tool_call>{body}</tool_call>" for body in ('{"name": "add", "arguments": {"a": 2, "b": 3}}',
                                                             '{"name": "upper", "arguments": {"word": "hi"}}',
                                                             '{"name": "mul", "arguments": {}}')]
PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>"] + WHOLE_CALLS
"""Added tokens (not special: they decode into the text), one id each: a call, valid or not, is one token
here, so that a tiny random model writes them often."""


def chatml_tokenizer(template: str):
    """An HFTokenizer over printable ASCII (one token a character), ChatML's specials (<|im_end|> the end
    token) and PIECES as whole tokens, with `template`; built here, no hub."""
    pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from rlvr.models.hf_tokenizer import HFTokenizer

    vocab = SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"]
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    bk.add_special_tokens(SPECIAL)
    bk.add_tokens([AddedToken(p, normalized=False) for p in PIECES])
    bk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return HFTokenizer(tok)


def test_the_declared_tools_reach_every_templated_prompt_and_tool_turn():
    """Through the template's tools= where it renders them (the prompt and the inserted tool turn rendered
    under the same declaration), as a system message where it does not; the same ids batched or not."""
    from rlvr.tasks import Example
    from rlvr.tokenizer import PromptFormat, encode_example, encode_examples

    t = JsonTools([ADD, UPPER])
    ex = Example(prompt="2+3?", answer="5")
    tok = chatml_tokenizer(REWRITING_CHAT)
    assert takes_tools(tok)
    tok.prompt_format = PromptFormat(chat="user", tools=tuple(t.schemas()))
    want = tok.tok.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=t.schemas(), tokenize=False,
                                       add_generation_prompt=True)
    ids = encode_example(tok, ex)
    assert tok.tok.decode(ids) == want and '"name": "upper"' in want and encode_examples(tok, [ex]) == [ids]
    assert tok.turn_text("tool", "5", after_end=True) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                                          "<|im_end|>\n<|im_start|>assistant\n")
    plain = chatml_tokenizer(REWRITING_CHAT.replace("{% if tools %}", "{% if false %}"))     # renders no tools
    assert not takes_tools(plain)
    plain.prompt_format = PromptFormat(chat="user", system="Be brief.", tools_text=t.system_text())
    text = plain.tok.decode(encode_example(plain, ex))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call these tools:\n") and "<tools>" not in text
    smol = chatml_tokenizer(SMOLLM2_CHAT)                       # SmolLM2's template renders no tools=
    assert not takes_tools(smol)
    smol.prompt_format = PromptFormat(chat="user", tools_text=t.system_text())
    text = smol.tok.decode(encode_example(smol, ex))          # in place of its default system turn
    assert text.startswith("<|im_start|>system\nYou may call these tools:\n") and "SmolLM" not in text


def test_the_run_declares_a_json_tool_task_s_tools_as_its_template_takes_them():
    from rlvr.build import check_call_stop, prompt_format
    from rlvr.config import Config
    from rlvr.setup_types import RunError
    from rlvr.tasks import Example, Task
    from rlvr.tokenizer import PromptFormat

    t = JsonTools([ADD, UPPER])
    task = Task(name="t", train=[Example("2+3?", "5")], heldout=[], rewards={}, goal=lambda p, r, a: True,
                max_new_tokens=8, tool=t)
    cfg, logs = Config(), []
    cfg.task.chat = "user"
    assert prompt_format(cfg, task, chatml_tokenizer(REWRITING_CHAT), logs.append).tools == tuple(t.schemas())
    ignores = chatml_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert prompt_format(cfg, task, ignores, logs.append) == PromptFormat("user", tools_text=t.system_text())
    assert logs == []
    cfg.task.chat = "off"                                  # no template: the prompt text must say it
    assert prompt_format(cfg, task, ignores, logs.append) == PromptFormat("off")
    assert len(logs) == 1 and "tools (add, upper) reach the model only through a chat template" in logs[0]
    cfg.sampling.max_tool_calls, cfg.sampling.stop = 2, ["</calc>"]
    with pytest.raises(RunError, match="add '</tool_call>' to sampling.stop"):
        check_call_stop(cfg, task)
    cfg.sampling.stop = ["</tool_call>"]
    check_call_stop(cfg, task)


def biased_policy(path, tok, bias: dict[str, float]):
    """A tiny Llama (its tokenizer `tok`) whose next-token logits are about `bias` (token -> logit, others 0)
    whatever the context, plus a context-dependent part of about one nat: its last MLP's output bias
    dominates the residual stream along one axis, and the head's column for that axis holds `bias`."""
    from hf_models import make_model_dir
    from transformers import AutoModelForCausalLM

    from rlvr.models.hf import load_policy

    make_model_dir(path, "llama_biased", tokenizer=False, vocab_size=tok.vocab_size, mlp_bias=True,
                   max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_pretrained(path)
    column = torch.zeros(tok.vocab_size)
    for t, b in bias.items():
        column[tok.tok.convert_tokens_to_ids(t)] = b
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.bias.zero_()[0] = 40.0     # the final norm maps it to 8 on axis 0
        model.lm_head.weight[:, 0] = column / 8
        model.lm_head.weight[:, 1:] *= 20                                # the context's part, about one nat
    model.save_pretrained(path)
    tok.tok.save_pretrained(path)
    return load_policy(path, dtype="fp32")


def test_an_episode_keeps_its_sampled_ids_under_a_template_that_rewrites_earlier_turns(tmp_path, monkeypatch):
    """Tool turns through REWRITING_CHAT (it drops every earlier assistant turn's reasoning) on a tiny
    Llama: each round is sampled on exactly the ids sampled and inserted before it, the episode's ids are
    those ids (the template's rendering of the same messages differs), and the learner's log-probs of the
    sampled tokens equal the sampler's across the tool turns. Valid calls of both tools and malformed ones
    are answered as the template's tool role."""
    from rlvr import sampling, scoring
    from rlvr.tasks import Example
    from rlvr.tokenizer import PromptFormat, encode_examples

    t = JsonTools([ADD, UPPER])
    bias = {"<think>": 3, "</think>": 3, "x": 2, "<|im_end|>": 2, **dict.fromkeys(WHOLE_CALLS, 2.5)}
    policy, tok = biased_policy(tmp_path, chatml_tokenizer(REWRITING_CHAT), bias)
    tok.prompt_format = PromptFormat(chat="user", tools=tuple(t.schemas()))
    examples = [Example(q, "") for q in ("2+3?", "shout hi", "go") for _ in range(4)]
    prompts = encode_examples(tok, examples[::4])
    calls, real = [], sampling.generate

    def spy(model, prompts, **kw):                  # every round of the loop: its context and what it drew
        r, G = real(model, prompts, **kw), kw["samples_per_prompt"]
        calls.extend((prompts[k // G], r.response_ids[k, :int(r.mask[k].sum())].tolist()) for k in range(len(r.mask)))
        return r

    kw = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    first = spy(policy, prompts, samples_per_prompt=4, max_new_tokens=256, eos_id=tok.eos_id, pad_id=tok.pad_id,
                generators=sampling.prompt_generators(5, 0, 3), stop=sampling.StopStrings(["</tool_call>"], tok.decode),
                **kw)
    monkeypatch.setattr(sampling, "generate", spy)
    r, stats = tools.respond_with_tools(policy, tok, first, examples, t, max_new_tokens=256, eos_id=tok.eos_id,
                                        stop=("</tool_call>",), max_calls=3, base_seed=5, first_row=0, sample_kw=kw,
                                        autocast=contextlib.nullcontext, role="tool")
    rows = [r.ids[b][r.attention_mask[b].bool()].tolist() for b in range(r.ids.size(0))]
    assert stats.rounds >= 2 and 0 < stats.malformed < stats.calls and stats.errors == 0
    assert all(any(row[:len(p) + len(s)] == p + s for row in rows) for p, s in calls)   # nothing re-tokenized
    assert sum(len(s) for _, s in calls) == r.mask.sum()
    text = tok.tok.decode(r.ids.view(-1), skip_special_tokens=False)
    for answer in ("5", '{"upper": "HI"}', "error: no tool named 'mul'; the tools are add, upper"):
        assert f"<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><|im_end|>" in text
    lp = scoring.sequence_token_logprobs(policy, r)
    assert torch.allclose(lp * r.mask, r.logp, atol=1e-5), (lp * r.mask - r.logp).abs().max()
    rewritten = 0
    for b, row in enumerate(rows):                  # the template renders the same turns otherwise
        turns = episode_turns(tok, r, b, t, examples[b])
        if len(turns) < 2:
            continue
        seen = tok.tok.decode(row[:len(row) - sum(len(x["ids"]) for x in turns[2:])], skip_special_tokens=False)
        messages = [{"role": "user", "content": examples[b].prompt}] + [{k: x[k] for k in ("role", "content")}
                                                                        for x in turns[:2]]
        again = tok.tok.apply_chat_template(messages, tools=t.schemas(), tokenize=False, add_generation_prompt=True)
        said = turns[0]["content"]
        assert again == seen.replace(said, said.split("</think>")[-1])
        rewritten += again != seen
    assert rewritten > 0


def episode_turns(tok, r, b: int, t: JsonTools, example) -> list[dict]:
    """Row b of a tool rollout as messages with their ids: each sampled stretch an assistant turn, each
    inserted one the tool's answer to the response up to it."""
    mask, ids = r.mask[b].tolist(), r.ids[b, r.prompt_len:].tolist()
    turns, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            if mask[start]:
                turns.append({"role": "assistant", "content": tok.decode(ids[start:k]), "ids": ids[start:k]})
            elif r.attention_mask[b, r.prompt_len + start]:
                turns.append({"role": "tool", "content": t(example.prompt, tok.decode(ids[:start]), None),
                              "ids": ids[start:k]})
            start = k
    return turns
