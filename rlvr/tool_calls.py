"""Tools declared as JSON schemas and called with JSON, as chat models call them.

A task gives ``Task.tool = JsonTools([ToolSpec(...), ...])``: several tools, each a name, a description, a
JSON schema of its parameters and the Python function that answers. ``JsonTools`` is an ordinary task
tool for rlvr.tools's loop (``tool(prompt, response_so_far, answer)``): the run stops a response at the
call's closing marker (``sampling.stop = ["</tool_call>"]``), the loop calls it, and the text it returns
is inserted (with ``sampling.tool_role = "tool"``: as the chat template's tool turn), attended to and
never trained on. The tokens sampled before stay as they were sampled: nothing is re-tokenized.

* The call is the JSON object ``{"name": ..., "arguments": {...}}`` inside the last pair of markers
  (``<tool_call>`` ... ``</tool_call>`` by default, as Qwen's and Hermes' templates write them), or,
  with ``markers=None``, the last JSON object in the response. It is parsed with ``json.loads``, never
  evaluated.
* A call that is not JSON, names no tool the task has, or whose arguments miss a required parameter or
  give one of the wrong JSON type is *malformed*: it is answered with an error message the model sees
  (``error: ...``), and counted (``ToolStats.malformed``, the metric ``train/tool_malformed``), never a
  crash. A function that raises is answered the same way (``error: NAME raised ...``).
* The result is the function's return value: a str as it is, anything else as JSON.

The schemas reach the prompt through the chat template (``apply_chat_template(..., tools=...)``) where
the template renders them (``takes_tools``), else as a system message (``system_text``); a tokenizer with
no chat template gets the prompt as the task wrote it (rlvr.tokenizer.example_prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

CALL_MARKERS = ("<tool_call>", "</tool_call>")
"""The default markers around a call."""
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "object": (dict,), "array": (list,), "null": (type(None),)}
"""JSON schema types and the Python values json.loads gives for them."""


class CallError(ValueError):
    """A malformed call; its message is what the model is answered with."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: what the model is told about it, and the function that answers."""

    name: str
    description: str
    parameters: dict
    """A JSON schema object: {"type": "object", "properties": {...}, "required": [...]}."""
    fn: Callable[..., Any] = field(compare=False)
    """Called with the call's arguments as keywords."""

    def schema(self) -> dict:
        """The tool as transformers' chat templates take it (OpenAI's function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def call_text(response: str, markers: tuple[str, str] | None) -> str | None:
    """The text of the response's last call: inside the last ``open ... close`` pair (None when there is
    none), or, with ``markers`` None, the last JSON object in the response (None when there is none)."""
    if markers is not None:
        open_, close = markers
        end = response.rfind(close)
        start = response.rfind(open_, 0, end if end >= 0 else None)
        if start < 0 or end < start:
            return None
        return response[start + len(open_):end]
    dec, last, k = json.JSONDecoder(), None, response.find("{")
    while k >= 0:                                   # outermost objects, left to right: keep the last
        try:
            _, n = dec.raw_decode(response, k)
            last, k = response[k:n], response.find("{", n)
        except json.JSONDecodeError:
            k = response.find("{", k + 1)
    return last


def _check_arguments(spec: ToolSpec, args: dict) -> None:
    """CallError for a missing required parameter, an unknown one (when the schema lists its properties),
    or a value of the wrong JSON type."""
    props = spec.parameters.get("properties", {})
    missing = [k for k in spec.parameters.get("required", []) if k not in args]
    if missing:
        raise CallError(f"{spec.name} needs the argument(s) {', '.join(missing)}")
    unknown = [k for k in args if props and k not in props]
    if unknown:
        raise CallError(f"{spec.name} takes no argument {unknown[0]!r}; it takes {', '.join(props)}")
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        types = JSON_TYPES.get(want) if isinstance(want, str) else None
        if types and (not isinstance(v, types) or (want != "boolean" and isinstance(v, bool))):
            raise CallError(f"{spec.name}: argument {k!r} must be a JSON {want}, got {json.dumps(v)[:40]}")


def parse_call(text: str, tools: dict[str, ToolSpec]) -> tuple[ToolSpec, dict]:
    """(the tool, its arguments) of one call's JSON text; CallError saying what is wrong otherwise. The
    arguments may also come as a JSON string holding the object (as OpenAI's API sends them)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CallError(f"the tool call is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise CallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    if obj["name"] not in tools:
        raise CallError(f"no tool named {obj['name']!r}; the tools are {', '.join(tools)}")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise CallError("the arguments are a string that is not a JSON object") from None
    if not isinstance(args, dict):
        raise CallError("the arguments must be a JSON object")
    spec = tools[obj["name"]]
    _check_arguments(spec, args)
    return spec, args


def result_text(value: Any) -> str:
    """What the model sees of a result: a str as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


class JsonTools:
    """A task tool (rlvr.tools) that answers JSON calls of several ToolSpecs (module docstring)."""

    def __init__(self, tools: list[ToolSpec], markers: tuple[str, str] | None = CALL_MARKERS):
        names = [t.name for t in tools]
        if not tools or len(set(names)) != len(names):
            raise ValueError(f"JsonTools: give one or more tools with distinct names, got {names}")
        self.tools = {t.name: t for t in tools}
        self.markers = markers

    def __call__(self, prompt: str, response: str, answer: Any) -> str | None:
        """The inserted text for the response's last call: the result, or ``error: ...`` for a malformed
        call (or one whose function raised). None (the response ends) when there is no call at all."""
        text = call_text(response, self.markers)
        if text is None:
            return None
        try:
            spec, args = parse_call(text, self.tools)
        except CallError as e:
            return f"error: {e}"
        try:
            return result_text(spec.fn(**args))
        except Exception as e:  # noqa: BLE001 - the model sees what went wrong; the run goes on
            return f"error: {spec.name} raised {type(e).__name__}: {e}"

    def malformed(self, response: str) -> bool:
        """True when the response's last call is malformed, as ``__call__`` answers it (False when there is
        no call: the response ends there)."""
        text = call_text(response, self.markers)
        if text is None:
            return False
        try:
            parse_call(text, self.tools)
        except CallError:
            return True
        return False

    def schemas(self) -> list[dict]:
        """Every tool as the chat template takes it (``ToolSpec.schema``)."""
        return [t.schema() for t in self.tools.values()]

    def system_text(self) -> str:
        """The tools and the call format as a system message, for a template that does not render tools."""
        open_, close = self.markers or ("", "")
        lines = ["You may call these tools:"] + [json.dumps(s["function"]) for s in self.schemas()]
        lines.append(f'To call one, write {open_}{{"name": <tool name>, "arguments": {{<arguments>}}}}{close}; '
                     "its result follows.")
        return "\n".join(lines)


SENTINEL = "rlvr_tool_sentinel_5e2a"


def takes_tools(tok) -> bool:
    """True when the tokenizer's chat template renders the ``tools=`` it is given (a sentinel tool's name
    appears in the rendered prompt); False without a template or when it ignores them."""
    inner = getattr(tok, "tok", tok)
    if not getattr(tok, "has_chat_template", False):
        return False
    probe = {"type": "function", "function": {"name": SENTINEL, "description": "", "parameters": {"type": "object"}}}
    try:
        text = inner.apply_chat_template([{"role": "user", "content": "?"}], tools=[probe], tokenize=False,
                                         add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render tools does not take them
        return False
    return SENTINEL in text


def join_system(turns: list[dict], text: str) -> list[dict]:
    """The turns with `text` in the system message: after the first turn's content when that turn is a
    system message, else as a new system message first."""
    if turns and turns[0].get("role") == "system":
        return [{**turns[0], "content": turns[0]["content"] + "\n\n" + text}] + list(turns[1:])
    return [{"role": "system", "content": text}] + list(turns)


def with_tools(turns: list[dict], tools: JsonTools) -> list[dict]:
    """The prompt turns with the tools' ``system_text`` in the system message (joined to the task's own
    system message when there is one), for a template that does not render ``tools=``."""
    return join_system(turns, tools.system_text())
