"""A run stopped early loses nothing: signals, kills during a save, non-finite updates, misbehaving rewards.

Each test drives a real `rlvr train` (a subprocess where the process itself must be signalled, killed
or must survive its rewards) on the tiny sizes of tests/test_resume.py, and checks what a user sees:
the exit code, the message, summary.json and metrics.jsonl, and that `--resume` then ends with the
same final checkpoint bytes as a run that was never stopped.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlvr import cli, trainer
from rlvr.state import PHASES

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.prompts_per_step=4",
        "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 50}", "--eval.prompts=20",
        "--eval.pass_k=0", "--eval.every=0", "--train.lr=0.01", "--train.lr_schedule=constant",
        "--train.threads=1", "--task.reward_workers=0"]
STEPS = 10
RUN = ["examples/sort.toml", *TINY, f"--train.steps={STEPS}", "--train.save_every=3", "--eval.keep_best=false"]
"""State is saved after steps 3, 6 and 9, then at the end (10); the only checkpoint save is the final
one (no best/, whose copies the step-0 and final evaluations would also write)."""


def env(**extra) -> dict:
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
    e.pop("RLVR_TEST_DIE_AT", None)
    e.update(extra)
    return e


def rlvr(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlvr.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def weights(run: Path) -> bytes:
    return (run / "checkpoint" / "model.safetensors").read_bytes()


def steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return [r["step"] for r in rows if "train/reward" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> bytes:
    """The final weights of the run that was never stopped."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert cli.main(["train", *RUN, "--out", str(out)]) == 0
    return weights(out)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_state_and_resume_ends_bit_identical(tmp_path, straight, sig, code):
    out = tmp_path / "run"
    proc = rlvr("train", *RUN, "--out", str(out), env=env())
    deadline = time.monotonic() + 300
    while not steps_logged(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code, stderr
    n = steps_logged(out)[-1]
    assert 1 <= n < STEPS
    assert f"interrupted after step {n}; continue with --resume" in stdout
    assert signal.Signals(sig).name in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] == n and summary["exit_code"] == code
    assert json.loads((out / "state" / "state.json").read_text())["step"] == n
    assert not (out / "checkpoint").exists()
    assert cli.main(["train", *RUN, "--out", str(out), "--resume"]) == 0
    assert steps_logged(out) == list(range(1, STEPS + 1))
    assert "interrupted" not in json.loads((out / "summary.json").read_text())
    assert weights(out) == straight


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    script = textwrap.dedent("""
        import os, signal, time
        from rlvr.trainer import Interrupts
        with Interrupts() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert stop.signum == signal.SIGINT      # the first one only asks to stop
            print("still running", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        print("not reached")
    """)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 130 and res.stdout == "still running\n"
    assert "SIGINT again: exiting now" in res.stderr and "Traceback" not in res.stderr
    assert time.monotonic() - t0 < 30


CUTS = [("state", p, 2) for p in PHASES] + [("checkpoint", p, 1) for p in ("written", "synced", "renamed")]


@pytest.mark.parametrize("name, phase, nth", CUTS, ids=[f"{n}:{p}" for n, p, _ in CUTS])
def test_a_kill_at_any_phase_of_a_save_resumes_bit_identical(tmp_path, straight, name, phase, nth):
    """SIGKILL at `phase` of the `nth` save of `name` (state: the save after step 6; checkpoint: the
    final one), then --resume: the final weights are those of the run that was never stopped."""
    out = tmp_path / "run"
    proc = rlvr("train", *RUN, "--out", str(out), env=env(RLVR_TEST_DIE_AT=f"{name}:{phase}:{nth}"))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr
    assert cli.main(["train", *RUN, "--out", str(out), "--resume"]) == 0
    assert weights(out) == straight
    assert steps_logged(out) == list(range(1, STEPS + 1))
    leftovers = [p.name for p in out.iterdir() if p.name.endswith((".tmp", ".old"))]
    assert leftovers == []


def test_save_every_minutes_saves_on_the_clock(tmp_path, monkeypatch):
    saved = []
    real = trainer.save
    monkeypatch.setattr(trainer, "save", lambda state, run_dir, wall: (saved.append(state.step),
                                                                       real(state, run_dir, wall)))
    args = ["train", "examples/sort.toml", *TINY, "--train.steps=3"]
    assert cli.main([*args, "--out", str(tmp_path / "a"), "--train.save_every_minutes=0"]) == 0
    assert saved == [3]                             # only the final save
    saved.clear()
    assert cli.main([*args, "--out", str(tmp_path / "b"), "--train.save_every_minutes=1e-9"]) == 0
    assert saved == [1, 2, 3]                       # the clock has passed after every step


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, capsys):
    """kl_coef = 1e308 makes every loss inf or nan (β·KL overflows float32): each update is skipped
    and counted; after 3 such steps in a row the run stops with the state saved after step 1 kept."""
    out = tmp_path / "run"
    rc = cli.main(["train", "examples/sort.toml", *TINY, "--train.steps=6", "--train.save_every=1",
                   "--algorithm.kl_coef=1e308", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "stopped at step 3: every update of the last 3 steps was skipped" in err
    assert "the last saved state (step 2) is kept" in err and "algorithm.kl_coef" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_updates"] for r in rows if "train/reward" in r] == [1, 1, 1]
    assert sum("updates skipped" in r.get("warning", "") for r in rows) == 3
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    assert not (out / "checkpoint").exists() and not (out / "summary.json").exists()


def test_an_update_that_breaks_the_weights_stops_the_run(tmp_path, capsys):
    """lr = 1e308 is inf in float32: the first update leaves inf/nan weights; the run stops there
    instead of failing to sample at step 2."""
    out = tmp_path / "run"
    rc = cli.main(["train", "examples/sort.toml", *TINY, "--train.steps=4", "--train.lr=1e308",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "stopped at step 1: the update left weights that are not finite" in err
    assert "no state was saved yet" in err and "train.lr" in err
    assert "Traceback" not in err


MISBEHAVING = textwrap.dedent('''
    """Rewards that misbehave once each, in this order, then score normally."""
    import ctypes, os, sys, time
    from rlvr.rewards import Reward, RewardCard
    from rlvr.tasks import Example, Task

    KINDS = ["sleep", "_exit", "exit", "interrupt", "memory", "segfault"]
    CARD = RewardCard(pays_for="matching characters", ignores="nothing", exploit="none")

    def make(markers):
        def claim():
            for kind in KINDS:   # O_EXCL: exactly one call, in any worker, gets each kind
                try:
                    os.close(os.open(os.path.join(markers, kind), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    return kind
                except FileExistsError:
                    continue
            return None

        def match(prompt, response, answer):
            kind = claim()
            if kind == "sleep":
                time.sleep(1e6)
            if kind == "_exit":
                os._exit(3)
            if kind == "exit":
                sys.exit(0)
            if kind == "interrupt":
                raise KeyboardInterrupt
            if kind == "memory":
                bytearray(2 * 2**30)        # past task.reward_memory_mb = 256
            if kind == "segfault":
                ctypes.string_at(0)
            return sum(a == b for a, b in zip(response, answer)) / len(answer)

        ex = [Example("%02d=" % i, "%02d" % (99 - i)) for i in range(100)]
        return Task(name="misbehaving", train=ex[:80], heldout=ex[80:], rewards={"match": Reward("match", match, CARD)},
                    goal=lambda p, r, a: r == a, max_new_tokens=2, alphabet="0123456789=", fixed_length=True)
''')


def test_every_reward_status_through_a_real_run(tmp_path):
    """A reward that sleeps forever, calls os._exit, sys.exit, raises KeyboardInterrupt, runs out of
    memory and segfaults (once each): the run finishes with exit code 0 and metrics.jsonl counts them."""
    (tmp_path / "markers").mkdir()
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        [task]
        path = "{tmp_path / 'misbehaving.py'}:make"
        reward = "match"
        options = {{ markers = "{tmp_path / 'markers'}" }}
        reward_workers = 2
        reward_timeout_s = 1
        reward_memory_mb = 256
        [model]
        n_layer = 1
        n_head = 2
        n_embd = 32
        [train]
        steps = 2
        prompts_per_step = 4
        samples_per_prompt = 4
        threads = 1
        [eval]
        every = 0
        at_start = false  # the failures fire once each: in training steps, not in a step-0 evaluation
        prompts = 8
        pass_k = 0
    """))
    out = tmp_path / "run"
    proc = rlvr("train", str(tmp_path / "run.toml"), "--out", str(out), env=env())
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward" in r]
    total = {k: sum(r[f"train/reward_status_{k}"] for r in steps) for k in ("timeout", "crashed", "exit", "error")}
    assert total == {"timeout": 1, "crashed": 2, "exit": 2, "error": 1}
    assert sum(r["train/reward_failures"] for r in steps) == 6
    assert any("calls failed" in r.get("warning", "") for r in rows)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
