"""``HFTokenizer``: a transformers tokenizer with the ``CharTokenizer`` surface the trainer uses.

``encode`` / ``decode`` / ``encode_prompt`` (chat templates) / ``save`` / ``load`` and the ids
``pad_id``, ``eos_id``, ``bos_id``. ``decode`` does not stop at eos by default, exactly like
``CharTokenizer.decode``: the sampler pads every column after a row's eos, so a rollout decodes to
its response either way; ``decode(ids, stop_at_eos=True)`` cuts at the first eos.
``transformers`` is imported inside functions only.
"""

from __future__ import annotations

from pathlib import Path


class HFTokenizer:
    """A transformers tokenizer with the ``CharTokenizer`` surface the trainer uses.

    ``encode(text)`` never appends eos and adds no special tokens except a leading BOS when the
    tokenizer adds one by default (Llama-style ``add_bos_token``); ``bos=True/False`` forces it.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        with_sp = tokenizer.encode("a", add_special_tokens=True)
        without = tokenizer.encode("a", add_special_tokens=False)
        self.adds_bos = (tokenizer.bos_token_id is not None and len(with_sp) > len(without)
                         and with_sp[0] == tokenizer.bos_token_id)

        # read once: transformers' token-id properties cost microseconds of Python each
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        self.bos_id: int | None = tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``, added tokens included (the model's embedding may be larger)."""
        return len(self.tok)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(self.tok.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    prompt_format = None
    """rlvr.tokenizer.PromptFormat, set by rlvr.build.build; its ``tools`` go to every template rendering."""

    def _template_kw(self) -> dict:
        """``tools=`` for apply_chat_template when the run's prompt format declares tools (empty otherwise),
        so that prompts and inserted turns render under the same tool declaration."""
        tools = self.prompt_format.tools if self.prompt_format is not None else ()
        return {"tools": list(tools)} if tools else {}

    TURN_SENTINEL = "rlvr-turn-sentinel-7c1f"

    def turn_text(self, role: str, content: str, *, after_end: bool = False) -> str:
        """The text that follows an assistant's words when a ``role`` turn holding ``content`` comes
        next, as the chat template renders it: the assistant turn's closing, the new turn, and the
        opening of the next assistant turn (rlvr.tools inserts it after a tool call). Found as the
        difference between the template over [user, assistant] and over [user, assistant, role] with
        the generation prompt; ValueError when the template renders the shared turns differently.
        ``after_end``: the assistant's words already end with the end token (the model sampled it), so
        a closing that starts with that token's text starts after it."""
        msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self.TURN_SENTINEL}]
        kw = self._template_kw()
        base = self.tok.apply_chat_template(msgs, tokenize=False, **kw)
        full = self.tok.apply_chat_template(msgs + [{"role": role, "content": content}], tokenize=False,
                                            add_generation_prompt=True, **kw)
        cut = base.find(self.TURN_SENTINEL) + len(self.TURN_SENTINEL)
        if cut < len(self.TURN_SENTINEL) or not full.startswith(base[:cut]):
            raise ValueError(f"the chat template does not render a {role!r} turn after the assistant's as a "
                             "continuation of the conversation before it")
        text = full[cut:]
        end = self.tok.convert_ids_to_tokens(self.eos_id) if after_end and self.eos_id is not None else None
        return text[len(end):] if end and text.startswith(end) else text

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False) -> list[int]:
        """Ids of ``text``: no specials, except BOS first when the tokenizer adds it by default
        (or ``bos=True``), and eos last only with ``eos=True``."""
        ids = self._ids(text)
        want_bos = self.adds_bos if bos is None else bos
        if want_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def _ids(self, text: str) -> list[int]:
        # the Rust backend directly: transformers' own encode adds Python work to every call
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt) -> list[int]:
        """A plain string goes through ``encode``; a list of ``{"role", "content"}`` messages through
        the chat template with ``add_generation_prompt=True`` (the template supplies BOS itself)."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                            for m in prompt):
            raise ValueError("encode_prompt: expected a string or a list of {'role', 'content'} dicts, "
                             f"got {type(prompt).__name__}")
        if not self.has_chat_template:
            raise ValueError("encode_prompt: the task gives chat messages but the tokenizer has no chat_template")
        ids = self._chat_ids(list(prompt))
        if hasattr(ids, "keys"):  # a BatchEncoding on some versions
            ids = ids["input_ids"]
        return list(ids)

    def _chat_ids(self, conversations: list) -> list:
        """``apply_chat_template`` with the generation prompt and the run's tools (``_template_kw``),
        tokenized; a template that raises (jinja's TemplateError, ``raise_exception`` in the template) is a
        ValueError naming the tokenizer."""
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                                return_dict=False, **self._template_kw())
        except TemplateError as e:
            where = getattr(self.tok, "name_or_path", "") or "the tokenizer"
            raise ValueError(f"the chat template of {where} (tokenizer_config.json, chat_template) raised "
                             f"{type(e).__name__}: {e}") from None

    ENCODE_BATCH = 2048
    """Prompts per batched call of ``encode_prompts``."""

    def encode_prompts(self, prompts: list) -> list[list[int]]:
        """``encode_prompt`` of each prompt, batched: the chat conversations through one
        ``apply_chat_template`` call (its renderer and a batched tokenizer call) per ENCODE_BATCH,
        the strings through the backend's ``encode_batch``; the same ids as one call each."""
        out: list = [None] * len(prompts)
        chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        backend = getattr(self.tok, "backend_tokenizer", None)
        if texts and backend is not None:
            for k in range(0, len(texts), self.ENCODE_BATCH):
                part = texts[k:k + self.ENCODE_BATCH]
                encs = backend.encode_batch([prompts[i] for i in part], add_special_tokens=False)
                bos = [self.bos_id] if self.adds_bos and self.bos_id is not None else []
                for i, e in zip(part, encs):
                    out[i] = bos + e.ids
        else:
            for i in texts:
                out[i] = self.encode(prompts[i])
        if chats:
            for i in chats:     # the same checks as encode_prompt, before any rendering
                p = prompts[i]
                if not isinstance(p, (list, tuple)) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                                for m in p):
                    raise ValueError("encode_prompt: expected a string or a list of {'role', 'content'} dicts, "
                                     f"got {type(p).__name__}")
            if not self.has_chat_template:
                raise ValueError("encode_prompt: the task gives chat messages but the tokenizer has no chat_template")
            for k in range(0, len(chats), self.ENCODE_BATCH):
                part = chats[k:k + self.ENCODE_BATCH]
                ids = self._chat_ids([list(prompts[i]) for i in part])
                if hasattr(ids, "keys"):  # a BatchEncoding on some versions
                    ids = ids["input_ids"]
                for i, row in zip(part, ids):
                    out[i] = list(row)
        return out

    def decode(self, ids, *, stop_at_eos: bool = False) -> str:
        """Text of ``ids`` (list or 1-D tensor) with every special token skipped; with ``stop_at_eos``
        everything from the first eos on is ignored. The default (no stop) is ``CharTokenizer``'s."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = list(ids)
        if stop_at_eos and self.eos_id is not None and self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        """``save_pretrained`` into the directory ``path``; a path ending in ``.json`` (as the trainer
        passes ``ckpt/"tokenizer.json"``) means its parent directory (where HF writes tokenizer.json)."""
        p = Path(path)
        if p.suffix == ".json":
            p = p.parent
        p.mkdir(parents=True, exist_ok=True)
        self.tok.save_pretrained(str(p))

    @classmethod
    def load(cls, path: str | Path) -> "HFTokenizer":
        from transformers import AutoTokenizer

        p = Path(path)
        return cls(AutoTokenizer.from_pretrained(str(p.parent if p.suffix == ".json" else p), local_files_only=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tok).__name__}, vocab={self.vocab_size}, pad={self.pad_id}, eos={self.eos_id})"

