"""train.snapshot_every / train.snapshots_keep: copies of the policy along a run, each a run directory
that `rlvr eval` reloads."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlvr import cli, config as config_mod, rundir
from rlvr.setup_types import RunError

TINY = ["examples/sort.toml", "--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2",
        "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 20}",
        "--eval.prompts=8", "--eval.pass_k=0", "--eval.every=0", "--eval.at_start=false", "--eval.keep_best=false",
        "--train.lr=0.01", "--train.lr_schedule=constant", "--task.reward_workers=0", "--model.autocast=off"]
"""`--model.autocast=off`: under auto each run times bf16 against fp32 itself, and two runs compared bit for bit
must not fall on either side of its threshold on a busy machine."""


def train(out: Path, *extra: str) -> int:
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return cli.main(["train", *TINY, "--out", str(out), *extra])


def weights(run: Path) -> bytes:
    return (run / "checkpoint" / "model.safetensors").read_bytes()


def test_snapshots_hold_the_policy_after_their_step_and_reload(tmp_path):
    run = tmp_path / "run"
    assert train(run, "--train.steps=5", "--train.snapshot_every=2") == 0
    assert [d.name for d in rundir.snapshot_dirs(run)] == ["step-000002", "step-000004"]
    four = run / "snapshots" / "step-000004"
    # the policy after step 4: what a 4-step run of the same config ends with, bit for bit
    short = tmp_path / "short"
    assert train(short, "--train.steps=4") == 0
    assert weights(four) == weights(short)
    assert weights(run / "snapshots" / "step-000002") != weights(four) != weights(run)
    assert 'snapshot_every = 2' in (four / "config.toml").read_text()
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["eval", str(four), "--prompts", "4"]) == 0
    assert "eval/goal" in json.loads(out.getvalue())


def test_only_the_newest_snapshots_are_kept(tmp_path):
    run = tmp_path / "run"
    assert train(run, "--train.steps=5", "--train.snapshot_every=1", "--train.snapshots_keep=2") == 0
    assert [d.name for d in rundir.snapshot_dirs(run)] == ["step-000004", "step-000005"]
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["step-000004", "step-000005"]  # no leftovers
    assert weights(run / "snapshots" / "step-000005") == weights(run)
    # a resumed run may start taking snapshots, and later ones are kept alongside
    assert train(run, "--train.steps=7", "--train.snapshot_every=3", "--train.snapshots_keep=3", "--resume") == 0
    assert [d.name for d in rundir.snapshot_dirs(run)] == ["step-000004", "step-000005", "step-000006"]


def test_the_space_check_counts_the_snapshots_kept(tmp_path, monkeypatch):
    price = SimpleNamespace(policy_bytes=1000, optimizer_bytes=100, reference_bytes=0)
    # state 1,100 twice, checkpoint and best/ 4 x 1,000; 3 snapshots kept plus the one being written
    usage = rundir.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: usage._replace(free=10_200))
    rundir.RunDir(tmp_path / "run", log=lambda *_: None).check_space(price, 3)
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: usage._replace(free=10_199))
    with pytest.raises(RunError, match="3 snapshots as much each"):
        rundir.RunDir(tmp_path / "run", log=lambda *_: None).check_space(price, 3)
    cfg = config_mod.load(None, ["--train.steps=10", "--train.snapshot_every=3"])
    assert rundir.snapshot_count(cfg.train) == 3
    assert rundir.snapshot_count(config_mod.load(None, ["--train.steps=10", "--train.snapshot_every=3",
                                                        "--train.snapshots_keep=2"]).train) == 2
    assert rundir.snapshot_count(config_mod.load(None, ["--train.steps=10"]).train) == 0


@pytest.mark.parametrize("key", ["snapshot_every", "snapshots_keep"])
def test_a_negative_count_is_refused_naming_the_key(key):
    with pytest.raises(config_mod.ConfigError, match=rf"train\.{key}.*must be >= 0"):
        config_mod.load("examples/sort.toml", [f"--train.{key}=-1"])


def test_a_tied_lora_model_snapshots_in_hugging_face_format(tmp_path):
    """A Hugging Face model with tied embeddings and LoRA (the shape of SmolLM2's example): each
    snapshot holds hf/ (LoRA merged, loadable by transformers) and rlvr eval reloads it."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from hf_models import make_model_dir
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    model = make_model_dir(tmp_path / "m", tie_word_embeddings=True)
    assert train(run, f"--model.path={model}", "--model.lora_r=4", "--train.steps=2", "--train.snapshot_every=1") == 0
    one, two = (run / "snapshots" / f"step-00000{i}" for i in (1, 2))
    assert load_file(str(two / "hf" / "model.safetensors")).keys() == load_file(str(run / "hf" / "model.safetensors")).keys()
    assert (two / "hf" / "model.safetensors").read_bytes() == (run / "hf" / "model.safetensors").read_bytes()
    assert (one / "hf" / "model.safetensors").read_bytes() != (two / "hf" / "model.safetensors").read_bytes()
    AutoModelForCausalLM.from_pretrained(one / "hf")
    with redirect_stdout(io.StringIO()):
        assert cli.main(["eval", str(one), "--prompts", "4"]) == 0
