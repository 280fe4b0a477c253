"""A run directory is data: reading it never runs its code, a cut-off or damaged one is handled,
and an output directory that cannot be written is refused before any model is built."""

import json
import os
import shutil
import tempfile
import textwrap

import pytest

from rlvr import cli, rundir, trainer

TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.prompts_per_step=4",
        "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 50}", "--eval.prompts=20",
        "--eval.pass_k=0", "--train.lr=0.01", "--train.threads=1", "--task.reward_workers=0"]


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """A finished 2-step run whose task is a file that leaves a mark whenever it is imported."""
    d = tmp_path_factory.mktemp("filetask")
    mark = d / "imported"
    (d / "marking.py").write_text(textwrap.dedent(f"""
        open({str(mark)!r}, "a").write("x")
        from rlvr.tasks.sort import sort_task

        def make(**options):
            return sort_task(**options)
    """))
    run = d / "run"
    assert cli.main(["train", "examples/sort.toml", *TINY, "--train.steps=2", "--eval.every=0",
                     f"--task.path={d / 'marking.py'}:make", "--out", str(run)]) == 0
    return run, mark


def test_eval_probe_and_audit_refuse_a_task_file_named_by_a_run_directory(file_run, capsys):
    run, mark = file_run
    mark.unlink(missing_ok=True)
    for argv in (["eval", str(run)], ["probe", str(run / "config.toml"), "--prompts=2", "--samples=2"],
                 ["audit", str(run / "config.toml"), "--prompts=2"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "marking.py:make" in err and "a run directory is data" in err and "--trust-run-config" in err
        assert not mark.exists(), argv                        # refused before importing anything
    assert cli.main(["eval", str(run), "--trust-run-config", "--prompts=4"]) == 0
    assert mark.exists()
    mark.unlink()
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--task.path=rlvr.tasks.sort:sort_task", "--prompts=4"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/prompts"] == 4
    assert not mark.exists()                                  # a module of the installed package is fine


def test_eval_of_a_run_cut_off_loads_best_then_the_last_state(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", *TINY, "--train.steps=2", "--eval.every=1",
                     "--out", str(run)]) == 0
    capsys.readouterr()
    shutil.rmtree(run / "checkpoint")                          # what a kill before the final save leaves
    assert cli.main(["eval", str(run), "--prompts=4"]) == 0
    assert "loading best/ (step " in capsys.readouterr().err
    shutil.rmtree(run / "best")
    assert cli.main(["eval", str(run), "--prompts=4"]) == 0
    assert "loading the last saved state (step 2)" in capsys.readouterr().err
    shutil.rmtree(run / "state")
    assert cli.main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "checkpoint" / "model.safetensors") in err and "there is no best/ or state/" in err


def test_a_corrupt_checkpoint_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", *TINY, "--train.steps=1", "--eval.every=0",
                     "--out", str(run)]) == 0
    capsys.readouterr()
    weights = run / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert cli.main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "truncated" in err and "Traceback" not in err
    (run / "checkpoint" / ".complete").unlink()                # no marker to compare sizes against
    assert cli.main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "unreadable" in err


@pytest.mark.parametrize("trouble, why", [("read-only", "Read-only file system"), ("full", "No space left")])
def test_an_unwritable_out_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch, trouble, why):
    """The tests run as root, which writes anywhere: the probe write is made to fail the way a
    read-only mount (EROFS) or a full disk (/dev/full: ENOSPC) fails it."""
    real = tempfile.mkstemp

    def mkstemp(**kw):
        if trouble == "read-only":
            raise OSError(30, "Read-only file system")
        fd, name = real(**kw)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(rundir.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(trainer, "build", lambda cfg: pytest.fail("the model was built"))
    out = tmp_path / "out" / "run"
    assert cli.main(["train", "examples/sort.toml", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write into {tmp_path}" in err and why in err
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_disk_too_full_for_the_saves_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    usage = rundir.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: usage._replace(free=50_000))
    out = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: 0.0 MiB free on its disk" in err and "the run's saves need about" in err
    assert not out.exists()


def test_probe_of_a_cut_off_run_does_not_import_its_task_file(file_run, tmp_path, capsys):
    """Without a final checkpoint the probe rebuilds the model from the run's config and state,
    which would import the run's task file: refused unless trusted."""
    run, mark = file_run
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoint")
    shutil.rmtree(cut / "best")
    mark.unlink(missing_ok=True)
    argv = ["probe", "examples/sort.toml", *TINY, "--checkpoint", str(cut), "--prompts=2", "--samples=2"]
    assert cli.main(argv) == 2
    assert "a run directory is data" in capsys.readouterr().err and not mark.exists()
    assert cli.main([*argv, "--trust-run-config"]) == 0
    assert "loading the last saved state (step 2)" in capsys.readouterr().err and mark.exists()
