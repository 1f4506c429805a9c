"""A run's final model and checkpoints to s3:// or gs:// (engines.model.io.uploads, what a Kubernetes run's launch.sh
calls with storage.export), against the local S3 stand-in of tests/test_model_sources.py (moto's server behind its
recording proxy), read back with fetch_model: the way the model comes back later."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.model.io import uploads
from engines.model.io.sources import SHA256SUMS, SourceError, fetch_model
from engines.model.io.uploads import UploadError, newest_checkpoint, upload_directory
from tests import test_model_sources as stand_in
from tests.test_model_sources import Proxy

s3_server, s3 = stand_in.s3_server, stand_in.s3  # the S3 stand-in's fixtures

ROOT = Path(__file__).resolve().parent.parent
MULTIPART = 9 * 2**20  # above boto3's multipart threshold (8 MiB)


def _final(d: Path) -> dict[str, bytes]:
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(MULTIPART),
             "tokenizer.json": os.urandom(200_000), "sub/generation_config.json": b"{}"}
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return files


def _puts() -> list[str]:
    return [r["path"].split("?")[0] for r in Proxy.log if r["method"] in ("PUT", "POST")]


def test_a_directory_goes_up_whole_and_comes_back_checked(s3, tmp_path):
    files = _final(tmp_path / "final")
    done = upload_directory(tmp_path / "final", "s3://models/runs/math/final", log=lambda line: None)
    assert (done.sent, done.kept, done.bytes) == (4, 0, sum(map(len, files.values())))
    manifest = s3.get_object(Bucket="models", Key=f"runs/math/final/{SHA256SUMS}")["Body"].read().decode()
    assert len(manifest.splitlines()) == 4 and "  sub/generation_config.json" in manifest
    assert _puts()[-1].endswith(f"/runs/math/final/{SHA256SUMS}")  # the manifest last: the upload is complete
    got = fetch_model("s3://models/runs/math/final", tmp_path / "cache")  # checked against SHA256SUMS
    assert {p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*") if p.is_file()
            and not p.name.startswith(".") and p.name != SHA256SUMS} == files


def test_a_second_upload_sends_only_what_changed(s3, tmp_path):
    _final(tmp_path / "final")
    upload_directory(tmp_path / "final", "s3://models/again", log=lambda line: None)
    Proxy.log = []
    done = upload_directory(tmp_path / "final", "s3://models/again", log=lambda line: None)
    assert (done.sent, done.kept) == (0, 4) and _puts() == ["/models/again/SHA256SUMS"]
    (tmp_path / "final" / "config.json").write_bytes(b'{"model_type": "qwen3"}')  # same size as before, not content
    Proxy.log = []
    assert upload_directory(tmp_path / "final", "s3://models/again", log=lambda line: None).sent == 1
    assert _puts() == ["/models/again/config.json", "/models/again/SHA256SUMS"]


def test_the_newest_complete_checkpoint_is_chosen(tmp_path):
    root = tmp_path / "checkpoints"
    for name, sealed in (("iter_000005", True), ("iter_000010", True), ("iter_000015", False),
                         ("iter_000020.tmp", True)):
        (root / name).mkdir(parents=True)
        if sealed:
            (root / name / "complete.json").write_text("{}")
    assert newest_checkpoint(root) == root / "iter_000010"
    assert newest_checkpoint(tmp_path / "none") is None


def test_bad_targets_and_missing_credentials_are_one_line(s3, tmp_path, monkeypatch):
    _final(tmp_path / "final")
    with pytest.raises(SourceError, match="an upload goes to s3://bucket/prefix"):
        upload_directory(tmp_path / "final", "Qwen/Qwen3-8B")
    with pytest.raises(UploadError, match="no such directory"):
        upload_directory(tmp_path / "missing", "s3://models/x")
    with pytest.raises(UploadError, match="NoSuchBucket"):
        upload_directory(tmp_path / "final", "s3://no-such-bucket/x", log=lambda line: None)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(UploadError, match="no credentials: set AWS_ACCESS_KEY_ID"):
        upload_directory(tmp_path / "final", "s3://models/x", log=lambda line: None)


def test_the_command_line_takes_the_credentials_from_a_mounted_secret(s3, tmp_path, s3_server):
    """What launch.sh runs: the credentials are files of the Secret's volume, not the run's environment; the newest
    checkpoint goes to URI/iter_N."""
    secret = tmp_path / "secret"
    secret.mkdir()
    for name, value in (("AWS_ACCESS_KEY_ID", "AKTEST"), ("AWS_SECRET_ACCESS_KEY", "secret\n"),
                        ("AWS_ENDPOINT_URL", s3_server), ("AWS_REGION", "us-east-1"), ("..data", "skipped")):
        (secret / name).write_text(value)
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000007"
    ckpt.mkdir(parents=True)
    (ckpt / "complete.json").write_text("{}")
    (ckpt / "state.json").write_text('{"iteration": 7}')
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(ROOT), AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    cmd = [sys.executable, "-m", "engines.model.io.uploads", str(tmp_path / "run" / "checkpoints"),
           "s3://models/runs/math/checkpoints/", "--newest-checkpoint", "--credentials-dir", str(secret)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 file(s) sent" in proc.stderr  # complete.json and state.json
    body = s3.get_object(Bucket="models", Key="runs/math/checkpoints/iter_000007/state.json")["Body"].read()
    assert body == b'{"iteration": 7}'
    proc = subprocess.run([*cmd[:5], "--credentials-dir", str(secret)], capture_output=True, text=True, env=env,
                          timeout=120)  # without --newest-checkpoint: the directory as it is
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*cmd[:4], "gs://Bad_Bucket/x"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "not a bucket name" in proc.stderr


def test_load_credentials_sets_only_variable_names(tmp_path, monkeypatch):
    (tmp_path / "HF_TOKEN").write_text("hf_x\n")
    (tmp_path / "..2026_01_01").mkdir()  # what a Secret volume holds besides its keys
    (tmp_path / "lower-case").write_text("no")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert uploads.load_credentials(tmp_path) == ["HF_TOKEN"] and os.environ["HF_TOKEN"] == "hf_x"


def test_a_stop_request_checkpoints_exports_and_ends_the_run_so_its_retry_resumes(s3, ray_cluster, tmp_path,
                                                                                   monkeypatch):
    """The chart's preStop writes stop-requested in the run directory, here while the trainers train: after the
    iteration the run saves a sealed checkpoint (exported with run.export_checkpoints), removes the file and ends
    with exit status 1; its retry (--auto-resume) goes on from that checkpoint to the end, and the final model reaches
    object storage too. (Asked during a rollout, the iteration is abandoned instead: tests/test_run.py.)"""
    import json

    import yaml

    from rl.cli import main as rl_main
    from rl.loop import controller
    from rl.loop.checkpoint import list_checkpoints
    from tests.test_run import TINY

    raw = json.loads(json.dumps(TINY))
    raw["run"].update(iterations=2, eval_every=10, save_every=10, eval_samples=0, collapse_guard=False,
                      export_uri="s3://models/runs/stopped", export_checkpoints=True)
    raw["env"]["num_eval"] = 8
    config, run = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(raw))
    run.mkdir()
    plan = controller.plan_update

    def asked_while_training(*args, **kwargs):
        (run / "stop-requested").write_text("node-1 1700000000\n")
        return plan(*args, **kwargs)

    monkeypatch.setattr(controller, "plan_update", asked_while_training)
    assert rl_main(["train", str(config), "--run-dir", str(run), "--auto-resume"]) == 1
    monkeypatch.setattr(controller, "plan_update", plan)
    assert [p.name for p in list_checkpoints(run)] == ["iter_000000"] and not (run / "stop-requested").exists()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="models", Prefix="runs/stopped/")["Contents"]}
    assert f"runs/stopped/checkpoints/iter_000000/{SHA256SUMS}" in keys
    assert rl_main(["train", str(config), "--run-dir", str(run), "--auto-resume"]) == 0
    assert [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    got = fetch_model("s3://models/runs/stopped/final", tmp_path / "cache")
    assert (got / "model.safetensors").read_bytes() == (run / "final" / "model.safetensors").read_bytes()


def test_the_export_container_uploads_what_the_run_asks_for_and_the_run_never_holds_the_keys(s3, tmp_path, s3_server):
    """The chart's split (issue 57, N4): `upload_service serve` holds the export's keys (a mounted Secret's files) and
    uploads what a process without any key asks for through the run directory: final/ and the newest checkpoint, to a
    prefix under storage.export.uri and from the run directories only; with no server, a request ends in one line."""
    import time

    from engines.model.io import upload_service

    secret = tmp_path / "secret"
    secret.mkdir()
    for name, value in (("AWS_ACCESS_KEY_ID", "AKTEST"), ("AWS_SECRET_ACCESS_KEY", "secret"),
                        ("AWS_ENDPOINT_URL", s3_server), ("AWS_REGION", "us-east-1")):
        (secret / name).write_text(value)
    runs = tmp_path / "runs"
    run = runs / "math"
    files = _final(run / "final")
    ckpt = run / "checkpoints" / "iter_000003"
    ckpt.mkdir(parents=True)
    (ckpt / "complete.json").write_text("{}")
    box = run / ".exports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(ROOT), AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    module = [sys.executable, "-m", "engines.model.io.upload_service"]
    server = subprocess.Popen([*module, "serve", str(box), "--allow", "s3://models/exported/math", "--root", str(runs),
                               "--credentials-dir", str(secret)], env=env, stderr=subprocess.DEVNULL)
    try:
        def ask(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*module, "request", str(box), *args], capture_output=True, text=True, env=env,
                                  timeout=120)
        done = ask(str(run / "final"), "s3://models/exported/math/final")
        assert done.returncode == 0 and "4 file(s) sent" in done.stderr, done.stderr
        got = fetch_model("s3://models/exported/math/final", tmp_path / "cache")
        assert (got / "config.json").read_bytes() == files["config.json"]
        done = ask(str(run / "checkpoints"), "s3://models/exported/math/checkpoints", "--newest-checkpoint")
        assert done.returncode == 0, done.stderr
        assert s3.head_object(Bucket="models", Key="exported/math/checkpoints/iter_000003/complete.json")
        inside = "s3://models/exported/math/x"
        for args, why in (((str(run / "final"), "s3://models/elsewhere"), "is not under storage.export.uri"),
                          ((str(tmp_path / "secret"), inside), "is not under the run directories"),
                          ((str(run / "final/../../../secret"), inside), "is not under the run directories")):
            refused = ask(*args)
            assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and why in refused.stderr, args
    finally:
        server.kill()
        server.wait()
    time.sleep(1.2)
    status, message = upload_service.request(box, run / "final", "s3://models/exported/math/final", stale_s=1.0)
    assert status == 1 and message.startswith(f"no export container serves {box} (its heartbeat is ")
    assert not list(box.glob("*.json"))  # the unanswered request withdrawn
    # a server that never came up: waited for as long as a stale one, then one line
    status, message = upload_service.request(tmp_path / "nobody", run / "final", "s3://models/x", stale_s=0.5)
    assert status == 1 and "(its heartbeat is missing after " in message
