"""Build a tiny random Llama and a character-level tokenizer, saved as a plain Hugging Face directory.

    python tests/configs/make_tiny_hf_model.py models/tiny-llama [--layers 2] [--hidden 128] [--heads 4]

A plumbing model for tests and tests/configs/hf_rgym.toml (it learns nothing useful: its weights
are random); point `model.path` at any real local checkpoint (safetensors + tokenizer) the same way.
The tokenizer covers printable ASCII one character per token, with <pad>, <bos>, <eos> and a
minimal chat template, so any English task prompt encodes.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def build(out: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, context: int = 512, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + chars)}, merges=[]))
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=context,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    a = ap.parse_args()
    print(build(a.out, layers=a.layers, hidden=a.hidden, heads=a.heads, context=a.context))
