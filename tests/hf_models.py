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
    (e.g. ``num_key_value_heads=2`` for GQA, ``tie_word_embeddings=True``, ``rope_parameters=``).
    ``kind``: "llama", "gpt2", or another transformers model type with Llama-like config fields
    ("qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3"; head_dim 16 where the config has one);
    "llama_biased" is a Llama whose biases (``attention_bias`` / ``mlp_bias``) are drawn non-zero."""
    from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    torch.manual_seed(seed)
    kw = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(llama_kw)
    if kind == "llama":
        cfg = LlamaConfig(**kw)
        model = LlamaForCausalLM(cfg)
    elif kind != "gpt2":
        cfg = AutoConfig.for_model("llama" if kind == "llama_biased" else kind, **kw)
        if hasattr(cfg, "head_dim") and "head_dim" not in llama_kw:
            cfg.head_dim = kw["hidden_size"] // kw["num_attention_heads"]
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # transformers zeroes biases at init: give Qwen 2's q/k/v biases values to test
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.normal_(0, 0.5)
                if name.endswith(("q_norm", "k_norm")):                  # and Qwen 3's head norms away from 1
                    m.weight.uniform_(0.5, 1.5)
                elif name.endswith("norm") and not m.weight.any():     # Gemma's x * (1 + w) norms away from 0
                    m.weight.normal_(0, 0.3)
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


GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GGUF_CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
             "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_gguf(path, *, tied=True, seed=0, layers=2, hidden=32, heads=4, kv_heads=2, context=256):
    """A tiny Llama written as a GGUF file at ``path`` the way llama.cpp writes SmolLM2, and the
    ``LlamaForCausalLM`` it holds.

    Byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``): three control tokens (bos
    ``<|im_start|>`` = 1, eos = pad ``<|im_end|>`` = 2, as SmolLM2), the 256 byte symbols and two
    merges; a ChatML template. Weights in F32 (nothing lost), q/k rows permuted as llama.cpp stores
    them; ``tied`` leaves out ``output.weight`` (the head reuses the embedding).
    """
    import numpy as np
    from gguf import GGUFWriter, TokenType
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_syms = [bytes_to_unicode()[b] for b in range(256)]
    merged = ["Ġt", "Ġ+"]
    tokens = GGUF_SPECIALS + byte_syms + merged
    types = [TokenType.CONTROL] * len(GGUF_SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(GGUF_SPECIALS))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(context)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "Ġ +"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(GGUF_CHAT)

    def permute(t, n_head):  # llama.cpp's convert_hf_to_gguf permute of q / k rows
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(layers):
        pre = f"model.layers.{i}."
        for gg, hf in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                       ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                       ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(sd[pre + hf + ".weight"]))
        w.add_tensor(f"blk.{i}.attn_q.weight", np.ascontiguousarray(permute(sd[pre + "self_attn.q_proj.weight"], heads)))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.ascontiguousarray(permute(sd[pre + "self_attn.k_proj.weight"], kv_heads)))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model
