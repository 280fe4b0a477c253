"""Fixed-shape decode steps (rlvr.models.decode_graph): the step a CUDA graph captures, run eagerly on
a CPU, gives the eager decode's tokens, log-probs and cache; unsupported models fall back to the eager
step; on a CUDA device the captured graph replays the same step."""

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import make_model_dir  # noqa: E402

from rlvr import sampling  # noqa: E402
from rlvr.models import decode_graph, lean_llama  # noqa: E402
from rlvr.models.hf import LoraSpec, load_policy  # noqa: E402

VARIANTS = {   # real shapes in miniature: GQA with a tied head and LoRA, biases, head norms, Gemma's norms
    "llama_gqa_tied_lora": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True), True),
    "qwen2": ("qwen2", dict(num_key_value_heads=2), False),
    "qwen3": ("qwen3", dict(num_key_value_heads=1), False),
    "gemma": ("gemma", dict(num_key_value_heads=2), False),
    "phi3": ("phi3", dict(), False),
}


@pytest.fixture(autouse=True)
def _ungrouped(monkeypatch):
    """A CPU cache would take the grouped layout (a CPU layout the static step does not cover)."""
    monkeypatch.setattr(lean_llama, "GROUP_ATTENTION_FLOPS", 0.0)


def _policy(tmp_path, name, **extra):
    kind, kw, lora = VARIANTS[name]
    d = make_model_dir(tmp_path / name, kind, seed=3, **{**kw, **extra})
    policy, tok = load_policy(d, lora=LoraSpec(r=4, alpha=8, target_modules="all-linear") if lora else None)
    if lora:                                      # B starts at 0: give the adapter an effect to get wrong
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    assert policy.uses_fast_path
    return policy, tok


PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 23, 30]]


def _generate(policy, eos_id, seed=0, **kw):
    return sampling.generate(policy, PROMPTS, samples_per_prompt=3, max_new_tokens=12, temperature=1.0,
                             eos_id=eos_id, pad_id=0, generators=sampling.prompt_generators(seed, 0, len(PROMPTS)),
                             **kw)


def _count_steps(monkeypatch):
    calls = []
    step = decode_graph.StaticDecode.step
    monkeypatch.setattr(decode_graph.StaticDecode, "step", lambda self, *a: calls.append(1) or step(self, *a))
    return calls


@pytest.mark.parametrize("name", list(VARIANTS))
def test_static_decode_samples_what_the_eager_decode_samples(tmp_path, monkeypatch, name):
    policy, _ = _policy(tmp_path, name)
    eager = _generate(policy, eos_id=None)
    eos = int(eager.ids[0, eager.prompt_len + 3])     # a token some rows draw: they end early, others go on
    eager = _generate(policy, eos_id=eos)
    calls = _count_steps(monkeypatch)
    policy.static_decode_off_gpu = True
    static = _generate(policy, eos_id=eos)
    assert len(calls) == static.ids.size(1) - static.prompt_len - 1 > 3     # every step after the first token
    assert bool(eager.mask.any(1).all()) and not bool(eager.mask.all())    # rows did finish early
    assert torch.equal(static.ids, eager.ids)
    assert torch.equal(static.mask, eager.mask)
    torch.testing.assert_close(static.logp, eager.logp, atol=1e-5, rtol=0)
    calls.clear()                        # two tokens: one step, so the price's probe pair both decode
    two = sampling.generate(policy, PROMPTS, samples_per_prompt=3, max_new_tokens=2, temperature=1.0, eos_id=None,
                            pad_id=0, generators=sampling.prompt_generators(0, 0, len(PROMPTS)))
    assert len(calls) == 1 and two.ids.size(1) == two.prompt_len + 2
    policy.static_decode_off_gpu = False                                      # off: the eager steps again
    calls.clear()
    _generate(policy, eos_id=eos)
    assert not calls


def _prefilled(policy, B=4, max_len=24):
    torch.manual_seed(0)
    ids = torch.randint(3, 48, (B, 5))
    am = torch.ones(B, 5, dtype=torch.long)
    am[1, :2] = 0                                                             # left padding
    am[3, :4] = 0
    cache = policy.new_cache(B, max_len)
    with torch.no_grad():
        logits = policy(ids, attention_mask=am, cache=cache)[:, -1]
    return cache, logits


@pytest.mark.parametrize("name", ["llama_gqa_tied_lora", "gemma"])
def test_static_steps_match_eager_logits_and_leave_the_same_cache(tmp_path, name):
    policy, _ = _policy(tmp_path, name)
    c_eager, _ = _prefilled(policy)
    c_static, _ = _prefilled(policy)
    torch.manual_seed(1)
    toks = torch.randint(3, 48, (7, 4))
    alive = torch.ones(7, 4, dtype=torch.bool)
    alive[3:, 0] = False                                  # row 0 ends after step 3, row 2 after step 5
    alive[5:, 2] = False
    policy.static_decode_off_gpu = True
    with torch.no_grad():
        static = policy.static_decoder(c_static)
        assert isinstance(static, decode_graph.StaticDecode) and not static.use_graph
        for t in range(7):
            want = policy(toks[t, :, None], attention_mask=alive[t, :, None].long(), cache=c_eager)[:, -1]
            got = static.step(toks[t], alive[t])
            live = alive[t]
            torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=0)
        static.finish()
    assert torch.equal(c_static.mask, c_eager.mask) and c_static.mask.dtype == c_eager.mask.dtype
    assert torch.equal(c_static.next_pos, c_eager.next_pos)
    assert c_static.length == c_eager.length == 12
    seen = c_eager.mask.bool()                                                 # (B, S): the columns that count
    for li in range(len(c_eager.k)):
        for a, b in ((c_static.k[li], c_eager.k[li]), (c_static.v[li], c_eager.v[li])):
            assert a.shape == b.shape
            torch.testing.assert_close(a.transpose(1, 2)[seen], b.transpose(1, 2)[seen], atol=1e-5, rtol=0)
    with torch.no_grad():                                                      # the eager steps carry on from it
        after = [policy(toks[0, :, None], cache=c)[:, -1] for c in (c_static, c_eager)]
    torch.testing.assert_close(after[0], after[1], atol=1e-5, rtol=0)


class _FakeGraphs:
    """torch.cuda's stream and graph calls as ``StaticDecode._capture`` makes them, on a CPU: a capture
    runs the body but leaves no trace (its state and the cache restored, as a real capture executes
    nothing), and a replay runs the body again into the captured output, as a graph's kernels write
    their fixed output tensor. What it checks is the control flow around the graph: the warm-up's
    rollback, inputs copied before each replay, and the output read after it."""

    def __init__(self, monkeypatch):
        self.captures, self.replays, self.sd = 0, 0, None
        fake = self

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                fake.replays += 1
                fake.sd.out.copy_(fake.sd._body())

        @contextlib.contextmanager
        def graph(g, capture_error_mode="global"):
            sd = fake.sd
            saved = [t.clone() for t in (sd.attend, sd.pos, sd.col, *sd.cache._kbuf, *sd.cache._vbuf)]
            yield
            for t, v in zip((sd.attend, sd.pos, sd.col, *sd.cache._kbuf, *sd.cache._vbuf), saved):
                t.copy_(v)
            fake.captures += 1

        for name, value in (("Stream", Stream), ("current_stream", lambda device=None: Stream()),
                            ("stream", lambda s: contextlib.nullcontext()), ("CUDAGraph", Graph), ("graph", graph)):
            monkeypatch.setattr(torch.cuda, name, value)


def test_graph_control_flow_replays_the_eager_steps(tmp_path, monkeypatch):
    """The graphed path's bookkeeping, run on a CPU with torch.cuda's graph calls faked (``_FakeGraphs``):
    one capture at the first step after a warm-up whose state is rolled back, a replay per step, and
    the logits and cache of the eager steps."""
    policy, _ = _policy(tmp_path, "llama_gqa_tied_lora")
    c_eager, _ = _prefilled(policy)
    c_graph, _ = _prefilled(policy)
    fake = _FakeGraphs(monkeypatch)
    torch.manual_seed(2)
    toks = torch.randint(3, 48, (6, 4))
    alive = torch.ones(6, 4, dtype=torch.bool)
    alive[2:, 1] = False
    with torch.no_grad():
        sd = decode_graph.StaticDecode(policy._hf_model(), c_graph, policy._rope, policy.config.block_size,
                                       graph=False)
        sd.use_graph, fake.sd = True, sd
        for t in range(6):
            want = policy(toks[t, :, None], attention_mask=alive[t, :, None].long(), cache=c_eager)[:, -1]
            got = sd.step(toks[t], alive[t])
            assert got is sd.out                                               # the graph's output tensor
            torch.testing.assert_close(got[alive[t]], want[alive[t]], atol=1e-5, rtol=0)
        sd.finish()
    assert (fake.captures, fake.replays) == (1, 6) and sd.graph is None and sd.out is None
    assert torch.equal(c_graph.mask, c_eager.mask) and torch.equal(c_graph.next_pos, c_eager.next_pos)
    seen = c_eager.mask.bool()
    for a, b in zip(c_graph.v, c_eager.v):
        torch.testing.assert_close(a.transpose(1, 2)[seen], b.transpose(1, 2)[seen], atol=1e-5, rtol=0)


def test_static_decode_refuses_a_full_cache_and_positions_past_the_context(tmp_path):
    policy, _ = _policy(tmp_path, "qwen2")
    policy.static_decode_off_gpu = True
    cache, _ = _prefilled(policy, max_len=7)
    tok, alive = torch.full((4,), 5), torch.ones(4, dtype=torch.bool)
    unbounded, _ = _prefilled(policy, max_len=7)
    with torch.no_grad():
        static = policy.static_decoder(cache)
        # no block size: the rotary table sized from the cache (a graph cannot read the positions' max)
        other = decode_graph.StaticDecode(policy._hf_model(), unbounded, policy._rope, None, graph=False)
        assert other.rope_len == 5 + 7 - 5
        for _ in range(2):
            torch.testing.assert_close(other.step(tok, alive), static.step(tok, alive), atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match="KV cache full: 7 \\+ 1 tokens > max_len 7"):
            static.step(tok, alive)
    short, _ = _policy(tmp_path / "short", "qwen2", max_position_embeddings=6)
    short.static_decode_off_gpu = True
    cache, _ = _prefilled(short, max_len=20)                                   # rows 0, 2 next at position 5
    with torch.no_grad():
        static = short.static_decoder(cache)
        static.step(tok, alive)                                                # position 5: the last one
        with pytest.raises(ValueError, match="position 6 >= block_size 6"):
            static.step(tok, alive)


def test_unsupported_models_and_caches_take_the_eager_step(tmp_path, monkeypatch):
    calls = _count_steps(monkeypatch)
    for name, kind, kw in (("sliding", "mistral", dict(sliding_window=4)),
                           ("softcap", "gemma2", dict(num_key_value_heads=2))):
        d = make_model_dir(tmp_path / name, kind, seed=3, **kw)
        policy, _ = load_policy(d)
        policy.static_decode_off_gpu = True
        cache, _ = _prefilled(policy)
        why = decode_graph.supported(policy._hf_model(), cache)
        assert why is not None and ("sliding" in why or "soft-capping" in why)
        with torch.no_grad():
            assert policy.static_decoder(cache) is None
        with pytest.raises(ValueError, match="StaticDecode: "):
            decode_graph.StaticDecode(policy._hf_model(), cache, policy._rope, 64, graph=False)
        eager = _generate(policy, eos_id=None)
        assert eager.ids.size(1) == eager.prompt_len + 12 and not calls
    policy, _ = _policy(tmp_path, "qwen2")
    policy.static_decode_off_gpu = True
    cache, _ = _prefilled(policy)
    with torch.no_grad():
        assert policy.static_decoder(cache) is not None
    assert policy.static_decoder(cache) is None                                # with gradient enabled
    monkeypatch.setattr(lean_llama, "GROUP_ATTENTION_FLOPS", 4.0)              # the CPU grouped layout
    grouped = _generate(policy, eos_id=None)
    assert not calls and grouped.ids.size(1) == grouped.prompt_len + 12
    policy.fast_path = False                                                   # the transformers forward
    with torch.no_grad():
        hf_cache = policy.new_cache(2, 10)
        assert "not a LeanCache" in decode_graph.supported(policy._hf_model(), hf_cache)
        assert policy.static_decoder(hf_cache) is None


def test_cuda_graphs_config_reaches_the_policy(tmp_path):
    from rlvr import config as config_mod
    from rlvr.build import _hf_policy

    d = make_model_dir(tmp_path / "m")
    for flag in (True, False):
        cfg = config_mod.Config()
        cfg.model.path = str(d)
        cfg.model.cuda_graphs = flag
        model, _ = _hf_policy(cfg, torch.device("cpu"), lambda s: None)
        assert model.cuda_graphs is flag
        assert model.static_decoder(model.new_cache(2, 8)) is None             # a CPU: never a graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_autocast"])
def test_cuda_graph_replays_the_eager_decode(tmp_path, monkeypatch, bf16):
    policy, _ = _policy(tmp_path, "llama_gqa_tied_lora")
    policy.to("cuda")
    calls = _count_steps(monkeypatch)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else torch.autocast("cuda", enabled=False)

    def run():
        with ctx:
            return sampling.generate(policy, PROMPTS, samples_per_prompt=3, max_new_tokens=12, temperature=1.0,
                                     eos_id=None, pad_id=0, generators=sampling.prompt_generators(0, 0, 3))

    policy.cuda_graphs = False
    eager = run()
    assert not calls
    policy.cuda_graphs = True
    graphed = run()
    assert len(calls) == 11
    tol = 2e-2 if bf16 else 1e-4
    same = (graphed.ids == eager.ids).all(1)                  # bf16 rounding may flip a late draw
    assert bool(same.float().mean() >= (0.5 if bf16 else 1.0))
    torch.testing.assert_close(graphed.logp[same], eager.logp[same], atol=tol, rtol=0)
