"""Experiment trackers (rl/loop/trackers.py): what MetricsLog records reaches wandb (offline), TensorBoard and MLflow,
read back with each library's own reader; a resume continues the same tracker runs; a missing package is one line."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from rl.config import dump_config, parse_config
from rl.errors import UserError
from rl.loop import trackers
from rl.loop.metrics import MetricsLog, plot_curves

CONFIG = {"run": {"name": "trk"}, "metrics": {"loggers": ["wandb", "tensorboard", "mlflow"], "project": "proj-t",
                                                "run_name": "first"},
          "rollout": {"max_tokens": 24}}
# records as the controller writes them: held-out accuracy only where measured, text beside the numbers
RECORDS = [
    {"iteration": 0, "reward_mean": 0.25, "accuracy": None, "reward_mean/function": 0.5, "env_errors": 0,
     "time_rollout": 1.5, "mem_train_peak_gib": None, "response_len": 7.0, "truncation_rate": 0.0, "temperature": 1.0},
    {"iteration": 1, "reward_mean": 0.5, "accuracy": 0.375, "reward_mean/function": 0.75, "env_errors": 1,
     "first_env_error": "env 'function', task t1: ValueError: bad", "time_rollout": 1.25, "response_len": 6.0,
     "truncation_rate": 0.125, "temperature": 1.0},
    {"iteration": 2, "reward_mean": 0.625, "accuracy": 0.5, "reward_mean/function": 1.0, "env_errors": 0,
     "time_rollout": 1.0, "response_len": 5.5, "truncation_rate": 0.0, "temperature": 1.0},
]


def numbers(rec: dict) -> dict[str, float]:
    """The reference: every number of a record but the iteration (None and text left out)."""
    return {k: v for k, v in rec.items() if k != "iteration" and isinstance(v, (int, float))}


def log_run(cfg, run_dir: Path, records: list[dict], resume: bool = False) -> tuple[dict, str]:
    """A run's tracker traffic without its workers: MetricsLog inside ``tracking``, as rl.api.run drives them;
    returns the summary and the console's text."""
    out = io.StringIO()
    console = Console(file=out, width=200)
    run_dir.mkdir(parents=True, exist_ok=True)
    with trackers.tracking(cfg, run_dir, console, resume) as tracking:
        log = MetricsLog(run_dir, console, resume_at=records[0]["iteration"] if resume else None)
        for rec in records:
            log.record(rec)
        plot_curves(log.records, run_dir / "curves.png", {"accuracy": 0.125})
        summary = {"initial_accuracy": 0.125, "final_accuracy": 0.5, "iterations": len(log.records), "wall_s": 9.5}
        tracking.finish(summary, run_dir / "curves.png")
    return summary, out.getvalue()


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One run logged to all three trackers, with no wandb credentials (so offline)."""
    run_dir = tmp_path_factory.mktemp("trk") / "run-a"
    mp = pytest.MonkeyPatch()
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI"):
        mp.delenv(key, raising=False)
    mp.setenv("NETRC", str(run_dir.parent / "no-netrc"))  # and no `wandb login` entry
    mp.setenv("WANDB_SILENT", "true")
    cfg = parse_config(json.loads(json.dumps(CONFIG)))
    summary, console = log_run(cfg, run_dir, RECORDS)
    yield cfg, run_dir, summary, console
    mp.undo()


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of the run's offline transaction logs, as wandb's own inspector prints them."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files
    out = []
    for f in files:
        text = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(f)],
                              capture_output=True, text=True, check=True, timeout=120).stdout
        out += [json.loads(line) for line in text.splitlines() if line.strip()]
    return out


def test_wandb_offline_run_has_config_metrics_curves_and_summary(tracked):
    cfg, run_dir, summary, console = tracked
    assert "wandb: no API key" in console and "logging offline" in console
    assert len([line for line in console.splitlines() if "wandb" in line]) == 1  # one line says so
    records = wandb_records(run_dir)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["project"] == "proj-t" and run["display_name"] == "first"
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == cfg.model_dump(mode="json")
    history = [r["history"] for r in records if r["type"] == "history"]
    by_step = {h["step"]["num"]: h["item"] for h in history}
    assert sorted(by_step) == [r["iteration"] for r in RECORDS]
    for rec in RECORDS:
        got = {k: v for k, v in by_step[rec["iteration"]].items() if not k.startswith(("_", "curves."))}
        assert got == numbers(rec), rec["iteration"]
    curves = [h["item"] for h in history if "curves._type" in h["item"]]
    assert len(curves) == 1 and curves[0]["_step"] == RECORDS[-1]["iteration"]  # beside the last iteration's
    assert curves[0]["curves.format"] == "png"
    (image,) = run_dir.glob("wandb/offline-run-*/files/" + curves[0]["curves.path"])
    import matplotlib.image

    assert matplotlib.image.imread(str(image)).shape == matplotlib.image.imread(str(run_dir / "curves.png")).shape
    final = {}
    for r in records:
        if r["type"] == "summary":
            final.update(r["summary"]["update"])
    assert {k: final[k] for k in summary} == summary
    assert next(r["exit"] for r in records if r["type"] == "exit").get("exit_code", 0) == 0


def test_tensorboard_events_hold_every_metric_by_iteration(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, run_dir, summary, _ = tracked
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    want: dict[str, list[tuple[int, float]]] = {}
    for rec in RECORDS:
        for k, v in numbers(rec).items():
            want.setdefault(k, []).append((rec["iteration"], v))
    assert set(ea.Tags()["scalars"]) == set(want)
    for key, points in want.items():
        got = ea.Scalars(key)
        assert [e.step for e in got] == [p[0] for p in points], key
        assert [e.value for e in got] == pytest.approx([p[1] for p in points]), key  # stored as float32
    (config,) = ea.Tensors("config/text_summary")
    assert dump_config(cfg) in config.tensor_proto.string_val[0].decode()
    (text,) = ea.Tensors("summary/text_summary")
    assert json.loads(text.tensor_proto.string_val[0].decode().strip("`json\n")) == summary
    (image,) = ea.Images("curves")
    import matplotlib.image

    height, width = matplotlib.image.imread(str(run_dir / "curves.png")).shape[:2]
    assert (image.step, image.width, image.height) == (2, width, height)


def test_mlflow_file_store_holds_params_metrics_and_artifacts(tracked, tmp_path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    cfg, run_dir, summary, _ = tracked
    client = MlflowClient((run_dir / "mlruns").absolute().as_uri())
    experiment = client.get_experiment_by_name("proj-t")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert run.info.run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert run.data.params["rollout.max_tokens"] == "24" and run.data.params["metrics.loggers"] == \
        json.dumps(["wandb", "tensorboard", "mlflow"])
    assert "reward_mean.function" in run.data.metrics  # a "/" in a name becomes "." (see trackers.mlflow_key)
    for key in numbers(RECORDS[1]):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key.replace("/", ".")))
        assert history == [(r["iteration"], numbers(r)[key]) for r in RECORDS if key in numbers(r)], key
    assert not client.get_metric_history(run.info.run_id, "first_env_error")
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "curves.png", "summary.json"} <= files
    local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path)))
    assert yaml.safe_load((local / "config.yaml").read_text()) == cfg.model_dump(mode="json")
    assert json.loads((local / "summary.json").read_text()) == summary
    assert (local / "curves.png").read_bytes() == (run_dir / "curves.png").read_bytes()
    assert client.get_metric_history(run.info.run_id, "summary.final_accuracy")[0].value == 0.5


def test_a_resume_continues_the_same_tracker_runs(tracked, tmp_path):
    """Iteration 2 redone and 3 added after a resume: the same MLflow run gets them, TensorBoard keeps the redone
    value only, wandb reopens the run of the same id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, run_dir, _, _ = tracked
    ids = json.loads((run_dir / "trackers.json").read_text())
    redo = [{**RECORDS[2], "reward_mean": 0.75}, {**RECORDS[2], "iteration": 3, "reward_mean": 0.875}]
    log_run(cfg, run_dir, redo, resume=True)
    assert json.loads((run_dir / "trackers.json").read_text()) == ids
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("reward_mean")] == [(0, 0.25), (1, 0.5), (2, 0.75), (3, 0.875)]
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").absolute().as_uri())
    steps = sorted(m.step for m in client.get_metric_history(ids["mlflow"], "reward_mean"))
    assert steps == [0, 1, 2, 2, 3]  # MLflow keeps both values of the redone step
    runs = {next(r["run"]["run_id"] for r in [rec] if rec["type"] == "run") for rec in wandb_records(run_dir)
            if rec["type"] == "run"}
    assert runs == {ids["wandb"]}


def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(trackers.MODULES, "mlflow", "mlflow_is_not_installed_here")
    cfg = parse_config({"metrics": {"loggers": ["tensorboard", "mlflow"]}})
    with pytest.raises(UserError) as e:
        with trackers.tracking(cfg, tmp_path / "run", Console(file=io.StringIO())):
            pass
    assert str(e.value) == "metrics.loggers: mlflow is not installed; pip install 'colocated-rl[trackers]' (or pip " \
                           "install mlflow-skinny)"
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_no_loggers_no_trackers_and_a_failed_run_is_marked(tmp_path):
    cfg = parse_config({"metrics": {"loggers": ["mlflow"]}, "run": {"name": "failing"}})
    with pytest.raises(RuntimeError, match="boom"):
        with trackers.tracking(cfg, tmp_path / "run", Console(file=io.StringIO())) as tracking:
            tracking.log(RECORDS[0])
            raise RuntimeError("boom")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "run" / "mlruns").absolute().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    assert run.info.status == "FAILED" and run.info.run_name == "run"
    assert math.isclose(run.data.metrics["reward_mean"], 0.25)
    with trackers.tracking(parse_config({}), tmp_path / "plain", Console(file=io.StringIO())) as none:
        assert trackers.current() is none and none.trackers == {}
    assert trackers.current() is None and not (tmp_path / "plain").exists()
