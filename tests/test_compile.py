"""model.compile: the lean forward's decoder layers (rlvr.models.lean_llama ``compiled_plan``) and the token
log-probs (rlvr.logprobs ``token_logprobs(compiled=True)``) through torch.compile (rlvr.compiled), checked
against the eager code on tiny Hugging Face models, with the fallback where compiling fails and a real run."""

import warnings

import pytest
import torch

from rlvr import compiled as rlvr_compiled
from rlvr import sampling
from rlvr.models import lean_llama as lean
from rlvr.models.hf import LoraSpec, load_policy
from rlvr.numerics import autocast_context

from hf_models import make_model_dir

pytest.importorskip("transformers")
pytest.importorskip("peft")

VARIANTS = {
    # Llama with GQA, LoRA on every Linear: the plan covers every layer
    "llama_lora": ("llama", {"num_key_value_heads": 2}, LoraSpec(r=4, alpha=8, target_modules="all-linear")),
    # Qwen 2: q/k/v biases, a tied head, LoRA on some projections only
    "qwen2_lora": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True},
                   LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    kind, kw, lora = VARIANTS[request.param]
    d = make_model_dir(tmp_path_factory.mktemp(request.param), kind, seed=3, **kw)
    policy, tok = load_policy(d, lora=lora)
    torch.manual_seed(0)
    with torch.no_grad():                     # a non-zero adapter (B starts at 0)
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    # the embeddings train too, so that every layer's input needs a gradient: one compiled code for
    # all layers (a first layer whose input needs none would compile a second one, doubling the
    # file's compile time) and each layer's backward computes its input's gradient
    policy._hf_model().model.embed_tokens.weight.requires_grad_(True)
    return policy, tok


def _rollout(policy, tok, G=3):
    prompts = [tok.encode("ab"), tok.encode("hello"), tok.encode("xyz q")]
    return sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=5, temperature=1.0,
                             eos_id=tok.eos_id, pad_id=tok.pad_id, generators=sampling.prompt_generators(0, 0, 3))


def _scored(policy, roll, compiled: bool, bf16: bool, calls: list):
    """(the shared-prompt forward's logits at the responses' real positions (n, V), the trainable
    parameters' gradients of a fixed weighting of them, the compiled calls seen so far), with
    ``policy.compile_layers = compiled``, under bf16 autocast or not."""
    params = [p for p in policy.parameters() if p.requires_grad]
    G = roll.ids.size(0) // 3
    policy.compile_layers = compiled
    try:
        with autocast_context(bf16, "cpu"):
            first, resp = policy.shared_prompt_logits(roll.ids, roll.attention_mask, roll.prompt_len, G)
    finally:
        policy.compile_layers = False
    real = roll.attention_mask[:, roll.prompt_len:-1].bool()
    w = torch.linspace(-1, 1, int(real.sum()))
    grads = torch.autograd.grad((resp[real].float().logsumexp(-1) * w).sum() + first.float().sum(), params)
    n = len(calls)
    return resp.detach()[real], grads, n


@pytest.fixture
def calls(monkeypatch):
    """The names of the compiled calls made (``rlvr.compiled.compiled_call``), in order."""
    seen = []
    real = lean.compiled_call

    def spy(name, *a, **k):
        seen.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(lean, "compiled_call", spy)
    return seen


@pytest.mark.parametrize("variant", ["llama_lora"], indirect=True)
def test_compiled_layers_give_the_eager_numbers(variant, calls):
    """fp32: every layer of the one-pass forward through one compiled function (the option reaching
    the forward), logits and gradients (LoRA factors, embeddings) equal to the eager layers' to float
    rounding; without model.compile nothing is compiled. (On the Llama, LoRA on every projection:
    Qwen 2's biases go through the same q/k/v function, whose fp32 numbers the prefill test below
    checks on it.)"""
    policy, tok = variant
    if not lean.compile_available():
        pytest.fail(f"torch.compile unavailable here: {rlvr_compiled.compile_failure()}")
    hf = policy._hf_model()
    assert all(lean.compiled_plan(layer) is not None for layer in hf.model.layers)
    roll = _rollout(policy, tok)
    eager = _scored(policy, roll, False, False, calls)
    assert eager[2] == 0
    comp = _scored(policy, roll, True, False, calls)
    assert calls == ["layer"] * len(hf.model.layers)
    torch.testing.assert_close(comp[0], eager[0], atol=1e-5, rtol=0)
    for a, b in zip(comp[1], eager[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert rlvr_compiled.compile_failure() is None


@pytest.mark.parametrize("variant", ["qwen2_lora"], indirect=True)
def test_compiled_layers_under_bf16_autocast(variant, calls):
    """Under CPU bf16 autocast the compiled layers compute in bf16 too (their own rounding: Inductor
    keeps fused elementwise chains in float32): as close to the float32 forward as the eager bf16
    layers are, within a factor of two, logits and gradients. (On Qwen 2: its q/k/v biases and its
    adapters on some projections take the bf16 copies too.)"""
    policy, tok = variant
    roll = _rollout(policy, tok)
    ref = _scored(policy, roll, False, False, calls)
    eager = _scored(policy, roll, False, True, calls)
    comp = _scored(policy, roll, True, True, calls)
    assert calls == ["layer"] * len(policy._hf_model().model.layers)

    def err(x):
        return ((x[0].float() - ref[0]).abs().mean().item(),
                max(((a - b).norm() / b.norm()).item() for a, b in zip(x[1], ref[1])))

    (e_logits, e_grads), (c_logits, c_grads) = err(eager), err(comp)
    assert 0 < e_logits and 0 < c_logits <= 2 * e_logits, (c_logits, e_logits)
    assert c_grads <= 2 * e_grads + 1e-6, (c_grads, e_grads)


def test_layers_a_plan_does_not_cover_run_eagerly(tmp_path, calls):
    """A layer outside ``compiled_plan`` (Gemma: (1 + w) norms, GELU) runs its eager layers with
    model.compile on: no compiled call, the same numbers to the bit."""
    d = make_model_dir(tmp_path / "gemma", "gemma", seed=3)
    policy, tok = load_policy(d)
    assert all(lean.compiled_plan(layer) is None for layer in policy._hf_model().model.layers)
    roll = _rollout(policy, tok)
    eager = _scored(policy, roll, False, False, calls)
    comp = _scored(policy, roll, True, False, calls)
    assert calls == []
    assert torch.equal(comp[0], eager[0]) and all(torch.equal(a, b) for a, b in zip(comp[1], eager[1]))


def test_a_failed_compile_warns_once_and_runs_eagerly(variant, monkeypatch):
    """Where compiling fails (here torch.compile's function raises, as it does without a C++
    compiler), one warning names the reason, this forward and later ones run the eager layers (the
    same numbers to the bit) and ``compile_available`` says no."""
    policy, tok = variant
    roll = _rollout(policy, tok)
    eager = _scored(policy, roll, False, False, [])

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler found\nmore")
        return run

    monkeypatch.setattr(rlvr_compiled, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp = _scored(policy, roll, True, False, [])
        again = _scored(policy, roll, True, False, [])
    said = [str(w.message) for w in caught if "model.compile" in str(w.message)]
    assert len(said) == 1 and "RuntimeError: no C++ compiler found" in said[0] and "eager code" in said[0]
    assert not rlvr_compiled.compile_available() and "no C++ compiler" in rlvr_compiled.compile_failure()
    for x in (comp, again):
        assert torch.equal(x[0], eager[0]) and all(torch.equal(a, b) for a, b in zip(x[1], eager[1]))


@pytest.mark.parametrize("variant", ["qwen2_lora"], indirect=True)
def test_compiled_prefill_and_learn_forwards_within_dynamos_recompile_limit(variant, calls, monkeypatch):
    """``lean_forward`` with model.compile, as a run calls it: a forward of whole rows (with gradient)
    and a prefill into a cache take the compiled layers (fp32: the eager numbers to float rounding);
    the decode steps after the prefill stay eager (no compiled call), so sampling's steps keep their
    own kernels. Then the forwards a learn stage with length buckets makes (with gradient and
    backward at one row and at several, two lengths, small buckets on the explicit attention and
    large ones on SDPA, and a no-gradient forward of each): all of these, the prefill's included,
    compile each function at most torch._dynamo's recompile_limit (8) times: with
    ``fail_on_recompile_limit_hit`` a ninth compile raises, which marks compiling failed. (The
    attention between the compiled halves used to be compiled too, and passed that limit within one
    learn stage: grad mode, keys with or without gradient, mask kind and one row each made a variant.
    A no-gradient fp32 call of at most ``HEAD_ROWS`` rows runs weight-major products, which stay
    eager: set to 0 here so that these small forwards compile, as a real one of more rows does.
    One variant: the guards that make a compile do not depend on the architecture.)"""
    monkeypatch.setattr(lean, "HEAD_ROWS", 0)
    monkeypatch.setattr(rlvr_compiled, "_COMPILED", {})
    torch._dynamo.reset()                               # this test's compiles only
    policy, tok = variant
    layers = len(policy._hf_model().model.layers)
    roll = _rollout(policy, tok)
    ids, am = roll.ids, roll.attention_mask
    params = [p for p in policy.parameters() if p.requires_grad]
    out = {}
    try:
        with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
            for compiled in (False, True):
                policy.compile_layers = compiled
                calls.clear()
                logits = policy(ids, attention_mask=am)                               # (B, L, V), with gradient
                grads = torch.autograd.grad((logits.logsumexp(-1) * am).sum(), params)
                assert calls == (["qkv", "out"] * layers if compiled else [])
                with torch.no_grad():
                    calls.clear()
                    cache = policy.new_cache(ids.size(0), ids.size(1))
                    pre = policy(ids[:, :-2], attention_mask=am[:, :-2], cache=cache)
                    assert calls == (["qkv", "out"] * layers if compiled else [])
                    calls.clear()
                    L = ids.size(1)
                    steps = [policy(ids[:, i:i + 1], attention_mask=am[:, i:i + 1], cache=cache) for i in (L - 2, L - 1)]
                    assert calls == []                                                # decode steps: eager
                out[compiled] = (logits.detach(), grads, pre, torch.cat(steps, 1))
            for small in (lean.SMALL_ATTENTION, 0):     # explicit products, then SDPA
                monkeypatch.setattr(lean, "SMALL_ATTENTION", small)
                for rows in (slice(0, 1), slice(None)):
                    for width in (ids.size(1), ids.size(1) - 2):
                        x, m = ids[rows, :width], am[rows, :width]
                        logits = policy(x, attention_mask=m)
                        torch.autograd.grad((logits.logsumexp(-1) * m).sum(), params)
                        with torch.no_grad():
                            policy(x, attention_mask=m)
    finally:
        policy.compile_layers = False
        torch._dynamo.reset()
    assert rlvr_compiled.compile_available(), rlvr_compiled.compile_failure()
    assert {"qkv", "out"} <= set(rlvr_compiled._COMPILED)
    real = am.bool()
    torch.testing.assert_close(out[True][0][real], out[False][0][real], atol=1e-5, rtol=0)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[True][2][real[:, :-2]], out[False][2][real[:, :-2]], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[True][3][real[:, -2:]], out[False][3][real[:, -2:]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_token_logprobs_give_the_chunked_numbers(dtype):
    """``token_logprobs(compiled=True)``: the chunked path's log-probs and logit gradients to float
    rounding (bf16 gradients: one bf16 step), at a low temperature whose exponents reach the floor
    and with an id at every vocabulary edge."""
    from rlvr.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)
    V = 300
    logits = (torch.randn(3, 7, V, generator=gen) * 6).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (3, 7), generator=gen)
    ids[0, 0], ids[0, 1] = 0, V - 1
    w = torch.randn(3, 7, generator=gen)
    out = {}
    for compiled in (False, True):
        logits.grad = None
        lp = token_logprobs(logits, ids, temperature=0.3, chunk_rows=4, compiled=compiled)
        (lp * w).sum().backward()
        out[compiled] = (lp.detach(), logits.grad.clone())
    assert out[True][0].dtype == torch.float32
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-6)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[True][1], out[False][1], **tol)
    assert rlvr_compiled.compile_failure() is None


def test_rlvr_train_with_model_compile_runs_the_compiled_layers(tmp_path, calls, capsys):
    """`rlvr train --model.compile=true` on a tiny LoRA Llama: the note says what is compiled, the
    run's rollout and learn stages call the compiled layers, and it trains to the end; without a
    Hugging Face model the key is refused before any compute. (Without the price probes, whose
    forwards at their own shapes would compile each function once more.)"""
    from rlvr import cli
    from rlvr.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"model\.compile: needs a Hugging Face model"):
        load(None, ["--model.compile=true"])
    d = make_model_dir(tmp_path / "llama", num_key_value_heads=2)
    rc = cli.main(["train", "examples/sort.toml", "--out", str(tmp_path / "run"), f"--model.path={d}",
                   "--model.lora_r=4", "--model.compile=true", "--train.prompts_per_step=4",
                   "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 30}", "--eval.prompts=8",
                   "--eval.pass_k=0", "--eval.every=0", "--train.steps=2",
                   "--train.price_probes=false"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "model.compile: 2 of 2 decoder layers and the token log-probs run compiled" in out
    assert calls.count("layer") >= 2 * 2                   # the learn stage's one-pass forwards, both steps
    assert rlvr_compiled.compile_failure() is None
