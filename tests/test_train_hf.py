"""`rlvr train` on a Hugging Face model saved locally: full fine-tuning, LoRA, the hf/ output."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402
from hf_models import make_model_dir  # noqa: E402

from rlvr import cli  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

BASE = ["--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 30}",
        "--eval.prompts=10", "--eval.pass_k=0", "--eval.every=0", "--train.steps=2", "--train.lr=0.01"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"))


def train(out, *extra):
    return cli.main(["train", "examples/sort.toml", "--out", str(out), *BASE, *extra])


def weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("lora", [False, True])
def test_trains_and_writes_a_plain_hf_model(tmp_path, model_dir, lora, capsys):
    out = tmp_path / "run"
    extra = [f"--model.path={model_dir}", "--algorithm.kl_coef=0.05"]
    if lora:
        extra += ["--model.lora_r=4", "--model.lora_target_modules=[\"q_proj\", \"v_proj\"]"]
    assert train(out, *extra) == 0
    stdout = capsys.readouterr().out
    if lora:
        assert "reference = the policy with its LoRA adapter disabled (no copy)" in stdout
        assert (out / "hf" / "adapter" / "adapter_config.json").is_file()
    else:
        assert "reference 0." in stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert tok("12=")["input_ids"]
    before, after = weights(model_dir), weights(out / "hf")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "training changed no weight"
    if lora:  # merged LoRA only touches the wrapped projections
        assert all("q_proj" in k or "v_proj" in k for k in changed)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/reward" in r]
    assert train_rows[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)   # π = π_ref at the first step
    assert abs(train_rows[0]["train/first_step_ratio_mean"] - 1) < 1e-4
    assert model.config.num_hidden_layers == 2
    summary = json.loads((out / "summary.json").read_text())
    price = json.loads((out / "price.json").read_text())
    # the prompt is run once per group (shared keys/values); counted work equals the price exactly
    Lp = price["prompt_tokens"]
    assert summary["cost/trained_tokens"] == price["trained_tokens_per_run"] == 2 * (4 * Lp + 16 * (3 - 1))
    assert summary["cost/forward_tokens"] == price["forward_tokens_per_run"]
    assert cli.main(["eval", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["eval/goal"] == summary["eval/goal"]


@pytest.mark.parametrize("kind,lora", [("qwen2", []), ("qwen3", ["q_proj", "v_proj"]), ("mistral", ["q_proj", "v_proj"]),
                                       ("gemma", []), ("gemma2", ["q_proj", "v_proj"]), ("phi3", ["all-linear"]),
                                       ("gemma3_text", ["all-linear"])])
def test_other_architectures_train_and_export(tmp_path, kind, lora, capsys):
    """Qwen 2 (q/k/v biases), Qwen 3 (q/k norms), Mistral, Gemma (tied head, scaled embeddings), Gemma 2
    (no SDPA in transformers: eager attention, with a note; soft-capped scores), Gemma 3 and Phi-3 (fused
    qkv_proj and gate_up_proj; no peft default targets, so "all-linear") train 2 steps on the lean forward
    with GQA and export hf/ that transformers loads; under LoRA only the adapted modules change in the merged export."""
    from rlvr.distributed.fsdp import blocks

    model_dir = make_model_dir(tmp_path / kind, kind, **({} if kind == "gpt2" else {"num_key_value_heads": 2}))
    from rlvr.models.hf import load_policy

    # all take the lean forward
    assert load_policy(model_dir)[0].fast_unsupported is None
    out = tmp_path / "run"
    extra = [f"--model.path={model_dir}", "--algorithm.kl_coef=0.05"]
    if lora:
        extra += ["--model.lora_r=4", f"--model.lora_target_modules={json.dumps(lora)}"]
    assert train(out, *extra) == 0, capsys.readouterr().err
    stdout = capsys.readouterr().out
    assert ("has no SDPA attention for this architecture; using its eager attention" in stdout) == (kind == "gemma2")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert exported.config.model_type == kind
    before, after = weights(model_dir), weights(out / "hf")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "training changed no weight"
    if lora and lora != ["all-linear"]:
        assert all(any(f"{m}.weight" in k for m in lora) for k in changed), sorted(changed)
    if lora:
        assert not any("norm" in k or "embed" in k for k in changed), sorted(changed)
        assert (out / "hf" / "adapter" / "adapter_config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval/goal" in summary


def test_lora_without_targets_on_a_model_peft_has_no_default_for_names_the_key(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path / "phi3", "phi3")
    assert train(tmp_path / "run", f"--model.path={model_dir}", "--model.lora_r=4") == 2
    err = capsys.readouterr().err
    assert "model.lora_target_modules = []" in err and "no default LoRA target modules for model type 'phi3'" in err
    assert "down_proj, gate_up_proj, o_proj, qkv_proj" in err and "all-linear" in err
    assert not (tmp_path / "run").exists()


def test_bad_model_dir_fails_before_any_compute(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(tmp_path / "run", f"--model.path={empty}") == 2
    err = capsys.readouterr().err
    assert "model.path" in err and str(empty) in err
    assert not (tmp_path / "run").exists()


def test_prompt_longer_than_the_context_is_refused(tmp_path, model_dir, capsys):
    # the tiny Llama has 64 positions; 40 digits + 40 new tokens do not fit
    rc = cli.main(["train", "examples/sort.toml", "--out", str(tmp_path / "run"), f"--model.path={model_dir}",
                   "--task.options={n = 40, heldout = 5, train = 20}", "--train.prompts_per_step=2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 64 tokens" in err
    assert not (tmp_path / "run").exists()


def test_lora_without_hf_model_is_a_config_error(tmp_path, capsys):
    assert train(tmp_path / "run", "--model.lora_r=4") == 2
    assert "model.lora_r" in capsys.readouterr().err


def test_hf_plumbing_config_runs_end_to_end(tmp_path, capsys):
    """tests/configs/make_tiny_hf_model.py + tests/configs/hf_rgym.toml, shortened: LoRA on reasoning-gym."""
    pytest.importorskip("reasoning_gym")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", "tests/configs/make_tiny_hf_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.build(tmp_path / "tiny-llama", hidden=32, heads=2, layers=1)
    out = tmp_path / "run"
    rc = cli.main(["train", "tests/configs/hf_rgym.toml", "--out", str(out), f"--model.path={model}", "--train.steps=1",
                   "--train.prompts_per_step=2", "--train.samples_per_prompt=2", "--eval.prompts=4",
                   "--eval.pass_k=0", "--task.options={name = \"leg_counting\", size = 40, heldout = 4, max_new_tokens = 8}"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "hf" / "model.safetensors").is_file() and (out / "hf" / "adapter").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and "eval/goal" in summary


def test_chat_template_applies_when_the_task_gives_messages(tmp_path, capsys):
    """A JSONL `messages` column reaches Example.meta; the tokenizer's chat template encodes it."""
    model = make_model_dir(tmp_path / "chat-llama", chat=True)
    rows = [{"prompt": f"say {c}", "answer": c, "messages": [{"role": "user", "content": f"say {c}"}]}
            for c in "abcdefghij"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    rc = cli.main(["train", "examples/sort.toml", "--out", str(out), f"--model.path={model}",
                   "--task.path=rlvr.tasks.dataset:jsonl_task", f'--task.options={{train = "{data}", max_new_tokens = 3}}',
                   "--task.reward=exact_match", "--train.steps=1", "--train.prompts_per_step=2",
                   "--train.samples_per_prompt=2", "--eval.prompts=2", "--eval.pass_k=0"])
    assert rc == 0, capsys.readouterr().err
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    templated = tok.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    plain = tok("say a", add_special_tokens=False)["input_ids"]
    price = json.loads((out / "price.json").read_text())
    assert price["prompt_tokens"] == len(templated) > len(plain) + 1


def test_plain_prompts_take_the_chat_template_as_user_turns_when_asked(tmp_path, capsys, monkeypatch):
    """Plain JSONL prompts on a chat model: sent as text by default, with a note at start; with
    `task.chat = user` and `task.system` each goes through the template after the system message
    (the price's prompt length and the prompts the sampler is given)."""
    import rlvr.sampling

    sampled = []
    generate = rlvr.sampling.generate
    monkeypatch.setattr(rlvr.sampling, "generate", lambda policy, prompts, **kw: sampled.append(
        {len(p) for p in prompts}) or generate(policy, prompts, **kw))
    model = make_model_dir(tmp_path / "chat-llama", chat=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {c}", "answer": c}) + "\n" for c in "abcdefghij"))
    common = [f"--model.path={model}", "--task.path=rlvr.tasks.dataset:jsonl_task",
              f'--task.options={{train = "{data}", max_new_tokens = 3}}', "--task.reward=exact_match",
              "--train.steps=1", "--train.prompts_per_step=2", "--train.samples_per_prompt=2", "--eval.prompts=2",
              "--eval.pass_k=0"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    turns = [{"role": "system", "content": "Reply with one letter."}, {"role": "user", "content": "say a"}]
    templated = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    from rlvr.models.hf_tokenizer import HFTokenizer

    plain = HFTokenizer(tok).encode("say a")                                  # the text as rlvr encodes it
    assert len(templated) > len(plain) + 4
    for out, extra in ((tmp_path / "plain", []), (tmp_path / "user", ["--task.chat=user", "--task.system=Reply with one letter."])):
        sampled.clear()
        rc = cli.main(["train", "examples/sort.toml", "--out", str(out), *common, *extra])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        assert ("prompts are plain text" in captured.out) == (not extra)
        want = len(templated) if extra else len(plain)
        assert json.loads((out / "price.json").read_text())["prompt_tokens"] == want
        assert sampled and all(lengths == {want} for lengths in sampled)      # training and evaluation


def test_lora_run_with_the_flat_optimizer_resumes_bit_for_bit(tmp_path, model_dir, monkeypatch):
    """LoRA adapters of whole-vector sizes train under rlvr.optim.FlatAdamW; its state saves in the
    per-parameter format and a resumed run continues on exactly the numbers of an uninterrupted one."""
    import rlvr.optim

    built = []
    orig = rlvr.optim.FlatAdamW.__init__
    monkeypatch.setattr(rlvr.optim.FlatAdamW, "__init__", lambda self, ps, **kw: built.append(len(ps)) or orig(self, ps, **kw))
    lora = [f"--model.path={model_dir}", "--model.lora_r=4", "--model.lora_target_modules=[\"q_proj\", \"v_proj\"]",
            "--train.lr_schedule=constant"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, *lora, "--train.steps=4") == 0
    assert train(split, *lora, "--train.steps=2") == 0
    assert train(split, *lora, "--train.steps=4", "--resume") == 0
    assert built == [8, 8, 8]                                 # 2 layers x (q, v) x (A, B), one flat buffer each run

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "memory/"))}
                for line in (run / "metrics.jsonl").read_text().splitlines() if "train/reward" in line]

    assert rows(split) == rows(straight) and len(rows(straight)) == 4
    a, b = weights(straight / "hf"), weights(split / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_new_adapter_is_drawn_from_train_seed(model_dir):
    """The LoRA A matrices' random init comes from train.seed: the same whatever this process drew
    before, different for another seed (B starts at zero, so only A shows it)."""
    from rlvr import build as build_mod, config as config_mod

    def lora_a(seed):
        cfg = config_mod.load("examples/sort.toml", [f"--model.path={model_dir}", "--model.lora_r=4", f"--train.seed={seed}"])
        model = build_mod.build(cfg, log=lambda *_: None).model
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first = lora_a(0)
    torch.randn(1000)                                   # the global stream moves on
    again, other = lora_a(0), lora_a(1)
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


@pytest.mark.parametrize("kind,lora,autocast", [("llama", 0, "off"), ("llama", 4, "off"), ("llama", 4, "bf16"),
                                                ("gemma", 4, "off"), ("gpt2", 0, "off"), ("gpt2", 4, "off"),
                                                ("gemma3_text", 4, "off")])
def test_gradient_checkpointing_recomputes_the_layers_for_the_same_gradient(tmp_path, kind, lora, autocast):
    """model.gradient_checkpointing: a training forward's layers run again in the backward (the lean
    forward's halves counted on a Llama, a Gemma and a Gemma 3, with the group's shared prompt; transformers'
    own on GPT-2, full and LoRA,
    counted with a pre-hook inside the layer), the gradient is the one without it; the price counts
    the recompute in the training FLOPs and keeps the checkpointed activations; a run trains and exports."""
    import dataclasses

    import rlvr.models.lean_llama as lean
    from rlvr import build as build_mod, config as config_mod, memory_model, numerics as numerics_mod, run_price, scoring

    from rlvr.distributed.fsdp import blocks

    model_dir = make_model_dir(tmp_path / kind, kind, **({} if kind == "gpt2" else {"num_key_value_heads": 2}))
    args = ["--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 30}",
            f"--model.path={model_dir}", f"--model.lora_r={lora}", f"--model.autocast={autocast}"]
    plain = build_mod.build(config_mod.load("examples/sort.toml", args), log=lambda *_: None)
    ckpt = build_mod.build(config_mod.load("examples/sort.toml", args + ["--model.gradient_checkpointing=true"]),
                     log=lambda *_: None)
    assert ckpt.model.gradient_checkpointing and not plain.model.gradient_checkpointing
    lean_model = kind != "gpt2"
    assert ckpt.model.differentiable_cache == lean_model          # transformers' checkpointing runs without a cache
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 2)
    am = torch.ones_like(ids)
    grads = []
    real_qkv = lean._qkv_in
    for setup in (plain, ckpt):
        calls = []
        inner = blocks(setup.model._hf_model())[0].mlp            # inside transformers' checkpointed forward
        hook = inner.register_forward_pre_hook(lambda *_: calls.append("layer"))
        lean._qkv_in = lambda *a: calls.append("qkv") or real_qkv(*a)
        try:
            setup.model.train()
            with setup.numerics.context():                      # bf16: the recompute runs under it too
                lp = scoring.sequence_token_logprobs(setup.model, (ids, am, 3), temperature=1.0, top_p=1.0,
                                                      group_size=2)
            forward = list(calls)
            lp.sum().backward()
        finally:
            hook.remove()
            lean._qkv_in = real_qkv
        grads.append([p.grad.clone() for p in setup.model.trainable_params()])
        if setup is ckpt:
            what = "qkv" if lean_model else "layer"
            assert forward.count(what) >= 1 and calls.count(what) == 2 * forward.count(what)
        else:
            assert "qkv" not in calls
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    p_plain, p_ckpt = run_price.price_of(plain, rate=1e11, decode_s=0.01), run_price.price_of(ckpt, rate=1e11, decode_s=0.01)
    shape = numerics_mod.model_shape(ckpt.model)
    assert shape.checkpointed and not numerics_mod.model_shape(plain.model).checkpointed
    assert p_ckpt.flops_train_per_batch > p_plain.flops_train_per_batch
    Lp, T = p_ckpt.prompt_tokens, p_ckpt.max_new_tokens
    tokens = 4 * Lp + 16 * T if lean_model else 16 * (Lp + T)    # the prompt once per group on the lean forward
    assert p_ckpt.memory_activation_bytes == memory_model.activation_bytes(shape, tokens, Lp + T, 4)
    assert p_ckpt.memory_activation_bytes < memory_model.activation_bytes(
        dataclasses.replace(shape, checkpointed=False), tokens, Lp + T, 4)
    assert train(tmp_path / "run", f"--model.path={model_dir}", f"--model.lora_r={lora}",
                 "--model.gradient_checkpointing=true") == 0
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()


def test_gradient_checkpointing_needs_a_hugging_face_model():
    from rlvr import config as config_mod

    with pytest.raises(config_mod.ConfigError, match="model.gradient_checkpointing: needs a Hugging Face model"):
        config_mod.load("examples/sort.toml", ["--model.gradient_checkpointing=true"])


@pytest.mark.parametrize("setting,want", [(-1, 3), (2, 2), (0, None)])
def test_logprob_chunk_rows_reaches_the_reference_and_training_forwards(tmp_path, model_dir, monkeypatch, setting, want):
    """model.logprob_chunk_rows reaches the scoring forwards: -1 (the default) sizes the chunks to
    the vocabulary (here the CPU block shrunk to 3 rows of the 48-token vocabulary), n chunks n
    rows, 0 scores all at once; the chunked path gets the head's logits as they are (float32 here)."""
    import rlvr.logprobs

    monkeypatch.setitem(rlvr.logprobs.LOGPROB_CHUNK_BYTES, "cpu", 3 * 48 * 4)
    seen = []
    real = rlvr.logprobs._ChunkedLogprob.apply
    monkeypatch.setattr(rlvr.logprobs._ChunkedLogprob, "apply",
                        lambda logits, ids, t, c: seen.append((c, torch.is_grad_enabled())) or real(logits, ids, t, c))
    assert train(tmp_path / "run", f"--model.path={model_dir}", "--algorithm.kl_coef=0.05",
                 f"--model.logprob_chunk_rows={setting}") == 0
    if want is None:
        assert seen == []
    else:   # every step: the reference's forward (no gradient) and the training forward
        assert {c for c, _ in seen} == {want} and {grad for _, grad in seen} == {True, False}
