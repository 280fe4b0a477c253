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
