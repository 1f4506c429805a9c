"""Runs on Kubernetes: ``rl launch --k8s`` installs the Helm chart in helm/ for a run config;
``rl status`` and ``rl logs`` read the RayJob it made through kubectl."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rl.errors import UserError

CHART = Path(__file__).resolve().parents[1] / "helm" / "colocated-rl"


def find_tool(name: str) -> str:
    """``helm`` or ``kubectl``: the one `make setup` put beside this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise UserError(f"{name} not found: `make setup` installs it into .venv/bin, or put it on PATH")
    return found


def release_name(run_name: str) -> str:
    """A Helm release name (a DNS label) from a run name: lower case, other characters as '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")[:40].rstrip("-")
    if not name:
        raise UserError(f"run name {run_name!r} gives no usable release name; pass --name")
    return name


def helm_command(config: Path, release: str, *, namespace: str | None = None, values: list[str] = (),
                 sets: list[str] = (), dry_run: bool = False, chart: Path = CHART) -> list[str]:
    """The helm invocation: ``template`` for a dry run, else ``upgrade --install``."""
    verb = ["template"] if dry_run else ["upgrade", "--install"]
    cmd = [find_tool("helm"), *verb, release, str(chart), "--set-file", f"runConfig={config}"]
    if namespace:
        cmd += ["--namespace", namespace]
    for v in values:
        cmd += ["--values", str(v)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def launch(config: str, *, values: list[str] = (), sets: list[str] = (), name: str | None = None,
           namespace: str | None = None, dry_run: bool = False, chart: Path = CHART) -> str:
    """Validate the run config, then install the chart (or render it); returns helm's output."""
    from rl.config import load_config

    cfg = load_config(config)  # a bad config fails here, naming the field, before anything reaches the cluster
    for v in values:
        if not Path(v).is_file():
            raise UserError(f"--values {v}: no such file")
    if not (chart / "Chart.yaml").is_file():
        raise UserError(f"no Helm chart at {chart} (rl launch runs from a source checkout or the runtime image)")
    cmd = helm_command(Path(config), name or release_name(cfg.run.name), namespace=namespace, values=values,
                       sets=sets, dry_run=dry_run, chart=chart)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"helm {'template' if dry_run else 'upgrade --install'} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def _kubectl(args: list[str], namespace: str | None) -> list[str]:
    return [find_tool("kubectl"), *args, *(["--namespace", namespace] if namespace else [])]


def describe_rayjob(job: dict[str, Any]) -> str:
    """A few lines on a RayJob object (``kubectl get rayjob -o json``): its state, cluster and times."""
    st = job.get("status") or {}
    lines = [f"run {job['metadata']['name']}: job {st.get('jobStatus') or 'PENDING'}, "
             f"deployment {st.get('jobDeploymentStatus') or 'New'}"]
    for key, label in (("rayClusterName", "ray cluster"), ("dashboardURL", "dashboard"), ("jobId", "ray job id"),
                       ("startTime", "started"), ("endTime", "ended"), ("failed", "failed attempts"),
                       ("reason", "reason"), ("message", "message")):
        if st.get(key) not in (None, ""):
            lines.append(f"  {label}: {st[key]}")
    return "\n".join(lines)


def status(name: str, namespace: str | None = None) -> str:
    """The state of a launched run, from its RayJob."""
    proc = subprocess.run(_kubectl(["get", "rayjob", name, "-o", "json"], namespace), capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"kubectl get rayjob {name} failed (is kubectl's context the cluster, and the run launched "
                        f"in this namespace?): {proc.stderr.strip()}")
    return describe_rayjob(json.loads(proc.stdout))


def logs(name: str, namespace: str | None = None, follow: bool = False) -> int:
    """Stream the run's console: the submitter Job (named after the RayJob) follows the Ray job's logs."""
    return subprocess.call(_kubectl(["logs", f"job/{name}", *(["--follow"] if follow else [])], namespace))
