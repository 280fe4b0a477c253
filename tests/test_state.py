"""Crash-safe saves: a kill at every phase of a save leaves a complete state; damage is named."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlvr.models.tiny import TinyConfig, TinyTransformer
from rlvr.state import (
    MARKER,
    PHASES,
    STATE_DIR,
    StateError,
    atomic_dir,
    find_complete,
    find_state,
    load_state,
    recover,
    save_state,
    write_dir_atomically,
)

ROOT = Path(__file__).resolve().parents[1]


def make_run(seed=0, model=None):
    """(model, opt, sched, rng, gen) of a tiny run after one optimizer step."""
    torch.manual_seed(seed)
    model = model or TinyTransformer(TinyConfig(vocab_size=7, n_layer=1, n_head=2, n_embd=8, block_size=8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model.zero_grad()
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    sched.step()
    return dict(model=model, opt=opt, sched=sched, rng=random.Random(seed), gen=torch.Generator().manual_seed(seed))


def save(run_dir, run, step):
    save_state(run_dir, step=step, ref=None, cost={"sampled_tokens": step}, wall=float(step), **run)


def load(run_dir, run):
    return load_state(run_dir, ref=None, **run)


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_restores_everything_and_leaves_one_copy(tmp_path):
    run = make_run(0)
    run["rng"].random()
    save(tmp_path, run, 5)
    expect_w, expect_rng = weights(run["model"]), run["rng"].getstate()
    expect_gen, expect_lr = run["gen"].get_state(), run["sched"].get_last_lr()
    other = make_run(1)
    restored = load(tmp_path, other)
    assert restored["step"] == 5 and restored["cost"] == {"sampled_tokens": 5} and restored["wall"] == 5.0
    assert same(weights(other["model"]), expect_w)
    assert other["rng"].getstate() == expect_rng and torch.equal(other["gen"].get_state(), expect_gen)
    assert other["sched"].get_last_lr() == expect_lr
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_DIR]
    assert json.loads((tmp_path / STATE_DIR / MARKER).read_text())["tag"] == 5


def test_tied_embeddings_are_saved_once_and_stay_tied(tmp_path):
    from hf_models import make_model_dir

    from rlvr.models.hf import load_policy

    make_model_dir(tmp_path / "m", tie_word_embeddings=True)
    model, _ = load_policy(tmp_path / "m")
    run = make_run(0, model)
    sd = model.state_dict()
    tied = [k for k in sd if k.endswith("lm_head.weight") or k.endswith("embed_tokens.weight")]
    assert len(tied) == 2 and sd[tied[0]].data_ptr() == sd[tied[1]].data_ptr()
    save(tmp_path / "run", run, 1)
    meta = json.loads((tmp_path / "run" / STATE_DIR / "state.json").read_text())
    stored = load_file(str(tmp_path / "run" / STATE_DIR / "tensors.safetensors"))
    assert len(meta["aliases"]) == 1 and sum(f"model.{k}" in stored for k in tied) == 1
    expect = weights(model)
    model2, _ = load_policy(tmp_path / "m")
    run2 = make_run(1, model2)
    load(tmp_path / "run", run2)
    sd2 = model2.state_dict()
    assert same(weights(model2), expect) and sd2[tied[0]].data_ptr() == sd2[tied[1]].data_ptr()


# --- damage is named ----------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    save(tmp_path, make_run(0), 3)
    return tmp_path / STATE_DIR


def test_truncated_tensors_name_the_file(saved, tmp_path):
    t = saved / "tensors.safetensors"
    t.write_bytes(t.read_bytes()[:100])
    with pytest.raises(StateError, match=r"tensors\.safetensors: 100 bytes, the save wrote \d+ \(truncated"):
        load(tmp_path, make_run(1))
    (saved / MARKER).unlink()           # a copy without a marker (an older save): safetensors finds it
    with pytest.raises(StateError, match=r"tensors\.safetensors: unreadable"):
        load(tmp_path, make_run(1))


def test_bad_json_names_the_file(saved, tmp_path):
    (saved / "state.json").write_text('{"step": 3, "param')
    (saved / MARKER).unlink()
    with pytest.raises(StateError, match=r"state\.json: not valid JSON"):
        load(tmp_path, make_run(1))


def test_a_missing_tensor_names_the_file_and_the_tensor(saved, tmp_path):
    t = saved / "tensors.safetensors"
    tensors = load_file(str(t))
    del tensors["generator"]
    save_file(tensors, str(t))
    (saved / MARKER).unlink()
    with pytest.raises(StateError, match=r"tensors\.safetensors: missing tensor 'generator'"):
        load(tmp_path, make_run(1))
    key = next(k for k in tensors if k.startswith("model."))
    del tensors[key]
    save_file(tensors, str(t))
    with pytest.raises(StateError, match=rf"tensors\.safetensors: does not fit the model: .*{key[6:]}"):
        load(tmp_path, make_run(1))


def test_a_missing_key_and_no_state_are_named(saved, tmp_path):
    meta = json.loads((saved / "state.json").read_text())
    del meta["cost"]
    (saved / "state.json").write_text(json.dumps(meta))
    (saved / MARKER).unlink()
    with pytest.raises(StateError, match=r"state\.json: missing 'cost'"):
        load(tmp_path, make_run(1))
    with pytest.raises(StateError, match="no saved state"):
        load(tmp_path / "elsewhere", make_run(1))


def test_a_save_that_cannot_be_written_is_a_state_error_and_keeps_the_old_copy(saved, tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("rlvr.state.save_file", full)
    with pytest.raises(StateError, match=rf"cannot save {tmp_path / STATE_DIR} .*No space left"):
        save(tmp_path, make_run(0), 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_DIR]
    assert load(tmp_path, make_run(1))["step"] == 3


# --- kills -------------------------------------------------------------------------------------

KILLED_SAVES = textwrap.dedent('''
    # For each phase, a forked child saves state at step 1, changes the weights, and saves step 2 with
    # RLVR_TEST_DIE_AT set. torch is imported and warmed up once, before any fork, on one thread.
    import json, os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_state import make_run, save, weights
    from safetensors.torch import save_file
    from rlvr.state import PHASES
    make_run(0)
    codes = {{}}
    for phase in PHASES:
        run_dir = os.path.join(sys.argv[1], phase)
        pid = os.fork()
        if pid == 0:
            run = make_run(0)
            save(run_dir, run, 1)
            save_file(weights(run["model"]), os.path.join(run_dir, "w1.safetensors"))
            for p in run["model"].parameters():
                p.data.add_(1.0)
            save_file(weights(run["model"]), os.path.join(run_dir, "w2.safetensors"))
            os.environ["RLVR_TEST_DIE_AT"] = "state:" + phase
            save(run_dir, run, 2)
            os._exit(0)
        codes[phase] = os.waitpid(pid, 0)[1]
    print(json.dumps({{k: os.WTERMSIG(v) if os.WIFSIGNALED(v) else -1 for k, v in codes.items()}}))
''')


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """{phase: run directory of a process SIGKILLed at that phase of its second save}."""
    root = tmp_path_factory.mktemp("killed")
    script = root / "killed_saves.py"
    script.write_text(KILLED_SAVES.format(tests=str(ROOT / "tests")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(root)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    signals = json.loads(proc.stdout.strip().splitlines()[-1])
    assert signals == {phase: 9 for phase in PHASES}        # each child was SIGKILLed at its phase
    return {phase: root / phase for phase in PHASES}


@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_each_phase_of_a_save_leaves_a_complete_state(killed, phase):
    run_dir = killed[phase]
    expect_step = 1 if phase in ("begin", "written") else 2
    assert find_state(run_dir) is not None
    run = make_run(1)
    assert load(run_dir, run)["step"] == expect_step
    assert same(weights(run["model"]), load_file(str(run_dir / f"w{expect_step}.safetensors")))
    save(run_dir, run, 3)                                # the next save cleans up what the kill left
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == [STATE_DIR]
    assert load(run_dir, make_run(1))["step"] == 3


# --- the generic helper --------------------------------------------------------------------


def test_atomic_dir_keeps_the_old_copy_when_the_writer_fails(tmp_path):
    write_dir_atomically(tmp_path, "best", 1, lambda d: (d / "best.json").write_text('{"step": 1}'))
    with pytest.raises(ZeroDivisionError):
        with atomic_dir(tmp_path, "best", 2) as d:
            (d / "best.json").write_text('{"step": 2}')
            1 / 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    assert json.loads((tmp_path / "best" / "best.json").read_text()) == {"step": 1}


def test_find_complete_prefers_a_newer_complete_leftover_and_ignores_an_incomplete_one(tmp_path):
    write_dir_atomically(tmp_path, "checkpoint", 1, lambda d: (d / "a").write_text("1"))
    cut = tmp_path / "checkpoint.3.tmp"          # cut off before its marker: ignored
    cut.mkdir()
    (cut / "a").write_text("3")
    assert find_complete(tmp_path, "checkpoint") == tmp_path / "checkpoint"
    done = tmp_path / "checkpoint.2.tmp"         # complete, but never renamed into place
    done.mkdir()
    (done / "a").write_text("2")
    (done / MARKER).write_text(json.dumps({"tag": 2, "files": {"a": 1}}))
    os.rename(tmp_path / "checkpoint", tmp_path / "checkpoint.old")
    assert find_complete(tmp_path, "checkpoint") == done
    assert recover(tmp_path, "checkpoint") == tmp_path / "checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert (tmp_path / "checkpoint" / "a").read_text() == "2"
