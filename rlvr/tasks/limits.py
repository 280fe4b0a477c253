"""Size bounds the built-in task factories check before they allocate anything.

A task is built whole in memory (every training and held-out example, as Python strings) before the
run is priced, so an option such as ``--task.options.n=1000000000`` would otherwise spend minutes and
gigabytes building a task no model can take. Each factory calls these checks on its own options
first; a ValueError names the factory, the option and the bound (``rlvr.tasks.load_task`` turns it
into a TaskError naming ``task.path``).
"""

from __future__ import annotations

from pathlib import Path

MAX_PROMPT_CHARS = 8192
"""Longest prompt or answer, in characters, a built-in task makes: the built-in model's whole context
(rlvr.config.MAX_BUILTIN_CONTEXT tokens, one a character); a Hugging Face tokenizer gives these ASCII
prompts at most one token a character, and few models train on longer prompts."""
MAX_EXAMPLES = 2_000_000
"""Most examples (train and held out together) a built-in task builds."""
EXAMPLE_BYTES = 400
"""Memory one example takes besides its text (the Example, its strings' headers, the list slot)."""


def check_count(factory: str, option: str, value: int, limit: int = MAX_EXAMPLES) -> None:
    """ValueError when the count option `option` of `factory` is above `limit`."""
    if value > limit:
        raise ValueError(f"{factory}: option {option} = {value:,} exceeds the limit of {limit:,}")


def check_length(factory: str, option: str, value: int, chars: int, limit: int = MAX_PROMPT_CHARS) -> None:
    """ValueError when option `option` = `value` makes prompts or answers of `chars` characters, above `limit`."""
    if chars > limit:
        shown = f"{value:,}" if value.bit_length() < 64 else f"a {value.bit_length()}-bit number"
        raise ValueError(f"{factory}: option {option} = {shown} makes prompts of {chars:,} characters or more, above "
                         f"the limit of {limit:,} (the built-in model's context); choose a smaller {option}")


def check_memory(factory: str, examples: int, chars: int, available: int | None = None) -> None:
    """ValueError when `examples` examples of about `chars` characters of text each (prompt and answer)
    would not fit in the memory the machine has available (MemAvailable; `available` overrides it)."""
    available = _available(available)
    need = examples * (chars + EXAMPLE_BYTES)
    if available is not None and need > available:
        gib = 2**30
        raise ValueError(f"{factory}: {examples:,} examples of {chars:,} characters need about {need / gib:.1f} GiB, "
                         f"but the machine has {available / gib:.1f} GiB available; ask for fewer (train, heldout)")


FILE_BYTES_FACTOR = 4
"""Memory a data file's rows take once read, per byte of the file (an upper estimate: each row's
decoded text, its dict and strings, and the examples made from them)."""


def check_file(factory: str, path, available: int | None = None) -> None:
    """ValueError when the data file at `path` would take more memory once read (`FILE_BYTES_FACTOR`
    times its size) than the machine has available (MemAvailable; `available` overrides it), before
    any of it is read."""
    available = _available(available)
    size = Path(path).stat().st_size
    if available is not None and size * FILE_BYTES_FACTOR > available:
        gib = 2**30
        raise ValueError(f"{factory}: data file {str(path)!r} holds {size / gib:.1f} GiB; read whole it needs about "
                         f"{size * FILE_BYTES_FACTOR / gib:.1f} GiB, but the machine has {available / gib:.1f} GiB "
                         f"available; use a smaller file (a sample of its rows)")


def _available(given: int | None) -> int | None:
    """`given`, or the machine's MemAvailable where None (None where it cannot be read)."""
    if given is not None:
        return given
    from rlvr.procmem import available_bytes

    return available_bytes()
