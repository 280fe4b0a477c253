"""HFPolicy / HFTokenizer / LoRA / export on tiny locally built Llama and GPT-2 models (no hub access)."""

import contextlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from rlvr import sampling, scoring  # noqa: E402
from rlvr.models.hf import HFLoadError, HFPolicy, LoraSpec, export_hf, load_policy  # noqa: E402

from hf_models import CHARS, SPECIALS, make_model_dir, make_tokenizer  # noqa: E402,F401


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), chat=True)


@pytest.fixture(scope="module")
def llama(llama_dir):
    return load_policy(llama_dir)


def left_pad(prompts, pad_id):
    Lp = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (Lp - len(p)) + p for p in prompts])
    am = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in prompts])
    return ids, am


PROMPTS = ["ab 12", "x", "hello, wor", "9,8"]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_left_padded_and_cached_decoding_match_full_forward(kind, tmp_path, llama):
    policy, tok = llama if kind == "llama" else load_policy(make_model_dir(tmp_path, "gpt2"))
    prompts = [tok.encode(s) for s in PROMPTS]
    ids, am = left_pad(prompts, tok.pad_id)
    P, Lp = ids.shape
    with torch.no_grad():
        full = policy(ids, attention_mask=am)                                  # (P, Lp, V)
        assert full.dtype == torch.float32 and torch.isfinite(full).all()
        for i, p in enumerate(prompts):                                        # padding changes nothing
            alone = policy(torch.tensor([p]))
            torch.testing.assert_close(full[i, Lp - len(p):], alone[0], atol=1e-5, rtol=0)
        cache = policy.new_cache(P, Lp + 4)
        parts = [policy(ids[:, :3], attention_mask=am[:, :3], cache=cache, logits_to_keep=3)]
        for t in range(3, Lp):                                                 # then token by token
            parts.append(policy(ids[:, t:t + 1], attention_mask=am[:, t:t + 1], cache=cache))
        stepped = torch.cat(parts, dim=1)
        real = am.bool()
        torch.testing.assert_close(stepped[real], full[real], atol=1e-5, rtol=0)
        assert cache.length == Lp and cache.next_pos.tolist() == [len(p) for p in prompts]
        # logits_to_keep keeps the last positions
        torch.testing.assert_close(policy(ids, attention_mask=am, logits_to_keep=2), full[:, -2:])
        with pytest.raises(ValueError, match="cache full"):
            policy(ids, attention_mask=am, cache=cache)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_generate_logp_equals_recomputed(llama, temperature, top_p):
    policy, tok = llama
    prompts = [tok.encode(s) for s in PROMPTS]
    g = torch.Generator().manual_seed(0)
    r = sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=6, temperature=temperature,
                          top_p=top_p, eos_id=tok.eos_id, pad_id=tok.pad_id, generator=g)
    assert r.ids.shape[0] == 12 and r.mask.sum() > 0
    with torch.no_grad():
        lp = scoring.sequence_token_logprobs(policy, r)
        lp_chunked = scoring.sequence_token_logprobs(policy, r, chunk_rows=5)
    torch.testing.assert_close(lp, r.logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_chunked, r.logp, atol=1e-5, rtol=0)
    # the chunked path also carries gradient
    policy.zero_grad()
    scoring.sequence_token_logprobs(policy, r, chunk_rows=5).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    policy.zero_grad()
    assert isinstance(tok.decode(r.response_ids[0]), str)


def test_gpt2_dropout_zeroed_train_mode_is_deterministic(tmp_path):
    policy, tok = load_policy(make_model_dir(tmp_path, "gpt2"))
    ids = torch.tensor([tok.encode("abc 123")])
    policy.train()
    with torch.no_grad():
        torch.testing.assert_close(policy(ids), policy(ids), atol=0, rtol=0)
    assert policy.config.block_size == 64


def test_lora_trains_adapter_only_and_reference_is_base(llama_dir, llama):
    base, tok = llama
    policy, _ = load_policy(llama_dir, lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = dict((n, p) for n, p in policy.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    assert {id(p) for p in policy.trainable_params()} == {id(p) for p in trainable.values()}
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}

    prompts = [tok.encode(s) for s in PROMPTS]
    r = sampling.generate(policy, prompts, samples_per_prompt=2, max_new_tokens=5, eos_id=tok.eos_id,
                          pad_id=tok.pad_id, generator=torch.Generator().manual_seed(1))
    policy.train()
    opt = torch.optim.AdamW(policy.trainable_params(), lr=1e-2)
    (-(scoring.sequence_token_logprobs(policy, r) * r.mask).sum()).backward()
    opt.step()
    policy.eval()
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(trainable)

    ids, am = r.ids, r.attention_mask
    with torch.no_grad():
        live = policy(ids, attention_mask=am)
        with policy.adapter_disabled():
            ref = policy(ids, attention_mask=am)
            lp_ref = scoring.sequence_token_logprobs(policy, r, top_p=1.0)
        base_logits = base(ids, attention_mask=am)
        assert not torch.allclose(live, base_logits, atol=1e-4)
        torch.testing.assert_close(ref[am.bool()], base_logits[am.bool()], atol=1e-5, rtol=0)
        torch.testing.assert_close(lp_ref, scoring.sequence_token_logprobs(base, r, top_p=1.0), atol=1e-5, rtol=0)
        torch.testing.assert_close(policy(ids, attention_mask=am), live)   # adapter is back on
    with pytest.raises(ValueError, match="no LoRA adapter"):
        with base.adapter_disabled():
            pass
    assert policy.flops_per_token(training=True) < 6 * policy._matmul_params()[0] + 12 * 2 * 64 * 64
    assert base.flops_per_token(training=True) == 3 * base.flops_per_token(training=False)


def test_attention_flops_use_the_heads_width(tmp_path):
    # Qwen 3 style: 4 heads of 32 = 128 wide attention on a 64-wide model; the score and value
    # products cost 4 x 128 FLOPs per key and layer in the forward, not 4 x 64
    wide, _ = load_policy(make_model_dir(tmp_path / "wide", "qwen3", head_dim=32))
    n = wide._matmul_params()[0]
    assert wide.flops_per_token(100, training=False) == 2 * n + 4 * 2 * 128 * 100
    plain, _ = load_policy(make_model_dir(tmp_path / "plain", "qwen3"))                # head_dim 16: 64 wide
    assert plain.flops_per_token(100, training=False) == 2 * plain._matmul_params()[0] + 4 * 2 * 64 * 100


def test_export_hf_merges_lora_and_loads_with_plain_transformers(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, tok = load_policy(llama_dir, lora=LoraSpec(r=4, alpha=8))
    with torch.no_grad():                       # a non-zero adapter (B starts at 0)
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    with torch.no_grad():
        live = policy(ids, attention_mask=am)
    out = export_hf(policy, tok, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    plain = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert hf_tok.encode("ab 12", add_special_tokens=False) == tok.encode("ab 12")
    pos = (am.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        exported = plain(input_ids=ids, attention_mask=am, position_ids=pos).logits
        torch.testing.assert_close(exported[am.bool()], live[am.bool()], atol=1e-5, rtol=0)
        torch.testing.assert_close(policy(ids, attention_mask=am), live)    # live model still has its adapter
    assert policy.has_adapter and policy.trainable_params()
    resumed, _ = load_policy(llama_dir, adapter=out / "adapter")              # base + saved adapter
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids, attention_mask=am)[am.bool()], live[am.bool()], atol=1e-5, rtol=0)
    assert resumed.trainable_params()


@pytest.mark.parametrize("lora", [None, LoraSpec(r=4, alpha=8, target_modules="all-linear")],
                         ids=["full", "lora"])
def test_tied_model_trains_exports_once_and_reloads_identical(tmp_path, lora):
    """SmolLM2 / Qwen2.5 / Gemma tie the input embedding and the head; safetensors refuses shared
    tensors, so the export must write the weight once and the loaders re-tie it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlvr.models.hf_load import tied_weight

    d = make_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    policy, tok = load_policy(d, lora=lora)
    emb = tied_weight(policy._hf_model())
    assert emb is not None and emb.requires_grad == (lora is None)
    assert policy.num_params() == sum(p.numel() for p in {id(p): p for p in policy.parameters()}.values())
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    opt = torch.optim.SGD(policy.trainable_params(), lr=0.5)
    before = emb.detach().clone()
    for _ in range(2):                                                         # two updates, as a run does
        opt.zero_grad()
        policy(ids, attention_mask=am).logsumexp(-1)[am.bool()].mean().backward()
        if lora is not None:                       # B starts at 0: the first step moves B only
            assert all(p.grad is not None for p in policy.trainable_params())
        opt.step()
    assert tied_weight(policy._hf_model()) is emb                              # still one tensor
    assert (lora is None) != torch.equal(emb.detach(), before)                 # full FT moved the shared weight
    with torch.no_grad():
        live = policy(ids, attention_mask=am)
    for out in (tmp_path / "hf", tmp_path / "best" / "hf"):                    # the hf/ and best/ exports
        export_hf(policy, tok, out)
        export_hf(policy, tok, out)                                            # saved again in place
        keys = set(load_file(str(out / "model.safetensors")))
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys   # written once
        plain = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        assert plain.lm_head.weight is plain.model.embed_tokens.weight         # re-tied on load
        pos = (am.cumsum(1) - 1).clamp_min(0)
        with torch.no_grad():
            exported = plain(input_ids=ids, attention_mask=am, position_ids=pos).logits
        torch.testing.assert_close(exported[am.bool()], live[am.bool()], atol=1e-5, rtol=0)
        again, _ = load_policy(out)
        assert tied_weight(again._hf_model()) is not None
        with torch.no_grad():
            torch.testing.assert_close(again(ids, attention_mask=am)[am.bool()], live[am.bool()], atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_lora_on_a_tied_head_is_refused(tmp_path):
    d = make_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(HFLoadError, match=r"tied.*LoRA on lm_head.*Leave lm_head out"):
        load_policy(d, lora=LoraSpec(r=2, target_modules=["q_proj", "lm_head"]))
    untied = make_model_dir(tmp_path / "untied")
    policy, _ = load_policy(untied, lora=LoraSpec(r=2, target_modules=["q_proj", "lm_head"]))  # fine untied
    assert any("lm_head" in n and "lora_A" in n for n, _ in policy.named_parameters())


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(HFLoadError, match="no such directory"):
        load_policy(tmp_path / "missing")
    no_w = make_model_dir(tmp_path / "no_weights", weights=False)
    with pytest.raises(HFLoadError, match=r"no_weights.*no weights"):
        load_policy(no_w)
    only_bin = make_model_dir(tmp_path / "bin", weights=False)
    (only_bin / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(HFLoadError, match="safetensors only"):
        load_policy(only_bin)
    no_tok = make_model_dir(tmp_path / "no_tok", tokenizer=False)
    with pytest.raises(HFLoadError, match=r"no_tok.*no tokenizer files"):
        load_policy(no_tok)
    (tmp_path / "adapter_only").mkdir()
    (tmp_path / "adapter_only" / "adapter_config.json").write_text("{}")
    with pytest.raises(HFLoadError, match="PEFT adapter"):
        load_policy(tmp_path / "adapter_only")
    with pytest.raises(ValueError, match="dtype"):
        load_policy(no_tok, dtype="fp8")
    assert issubclass(HFLoadError, ValueError)


def test_pad_note_and_bf16(tmp_path):
    d = make_model_dir(tmp_path, pad=False)
    policy, tok = load_policy(d, dtype="bf16")
    assert "no pad token" in policy.load_note and tok.pad_id == tok.eos_id == 2
    assert isinstance(policy, HFPolicy) and policy.dtype == torch.bfloat16
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    with torch.no_grad():
        logits = policy(ids, attention_mask=am)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    r = sampling.generate(policy, [tok.encode("ab")], samples_per_prompt=2, max_new_tokens=3,
                          eos_id=tok.eos_id, pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    assert r.ids.shape[0] == 2


def test_tokenizer_surface(llama, tmp_path):
    _, tok = llama
    assert tok.vocab_size == len(SPECIALS) + len(CHARS)
    ids = tok.encode("ab 12")
    assert ids == [3 + CHARS.index(c) for c in "ab 12"] and not tok.adds_bos
    assert tok.encode("ab", bos=True, eos=True) == [tok.bos_id, *tok.encode("ab"), tok.eos_id]
    assert tok.decode(ids + [tok.eos_id] + tok.encode("zz"), stop_at_eos=True) == "ab 12"
    assert tok.decode(torch.tensor([tok.pad_id, *ids, tok.pad_id])) == "ab 12"
    # the default keeps going past eos (dropping it), like CharTokenizer.decode
    assert tok.decode(ids + [tok.eos_id, 4]) == "ab 121" == tok.decode(ids + [tok.eos_id, 4], stop_at_eos=False)
    chat = tok.encode_prompt([{"role": "user", "content": "sort 3,1"}])
    assert chat[0] == tok.bos_id and tok.decode(chat) == "user: sort 3,1 assistant:"
    assert tok.encode_prompt("ab") == tok.encode("ab")
    with pytest.raises(ValueError, match="expected a string"):
        tok.encode_prompt(42)
    tok.save(tmp_path / "ckpt" / "tokenizer.json")                             # the trainer's call shape
    from rlvr.models.hf import HFTokenizer

    again = HFTokenizer.load(tmp_path / "ckpt")
    assert again.encode("ab 12") == ids and again.pad_id == tok.pad_id


def test_import_is_lazy():
    """transformers / peft are imported inside functions only (the core must not need them)."""
    import ast
    import inspect

    import rlvr.models.hf
    import rlvr.models.hf_load
    import rlvr.models.hf_source
    import rlvr.models.hf_policy
    import rlvr.models.hf_tokenizer
    import rlvr.models.lean_llama

    for mod in (rlvr.models.hf, rlvr.models.hf_load, rlvr.models.hf_policy, rlvr.models.hf_tokenizer,
                rlvr.models.lean_llama, rlvr.models.hf_source):
        top = [n for n in ast.parse(inspect.getsource(mod)).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name.split(".")[0] for n in top for a in n.names} | {
            (n.module or "").split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
        assert not names & {"transformers", "peft", "tokenizers", "safetensors", "gguf"}, (mod.__name__, names)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_shared_prompt_forward_equals_full_forward(llama, temperature, top_p):
    """group_size=G runs each prompt once; logits, log-probs and gradients equal the full forward."""
    policy, tok = llama
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    g = torch.Generator().manual_seed(0)
    roll = sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=5, temperature=temperature,
                             top_p=top_p, eos_id=tok.eos_id, pad_id=tok.pad_id, generator=g)
    grads = []
    for G in (None, 3):
        policy.zero_grad()
        lp = scoring.sequence_token_logprobs(policy, roll, group_size=G)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        grads.append((lp.detach(), [p.grad.clone() for p in policy.parameters() if p.grad is not None]))
    (full, gf), (shared, gs) = grads
    assert torch.allclose(full, shared, atol=1e-5)
    assert torch.allclose(shared, roll.logp, atol=1e-5)
    assert len(gf) == len(gs) > 0 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(gf, gs))


@pytest.mark.parametrize("chunk_rows", [None, 4])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_scoring_the_shared_prompt_blocks_apart_equals_scoring_them_joined(llama, top_p, chunk_rows):
    """With a shared prompt the prompt's last position and the responses' logits are scored block by
    block (no joined copy of all the logits): the log-probs, no-nucleus log-probs, entropies and
    parameter gradients are those of the joined (B, T, V) block, to the last bit."""
    policy, tok = llama
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    roll = sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=5, temperature=0.8,
                             top_p=top_p, eos_id=None, pad_id=tok.pad_id, generator=torch.Generator().manual_seed(2))
    w = torch.linspace(-1, 1, roll.logp.numel()).view_as(roll.logp)
    Lp, T = roll.prompt_len, roll.ids.size(1) - roll.prompt_len
    params = [p for p in policy.parameters() if p.requires_grad]
    out = []
    for joined in (False, True):
        if joined:
            blocks = scoring._response_logits(policy, roll.ids, roll.attention_mask, Lp, T, 3)
            assert [b.size(1) for b in blocks] == [1, T - 1]
            lp, full, ent = scoring._score(torch.cat(blocks, dim=1), roll.ids[:, Lp:], roll.attention_mask[:, Lp:] == 0,
                                            temperature=0.8, top_p=top_p, top_k=0, min_p=0.0, chunk_rows=chunk_rows,
                                            entropy=True)
        else:
            lp, full, ent = scoring.sequence_token_logprobs(policy, roll, group_size=3, chunk_rows=chunk_rows,
                                                             return_full=True, return_entropy=True)
        grads = torch.autograd.grad((lp * w).sum() + (full * w).sum() + (ent * w).sum(), params)
        out.append((lp.detach(), full.detach(), ent.detach(), grads))
    (a_lp, a_full, a_ent, a_g), (b_lp, b_full, b_ent, b_g) = out
    assert torch.equal(a_lp, b_lp) and torch.equal(a_full, b_full) and torch.equal(a_ent, b_ent)
    assert all(torch.equal(x, y) for x, y in zip(a_g, b_g))


# ---------------------------------------------------------------------- lean Llama forward vs transformers
FAST_VARIANTS = {
    "plain": ({}, None),
    "gqa": ({"num_key_value_heads": 2}, None),
    "tied": ({"tie_word_embeddings": True}, None),
    "lora": ({"num_key_value_heads": 2}, LoraSpec(r=4, alpha=8, target_modules="all-linear")),
    # Qwen 2: biases on q/k/v (and a tied head, as Qwen2.5's small models); LoRA on the biased projections
    "qwen2": ({"kind": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True}, None),
    "qwen2_lora": ({"kind": "qwen2", "num_key_value_heads": 2},
                   LoraSpec(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])),
    "mistral": ({"kind": "mistral", "num_key_value_heads": 2, "sliding_window": None}, None),
    # a sliding window narrower than the tests' sequences (8 columns): its mask acts
    "mistral_window": ({"kind": "mistral", "num_key_value_heads": 2, "sliding_window": 8}, None),
    # Llama 3.1 / 3.2's RoPE (low frequencies divided by the factor; original context 32 of the 64 here)
    "llama3_rope": ({"num_key_value_heads": 2, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0}}, None),
    # a Llama with biases on every projection (attention_bias, mlp_bias): o, gate/up and down too
    "llama_bias": ({"kind": "llama_biased", "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True},
                   LoraSpec(r=4, alpha=8, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"])),
    # Qwen 3: a norm on each query and key head before the rotation (weights drawn away from 1)
    "qwen3": ({"kind": "qwen3", "num_key_value_heads": 2}, LoraSpec(r=4, alpha=8, target_modules="all-linear")),
    # Gemma: scaled embeddings, x * (1 + w) norms (drawn away from 0), tanh-GELU, a tied head
    "gemma": ({"kind": "gemma", "num_key_value_heads": 2}, LoraSpec(r=4, alpha=8, target_modules="all-linear")),
    # Gemma 2: those and norms around the attention and the MLP, attention scaled by query_pre_attn_scalar,
    # sliding (6 columns) and full layers alternating, its attention scores and logits soft-capped (caps
    # small enough to act on this model's small scores and logits)
    "gemma2": ({"kind": "gemma2", "num_key_value_heads": 2, "sliding_window": 6, "attn_logit_softcapping": 0.02,
                "final_logit_softcapping": 0.5}, None),
    # Phi-3: q/k/v fused in one qkv_proj and gate/up in one gate_up_proj (LoRA on the fused modules), a sliding
    # window of 8 columns
    "phi3": ({"kind": "phi3", "num_key_value_heads": 2, "sliding_window": 8},
             LoraSpec(r=4, alpha=8, target_modules="all-linear")),
    # Gemma 3 (text): scaled embeddings, x * (1 + w) norms (drawn away from 0) around the attention and the
    # MLP, q/k head norms, tanh-GELU, a tied head, attention scaled by query_pre_attn_scalar (256: not
    # 1 / sqrt(head_dim)), and one rotary table per layer type (a sliding layer, then a full one with
    # another base and linear scaling); the sliding layer's window is 6 columns
    "gemma3": ({"kind": "gemma3_text", "num_key_value_heads": 2, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}},
               LoraSpec(r=4, alpha=8, target_modules="all-linear")),
}


@pytest.fixture(scope="module", params=sorted(FAST_VARIANTS))
def fast_variant(request, tmp_path_factory):
    llama_kw, lora = FAST_VARIANTS[request.param]
    llama_kw = dict(llama_kw)
    kind = llama_kw.pop("kind", "llama")
    d = make_model_dir(tmp_path_factory.mktemp(f"fast_{request.param}"), kind, seed=3, **llama_kw)
    policy, tok = load_policy(d, lora=lora)
    if lora is not None:                        # a non-zero adapter (B starts at 0)
        torch.manual_seed(0)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    assert policy.fast_unsupported is None and policy.uses_fast_path, policy.fast_unsupported
    if llama_kw.get("tie_word_embeddings"):
        hf = policy._hf_model()
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    return request.param, policy, tok


@contextlib.contextmanager
def transformers_path(policy):
    """Force the transformers forward (the reference the lean forward must match)."""
    was = policy.fast_path
    policy.fast_path = False
    try:
        yield policy
    finally:
        policy.fast_path = was


def _both(policy, fn):
    """fn() on the lean path, then on the transformers path."""
    fast = fn()
    with transformers_path(policy):
        slow = fn()
    return fast, slow


@pytest.fixture(params=["matmul_attention", "sdpa_attention"])
def attention_kind(request, monkeypatch):
    """The lean path's two attention kernels: explicit matmuls for small score matrices, SDPA above."""
    import rlvr.models.lean_llama as lean

    if request.param == "sdpa_attention":
        monkeypatch.setattr(lean, "SMALL_ATTENTION", 0)
    return request.param


def test_fast_forward_left_padding_and_logits_to_keep(fast_variant, attention_kind):
    _, policy, tok = fast_variant
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    real = am.bool()
    with torch.no_grad():
        fast, slow = _both(policy, lambda: policy(ids, attention_mask=am))
        assert torch.isfinite(fast).all()                                     # pad queries too
        torch.testing.assert_close(fast[real], slow[real], atol=1e-5, rtol=0)
        k3, _ = _both(policy, lambda: policy(ids, attention_mask=am, logits_to_keep=3))
        torch.testing.assert_close(k3, fast[:, -3:], atol=1e-6, rtol=0)
        nomask, slow_nomask = _both(policy, lambda: policy(ids[:1]))            # no mask: plain causal
        torch.testing.assert_close(nomask, slow_nomask, atol=1e-5, rtol=0)
        pos = (am.cumsum(1) - 1).clamp_min(0) + 2                              # explicit positions
        fp, sp = _both(policy, lambda: policy(ids, attention_mask=am, positions=pos))
        torch.testing.assert_close(fp[real], sp[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["grouped", "grouped_chunked", "repeated", "repeated_transposed"])
def test_fast_cached_decoding_matches_transformers(fast_variant, attention_kind, layout, monkeypatch):
    """Prefill, repeat_interleave, then token-by-token decode with a pad column in the middle (a
    finished row): the lean cache gives the transformers logits of the whole sequence, in the
    grouped layout (the prompt's keys once per prompt; also with its queries chunked one by one and
    the last two tokens in one call) and in the repeated one (the prompt's keys copied per row; its
    keys row-major at this width, and transposed with KEYS_ROW_MAJOR at 0)."""
    import rlvr.models.lean_llama as lean

    if layout.startswith("repeated"):
        monkeypatch.setattr(lean, "GROUP_ATTENTION_FLOPS", 0.0)
    if layout == "repeated_transposed":
        monkeypatch.setattr(lean, "KEYS_ROW_MAJOR", 0)
    if layout == "grouped_chunked":
        monkeypatch.setattr(lean, "GROUP_SCORES", 1)
    _, policy, tok = fast_variant
    prompts = [tok.encode(s) for s in PROMPTS]
    pids, pam = left_pad(prompts, tok.pad_id)
    G, T = 2, 4
    g = torch.Generator().manual_seed(0)
    steps = torch.randint(3, 40, (pids.size(0) * G, T), generator=g)
    step_am = torch.ones_like(steps)
    step_am[1, 1:] = 0                                                      # row 1 "finished" after 1 token
    step_am[4, 2] = 0
    ids = torch.cat([pids.repeat_interleave(G, 0), steps], 1)
    am = torch.cat([pam.repeat_interleave(G, 0), step_am], 1)
    real = am.bool()
    with torch.no_grad():
        cache = policy.new_cache(pids.size(0), ids.size(1))
        assert type(cache).__name__ == "LeanCache"
        parts = [policy(pids, attention_mask=pam, cache=cache, logits_to_keep=1).repeat_interleave(G, 0)]
        cache.repeat_interleave(G)
        calls = [(0, 1), (1, 3)] if layout == "grouped_chunked" else [(t, t + 1) for t in range(T - 1)]
        for a, b in calls:
            parts.append(policy(steps[:, a:b], attention_mask=step_am[:, a:b], cache=cache))
        stepped = torch.cat(parts, 1)                                         # (B, T, V): logits at Lp-1 ...
        assert torch.isfinite(stepped).all()
        # without gradient the cache writes in place: every layer's keys are the first columns of one
        # buffer allocated at repeat_interleave (grouped: prompt columns once, then G per step) or at
        # prefill (repeated once for the G rows), so a decode step copies its new columns only; on a
        # CPU the keys' buffers are transposed in the grouped layout, (P, Hkv, D, cols), and in the
        # repeated one row-major up to KEYS_ROW_MAJOR columns, (rows, Hkv, cols, D), transposed past it
        Lp = pids.size(1)
        grouped = not layout.startswith("repeated")
        transposed = layout != "repeated"
        assert cache.group == (G if grouped else 1)
        assert cache.spare_cols
        cols = Lp + G * (cache.max_len - Lp) if grouped else cache.max_len
        col_dim = 3 if grouped else 2                     # of k[li]: grouped (P, Hkv, D, S), plain (B, Hkv, S, D)
        for k, buf in zip(cache.k, cache._kbuf):
            D = k.size(2) if grouped else k.size(3)
            assert buf.shape[2:] == ((D, cols) if transposed else (cols, D))
        assert all(k.data_ptr() == buf.data_ptr() and vb.size(2) == cols
                   and k.size(0) == (pids.size(0) if grouped else ids.size(0)) and k.size(col_dim) == v.size(2)
                   for k, buf, v, vb in zip(cache.k, cache._kbuf, cache.v, cache._vbuf))
        with transformers_path(policy):
            full = policy(ids, attention_mask=am)
            hf_cache = policy.new_cache(pids.size(0), ids.size(1))
            assert type(hf_cache).__name__ == "HFCache"
        want = full[:, Lp - 1:-1]
        keep = real[:, Lp - 1:-1]
        torch.testing.assert_close(stepped[keep], want[keep], atol=1e-5, rtol=0)
        assert cache.length == ids.size(1) - 1
        assert cache.next_pos.tolist() == am[:, :-1].sum(1).tolist()
        # a multi-token chunk on a non-empty cache (causal inside the chunk + padded cache)
        cache2 = policy.new_cache(ids.size(0), ids.size(1))
        a = policy(ids[:, :Lp], attention_mask=am[:, :Lp], cache=cache2)
        b = policy(ids[:, Lp:], attention_mask=am[:, Lp:], cache=cache2)
        torch.testing.assert_close(torch.cat([a, b], 1)[real], full[real], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="cache full"):
            policy(ids[:, :1], attention_mask=am[:, :1], cache=cache2)


def test_shared_prompt_runs_prompt_and_responses_in_one_pass(fast_variant, attention_kind):
    """On the lean path a shared-prompt scoring forward is ONE pass over the layers (every
    projection called once, on the prompts' and the responses' tokens together) and gives the
    numbers of the two calls it replaces (the prompts into a cache, then the responses over it
    repeated G times): logits and parameter gradients to float rounding. With its layers
    checkpointed, the same pass with every layer run again in the backward: the same numbers."""
    _, policy, tok = fast_variant
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    G = 3
    roll = sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=5, temperature=1.0,
                             eos_id=tok.eos_id, pad_id=tok.pad_id, generators=sampling.prompt_generators(0, 0, 3))
    ids, am, Lp = roll.ids, roll.attention_mask, roll.prompt_len
    T = ids.size(1) - Lp
    o_proj = policy._hf_model().model.layers[0].self_attn.o_proj
    calls = []
    hook = o_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[:-1]))
    params = [p for p in policy.parameters() if p.requires_grad]
    try:
        first, resp = policy.shared_prompt_logits(ids, am, Lp, G)
        assert calls == [(1, 3 * Lp + 3 * G * (T - 1))]                  # one call: every token at once
        assert first.shape == (3, 1, resp.size(-1)) and resp.shape[:2] == (3 * G, T - 1)
        calls.clear()
        cache = policy.new_cache(3, Lp + T)
        first2 = policy(ids[::G, :Lp], attention_mask=am[::G, :Lp], cache=cache, logits_to_keep=1)
        cache.repeat_interleave(G)
        resp2 = policy(ids[:, Lp:-1], attention_mask=am[:, Lp:-1], cache=cache)
        assert len(calls) == 2
    finally:
        hook.remove()
    real = am[:, Lp:-1].bool()
    torch.testing.assert_close(first, first2, atol=1e-5, rtol=0)
    torch.testing.assert_close(resp[real], resp2[real], atol=1e-5, rtol=0)
    w = torch.linspace(-1, 1, resp[real].numel())
    g1 = torch.autograd.grad((resp[real].flatten() * w).sum() + first.sum(), params)
    g2 = torch.autograd.grad((resp2[real].flatten() * w).sum() + first2.sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    policy.checkpoint_layers, was_training = True, policy.training
    try:                                           # checkpointed: the same pass, its layers run again
        policy.train()
        calls.clear()
        hook = o_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[:-1]))
        first3, resp3 = policy.shared_prompt_logits(ids, am, Lp, G)
        g3 = torch.autograd.grad((resp3[real].flatten() * w).sum() + first3.sum(), params)
        assert calls == [(1, 3 * Lp + 3 * G * (T - 1))] * 2
        torch.testing.assert_close(resp3, resp)
        assert all(torch.equal(a, b) for a, b in zip(g1, g3))
    finally:
        hook.remove()
        policy.checkpoint_layers = False
        policy.train(was_training)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_fast_generate_and_shared_prompt_grads_match_transformers(fast_variant, attention_kind, temperature,
                                                                 top_p):
    """generate's logp on the lean path equals the transformers recomputation; the shared-prompt
    training forward (group_size=G) gives the transformers full forward's log-probs and gradients."""
    _, policy, tok = fast_variant
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    G = 3
    roll = sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=5, temperature=temperature,
                             top_p=top_p, eos_id=tok.eos_id, pad_id=tok.pad_id,
                             generators=sampling.prompt_generators(0, 0, len(prompts)))  # as rlvr.rollout
    with torch.no_grad(), transformers_path(policy):
        lp_slow = scoring.sequence_token_logprobs(policy, roll)
    torch.testing.assert_close(roll.logp, lp_slow, atol=1e-5, rtol=0)

    params = [p for p in policy.parameters() if p.requires_grad]
    weights = torch.linspace(-1, 1, roll.logp.numel()).view_as(roll.logp)
    results = []
    for fast, group in ((True, G), (True, None), (False, None)):
        policy.fast_path = fast
        policy.zero_grad()
        try:
            lp = scoring.sequence_token_logprobs(policy, roll, group_size=group)
        finally:
            policy.fast_path = True
        (lp * weights).sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in params]))
    policy.zero_grad()
    (lp_ref, g_ref) = results[-1]
    for lp, grads in results[:-1]:
        torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
        assert all(torch.isfinite(g).all() for g in grads)
        for a, b in zip(grads, g_ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fast_lora_adapter_disabled_matches_transformers_base(tmp_path):
    d = make_model_dir(tmp_path, seed=5, num_key_value_heads=2)
    base, tok = load_policy(d, fast=False)
    assert not base.uses_fast_path and base.fast_path is False
    policy, _ = load_policy(d, lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert policy.uses_fast_path
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    real = am.bool()
    with torch.no_grad():
        live, live_slow = _both(policy, lambda: policy(ids, attention_mask=am))
        torch.testing.assert_close(live[real], live_slow[real], atol=1e-5, rtol=0)
        with policy.adapter_disabled():
            ref = policy(ids, attention_mask=am)
        want = base(ids, attention_mask=am)
        assert not torch.allclose(live[real], want[real], atol=1e-3)
        torch.testing.assert_close(ref[real], want[real], atol=1e-5, rtol=0)
        torch.testing.assert_close(policy(ids, attention_mask=am), live)      # adapter back on


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_windows_are_masked_as_transformers_masks_them(tmp_path, monkeypatch, kind):
    """A 16-column sliding window (Mistral: every layer; Qwen 2 with use_sliding_window: its second
    layer only, the first attends to everything): 30-column sequences, left-padded or not, take the
    lean forward with transformers' logits, which differ from the same weights' without a window
    beyond column 16 (the window acts) and equal them inside it; so does cached decoding past the
    window, in the grouped layout (a prompt's G rows) and the repeated one."""
    import rlvr.models.hf_policy as hp
    from rlvr.models.lean_llama import layer_windows, lean_forward

    extra = {"use_sliding_window": True, "max_window_layers": 1} if kind == "qwen2" else {}
    d = make_model_dir(tmp_path / kind, kind, num_key_value_heads=2, sliding_window=16, **extra)
    policy, tok = load_policy(d)
    assert policy.fast_unsupported is None and policy.sliding_window == 16 and policy.uses_fast_path
    assert layer_windows(policy._hf_model()) == ([None, 16] if kind == "qwen2" else [16, 16])
    assert type(policy.new_cache(2, 40)).__name__ == "LeanCache"
    calls = []
    monkeypatch.setattr(hp, "lean_forward", lambda *a, **k: calls.append(a[1].shape) or lean_forward(*a, **k))
    ids, am = left_pad([tok.encode(s * 3) for s in ("abcdefghij", "xyz 12")], tok.pad_id)  # 30 columns, padded
    unwindowed, _ = load_policy(d)
    cfg = unwindowed._hf_model().config
    for layer in unwindowed._hf_model().model.layers:      # transformers with a window wider than all
        if layer.self_attn.__dict__.get("sliding_window") is not None:
            layer.self_attn.sliding_window = 10**6
    cfg.sliding_window = 10**6
    unwindowed.fast_path = False
    with torch.no_grad():
        fast, slow = _both(policy, lambda: policy(ids, attention_mask=am))
        assert calls == [ids.shape]                                           # the lean forward, once
        real = am.bool()
        torch.testing.assert_close(fast[real], slow[real], atol=1e-5, rtol=0)
        free = unwindowed(ids, attention_mask=am)
        torch.testing.assert_close(fast[0, :16], free[0, :16], atol=1e-5, rtol=0)  # inside the window
        assert (fast[0, 16:] - free[0, 16:]).abs().max() > 1e-3                # the window acts beyond it
    prompts = [tok.encode("abcdefghij" * 2), tok.encode("xyz")]                   # 20 and 3 columns
    for group in (4.0, 0.0):                                  # grouped layout, then the repeated one
        monkeypatch.setattr("rlvr.models.lean_llama.GROUP_ATTENTION_FLOPS", group)

        def sample():
            with torch.no_grad():
                return sampling.generate(policy, prompts, samples_per_prompt=2, max_new_tokens=12, temperature=0.9,
                                         eos_id=None, pad_id=tok.pad_id, generators=sampling.prompt_generators(3, 0, 2))
        lean, ref = _both(policy, sample)
        assert torch.equal(lean.ids, ref.ids)
        torch.testing.assert_close(lean.logp, ref.logp, atol=1e-5, rtol=0)


def test_fast_path_falls_back_for_other_configs(tmp_path):
    scaled, _ = load_policy(make_model_dir(tmp_path / "dynamic", rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    assert scaled.fast_unsupported == "rope_type 'dynamic' (the lean forward takes 'default', 'linear', 'llama3')"
    assert not scaled.uses_fast_path and type(scaled.new_cache(1, 4)).__name__ == "HFCache"
    gpt2, tok = load_policy(make_model_dir(tmp_path / "gpt2", "gpt2"))
    assert ("GPT2LMHeadModel is not one of Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM, LlamaForCausalLM, "
            "MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM") in \
        gpt2.fast_unsupported and not gpt2.uses_fast_path
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    with torch.no_grad():                                                     # still works (transformers path)
        assert torch.isfinite(scaled(ids, attention_mask=am)).all()
    # a cache keeps the path it was made for, whatever fast_path says later
    fast, _ = load_policy(make_model_dir(tmp_path / "llama"))
    cache = fast.new_cache(ids.size(0), ids.size(1))
    fast.fast_path = False
    with torch.no_grad():
        a = fast(ids, attention_mask=am, cache=cache)
        b = fast(ids, attention_mask=am)
    torch.testing.assert_close(a[am.bool()], b[am.bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_fast_bf16_close_to_transformers(tmp_path, kind):
    # bf16 weights (Qwen 2's biases, Qwen 3's head norms and the Gemmas' norms in bf16 too)
    extra = {"layer_types": ["sliding_attention", "full_attention"]} if kind == "gemma3_text" else {}
    policy, tok = load_policy(make_model_dir(tmp_path, kind, num_key_value_heads=2, **extra), dtype="bf16")
    assert policy.uses_fast_path
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    with torch.no_grad():
        fast, slow = _both(policy, lambda: policy(ids, attention_mask=am))
    assert fast.dtype == torch.float32 and torch.isfinite(fast).all()
    torch.testing.assert_close(fast[am.bool()], slow[am.bool()], atol=2e-2, rtol=0)


def test_lean_norm_and_chunked_head_equal_the_modules(monkeypatch, fast_variant):
    """The fused RMSNorm gives the module's numbers; the output head in vocabulary blocks (taken only
    without gradient, few rows, no autocast) gives the Linear's, and with gradient the Linear itself."""
    import rlvr.models.lean_llama as lean

    _, policy, _ = fast_variant
    hf = policy._hf_model()
    h = torch.randn(5, 3, hf.config.hidden_size)
    norm = hf.model.norm
    assert torch.equal(lean.rms_norm(norm, h), norm(h))
    hb = h.bfloat16()                                             # not float32: the module itself
    assert torch.equal(lean.rms_norm(norm.bfloat16(), hb), norm(hb))
    norm.float()
    monkeypatch.setattr(lean, "HEAD_CHUNK", 7)                    # uneven blocks over the vocabulary
    head = hf.lm_head
    with torch.no_grad():
        torch.testing.assert_close(lean.output_head(head, h), head(h), atol=1e-6, rtol=0)
    hg = h.clone().requires_grad_()
    out = lean.output_head(head, hg)
    assert out.grad_fn is not None and out.grad_fn.name() == head(hg).grad_fn.name()


def test_weight_major_products_equal_the_modules(tmp_path):
    """linear_t (decode's weight-major products) gives each projection's own output: a bias-free Linear and a
    plain LoRA Linear as W @ xT (+ B @ (A @ xT) * scaling); a merged, disabled or dropout-acting adapter and a
    biased Linear through the module itself."""
    import torch.nn as nn

    import rlvr.models.lean_llama as lean

    d = make_model_dir(tmp_path, seed=4, num_key_value_heads=2)
    policy, _ = load_policy(d, lora=LoraSpec(r=4, alpha=8, dropout=0.5, target_modules=["q_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    layer = policy._hf_model().model.layers[0]
    q, down, k = layer.self_attn.q_proj, layer.mlp.down_proj, layer.self_attn.k_proj

    def check(m, plain):
        x = torch.randn(6, m.in_features)
        assert (lean._plain_lora(m, x.dtype) is not None) == plain
        torch.testing.assert_close(lean.linear_t(m, x.t()).t(), m(x), atol=1e-6, rtol=0)

    policy.eval()                                          # dropout off: plain LoRA
    with torch.no_grad():
        check(q, True)
        check(down, True)
        check(k, False)                                    # a plain Linear: W @ xT
        assert type(k) is nn.Linear and torch.equal(lean.linear_t(k, torch.eye(k.in_features)), k.weight)
        with policy.adapter_disabled():
            check(q, False)
        check(nn.Linear(5, 3), False)                      # with bias: the module
        policy.train()                                     # dropout acts: the module (not deterministic)
        assert lean._plain_lora(q, torch.float32) is None
        policy.eval()
        q.merge()
        check(q, False)
        q.unmerge()
        check(q, True)
        seen = []                                          # a forward hook: the module is called, the hook runs
        for m in (k, q.lora_A["default"]):
            handle = m.register_forward_hook(lambda mod, args, out: seen.append(mod))
            check(k, False)
            check(q, m is k)                               # a hook on k leaves q plain, one on q's A does not
            handle.remove()
        assert seen == [k, k, q.lora_A["default"], q.lora_A["default"]]   # twice: linear_t, then the module


def test_weight_major_products_read_a_transposed_operand_at_two_to_eleven_rows(monkeypatch):
    """linear_t hands its product a contiguous float32 (K, rows) operand as the transposed view of a (rows, K)
    copy at TRANSPOSED_OPERAND_ROWS (2-11) rows, where MKL runs that layout faster (a decode step's down_proj
    reads the MLP's contiguous product); at 1 and 12 rows, for a view already transposed, for bf16, and with the
    setting None it passes the operand as it is. The values are the same either way."""
    import torch.nn as nn

    import rlvr.models.lean_llama.weight_major as wm

    operands = []
    real_mm_bias = wm._mm_bias
    monkeypatch.setattr(wm, "_mm_bias", lambda W, b, xT: operands.append(xT.stride()) or real_mm_bias(W, b, xT))
    m = nn.Linear(24, 16, bias=False)
    with torch.no_grad():
        for rows, transposed in ((1, False), (2, True), (5, True), (11, True), (12, False)):
            xT = torch.randn(24, rows)                               # contiguous, as one product hands the next
            out = wm.linear_t(m, xT)
            assert operands.pop() == ((1, 24) if transposed else (rows, 1)), rows
            assert torch.equal(out, torch.mm(m.weight, xT.t().contiguous().t() if transposed else xT))
        view = torch.randn(5, 24).t()                                # already a transposed view: no copy
        assert wm._operand_t(view) is view and wm._operand_t(torch.randn(24, 5).bfloat16()).dtype == torch.bfloat16
        monkeypatch.setattr(wm, "TRANSPOSED_OPERAND_ROWS", None)
        xT = torch.randn(24, 5)
        wm.linear_t(m, xT)
        assert operands.pop() == (5, 1)


def test_decode_steps_take_the_weight_major_products(monkeypatch, fast_variant):
    """Without gradient, on CPU, in float32 and on at most HEAD_ROWS rows the lean forward computes its projections
    weight-major (linear_t), with the logits of the row-major forward; with gradient or more rows it does not;
    under bf16 autocast only in rlvr's context, whose bf16 weight copies it reads."""
    import rlvr.models.lean_llama as lean
    from rlvr.numerics import autocast_context

    _, policy, tok = fast_variant
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    calls = []
    real_linear_t, real_weight_major = lean.linear_t, lean._weight_major
    monkeypatch.setattr(lean, "linear_t", lambda m, xT: calls.append(xT.size(1)) or real_linear_t(m, xT))
    with torch.no_grad():
        wm = policy(ids, attention_mask=am)
        assert calls and set(calls) == {ids.numel()}
        monkeypatch.setattr(lean, "_weight_major", lambda h: None)
        rm = policy(ids, attention_mask=am)
    torch.testing.assert_close(wm, rm, atol=1e-6, rtol=0)
    monkeypatch.setattr(lean, "_weight_major", real_weight_major)
    h = torch.zeros(lean.HEAD_ROWS, 1, 8)
    with torch.no_grad():
        assert lean._weight_major(h) == torch.float32 and lean._weight_major(torch.zeros(lean.HEAD_ROWS + 1, 1, 8)) is None
        assert lean._weight_major(h.bfloat16()) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):   # autocast alone: no bf16 weight copies to read
            assert lean._weight_major(h) is None
        with autocast_context(True, "cpu"):                 # rlvr's bf16 context: bf16 products from its copies
            assert lean._weight_major(h) == (torch.bfloat16 if lean._weight_major_bf16_ok() else None)
    assert lean._weight_major(h) is None                   # gradient enabled


def test_lora_with_a_power_of_two_scaling_is_one_addmm(tmp_path, monkeypatch):
    """linear_t adds a plain adapter as one addmm when its scaling (alpha / r) is a power of two (scaling the
    product is then exact) and as peft's product-times-scaling otherwise; both give W @ xT + B @ (A @ xT) * s."""
    import rlvr.models.lean_llama as lean

    d = make_model_dir(tmp_path, seed=4, num_key_value_heads=2)
    addmms = []
    real_addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: addmms.append(k.get("alpha")) or real_addmm(*a, **k))
    for alpha, r, fused in ((8, 4, True), (6, 4, False), (1, 4, True)):
        policy, _ = load_policy(d, lora=LoraSpec(r=r, alpha=alpha, target_modules=["q_proj"]))
        policy.eval()
        q = policy._hf_model().model.layers[0].self_attn.q_proj
        with torch.no_grad():
            q.lora_B["default"].weight.normal_(0, 0.05)
            xT = torch.randn(64, q.in_features).t()
            addmms.clear()
            got = lean.linear_t(q, xT)
            A, B = q.lora_A["default"].weight, q.lora_B["default"].weight
            want = torch.mm(q.base_layer.weight, xT) + torch.mm(B, torch.mm(A, xT)) * (alpha / r)
        assert addmms == ([alpha / r] if fused else [])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_group_attend_mask_by_hand():
    """The grouped layout's mask: 2 prompts x 2 rows, a 3-column prompt (prompt 1 left-padded by one), then 2
    steps (row 1 of prompt 0 finished after its first token); a one-token call at step 1 and a two-token call
    from step 0. Columns: the prompt's 3, then step s row g' at 3 + 2 * s + g'."""
    import rlvr.models.lean_llama as lean

    full_am = torch.tensor([[1, 1, 1, 1, 1],
                            [1, 1, 1, 1, 0],
                            [0, 1, 1, 1, 1],
                            [0, 1, 1, 1, 1]])
    m = lean._group_attend_mask(full_am, prefix=3, G=2, past=4, L=1).int()        # (P, G, L, 3 + 2 * 2)
    assert m.shape == (2, 2, 1, 7)
    assert m[0, 0, 0].tolist() == [1, 1, 1, 1, 0, 1, 0]      # row 0: the prompt, its steps 0 and 1
    assert m[0, 1, 0].tolist() == [1, 1, 1, 0, 1, 0, 1]      # row 1: its step 1 is a pad: its own column, kept
    assert m[1, 0, 0].tolist() == [0, 1, 1, 1, 0, 1, 0]      # prompt 1's pad column is masked
    two = lean._group_attend_mask(full_am, prefix=3, G=2, past=3, L=2).int()
    assert two[0, 0].tolist() == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 1, 0]]  # step 0 does not see step 1
    assert two[0, 1].tolist() == [[1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 1, 0, 1]]


def test_a_cache_takes_the_grouped_layout_where_it_pays(fast_variant, monkeypatch):
    """repeat_interleave(G) groups a cache filled without gradient on CPU when (prefix + G new) / (prefix + new)
    <= GROUP_ATTENTION_FLOPS, and then samples what the repeated layout samples (to float rounding); with
    gradient, or past the ratio, it repeats the rows."""
    import rlvr.models.lean_llama as lean

    _, policy, tok = fast_variant
    prompts = [tok.encode(s) for s in PROMPTS]
    pids, pam = left_pad(prompts, tok.pad_id)
    Lp = pids.size(1)

    def repeated_cache(G, new, grad=False):
        with torch.set_grad_enabled(grad):
            cache = policy.new_cache(pids.size(0), Lp + new)
            policy(pids, attention_mask=pam, cache=cache, logits_to_keep=1)
            return cache.repeat_interleave(G)

    ratio = lambda G, new: (Lp + G * new) / (Lp + new)                       # noqa: E731
    G = 8
    new = max(n for n in range(1, 10 * Lp) if ratio(G, n) <= lean.GROUP_ATTENTION_FLOPS)
    assert repeated_cache(G, new).group == G
    assert repeated_cache(G, new + 1).group == 1                              # past the ratio: repeated
    assert repeated_cache(G, new, grad=True).group == 1                       # gradient: torch.cat, repeated
    assert repeated_cache(1, new).group == 1

    def sample(flops):
        monkeypatch.setattr(lean, "GROUP_ATTENTION_FLOPS", flops)
        return sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=6, temperature=1.0,
                                 eos_id=None, pad_id=tok.pad_id, generators=sampling.prompt_generators(5, 0, len(prompts)))

    grouped, repeated = sample(4.0), sample(0.0)
    assert torch.equal(grouped.ids, repeated.ids)
    torch.testing.assert_close(grouped.logp, repeated.logp, atol=1e-5, rtol=0)


def _ragged_rollout(tok, lengths, G, T, temperature, top_p, seed=0):
    """A rollout built by hand: 3 prompts x G rows, row b's response `lengths[b]` tokens, then pads."""
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    Lp = max(map(len, prompts))
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for b, n in enumerate(lengths):
        p = prompts[b // G]
        resp = torch.randint(3, len(CHARS), (n,), generator=g).tolist() + [tok.pad_id] * (T - n)
        rows.append([tok.pad_id] * (Lp - len(p)) + p + resp)
        masks.append([0] * (Lp - len(p)) + [1] * len(p) + [1] * n + [0] * (T - n))
    ids, am = torch.tensor(rows), torch.tensor(masks)
    return sampling.Rollout(ids=ids, attention_mask=am, prompt_len=Lp, mask=am[:, Lp:].float(),
                            logp=torch.zeros(len(rows), T), truncated=torch.zeros(len(rows), dtype=torch.bool),
                            temperature=temperature, top_p=top_p)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_scoring_rows_that_all_end_early_gives_the_full_forwards_numbers(fast_variant, temperature, top_p,
                                                                        monkeypatch):
    """Every row ends before the last column (a minibatch of short rows): the scoring forward stops
    at the longest row, and its log-probs, no-nucleus log-probs, entropies and gradients equal the
    full forward through transformers, with and without gradient; 0 past each row's end."""
    _, policy, tok = fast_variant
    G, T = 3, 14
    lengths = [1, 12, 12, 2, 12, 3, 5, 6, 1]             # no row reaches column 14
    roll = _ragged_rollout(tok, lengths, G, T, temperature, top_p)
    widths = []
    real = scoring._response_logits
    monkeypatch.setattr(scoring, "_response_logits", lambda *a: widths.append(a[4]) or real(*a))
    params = [p for p in policy.parameters() if p.requires_grad]
    weights = torch.linspace(-1, 1, roll.logp.numel()).view_as(roll.logp)
    results = []
    for fast, group in ((True, G), (False, None)):
        policy.fast_path = fast
        policy.zero_grad()
        try:
            out = scoring.sequence_token_logprobs(policy, roll, group_size=group, return_full=True,
                                                   return_entropy=True)
            with torch.no_grad():
                nograd = scoring.sequence_token_logprobs(policy, roll, group_size=group)
        finally:
            policy.fast_path = True
        (out.logp * weights + 0.1 * out.entropy).sum().backward()
        results.append((out, nograd, [p.grad.clone() for p in params]))
    policy.zero_grad()
    (got, got_ng, g_got), (want, want_ng, g_want) = results
    assert widths and set(widths) == {max(lengths)}                # forwarded only as far as the longest row
    assert got.logp.shape == (len(lengths), T) and not got.logp[roll.mask == 0].any()
    for a, b in ((got.logp, want.logp), (got.logp_full, want.logp_full), (got.entropy, want.entropy),
                 (got_ng, want_ng), (got_ng, want.logp.detach())):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(g_got, g_want):
        assert torch.isfinite(a).all() and a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_frozen_weights_bf16_copies_are_kept_across_regions_until_they_change():
    """A frozen weight's bf16 copy (and its prepacked copy, where oneDNN has one) made in one bf16
    region serves the next; a trainable weight's is made again in each region; a frozen weight
    changed in place (an op, load_state_dict) or given new data is copied again, each product
    equal to autocast's; a change through ``.data`` in place, which no version counter sees, is
    seen after ``drop_kept_copies``; the copies go with their weight."""
    import gc

    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    torch.manual_seed(0)
    frozen, trained = torch.nn.Linear(64, 96).requires_grad_(False), torch.nn.Linear(64, 96)
    x = torch.randn(8, 64)
    pack = f"pack {lean_llama.PACK_ROWS}"

    def region():
        with autocast_context(True, "cpu"), torch.no_grad():
            scope = lean_llama._SCOPE.weights
            outs = [lean_llama.linear(m, x) for m in (frozen, trained)]
            copies = [scope.get(t) for t in (frozen.weight, frozen.bias, trained.weight)]
            packed = lean_llama._KEPT.find(pack, (frozen.weight,))
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            assert all(torch.equal(o, m(x)) for o, m in zip(outs, (frozen, trained)))  # autocast's bits
        assert torch.equal(copies[0], frozen.weight.to(torch.bfloat16))
        assert (packed is not None) == lean_llama._packed_linear_ok()
        return copies, packed

    (w1, b1, t1), p1 = region()
    (w2, b2, t2), p2 = region()
    assert w2 is w1 and b2 is b1 and p2 is p1 and t2 is not t1     # kept; the trainable one made again
    with torch.no_grad():
        frozen.weight.mul_(2.0)                                     # an in-place op
    (w3, b3, _), p3 = region()
    assert w3 is not w1 and b3 is b1 and (p3 is None or p3 is not p1)
    frozen.load_state_dict({"weight": torch.randn(96, 64), "bias": torch.randn(96)})
    (w4, b4, _), _ = region()
    assert w4 is not w3 and b4 is not b1
    frozen.weight.data = torch.randn(96, 64)                        # new data
    (w5, _, _), _ = region()
    assert w5 is not w4
    frozen.weight.data.add_(1.0)                  # unseen: .data counts its versions apart from the weight
    with autocast_context(True, "cpu"), torch.no_grad():
        assert lean_llama._SCOPE.weights.get(frozen.weight) is w5   # the stale copy, until dropped
    lean_llama.drop_kept_copies()
    (w7, _, _), _ = region()
    assert w7 is not w5
    wid = id(frozen.weight)
    assert any(k[1:] == (wid,) for k in lean_llama._KEPT.entries)
    del frozen, w1, w2, w3, w4, w5, w7, p1, p2, p3
    gc.collect()
    assert not any(k[1:] == (wid,) for k in lean_llama._KEPT.entries)  # gone with the weight


def test_bf16_weight_copies_give_autocasts_numbers_bit_for_bit(fast_variant, monkeypatch):
    """Under rlvr's CPU bf16 context (torch.autocast + a region of bf16 weight copies) the lean
    forward's logits, sampling (its decode steps weight-major from the copies, q/k/v and gate/up
    from stacked copies, the head from a prepacked one) and gradients equal plain torch.autocast's
    to the last bit; a weight changed in place inside the region is copied again; the copies are
    made once per region."""
    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    _, policy, tok = fast_variant
    if not policy.uses_fast_path:
        pytest.skip("not the lean path")
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    params = [p for p in policy.parameters() if p.requires_grad]
    plain = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    outs, wm_calls = [], []
    real = lean_llama._linear_t_bf16
    monkeypatch.setattr(lean_llama, "_linear_t_bf16", lambda m, xT: wm_calls.append(1) or real(m, xT))
    for ctx in (plain, lambda: autocast_context(True, "cpu")):
        wm_calls.clear()
        policy.zero_grad()
        with ctx():
            logits = policy(ids, attention_mask=am)
            scope = getattr(lean_llama._SCOPE, "weights", None)
            linears = [m for m in policy._hf_model().modules() if type(m) is torch.nn.Linear]  # LoRA's too
            tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]      # Qwen 2's biases
            mine = {(id(t),) for t in tensors}
            if scope is not None:                           # with gradient: the frozen ones, each copied once
                assert len(scope.made("copy") & mine) == sum(not t.requires_grad for t in tensors)
            with torch.no_grad():
                roll = sampling.generate(policy, [tok.encode("ab"), tok.encode("hello")], samples_per_prompt=3,
                                         max_new_tokens=4, temperature=0.7, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                         generators=sampling.prompt_generators(0, 0, 2))
            if scope is not None:   # without: all of them (decode's weight-major products), once for the call
                packs = scope.made(f"pack {lean_llama.PACK_ROWS}") & mine
                held = (scope.made("copy") | packs) & mine   # the head prepacked where oneDNN has it
                wm_ok = lean_llama._weight_major_bf16_ok()
                if not wm_ok:   # row-major decode: the LoRA factors run under autocast, but the A factors of
                    # q/k/v and gate/up join their stacked pack where oneDNN's packed linear serves (a copy each),
                    # and their B factors' products then read a copy each
                    hf = policy._hf_model()
                    base = [m for n, m in hf.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in n]
                    stacked = [m for layer in hf.model.layers for m in lean_llama._qkv_mods(layer.self_attn)
                               + (lean_llama._gate_up_mods(layer.mlp) if lean_llama._stock_mlp(layer.mlp) else ())]
                    factors = [f.weight for m in stacked if hasattr(m, "lora_A")
                               for f in (*m.lora_A.values(), *m.lora_B.values())]
                    tensors = [t for m in base for t in (m.weight, m.bias) if t is not None]
                    tensors += factors if lean_llama._packed_linear_ok() else []
                    mine = {(id(t),) for t in tensors}
                assert len(held) == len(tensors) > 0 and mine == held
                # prepacked where oneDNN has it: the head, and row-major decode's frozen weights too (q/k/v
                # and gate/up in one pack each where their stacked product gives autocast's bits)
                frozen = {(id(m.weight),) for m in linears if not m.weight.requires_grad}
                head = {(id(policy._hf_model().lm_head.weight),)}
                stack_packs = scope.made(f"stack pack {lean_llama.PACK_ROWS}") | {   # with the A factors: the bases'
                    tuple(w for w in k if (w,) in frozen) for k in scope.made(f"stack+ pack {lean_llama.PACK_ROWS}")}
                packed = (packs | {(w,) for k in stack_packs for w in k}) & (frozen | head)
                assert packed == ((head | (set() if wm_ok else frozen)) if lean_llama._packed_linear_ok() else set())
                layer_ids = {id(t) for t in tensors} | {id(t) for m in linears for t in (m.weight,)}
                stacks = {k for k in scope.made("stack") if set(k) <= layer_ids} - stack_packs  # weight-major decode's
                # q/k/v, gate/up a layer
                assert len(stacks) == (2 * len(policy._hf_model().model.layers) if wm_ok else 0)
            # decode weight-major in bf16 in rlvr's context only, where this CPU's layouts round alike
            assert bool(wm_calls) == (scope is not None and lean_llama._weight_major_bf16_ok())
        logits.float().logsumexp(-1)[am.bool()].sum().backward()
        outs.append((logits.detach(), roll, [p.grad.clone() for p in params]))
    policy.zero_grad()
    (l1, r1, g1), (l2, r2, g2) = outs
    with torch.no_grad():
        assert not torch.allclose(policy(ids, attention_mask=am), l1, atol=1e-4)   # bf16 products reached
    assert torch.equal(l1, l2) and torch.equal(r1.ids, r2.ids) and torch.equal(r1.logp, r2.logp)
    assert len(g1) == len(g2) > 0 and all(torch.equal(a, b) for a, b in zip(g1, g2))

    head = policy._hf_model().lm_head
    x = torch.randn(2, head.in_features)
    with autocast_context(True, "cpu"), torch.no_grad():
        scope = lean_llama._SCOPE.weights
        first = lean_llama.linear(head, x)
        made = lambda: {k for kind in ("copy", f"pack {lean_llama.PACK_ROWS}") for k in scope.made(kind)  # noqa: E731
                        if k == (id(head.weight),)}
        assert made() == {(id(head.weight),)} and torch.equal(lean_llama.linear(head, x), first)
        head.weight.mul_(2.0)                               # changed in place: copied again
        try:
            torch.testing.assert_close(lean_llama.linear(head, x).float(), 2 * first.float(), rtol=1e-2, atol=1e-2)
            with autocast_context(True, "cpu"):             # a nested region shares the outer's copies
                assert lean_llama._SCOPE.weights is scope
        finally:
            head.weight.mul_(0.5)
    assert lean_llama._SCOPE.weights is None                # freed at the end of the region


def test_the_weight_major_bf16_probe_sees_one_output_rounded_otherwise(monkeypatch):
    """_weight_major_bf16_ok compares the weight-major bf16 products (plain and biased) with
    autocast's row-major ones: one output one bf16 step off in either turns decode's bf16 products
    back to row-major; bit-equal products keep them weight-major. (This CPU's own answer is what the
    bf16 tests above read.)"""
    import torch.nn.functional as F

    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    real = lean_llama._mm_bias
    for biased in (False, True):
        def off_by_one_step(W, b, xT):
            out = real(W, b, xT)
            if (b is not None) is biased:
                out[3, 1] = out[3, 1] * 1.01 + 0.01       # one output off by at least one bf16 step
            return out

        monkeypatch.setattr(lean_llama, "_WM_BF16_OK", [])
        monkeypatch.setattr(lean_llama, "_mm_bias", off_by_one_step)
        assert lean_llama._weight_major_bf16_ok() is False
    monkeypatch.setattr(lean_llama, "_WM_BF16_OK", [])
    monkeypatch.setattr(lean_llama, "_mm_bias", lambda W, b, xT: F.linear(xT.t().contiguous(), W, b).t())
    assert lean_llama._weight_major_bf16_ok() is True
    monkeypatch.setattr(lean_llama, "_WM_BF16_OK", [False])
    with autocast_context(True, "cpu"), torch.no_grad():
        assert lean_llama._weight_major(torch.zeros(4, 1, 8)) is None


def test_the_packed_linear_probe_sees_one_output_rounded_otherwise(monkeypatch):
    """_packed_linear_ok compares oneDNN's packed bf16 products (plain and biased, 1 to 200 rows from
    one pack) with F.linear's: one output one bf16 step off in either turns the packs off."""
    from rlvr.models import lean_llama

    monkeypatch.setattr(lean_llama, "_PACKED_OK", [])
    if not lean_llama._packed_linear_ok():
        pytest.skip("this torch has no oneDNN packed bf16 linear with autocast's numbers")
    real = lean_llama._packed_linear
    for biased in (False, True):
        for rows in (1, 96):
            def off_by_one_step(x, Wp, bb):
                out = real(x, Wp, bb)
                if (bb is not None) is biased and x.size(0) == rows:
                    out[-1, 7] = out[-1, 7] * 1.01 + 0.01   # one output off by at least one bf16 step
                return out

            monkeypatch.setattr(lean_llama, "_PACKED_OK", [])
            monkeypatch.setattr(lean_llama, "_packed_linear", off_by_one_step)
            assert lean_llama._packed_linear_ok() is False
    monkeypatch.setattr(lean_llama, "_PACKED_OK", [])
    monkeypatch.setattr(lean_llama, "_packed_linear", real)
    assert lean_llama._packed_linear_ok() is True


def test_bf16_decode_stacks_and_packed_head_keep_autocasts_numbers(fast_variant, monkeypatch):
    """The stacked q/k/v and gate/up products and the prepacked head of bf16 decode, checked where the
    first test does not reach: without oneDNN's packed linear (the plain-copy fallback) on the
    untied variants, and a LoRA scaling that is not a power of two (1.5: scaled, then added) on the
    LoRA one; sampled tokens and log-probs equal plain torch.autocast's. A stacked weight changed in
    place inside the region is stacked again from its new values."""
    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    name, policy, tok = fast_variant
    if not policy.uses_fast_path:
        pytest.skip("not the lean path")
    hf = policy._hf_model()
    loras = [m for m in hf.modules() if hasattr(m, "scaling") and hasattr(m, "lora_A")]
    saved = [dict(m.scaling) for m in loras]
    if name == "lora":
        assert loras
        for m in loras:
            for k in m.scaling:
                m.scaling[k] = 1.5
    elif name != "tied":
        monkeypatch.setattr(lean_llama, "_PACKED_OK", [False])
    prompts = [tok.encode("ab"), tok.encode("hello")]

    def sample(ctx):
        lean_llama.drop_kept_copies()          # what this call makes, not what an earlier test kept
        with ctx(), torch.no_grad():
            roll = sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=4, temperature=0.7,
                                     eos_id=tok.eos_id, pad_id=tok.pad_id,
                                     generators=sampling.prompt_generators(1, 0, 2))
            scope = getattr(lean_llama._SCOPE, "weights", None)
            mine = {id(t) for t in hf.parameters()}
            if scope is None:
                return roll, None
            frozen_ids = {id(t) for t in hf.parameters() if not t.requires_grad}
            stack_packs = scope.made(f"stack pack {lean_llama.PACK_ROWS}") | {   # row-major decode's (the bases
                tuple(w for w in k if w in frozen_ids) for k in scope.made(f"stack+ pack {lean_llama.PACK_ROWS}")}
            stacks = {k for k in scope.made("stack") if set(k) <= mine} - stack_packs  # weight-major decode's
            packed = {w for k in scope.made(f"pack {lean_llama.PACK_ROWS}") | stack_packs if set(k) <= mine for w in k}
            return roll, (len(stacks), len(packed))

    try:
        (r1, _), (r2, held) = sample(lambda: torch.autocast("cpu", dtype=torch.bfloat16)), \
            sample(lambda: autocast_context(True, "cpu"))
    finally:
        for m, sc in zip(loras, saved):
            m.scaling.update(sc)
    assert torch.equal(r1.ids, r2.ids) and torch.equal(r1.logp, r2.logp)
    wm_ok = lean_llama._weight_major_bf16_ok()       # row-major decode reads its frozen weights packed too
    frozen = {id(m.weight) for m in hf.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad}
    packs = {id(hf.lm_head.weight)} | (set() if wm_ok else frozen)
    assert held == (2 * len(hf.model.layers) if wm_ok else 0, len(packs) if lean_llama._packed_linear_ok() else 0)

    layer = hf.model.layers[0]
    mods = lean_llama._qkv_mods(layer.self_attn)           # q, k, v (Phi-3: its one fused qkv_proj)
    q = mods[0]
    W = (q.base_layer if hasattr(q, "base_layer") else q).weight
    xT = torch.randn(W.size(1), 3).to(torch.bfloat16)
    with autocast_context(True, "cpu"), torch.no_grad():
        prod, outs = lean_llama._stacked_t_bf16(mods, xT)
        want = [lean_llama._linear_t_bf16(m, xT) for m in mods]
        assert all(torch.equal(a, b) for a, b in zip(outs, want))
        W.mul_(2.0)                                         # changed in place: stacked again
        try:
            _, outs2 = lean_llama._stacked_t_bf16(mods, xT)
            assert not torch.equal(outs2[0], outs[0]) and all(torch.equal(a, b) for a, b in zip(outs2[1:], outs[1:]))
            assert torch.equal(outs2[0], lean_llama._linear_t_bf16(mods[0], xT))
        finally:
            W.mul_(0.5)


def test_row_major_bf16_decode_reads_stacked_packs_with_autocasts_numbers(fast_variant, monkeypatch):
    """Row-major bf16 decode (forced here, whatever this CPU's weight-major probe says) computes q/k/v
    and gate/up from one prepacked stack of their frozen base weights exactly where ``_pack_ok`` says
    the stacked product rounds as each weight's own (probed for every such call where the bases are
    frozen, as under LoRA): each such call's outputs equal the per-module ``linear`` products to the
    last bit (the oracle, LoRA terms included), and the sampled tokens and log-probs equal plain
    torch.autocast's."""
    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    _, policy, tok = fast_variant
    if not policy.uses_fast_path or not lean_llama._packed_linear_ok():
        pytest.skip("not the lean path, or no oneDNN packed bf16 linear with autocast's numbers")
    monkeypatch.setattr(lean_llama, "_WM_BF16_OK", [False])
    monkeypatch.setattr(lean_llama, "_PACK_OK_AT", {})
    calls, real = [], lean_llama._stacked_linear

    def checked(mods, x):
        outs = real(mods, x)
        if outs is not None:
            want = [lean_llama.linear(m, x) for m in mods]
            assert all(torch.equal(a, b) for a, b in zip(outs, want))
        if getattr(lean_llama._SCOPE, "weights", None) is not None:    # rlvr's bf16 context
            bases = [m if type(m) is torch.nn.Linear else m.base_layer for m in mods]
            key = (tuple(m.weight.size(0) for m in bases), x.size(-1), x.numel() // x.size(-1),
                   tuple(m.bias is not None for m in bases))
            rs = tuple(A.weight.size(0) for m in mods if hasattr(m, "lora_A") for A in m.lora_A.values())
            with_factors = (key[0] + rs, key[1], key[2], key[3] + (False,) * len(rs)) if rs else None
            calls.append((outs is not None, key, with_factors))
        return outs

    monkeypatch.setattr(lean_llama, "_stacked_linear", checked)
    prompts = [tok.encode("ab"), tok.encode("hello")]

    def sample(ctx):
        with ctx(), torch.no_grad():
            return sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=5, temperature=0.7,
                                     eos_id=tok.eos_id, pad_id=tok.pad_id,
                                     generators=sampling.prompt_generators(2, 0, 2))

    r1, r2 = sample(lambda: torch.autocast("cpu", dtype=torch.bfloat16)), sample(lambda: autocast_context(True, "cpu"))
    assert torch.equal(r1.ids, r2.ids) and torch.equal(r1.logp, r2.logp)
    frozen_bases = not any(p.requires_grad for n, p in policy._hf_model().named_parameters() if "lora_" not in n)
    assert calls
    ok = lean_llama._PACK_OK_AT
    for taken, key, with_factors in calls:   # in rlvr's context where the bases are frozen: probed, and taken
        # where it passed; the bases with the LoRA A factors first, the bases alone where that failed
        if with_factors is not None and frozen_bases:
            assert with_factors in ok and (ok[with_factors] or key in ok)
            assert taken == (ok[with_factors] or ok[key])
        else:
            assert (key in ok) == frozen_bases
            assert taken == (frozen_bases and ok[key])


def _lora_policy(tmp_path):
    """The "lora" fast variant's policy and tokenizer, its adapter made non-zero (B starts at 0)."""
    llama_kw, lora = FAST_VARIANTS["lora"]
    policy, tok = load_policy(make_model_dir(tmp_path, "llama", seed=3, **llama_kw), lora=lora)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    return policy, tok


def test_row_major_bf16_decode_packs_the_bases_alone_where_the_factors_stacked_product_does_not_round_alike(
        tmp_path, monkeypatch):
    """Where ``_pack_ok`` says a stack of the frozen bases with the LoRA A factors does not give each
    weight's own bits (forced here for every stack of four weights or more: q/k/v with their three
    factors, gate/up with their two), row-major decode packs the bases alone and runs the factors
    under autocast: each stacked call's outputs still equal the per-module ``linear`` products, no
    stack with factors is read, and the sampled tokens and log-probs equal plain torch.autocast's."""
    from rlvr.models import lean_llama
    from rlvr.models.lean_llama import products
    from rlvr.numerics import autocast_context

    if not lean_llama._packed_linear_ok():
        pytest.skip("no oneDNN packed bf16 linear with autocast's numbers")
    policy, tok = _lora_policy(tmp_path)
    monkeypatch.setattr(lean_llama, "_WM_BF16_OK", [False])
    monkeypatch.setattr(lean_llama, "_PACK_OK_AT", {})
    real_ok, real = products._pack_ok, lean_llama._stacked_linear
    monkeypatch.setattr(products, "_pack_ok", lambda Wp, Wbs, bbs, rows: len(Wbs) < 4 and real_ok(Wp, Wbs, bbs, rows))
    taken = []

    def checked(mods, x):
        outs = real(mods, x)
        if outs is not None:
            assert all(torch.equal(a, b) for a, b in zip(outs, [lean_llama.linear(m, x) for m in mods]))
        taken.append(outs is not None)
        return outs

    monkeypatch.setattr(lean_llama, "_stacked_linear", checked)
    plans, real_plan = [], products._stacked_plan
    monkeypatch.setattr(products, "_stacked_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])

    def sample(ctx):
        with ctx(), torch.no_grad():
            return sampling.generate(policy, [tok.encode("ab"), tok.encode("hello")], samples_per_prompt=3,
                                     max_new_tokens=5, temperature=0.7, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                     generators=sampling.prompt_generators(2, 0, 2))

    r1, r2 = sample(lambda: torch.autocast("cpu", dtype=torch.bfloat16)), sample(lambda: autocast_context(True, "cpu"))
    assert torch.equal(r1.ids, r2.ids) and torch.equal(r1.logp, r2.logp)
    assert any(taken) and plans and all(p is not None for p in plans)
    served = [o for choice, _ in plans for o in choice.at.values()]
    assert served and all(o is not None for o in served)                 # the bases' stacked pack served
    assert not any(factored for _, (_, _, factored, _) in served)       # never one with the A factors


def test_decode_plans_are_made_once_a_region_and_again_when_what_they_rest_on_changes(tmp_path, monkeypatch):
    """A no-gradient decode call of ``linear`` / ``_stacked_linear`` reads what a plan made at its
    first call in the region says (copies, packs, LoRA factors), served to later calls; an in-place
    change of a weight, the adapter disabled, a forward hook or train mode inside the
    region makes it again (a call at another row count does not), and every call gives what plain
    torch.autocast's module call gives."""
    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    policy, _ = _lora_policy(tmp_path)
    assert policy.uses_fast_path
    hf = policy._hf_model()
    attn = hf.model.layers[0].self_attn
    q = attn.q_proj
    made = []
    real = lean_llama._linear_plan
    monkeypatch.setattr(lean_llama, "_linear_plan", lambda *a: made.append(a[1]) or real(*a))
    x = torch.randn(4, 1, q.in_features)

    def plain() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            return q(x)

    was = hf.training
    hf.eval()
    try:
        with autocast_context(True, "cpu"), torch.no_grad():
            got = lean_llama.linear(q, x)
            assert torch.equal(lean_llama.linear(q, x), got) and len(made) == 1          # served again
            x2 = torch.randn(2, 1, q.in_features)              # fewer rows (rows that ended left the batch)
            at2 = lean_llama.linear(q, x2)
            assert len(made) == 1                                                        # the same plan
            checks = []
            W = q.base_layer.weight   # (a factor's bf16 cast is autocast's own, cached for the region)
            W.mul_(2.0)                                                                  # the weight changed
            checks.append(lean_llama.linear(q, x))
            with policy.model.disable_adapter():                                         # the adapter off
                checks.append(lean_llama.linear(q, x))
            handle = q.register_forward_hook(lambda mod, args, out: out * 0)            # a hook: the module runs
            checks.append(lean_llama.linear(q, x))
            handle.remove()
            hf.train()                                                                   # train mode
            checks.append(lean_llama.linear(q, x))
            hf.eval()
            assert len(made) == 5
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            want = [q(x)]
            with policy.model.disable_adapter():
                want.append(q(x))
            want.append(q(x) * 0)
            hf.train()
            want.append(q(x))
            hf.eval()
        assert all(torch.equal(a, b) for a, b in zip(checks, want))
        W.mul_(0.5)
        assert torch.equal(got, plain())
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            assert torch.equal(at2, q(x2))
    finally:
        hf.train(was)


def test_the_pack_probe_sees_one_output_rounded_otherwise(monkeypatch):
    """_pack_ok compares one product from a (stacked) pack with each weight's F.linear (with and
    without biases, at the asked row count): one output one bf16 step off in one weight's block turns
    that shape and row count off; an honest product keeps it on where this CPU rounds alike, each
    (shapes, biases, rows) probed once."""
    import torch.nn.functional as F

    from rlvr.models import lean_llama

    if not lean_llama._packed_linear_ok():
        pytest.skip("this torch has no oneDNN packed bf16 linear with autocast's numbers")
    gen = torch.Generator().manual_seed(0)
    Wbs = tuple(torch.randn(n, 32, generator=gen).to(torch.bfloat16) for n in (48, 16, 16))
    Wp = torch.ops.mkldnn._reorder_linear_weight(torch.cat(Wbs), lean_llama.PACK_ROWS)
    biases = {"none": (None,) * 3, "some": (torch.ones(48, dtype=torch.bfloat16), None, torch.ones(16, dtype=torch.bfloat16))}
    real = lean_llama._packed_linear
    monkeypatch.setattr(lean_llama, "_PACK_OK_AT", {})
    honest = {k: lean_llama._pack_ok(Wp, Wbs, bbs, 8) for k, bbs in biases.items()}
    x = torch.randn(8, 32).to(torch.bfloat16)
    for k, bbs in biases.items():   # what the probe said is what the products do
        bias = None if k == "none" else torch.cat([b if b is not None else torch.zeros(16, dtype=torch.bfloat16) for b in bbs])
        assert honest[k] == torch.equal(real(x, Wp, bias), torch.cat([F.linear(x, W, b) for W, b in zip(Wbs, bbs)], 1))
        for col in (5, 48 + 3, 64 + 15):                           # in each weight's block
            def off_by_one_step(x, Wp, bb, col=col):
                out = real(x, Wp, bb)
                out[-1, col] = out[-1, col] * 1.01 + 0.01          # one output off by at least one bf16 step
                return out

            monkeypatch.setattr(lean_llama, "_PACK_OK_AT", {})
            monkeypatch.setattr(lean_llama, "_packed_linear", off_by_one_step)
            assert lean_llama._pack_ok(Wp, Wbs, bbs, 8) is False
    monkeypatch.setattr(lean_llama, "_packed_linear", real)
    monkeypatch.setattr(lean_llama, "_PACK_OK_AT", {})
    assert {k: lean_llama._pack_ok(Wp, Wbs, bbs, 8) for k, bbs in biases.items()} == honest
    assert len(lean_llama._PACK_OK_AT) == 2                        # one probe per (shapes, biases, rows)


def test_decode_step_on_live_rows_only(fast_variant, monkeypatch):
    """A decode step in which rows have finished (their new column masked) computed on the live rows
    only (``LIVE_ROWS``) gives the live rows the logits of the step over every row, zero logits to
    the finished ones, and the same later steps; in rlvr's bf16 context too. Sampling with eos takes
    it and draws the same rows."""
    import rlvr.models.lean_llama as lean
    from rlvr.numerics import autocast_context

    _, policy, tok = fast_variant
    taken = []
    real = lean._live_rows
    monkeypatch.setattr(lean, "_live_rows", lambda *a: taken.append(r := real(*a)) or r)
    prompts = [tok.encode(s) for s in PROMPTS]
    pids, pam = left_pad(prompts, tok.pad_id)
    G, T = 3, 4
    B = pids.size(0) * G
    steps = torch.randint(3, 40, (B, T), generator=torch.Generator().manual_seed(1))
    step_am = torch.ones_like(steps)
    step_am[::2, 1:] = 0                                          # every other row finished after 1 token
    step_am[1, 3] = 0

    def decode(live_rows, ctx):
        monkeypatch.setattr(lean, "LIVE_ROWS", live_rows)
        taken.clear()
        with ctx(), torch.no_grad():
            cache = policy.new_cache(pids.size(0), pids.size(1) + T)
            policy(pids, attention_mask=pam, cache=cache, logits_to_keep=1)
            cache.repeat_interleave(G)
            out = [policy(steps[:, t:t + 1], attention_mask=step_am[:, t:t + 1], cache=cache) for t in range(T)]
        return torch.cat(out, 1), sum(r is not None for r in taken)

    for ctx in (contextlib.nullcontext, lambda: autocast_context(True, "cpu")):
        every, n_every = decode(0.0, ctx)
        live, n_live = decode(0.99, ctx)
        assert n_every == 0 and n_live == T - 1                   # steps 1-3 have finished rows
        real_cols = step_am.bool()
        torch.testing.assert_close(live[real_cols], every[real_cols], atol=1e-5, rtol=0)
        assert (live[~real_cols] == 0).all() and (every[~real_cols] != 0).any()

    def sample(live_rows):
        monkeypatch.setattr(lean, "LIVE_ROWS", live_rows)
        taken.clear()
        with torch.no_grad():
            r = sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=6, temperature=1.0,
                                  eos_id=eos, pad_id=tok.pad_id,
                                  generators=sampling.prompt_generators(2, 0, len(prompts)))
        return r, sum(x is not None for x in taken)

    monkeypatch.setattr(lean, "LIVE_ROWS", 0.0)
    with torch.no_grad():                                         # an eos that some rows draw early
        first = sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=6, temperature=1.0, eos_id=None,
                                  pad_id=tok.pad_id, generators=sampling.prompt_generators(2, 0, len(prompts)))
    eos = int(first.response_ids[:, 1].mode().values)
    (a, n_a), (b, n_b) = sample(0.0), sample(0.99)
    assert n_a == 0 and n_b > 0 and a.mask.sum() < a.mask.numel()
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
    torch.testing.assert_close(a.logp, b.logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fast", [True, False])
def test_float_logits_false_keeps_the_heads_dtype_and_its_values(llama, fast, monkeypatch):
    """``float_logits=False`` returns the logits in the head's dtype (bf16 under rlvr's CPU bf16
    context), the same numbers the default float32 logits round from, on the lean forward and on
    transformers' own; the training scorer takes them so, and scores them as the float32 copy."""
    from rlvr.numerics import autocast_context

    policy, tok = llama
    ids, am = left_pad([tok.encode(s) for s in PROMPTS], tok.pad_id)
    was = policy.fast_path
    policy.fast_path = fast
    try:
        assert policy.uses_fast_path == fast
        with torch.no_grad(), autocast_context(True, "cpu"):
            f32 = policy(ids, attention_mask=am)
            kept = policy(ids, attention_mask=am, float_logits=False)
        assert f32.dtype == torch.float32 and kept.dtype == torch.bfloat16
        assert torch.equal(kept.float(), f32)
        with torch.no_grad():                                # fp32 forwards: float32 either way
            assert policy(ids, attention_mask=am, float_logits=False).dtype == torch.float32
        r = sampling.generate(policy, [tok.encode(s) for s in PROMPTS], samples_per_prompt=2, max_new_tokens=3,
                              temperature=1.0, eos_id=None, pad_id=tok.pad_id, generators=[torch.Generator().manual_seed(1)] * 4)
        seen = []
        real = scoring._score
        monkeypatch.setattr(scoring, "_score", lambda logits, *a, **kw: seen.append(logits.dtype) or real(logits, *a, **kw))
        with autocast_context(True, "cpu"):
            scoring.sequence_token_logprobs(policy, r, group_size=2)
        assert seen == [torch.bfloat16] * 2          # the group's shared prompt position, then the responses
    finally:
        policy.fast_path = was


def test_positions_past_the_context_are_refused_in_both_shared_prompt_paths(tmp_path):
    """A response running past max_position_embeddings is refused with the position and the limit,
    whether a group's prompt is scored in one pass or in two calls (prompt into a cache, responses
    over it), before any layer runs."""
    policy, _ = load_policy(make_model_dir(tmp_path / "m", max_position_embeddings=8))
    ids = torch.arange(1, 11).repeat(2, 1)                                 # 1 prompt x G = 2 rows, 10 columns
    am = torch.ones_like(ids)
    with pytest.raises(ValueError, match=r"position 8 >= block_size 8 \(max_position_embeddings\)"):
        policy.shared_prompt_logits(ids, am, 4, 2)                          # positions 0-3, then 4-8
    cache = policy.new_cache(1, 10)
    policy(ids[:1, :4], attention_mask=am[:1, :4], cache=cache)
    cache.repeat_interleave(2)
    with pytest.raises(ValueError, match=r"position 8 >= block_size 8 \(max_position_embeddings\)"):
        policy(ids[:, 4:-1], attention_mask=am[:, 4:-1], cache=cache)
    assert policy.shared_prompt_logits(ids[:, :8], am[:, :8], 4, 2)[1].shape[:2] == (2, 3)  # within: scored


@pytest.mark.parametrize("layout", ["lean_grouped", "lean_grouped_transposed", "lean_repeated",
                                    "lean_repeated_transposed", "transformers"])
def test_finished_rows_leave_the_batch_on_every_cache(llama, layout, monkeypatch):
    """Rows dropped from the batch as they end (rlvr.sampling.COMPACT_FINISHED) on the lean cache in
    its grouped layout (whole groups leave, then the layout is left) and its repeated one (each with
    the plain layout's keys row-major, and transposed: KEYS_ROW_MAJOR at 0), and on
    transformers' DynamicCache:
    every row is sampled as with every row computed (tokens, masks; log-probs to float rounding),
    and fewer rows are computed."""
    import rlvr.models.lean_llama as lean

    policy, tok = llama
    if layout.startswith("lean_repeated"):
        monkeypatch.setattr(lean, "GROUP_ATTENTION_FLOPS", 0.0)
    if layout.endswith("_transposed"):
        monkeypatch.setattr(lean, "KEYS_ROW_MAJOR", 0)
    prompts = [tok.encode(s) for s in PROMPTS]
    kinds = []
    real = sampling.cache_rows.keep_rows
    monkeypatch.setattr(sampling.cache_rows, "keep_rows",
                        lambda c, r, **kw: kinds.append((type(c).__name__, getattr(c, "group", 1))) or real(c, r, **kw))

    def roll(compact):
        monkeypatch.setattr(sampling, "COMPACT_FINISHED", compact)
        return sampling.generate(policy, prompts, samples_per_prompt=3, max_new_tokens=14, temperature=1.0,
                                 eos_id=tok.eos_id, pad_id=tok.pad_id, budgets=[14, 2, 7, 4],
                                 generators=sampling.prompt_generators(5, 0, len(prompts)))

    with (transformers_path(policy) if layout == "transformers" else contextlib.nullcontext()):
        every, dropped = roll(None), roll(0.25)
    want = {"lean_grouped": ("LeanCache", 3), "lean_repeated": ("LeanCache", 1), "transformers": ("HFCache", 1)}
    want = want[layout.removesuffix("_transposed")]
    # the grouped layout is left for the plain one (cache_rows.ungroup) once its finished rows cost a copy
    assert kinds and kinds[0] == want and set(kinds) <= {want, ("LeanCache", 1)}
    assert torch.equal(every.ids, dropped.ids) and torch.equal(every.mask, dropped.mask)
    torch.testing.assert_close(dropped.logp, every.logp, atol=1e-5, rtol=0)
    assert dropped.decode_rows < every.decode_rows and dropped.finished_row_frac < every.finished_row_frac
