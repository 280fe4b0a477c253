"""The built-in tiny transformer (KV cache, left padding, save/load) and the char tokenizer."""

import json

import pytest
import torch

from rlvr.models.tiny import KVCache, TinyConfig, TinyTransformer, attend
from rlvr.tokenizer import CharTokenizer

V = 13


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=32, block_size=24)
    cfg.update(kw)
    return TinyTransformer(TinyConfig(**cfg)).eval()


def left_pad(seqs, pad=0):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    am = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s)
        am[i, L - len(s):] = 1
    return ids, am


def random_seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------- model
def test_left_padded_prompt_matches_unpadded_prompt_alone():
    m = make_model()
    seqs = random_seqs([2, 7, 4, 1])
    ids, am = left_pad(seqs)
    with torch.no_grad():
        batched = m(ids, attention_mask=am)                       # (4, 7, V)
        for i, s in enumerate(seqs):
            alone = m(torch.tensor([s]))                          # no mask: is_causal path
            n = len(s)
            torch.testing.assert_close(batched[i, -n:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(batched).all()                          # pad queries must not give NaN


@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [9]])
def test_cached_incremental_decoding_equals_full_forward(chunks):
    """Feed a left-padded batch through the cache in chunks; logits equal the one-shot forward."""
    m = make_model(seed=3)
    seqs = random_seqs([3, 9, 5], seed=2)
    ids, am = left_pad(seqs)                                       # (3, 9)
    # generated tokens: the third row "finishes" early, its later tokens are pad (mask 0)
    gen = torch.randint(1, V, (3, 4), generator=torch.Generator().manual_seed(5))
    gen_am = torch.ones(3, 4, dtype=torch.long)
    gen_am[2, 2:] = 0
    gen[2, 2:] = 0
    ids, am = torch.cat([ids, gen], 1), torch.cat([am, gen_am], 1)  # (3, 13)
    chunks = chunks + [4]
    with torch.no_grad():
        full = m(ids, attention_mask=am)
        cache = m.new_cache(3, ids.size(1))
        parts, s = [], 0
        for n in chunks:
            parts.append(m(ids[:, s:s + n], attention_mask=am[:, s:s + n], cache=cache))
            s += n
        inc = torch.cat(parts, 1)
    real = am.bool()
    torch.testing.assert_close(inc[real], full[real], atol=1e-5, rtol=1e-5)
    assert cache.length == ids.size(1)
    assert cache.next_pos.tolist() == am.sum(1).tolist()


def test_cache_repeat_interleave_keeps_rows_grouped():
    m = make_model()
    ids, am = left_pad(random_seqs([2, 5]))
    with torch.no_grad():
        c = m.new_cache(2, 8)
        m(ids, attention_mask=am, cache=c)
        c3 = c.repeat_interleave(3)
        nxt = torch.tensor([[4]] * 6)
        out = m(nxt, attention_mask=torch.ones(6, 1, dtype=torch.long), cache=c3)[:, -1]
        for b in range(6):
            full = m(torch.cat([ids[b // 3:b // 3 + 1], nxt[:1]], 1),
                     attention_mask=torch.cat([am[b // 3:b // 3 + 1], torch.ones(1, 1, dtype=torch.long)], 1))
            torch.testing.assert_close(out[b], full[0, -1], atol=1e-5, rtol=1e-5)
    assert isinstance(c3, KVCache) and c3.batch_size == 6 and c3.length == c.length + 1


def test_causal_and_logits_to_keep():
    m = make_model()
    ids = torch.tensor([random_seqs([8])[0]])
    with torch.no_grad():
        a = m(ids)
        ids2 = ids.clone()
        ids2[0, 5] = (ids2[0, 5] % (V - 1)) + 1
        b = m(ids2)
        torch.testing.assert_close(a[:, :5], b[:, :5])            # the future does not leak
        assert not torch.allclose(a[:, 5:], b[:, 5:])
        torch.testing.assert_close(m(ids, logits_to_keep=3), a[:, -3:])


def test_position_and_cache_bounds_raise():
    m = make_model(block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        m(torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="cache full"):
        m(torch.ones(1, 3, dtype=torch.long), cache=m.new_cache(1, 2))
    with pytest.raises(ValueError, match="divisible"):
        TinyConfig(vocab_size=5, n_embd=30, n_head=4)


def test_gradients_finite_under_left_padding():
    m = make_model().train()
    ids, am = left_pad(random_seqs([2, 6, 3]))
    m(ids, attention_mask=am).logsumexp(-1)[am.bool()].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_num_params_and_flops_arithmetic():
    cfg = TinyConfig(vocab_size=14)                               # the defaults: 2 layers, 128 wide
    m = TinyTransformer(cfg)
    C, Lyr = 128, 2
    per_block = 3 * C * C + C * C + 8 * C * C + 4 * C             # attn, proj, mlp, two LayerNorms
    assert m.num_params() == 14 * C + 64 * C + Lyr * per_block + 2 * C
    n_matmul = Lyr * 12 * C * C + 14 * C                          # Linears + tied head
    assert m.flops_per_token(11) == 6 * n_matmul + 12 * Lyr * C * 11
    assert m.flops_per_token(11, training=False) == 2 * n_matmul + 4 * Lyr * C * 11
    untied = TinyTransformer(TinyConfig(vocab_size=14, tie_embeddings=False))
    assert untied.num_params() == m.num_params() + 14 * C
    assert untied.flops_per_token(11) == m.flops_per_token(11)    # the input lookup is not a matmul


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip(tmp_path, tie):
    m = make_model(tie_embeddings=tie)
    m.save_pretrained(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["n_embd"] == 32
    m2 = TinyTransformer.from_pretrained(tmp_path / "ckpt").eval()
    assert m2.config == m.config
    ids, am = left_pad(random_seqs([3, 6]))
    with torch.no_grad():
        assert torch.equal(m(ids, attention_mask=am), m2(ids, attention_mask=am))


# ---------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_and_specials(tmp_path):
    tok = CharTokenizer("0123456789,>")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 15)
    ids = tok.encode("31,2>", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids[1] == 3 + 3
    assert tok.decode(ids) == "31,2>"
    assert tok.decode([tok.pad_id, *tok.encode("12"), tok.eos_id, *tok.encode("9")]) == "129"
    assert tok.decode(torch.tensor(tok.encode("12", eos=True) + tok.encode("9")), stop_at_eos=True) == "12"
    tok.save(tmp_path / "tok.json")
    assert CharTokenizer.load(tmp_path / "tok.json") == tok
    assert CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict()))).encode("0,") == tok.encode("0,")


def test_tokenizer_errors():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        tok.encode("abxc")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([99])
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("abca")
    with pytest.raises(ValueError, match="not a CharTokenizer"):
        CharTokenizer.from_dict({"type": "BPE"})


@pytest.mark.parametrize("padded", [False, True])
def test_cpu_attention_matches_sdpa(padded):
    """``attend`` takes explicit matmuls on CPU; F.scaled_dot_product_attention is the oracle."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 8, generator=g) for _ in range(3))
    if padded:
        allowed = torch.ones(3, 1, 5, 5, dtype=torch.bool).tril()
        allowed[1, :, :, :2] = False
        allowed[1, :, torch.arange(5), torch.arange(5)] = True
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:
        bias = None
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attend(q, k, v, bias), want, atol=1e-5, rtol=1e-5)
