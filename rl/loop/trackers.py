"""Experiment trackers (``metrics.loggers``): Weights & Biases, TensorBoard and MLflow beside ``metrics.jsonl``.

Each gets the validated config as the run's config, every number of each iteration's ``metrics.jsonl`` record at
step = iteration (a metric not measured that iteration, ``null`` in the file, is left out; text such as
``first_env_error`` stays in the file), and at the end ``curves.png`` and the summary. ``tracking`` opens them
around a run (``rl train`` and ``rl.train`` both do); ``MetricsLog.record`` passes each record to the trackers
open in its context. A resumed run continues the same wandb and MLflow runs (their ids are kept in
``trackers.json`` in the run directory); TensorBoard drops the events of iterations a resume redoes.
"""

from __future__ import annotations

import contextvars
import importlib.util
import json
import math
import netrc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from rich.console import Console

from rl.config import Config, dump_config
from rl.errors import UserError

EXTRA = "trackers"  # the optional dependencies in pyproject.toml
MODULES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}  # logger -> the module it needs
IDS_FILE = "trackers.json"
_current: contextvars.ContextVar[Trackers | None] = contextvars.ContextVar("rl_trackers", default=None)


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record, the iteration apart (it is the step)."""
    return {k: float(v) for k, v in rec.items()
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and text values (MLflow's params); lists as JSON."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, str) else json.dumps(v)
    return out


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any], curves: Path | None, failed: bool) -> None: ...


class WandbTracker:
    """A wandb run in ``RUN_DIR/wandb``: online with an API key, else offline (``wandb sync`` uploads it later)."""

    def __init__(self, cfg: Config, run_dir: Path, names: tuple[str, str], console: Console,
                 run_id: str | None) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_key_present() else "offline")
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            console.print(f"wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline to {run_dir}/wandb; "
                          f"upload with `wandb sync {run_dir}/wandb/offline-run-*`", soft_wrap=True)
        self.run = wandb.init(project=names[0], name=names[1], entity=cfg.metrics.wandb_entity, dir=str(run_dir),
                              mode=mode, config=cfg.model_dump(mode="json"), id=run_id,
                              resume="allow" if run_id else None)
        self.id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict[str, Any], curves: Path | None, failed: bool) -> None:
        import wandb

        if curves is not None:
            self.run.log({"curves": wandb.Image(str(curves))})
        self.run.summary.update(summary)
        self.run.finish(exit_code=1 if failed else 0)


class TensorBoardTracker:
    """Event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.dir, self.config = run_dir / "tensorboard", dump_config(cfg)
        self.writer = None
        self.id = None

    def _open(self, step: int) -> Any:
        if self.writer is None:  # at the first step this process logs: a resume's redone iterations replace theirs
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir), purge_step=step)
            self.writer.add_text("config", f"```yaml\n{self.config}```", step)
        return self.writer

    def log(self, values: dict[str, float], step: int) -> None:
        writer = self._open(step)
        for key, value in values.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def finish(self, summary: dict[str, Any], curves: Path | None, failed: bool) -> None:
        if self.writer is None and not summary:  # a run that failed before its first iteration
            return
        step = max(0, int(summary.get("iterations", 1)) - 1)
        writer = self._open(step)
        if curves is not None:
            import matplotlib.image

            image = matplotlib.image.imread(str(curves))[..., :3]  # RGBA floats in [0, 1]
            writer.add_image("curves", image, step, dataformats="HWC")
        writer.add_text("summary", f"```json\n{json.dumps(summary, indent=2)}\n```", step)
        writer.close()


class MlflowTracker:
    """An MLflow run: the config as params (dotted keys) and config.yaml, metrics by step (a ``/`` in a name
    becomes ``.``: ``reward_mean/function`` is ``reward_mean.function``), curves.png and summary.json as
    artifacts. The store is ``metrics.mlflow_tracking_uri``, $MLFLOW_TRACKING_URI, or a file store in
    ``RUN_DIR/mlruns`` (``mlflow ui --backend-store-uri RUN_DIR/mlruns``)."""

    def __init__(self, cfg: Config, run_dir: Path, names: tuple[str, str], run_id: str | None) -> None:
        uri = cfg.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            (run_dir / "mlruns").absolute().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store for those who ask: a local run needs no database server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(names[0])
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(names[0])
            run_id = self.client.create_run(experiment_id, run_name=names[1]).info.run_id
            params = [Param(k, v[:6000]) for k, v in flat(cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(run_id, params=params[i:i + 100])
            self.client.log_text(run_id, dump_config(cfg), "config.yaml")
        self.id = run_id

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in values.items()])

    def finish(self, summary: dict[str, Any], curves: Path | None, failed: bool) -> None:
        if curves is not None:
            self.client.log_artifact(self.id, str(curves))
        self.client.log_dict(self.id, summary, "summary.json")
        numbers = {k: v for k, v in scalars(summary).items() if math.isfinite(v)}
        if numbers:
            self.log({f"summary.{k}": v for k, v in numbers.items()}, int(summary.get("iterations", 0)))
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")


def mlflow_key(name: str) -> str:
    """A metric's MLflow name: MLflow's file store keeps a metric in a file named by its key, so ``reward_mean`` and
    ``reward_mean/function`` cannot both be kept there; ``.`` nests nothing."""
    return name.replace("/", ".")


def wandb_key_present() -> bool:
    """Whether wandb has credentials here: $WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc (or $NETRC)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_installed(loggers: list[str]) -> None:
    """One line naming the extra when a logger's package is missing."""
    for logger in loggers:
        if importlib.util.find_spec(MODULES[logger]) is None:
            raise UserError(f"metrics.loggers: {logger} is not installed; pip install 'colocated-rl[{EXTRA}]' "
                            f"(or pip install {'mlflow-skinny' if logger == 'mlflow' else logger})")


class Trackers:
    """The run's open trackers: each record goes to every one; ``finish`` sends the curves and the summary."""

    def __init__(self, trackers: dict[str, Tracker]) -> None:
        self.trackers = trackers
        self.finished = False

    def log(self, rec: dict[str, Any]) -> None:
        values = scalars(rec)
        for tracker in self.trackers.values():
            tracker.log(values, int(rec["iteration"]))

    def finish(self, summary: dict[str, Any], curves: Path | None = None, failed: bool = False) -> None:
        """Close every tracker with the run's ``curves`` image and ``summary``; ``failed`` marks the run so."""
        if self.finished:
            return
        self.finished = True
        for tracker in self.trackers.values():
            tracker.finish(summary, curves if curves is not None and curves.is_file() else None, failed)


def current() -> Trackers | None:
    """The trackers opened by the enclosing ``tracking`` (None outside one)."""
    return _current.get()


@contextmanager
def tracking(cfg: Config, run_dir: Path, console: Console, resume: bool = False) -> Iterator[Trackers]:
    """Open ``cfg.metrics.loggers`` for a run in ``run_dir`` (continuing its earlier tracker runs on ``resume``);
    the caller finishes them with the summary, and a run that raises closes them as failed."""
    loggers = list(dict.fromkeys(cfg.metrics.loggers))
    check_installed(loggers)
    ids_file = run_dir / IDS_FILE
    ids = json.loads(ids_file.read_text()) if resume and ids_file.is_file() else {}
    names = (cfg.metrics.project or cfg.run.name, cfg.metrics.run_name or run_dir.absolute().name)
    opened: dict[str, Tracker] = {}
    trackers = Trackers(opened)
    try:
        for logger in loggers:
            if logger == "wandb":
                opened[logger] = WandbTracker(cfg, run_dir, names, console, ids.get(logger))
            elif logger == "tensorboard":
                opened[logger] = TensorBoardTracker(cfg, run_dir)
            else:
                opened[logger] = MlflowTracker(cfg, run_dir, names, ids.get(logger))
        if opened:
            run_dir.mkdir(parents=True, exist_ok=True)
            ids_file.write_text(json.dumps({k: t.id for k, t in opened.items() if t.id is not None}))
        token = _current.set(trackers)
        try:
            yield trackers
        finally:
            _current.reset(token)
    except BaseException:
        trackers.finish({}, None, failed=True)
        raise
    trackers.finish({})  # a caller that did not finish them: closed without a summary
