"""Tiny Hugging Face models and tokenizers built locally for tests (no hub access)."""

import torch

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz ,:")
CHAT = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer(*, pad=True, chat=False):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + CHARS)}, merges=[]))
    bk.add_special_tokens(SPECIALS)
    bk.decoder = decoders.Fuse()
    kw = {"pad_token": "<pad>"} if pad else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<bos>", eos_token="<eos>", **kw)
    if chat:
        tok.chat_template = CHAT
    return tok


def make_model_dir(path, kind="llama", *, pad=True, chat=False, tokenizer=True, weights=True, seed=0,
                   **llama_kw):
    """A tiny model + tokenizer saved to ``path``. ``llama_kw`` overrides LlamaConfig fields
    (e.g. ``num_key_value_heads=2`` for GQA, ``tie_word_embeddings=True``, ``rope_parameters=``)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        kw = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
        kw.update(llama_kw)
        cfg = LlamaConfig(**kw)
        model = LlamaForCausalLM(cfg)
    else:  # GPT-2 keeps its default dropouts (0.1): load_policy must zero them
        cfg = GPT2Config(vocab_size=48, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                         bos_token_id=1, eos_token_id=2)
        model = GPT2LMHeadModel(cfg)
    if weights:
        model.save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    if tokenizer:
        make_tokenizer(pad=pad, chat=chat).save_pretrained(path)
    return path
