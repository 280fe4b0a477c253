"""JSON tool calls (rlvr.tool_calls): parsed, malformed ones answered and counted, several tools in one task,
schemas through the chat template or a system message."""

from __future__ import annotations

import string

import pytest

from rlvr import tools
from rlvr.tokenizer import CharTokenizer
from rlvr.tool_calls import JsonTools, ToolSpec, call_text, takes_tools, with_tools

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
CALL_ADD, CALL_UPPER = '{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name": "upper", "arguments": {"word": "hi"}}'
PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", CALL_ADD, CALL_UPPER, '{"name": "mul"}']
"""Added tokens (not special: they decode into the text), one id each."""


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
    assert tok.turn_text("tool", "5", after_end=True) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    plain = chatml_tokenizer(REWRITING_CHAT.replace("{% if tools %}", "{% if false %}"))     # renders no tools
    assert not takes_tools(plain)
    plain.prompt_format = PromptFormat(chat="user", system="Be brief.", tools_text=t.system_text())
    text = plain.tok.decode(encode_example(plain, ex))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call these tools:\n") and "<tools>" not in text


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
