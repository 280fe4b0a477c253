"""rlvr.tracking: rows reach each backend as numbers, read back with the backend's own reader.

TensorBoard is installed with the `test` extra and always tested. W&B, MLflow and trackio are
optional extras: their tests run when the package imports and are skipped, with the reason
printed by `pytest -rs`, when it does not.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlvr import tracking
from rlvr.cli import main
from rlvr.config import LogConfig

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"step": 1, "train/reward": 0.25, "train/pass_rate_hist": [3, 0, 0, 0, 0, 1], "train/groups": 4},
    {"step": 1, "warning": "62% of groups agree"},
    {"step": 2, "train/reward": 0.5, "time/step_s": 0.125, "train/flag": True},
    {"step": 2, "eval/goal": 0.75, "eval/pass@4": 1.0},
    {"step": 3, "train/reward": 1.0},
]
EXPECTED = {"train/reward": [(1, 0.25), (2, 0.5), (3, 1.0)], "train/groups": [(1, 4.0)], "time/step_s": [(2, 0.125)],
            "eval/goal": [(2, 0.75)], "eval/pass@4": [(2, 1.0)]}
CONFIG = {"train": {"lr": 0.001, "betas": [0.9, 0.99]}, "task": {"options": {"n": 5}}}


def _log_all(cfg_log: LogConfig, run_dir: Path) -> None:
    tracker = tracking.open_trackers(cfg_log, run_dir, CONFIG)
    for row in ROWS:
        tracker.log(row["step"], row)
    tracker.close()
    tracker.close()  # a second close is harmless


def test_scalars_keep_numbers_only():
    assert tracking.scalars({"step": 3, "a": 1, "b": 0.5, "s": "text", "l": [1, 2], "t": True}) == {"a": 1.0, "b": 0.5}


def test_flatten_config_for_parameter_stores():
    assert tracking.flatten(CONFIG) == {"train.lr": 0.001, "train.betas": "[0.9, 0.99]", "task.options": '{"n": 5}'}


def test_no_backend_is_a_no_op(tmp_path):
    tracker = tracking.open_trackers(LogConfig(), tmp_path, CONFIG)
    tracker.log(1, {"train/reward": 1.0})
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_event_files_read_back_with_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all(LogConfig(tensorboard=True), tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()
    assert set(tags["scalars"]) == set(EXPECTED)  # no list, string or boolean entry became a scalar
    for tag, want in EXPECTED.items():
        assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)] == want
    assert any(t.startswith("config") for t in tags["tensors"])  # the resolved config as text


def test_missing_backend_names_the_extra(monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name in ("wandb", "mlflow") else real(name))
    with pytest.raises(tracking.TrackingError) as e:
        tracking.check_installed(LogConfig(wandb=True, mlflow=True, tensorboard=True))
    msg = str(e.value)
    assert "log.wandb = true, log.mlflow = true" in msg and "pip install 'rlvr[wandb,mlflow]'" in msg
    assert "tensorboard" not in msg


def test_train_refuses_a_missing_backend_before_any_compute(monkeypatch, tmp_path, capsys):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    out = tmp_path / "run"
    rc = main(["train", str(ROOT / "examples" / "sort.toml"), "--out", str(out), "--log.wandb=true"])
    assert rc == 2
    assert "pip install 'rlvr[wandb]'" in capsys.readouterr().err
    assert not out.exists()


# --- optional backends ------------------------------------------------------------------------


def _wandb_records(path: Path):
    """Records of an offline .wandb file: wandb's protobuf Record in LevelDB log framing
    (a 7-byte ':W&B' header, then 32 KiB blocks of [crc32, length, type] + payload chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'rlvr[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_all(LogConfig(wandb=True), tmp_path)
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # wandb's service process writes the file; finish() can return before the last records are on
    # disk, so wait (up to 60 s) for the run's exit record
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(files[0])):
        assert time.monotonic() < deadline, "the offline run file never received its exit record"
        time.sleep(0.2)
    got: dict[str, list] = {}
    for rec in _wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            for k, v in items.items():
                if not k.startswith("_"):
                    got.setdefault(k, []).append((items["_step"], v))
    assert got == EXPECTED


def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'rlvr[mlflow]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _log_all(LogConfig(mlflow=True, project="sortexp"), tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("sortexp")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.001"
    renamed = {"eval/pass@4": "eval/pass_4"}
    for tag, want in EXPECTED.items():
        hist = client.get_metric_history(run.info.run_id, renamed.get(tag, tag))
        assert sorted((m.step, pytest.approx(m.value)) for m in hist) == want


def test_trackio_local_database_reads_back(tmp_path):
    pytest.importorskip("trackio", reason="trackio is not installed (pip install 'rlvr[trackio]')")
    # trackio reads TRACKIO_DIR when it is imported, so the run happens in a fresh interpreter
    script = f"""
import json, sys
from pathlib import Path
from rlvr import tracking
from rlvr.config import LogConfig
rows = json.loads({json.dumps(json.dumps(ROWS))})
t = tracking.open_trackers(LogConfig(trackio=True, project="sortexp"), Path({str(tmp_path / "run")!r}), {{"train": {{"lr": 0.001}}}})
for r in rows:
    t.log(r["step"], r)
t.close()
from trackio.sqlite_storage import SQLiteStorage
print("LOGS=" + json.dumps(SQLiteStorage.get_logs("sortexp", "run")))
"""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    logs = json.loads(res.stdout.split("LOGS=", 1)[1].splitlines()[0])
    got: dict[str, list] = {}
    for entry in logs:
        for k, v in entry.items():
            if k not in ("step", "timestamp"):
                got.setdefault(k, []).append((entry["step"], v))
    assert got == EXPECTED
