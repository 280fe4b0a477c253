"""A run's saved policy: `save_checkpoint` writes the built-in model's checkpoint/ or a Hugging Face
model's hf/ atomically, `load_checkpoint` reads one back, naming a missing or damaged file.
"""

from __future__ import annotations

from pathlib import Path

from rlvr import config as config_mod
from rlvr.models.tiny import TinyTransformer
from rlvr.policy import Policy, Tokenizer
from rlvr.setup_types import RunError
from rlvr.state import StateError, verify, write_dir_atomically
from rlvr.tokenizer import CharTokenizer


def save_checkpoint(run_dir: Path, model: Policy, tok: Tokenizer, tag: int = 0) -> None:
    """Built-in model: RUN_DIR/checkpoint (safetensors, config, tokenizer JSON). Hugging Face model:
    RUN_DIR/hf, a plain transformers directory (LoRA merged in; the adapter also in hf/adapter).
    Written beside the old copy, fsynced and renamed into place (rlvr.state.atomic_dir)."""
    if isinstance(model, TinyTransformer):
        def write(d: Path) -> None:
            model.save_pretrained(d)
            tok.save(d / "tokenizer.json")
        write_dir_atomically(run_dir, "checkpoint", tag, write)
    else:
        from rlvr.models.hf import export_hf

        write_dir_atomically(run_dir, "hf", tag, lambda d: export_hf(model, tok, d))


def load_checkpoint(d: Path, cfg: config_mod.Config) -> tuple[Policy, Tokenizer]:
    """The policy and tokenizer saved in `d` (checkpoint/ or hf/); RunError naming a missing or damaged file."""
    try:
        verify(d)
    except StateError as e:
        raise RunError(str(e)) from None
    if cfg.model.path:
        from rlvr.models.hf import load_policy

        if not (d / "config.json").is_file():
            raise RunError(f"{d / 'config.json'} is missing")
        try:
            return load_policy(d, dtype=cfg.model.dtype)
        except Exception as e:  # transformers / safetensors raise many kinds on a damaged file
            raise RunError(f"{d}: cannot load the checkpoint ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    for need in (d / "model.safetensors", d / "config.json", d / "tokenizer.json"):
        if not need.is_file():
            raise RunError(f"{need} is missing")
    return load_built_in(d)


def load_built_in(d: Path, prefix: str = "") -> tuple[TinyTransformer, CharTokenizer]:
    """The built-in model and its tokenizer saved in `d`; RunError (its message after `prefix`, e.g.
    the config key that named `d`) naming the file that is unreadable."""
    try:
        tok = CharTokenizer.load(d / "tokenizer.json")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunError(f"{prefix}{d / 'tokenizer.json'}: unreadable ({type(e).__name__}: {e})") from None
    try:
        return TinyTransformer.from_pretrained(d), tok
    except Exception as e:  # safetensors raises its own SafetensorError on a truncated file
        raise RunError(f"{prefix}{d / 'model.safetensors'} (or {d / 'config.json'}): unreadable "
                       f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
