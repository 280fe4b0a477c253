"""A character-level tokenizer: one id per character of a fixed alphabet, plus three specials.

Ids 0, 1, 2 are the specials ``<pad>``, ``<bos>``, ``<eos>``; the alphabet's characters follow in
the order given, so ``CharTokenizer("0123456789,")`` maps "0" to 3 and "," to 13. Saved as JSON
(``to_dict`` / ``save``), never pickled, so a checkpoint can be read without running code.

``decode`` drops every special wherever it occurs and does not stop at eos by default, like
``HFTokenizer.decode``: the sampler already pads everything after eos, and a caller that wants
"text up to the first eos" passes ``decode(ids, stop_at_eos=True)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlvr.tool_calls import join_system

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)


class CharTokenizer:
    """Character-level tokenizer over ``alphabet`` (distinct characters) with pad=0, bos=1, eos=2."""

    def __init__(self, alphabet: str):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError("alphabet must be a non-empty string of distinct characters")
        dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if dupes:
            raise ValueError(f"alphabet has repeated characters: {dupes!r}")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._char_to_id = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
        self._id_to_char = {i: c for c, i in self._char_to_id.items()}

    has_chat_template = False
    """Prompts are plain text; chat messages are not templated (``encode_example`` uses the prompt)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids: the three specials plus one per alphabet character."""
        return len(SPECIALS) + len(self.alphabet)

    @property
    def special_ids(self) -> tuple[int, int, int]:
        return (self.pad_id, self.bos_id, self.eos_id)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``'s characters, optionally wrapped in bos / eos. Unknown chars raise."""
        try:
            ids = [self._char_to_id[c] for c in text]
        except KeyError as e:
            pos = next(i for i, c in enumerate(text) if c not in self._char_to_id)
            raise ValueError(
                f"character {e.args[0]!r} at position {pos} of {text!r} is not in the "
                f"tokenizer alphabet {self.alphabet!r}"
            ) from None
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_prompt(self, prompt: str) -> list[int]:
        """Prompt ids: the text's characters (no specials)."""
        if not isinstance(prompt, str):
            raise ValueError(f"CharTokenizer.encode_prompt: expected a string, got {type(prompt).__name__}")
        return self.encode(prompt)

    def decode(self, ids, *, stop_at_eos: bool = False) -> str:
        """Text of ``ids`` (list or 1-D tensor) with all specials dropped.

        With ``stop_at_eos`` everything from the first eos on is ignored. Ids outside the
        vocabulary raise ``ValueError``.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        for i in ids:
            if i == self.eos_id and stop_at_eos:
                break
            if i in (self.pad_id, self.bos_id, self.eos_id):
                continue
            c = self._id_to_char.get(i)
            if c is None:
                raise ValueError(f"id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(c)
        return "".join(out)

    def to_dict(self) -> dict:
        return {"type": "CharTokenizer", "alphabet": self.alphabet, "specials": list(SPECIALS)}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        """The tokenizer `to_dict` describes; ValueError on anything else (not a dict, another type)."""
        if not isinstance(d, dict):
            raise ValueError(f"not a CharTokenizer dict: a JSON {type(d).__name__}")
        if d.get("type") != "CharTokenizer":
            raise ValueError(f"not a CharTokenizer dict: type={d.get('type')!r}")
        if list(d.get("specials", SPECIALS)) != list(SPECIALS):
            raise ValueError(f"unsupported specials {d.get('specials')!r}; expected {list(SPECIALS)}")
        return cls(d["alphabet"])

    def save(self, path: str | Path) -> None:
        """Write ``to_dict()`` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(self.alphabet)

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r})"


@dataclass(frozen=True)
class PromptFormat:
    """How ``encode_example`` turns a task example into prompt ids for one run (``task.chat`` and
    ``task.system``; rlvr.build.build sets it on the run's tokenizer as ``prompt_format``)."""

    chat: str = "messages"
    """``messages``, ``user`` or ``off`` (see rlvr.config.TaskConfig.chat)."""
    system: str = ""
    """A system message first in every templated prompt ("" = none)."""
    tools: tuple = ()
    """The task's tools as JSON schemas (rlvr.tool_calls.JsonTools.schemas), given to the chat template as
    ``tools=`` wherever it renders the conversation: prompts and inserted turns (() = none)."""
    tools_text: str = ""
    """The task's tools as a system message (JsonTools.system_text), for a chat template that does not
    render ``tools=``; joined to the system message of every templated prompt ("" = none)."""


def example_prompt(tok, example):
    """What ``encode_example`` encodes for a task example, as the tokenizer's ``prompt_format`` says
    (default: ``messages``): with a chat template (Hugging Face), the task's
    ``example.meta["messages"]`` when it gives them, or (``user``) the prompt as one user turn,
    after the format's system message when there is one, and the tools' text joined to the system
    message when the format has one (a list of ``{"role", "content"}`` turns); else (``off``, no
    template, or plain prompts under ``messages``) the prompt text."""
    fmt = getattr(tok, "prompt_format", None) or PromptFormat()
    messages = example.meta.get("messages") if isinstance(example.meta, dict) else None
    if fmt.chat == "off" or not tok.has_chat_template or not (messages or fmt.chat == "user"):
        return example.prompt
    turns = list(messages) if messages else [{"role": "user", "content": example.prompt}]
    if fmt.system and not any(m.get("role") == "system" for m in turns):
        turns = [{"role": "system", "content": fmt.system}] + turns
    return join_system(turns, fmt.tools_text) if fmt.tools_text else turns


def encode_example(tok, example) -> list[int]:
    """Prompt token ids of a task example: ``example_prompt`` through the tokenizer's ``encode_prompt``
    (chat turns through its template, text as it is)."""
    return tok.encode_prompt(example_prompt(tok, example))


def encode_examples(tok, examples) -> list[list[int]]:
    """``encode_example`` of each example, in one batched call where the tokenizer has one
    (``encode_prompts``: Hugging Face renders the chat templates and tokenizes them together,
    faster than one call a prompt over a task's train and held-out sets; see docs/performance.md);
    the same ids either way."""
    prompts = [example_prompt(tok, ex) for ex in examples]
    batched = getattr(tok, "encode_prompts", None)
    return batched(prompts) if batched is not None else [tok.encode_prompt(p) for p in prompts]
