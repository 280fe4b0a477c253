"""Experiment tracking besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow, trackio.

    tracker = open_trackers(cfg.log, run_dir, config.to_dict(cfg))   # before the first step
    tracker.log(step, row)                                          # every metrics row
    tracker.close()                                                 # after the last row

Each backend is switched on by its `[log]` key and is off by default. metrics.jsonl stays the
record of the run; a backend receives the same rows, numbers only (strings such as warnings,
lists such as `train/pass_rate_hist`, and booleans are skipped), at the row's `step`.

| key               | writes                                   | install            | without network |
|-------------------|------------------------------------------|--------------------|-----------------|
| `log.tensorboard` | RUN_DIR/tensorboard (event files)        | extra `tensorboard`| always local    |
| `log.wandb`       | RUN_DIR/wandb (run files), W&B project   | extra `wandb`      | WANDB_MODE=offline, later `wandb sync RUN_DIR/wandb/offline-run-*` |
| `log.mlflow`      | MLFLOW_TRACKING_URI, else RUN_DIR/mlruns | extra `mlflow`     | the file store is local |
| `log.trackio`     | trackio's local database (TRACKIO_DIR)   | extra `trackio`    | always local    |

`log.project` names the W&B / trackio project and the MLflow experiment; the run is named after
RUN_DIR. MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set; when rlvr chooses the
file store itself (no MLFLOW_TRACKING_URI) it sets that variable for this process. MLflow metric
names may not contain characters such as `@`: they are replaced by `_` there (`eval/pass_4`).

`check_installed` names a backend that is asked for and not importable, with the extra to
install, before anything is built; `open_trackers` calls it too.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any


class TrackingError(ValueError):
    """A tracking backend was asked for and cannot be used (not installed, failed to start)."""


# key in [log] -> (module that must import, pip extra of rlvr that installs it)
REQUIREMENTS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def requested(cfg_log: Any) -> list[str]:
    """The backends switched on in a LogConfig, in REQUIREMENTS order."""
    return [name for name in REQUIREMENTS if getattr(cfg_log, name, False)]


def check_installed(cfg_log: Any) -> None:
    """Raise TrackingError naming every requested backend that is not installed, and the extra."""
    missing = [name for name in requested(cfg_log) if importlib.util.find_spec(REQUIREMENTS[name][0]) is None]
    if missing:
        extras = ",".join(REQUIREMENTS[m][1] for m in missing)
        raise TrackingError(
            f"{', '.join('log.' + m + ' = true' for m in missing)} but "
            f"{', '.join(REQUIREMENTS[m][0] for m in missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'rlvr[{extras}]' (or set {', '.join('log.' + m for m in missing)} = false)")


def scalars(row: dict) -> dict[str, float]:
    """The numeric entries of a metrics row, as floats (step, strings, lists and booleans left out)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(config_dict: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; lists and tables below a key become JSON text."""
    out: dict[str, Any] = {}
    for k, v in config_dict.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not prefix:
            out.update(flatten(v, key + "."))
        elif isinstance(v, (dict, list)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


# --- backends: each has log(step, scalars) and close() ----------------------------------------


class _TensorBoard:
    """One event per row holding all its scalars: torch's FileWriter pays per event, so one
    add_scalar call per key costs several times as much a row (docs/benchmarks.md)."""

    def __init__(self, run_dir: Path, config_dict: dict, project: str):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import text
        from torch.utils.tensorboard.writer import FileWriter

        self.Summary = Summary
        self.writer = FileWriter(str(run_dir / "tensorboard"))
        self.writer.add_summary(text("config", "```\n" + json.dumps(config_dict, indent=2) + "\n```"), 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        S = self.Summary
        self.writer.add_summary(S(value=[S.Value(tag=k, simple_value=v) for k, v in values.items()]), step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, config_dict: dict, project: str):
        import wandb

        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config_dict,
                              reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


class _MLflow:
    """Metrics are sent in batches of FLUSH_AT (and at close): each log_batch call has a fixed cost
    against a store, too much to pay once a row (docs/benchmarks.md)."""

    FLUSH_AT = 500

    def __init__(self, run_dir: Path, config_dict: dict, project: str):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        self.uri = uri
        self.pending: list = []
        params = [Param(_MLFLOW_BAD.sub("_", k), str(v)[:6000]) for k, v in flatten(config_dict).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(_MLFLOW_BAD.sub("_", k), v, now, step) for k, v in values.items() if math.isfinite(v)]
        if len(self.pending) >= self.FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self.pending), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + 1000])
        self.pending = []

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, run_dir: Path, config_dict: dict, project: str):
        import trackio

        self.run = trackio.init(project=project, name=run_dir.name, config=flatten(config_dict))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow, "trackio": _Trackio}
"""Name in [log] -> backend class (log(step, scalars), close())."""


class Tracker:
    """Fans a metrics row out to every open backend; with none open, log and close do nothing."""

    def __init__(self, backends: dict[str, Any] | None = None):
        self.backends = dict(backends or {})

    def log(self, step: int, row: dict) -> None:
        """Log the numeric entries of `row` at `step` (strings, lists and booleans are skipped)."""
        values = scalars(row)
        if values:
            for b in self.backends.values():
                b.log(int(step), values)

    def close(self) -> None:
        """Flush and close every backend (safe to call twice)."""
        backends, self.backends = self.backends, {}
        for b in backends.values():
            b.close()


def open_trackers(cfg_log: Any, run_dir: str | Path, config_dict: dict) -> Tracker:
    """Open every backend switched on in `cfg_log` (a LogConfig) for the run in `run_dir`.

    Raises TrackingError, before opening any backend, when one is not installed; and when a
    backend fails to start (the ones already open are closed first).
    """
    check_installed(cfg_log)
    run_dir = Path(run_dir)
    project = getattr(cfg_log, "project", "rlvr") or "rlvr"
    opened: dict[str, Any] = {}
    for name in requested(cfg_log):
        try:
            opened[name] = BACKENDS[name](run_dir, config_dict, project)
        except Exception as e:
            Tracker(opened).close()
            raise TrackingError(f"log.{name}: could not start {name}: {type(e).__name__}: {e}") from e
    return Tracker(opened)
