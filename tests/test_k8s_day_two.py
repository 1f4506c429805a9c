"""What the chart's pods run on day two (issue 44), run here: launch.sh under bash (rl and python3 replaced by
stand-ins that record their calls), the init containers' and preStop's shell commands, the image check with this
machine's Ray, the run's deadline and `rl launch`'s operator check against ``KubeApiStandIn`` (a test double of the
Kubernetes API server, since none can run here), the pod backend's NetworkPolicy check and owner leases, and the
session namespace's ValidatingAdmissionPolicy evaluated by a CEL interpreter (cel-python) on the pods the real pod
backend builds."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import celpy
import pytest
import ray
import yaml

from rl.cli import main as rl_main
from rl.errors import CommandFailed
from rl.launch import CHART, Kube, seconds_left
from sandbox import k8s_manifests as m
from sandbox.backend import Limits, SandboxError
from sandbox.k8s_leases import OwnerLease
from sandbox.kubernetes import KubernetesBackend
from sandbox.options import KubernetesOptions
from tests.k8s_policy import pod_templates
from tests.kube_standin import KubeApiStandIn
from tests.test_helm_chart import HELM, QUICKSTART, helm, one, render, run_configmap
from tests.test_k8s_commands import kubeconfig, operator_pod, rayjob

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")
ROOT = Path(__file__).resolve().parents[1]
RAYJOBS = "apis/ray.io/v1/rayjobs"


def head_spec(docs: list[dict]) -> dict:
    return dict(pod_templates(docs))["ray-head"]["spec"]


def init_command(docs: list[dict], name: str, where: str = "ray-head") -> list[str]:
    spec = dict(pod_templates(docs))[where]["spec"]
    return next(i["command"] for i in spec["initContainers"] if i["name"] == name)


def stand_ins(tmp_path: Path, deadline: int = 100000) -> tuple[dict, Path]:
    """A PATH whose rl and python3 record their calls in CALLS (rl train prints a line and exits TRAIN_STATUS; the
    deadline answers ``deadline``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "rl").write_text('#!/bin/bash\necho "rl $*" >> "$CALLS"\n[ "$1" = train ] && '
                                '{ echo "iter 0 reward 0.25"; exit "${TRAIN_STATUS:-0}"; }\nexit 0\n')
    (bin_dir / "python3").write_text(f'#!/bin/bash\necho "python3 $*" >> "$CALLS"\n'
                                     f'[ "$3" = deadline ] && echo {deadline}\nexit 0\n')
    for tool in ("rl", "python3"):
        (bin_dir / tool).chmod(0o755)
    calls = tmp_path / "calls"
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls)}, calls


def bash(script: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=timeout)


# --- launch.sh ------------------------------------------------------------------------------------------------------

def test_d15_d6_launch_sh_guards_its_run_directory_and_keeps_each_attempts_console(tmp_path):
    """Two releases given one run directory (the example's fixed run.name): the second is refused before it trains,
    naming the first. Each attempt's console is kept on the claim; a stale stop request and the .running marker go."""
    data = tmp_path / "data"
    script = run_configmap(render(sets=(f"storage.mountPath={data}", "run.name=shared")))["data"]["launch.sh"]
    env, calls = stand_ins(tmp_path)
    run_dir = data / "runs" / "shared"
    run_dir.mkdir(parents=True)
    (run_dir / "stop-requested").write_text("left by a pod of an earlier attempt\n")
    proc = bash(script, env)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / ".owner").read_text() == "rl/myrun\n"
    [log] = (run_dir / "logs").glob("attempt-*.log")
    assert "iter 0 reward 0.25" in log.read_text()
    assert not (run_dir / "stop-requested").exists() and not (run_dir / ".running").exists()
    other = helm("template", "other", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", "--set",
                 f"storage.mountPath={data}", "--set", "run.name=shared").stdout
    script = next(d for d in yaml.safe_load_all(other) if d and d["kind"] == "ConfigMap")
    calls.unlink()
    proc = bash(script["data"]["launch.sh"], env)
    assert proc.returncode == 1 and f"run directory {run_dir} belongs to run rl/myrun" in proc.stderr
    assert not calls.exists()  # nothing ran
    assert bash(run_configmap(render(sets=(f"storage.mountPath={data}", "run.name=shared")))["data"]["launch.sh"],
                env).returncode == 0  # its own run again (a retry, rl launch --replace)


#: the N6 test's root worker (another pod in a cluster): without CAP_DAC_OVERRIDE, the trainer's umask, it makes each
#: directory the head asks for (a line on the request FIFO) and writes a shard there, answering on the reply FIFO
_ROOT_WORKER = "setpriv --bounding-set=-dac_override,-dac_read_search,-fowner --groups 1000".split()
_WORKER = """
import os, sys
from rl.loop.workers import apply_run_umask
apply_run_umask()
with open(sys.argv[1]) as requests, open(sys.argv[2], "w") as replies:
    for line in requests:
        try:
            os.makedirs(line.strip(), exist_ok=True)
            open(os.path.join(line.strip(), "__0_0.shard"), "w").write("x")
            replies.write("ok\\n")
        except OSError as e:
            replies.write(f"{e}\\n")
        replies.flush()
"""
#: the test's "rl train" (the head, uid 1000): two checkpoints saved by rl.loop.checkpoint.write_aside, the first
#: deleted once the second is sealed; final/ made by the worker, a file added to it by the head
_SAVES = """
import os, shutil, sys
from pathlib import Path
from rl.loop.checkpoint import write_aside
run, requests, replies = Path(sys.argv[1]), open(sys.argv[2], "w"), open(sys.argv[3])
def worker(path):
    requests.write(f"{path}\\n"); requests.flush()
    answer = replies.readline().strip()
    if answer != "ok":
        raise OSError(f"the root worker could not write {path}: {answer}")
for i in (1, 2):
    write_aside(run / "checkpoints" / f"iter_{i}", lambda tmp: worker(tmp / "shards"), "checkpoint", None, "", "")
shutil.rmtree(run / "checkpoints" / "iter_1")
worker(run / "final")
(run / "final" / "tokenizer.json").write_text("{}")
print("saved", os.getuid())
"""


def _pythonpath() -> str:
    import site

    return os.pathsep.join([str(ROOT), *site.getsitepackages()])


def _python_for(user: list[str]) -> str:
    """An interpreter ``user`` may run with this checkout's packages: this one, or the system's of the same version
    where this one lies under a directory only root may enter (a pyenv under /root)."""
    for python in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run([*user, "bash", "-c", f"cd / && exec {python} -c 'import rl.loop.checkpoint, sys; "
                                f"sys.exit(sys.version_info[:2] != {tuple(sys.version_info[:2])})'"],
                               capture_output=True, env={"PYTHONPATH": _pythonpath(), "PATH": "/usr/bin:/bin"})
        if probe.returncode == 0:
            return python
    pytest.skip("uid 1000 can run no Python with this checkout's packages")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)")
def test_n6_a_root_rdma_worker_and_the_uid_1000_head_write_and_delete_each_others_checkpoints(tmp_path):
    """memlock: root without IPC_LOCK is refused (it ran as root with every capability dropped). With it, the worker is
    root without CAP_DAC_OVERRIDE, and could not write into the uid-1000 head's iter_N.tmp (0755): the first save
    failed. launch.sh now makes the run directory setgid and its processes' umask 0002, as RL_RUN_UMASK does the
    trainer's: real processes as uid 1000 (the head) and as root without DAC override (the worker) save, seal and
    delete checkpoints, and fill final/ together."""
    sets = ("workerGroups[0].name=w", "workerGroups[0].replicas=1", "workerGroups[0].cpu=2000m",
            "workerGroups[0].memory=16Gi", "workerGroups[0].memlock=root")
    err = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}",
               *[x for s in sets for x in ("--set", s)], check=False).stderr
    assert "workerGroups[0].memlock root: the worker runs as root only to keep IPC_LOCK" in err
    top = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own is root's alone (0700)
    try:
        top.chmod(0o755)
        data = top / "data"
        data.mkdir()
        os.chown(data, 1000, 1000)
        head = ["setpriv", "--reuid", "1000", "--regid", "1000", "--groups", "1000"]
        python = _python_for(head)
        # without the fix, as the chart had it: the root worker is refused in a directory of the head's
        (data / "plain").mkdir()
        os.chown(data / "plain", 1000, 1000)
        assert subprocess.run([*_ROOT_WORKER, "touch", str(data / "plain" / "shard")], capture_output=True
                              ).returncode != 0
        script = run_configmap(render(sets=(f"storage.mountPath={data}", "sandbox.enabled=false")))["data"]["launch.sh"]
        bin_dir = top / "bin"
        bin_dir.mkdir()
        (bin_dir / "saves.py").write_text(_SAVES)
        fifos = [top / "requests", top / "replies"]
        for f in fifos:
            os.mkfifo(f)
            f.chmod(0o666)
        # launch.sh runs `rl train CONFIG --run-dir RUN_DIR ...`
        (bin_dir / "rl").write_text(f'#!/bin/bash\nexec {python} {bin_dir}/saves.py "$4" {fifos[0]} {fifos[1]}\n')
        (bin_dir / "rl").chmod(0o755)
        run_dir = data / "runs" / "myrun"  # the release's name where run.name is unset
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": _pythonpath(), "RL_RUN_UMASK": "0002"}
        worker = subprocess.Popen([*_ROOT_WORKER, sys.executable, "-c", _WORKER, *map(str, fifos)], env=env,
                                  stderr=subprocess.PIPE, text=True)
        proc = subprocess.run([*head, "bash", "-c", script], env=env,
                              capture_output=True, text=True, timeout=120)
        worker.wait(timeout=60)
        assert proc.returncode == 0 and "saved 1000" in proc.stdout, proc.stdout + proc.stderr
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_2"]  # iter_1 deleted by uid 1000
        shard = run_dir / "checkpoints" / "iter_2" / "shards" / "__0_0.shard"
        assert shard.stat().st_uid == 0 and shard.stat().st_gid == 1000 and (run_dir / "checkpoints" / "iter_2" /
                                                                              "complete.json").is_file()
        assert (run_dir / "final").stat().st_uid == 0 and (run_dir / "final" / "tokenizer.json").stat().st_uid == 1000
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.serial
def test_d18_launch_sh_stops_a_run_past_its_deadline_and_bounds_the_attempt(tmp_path):
    data = tmp_path / "data"
    script = run_configmap(render(sets=(f"storage.mountPath={data}", "rayJob.activeDeadlineSeconds=600",
                                        "sandbox.enabled=false")))["data"]["launch.sh"]
    env, calls = stand_ins(tmp_path, deadline=-5)
    proc = bash(script, env)  # its messages go to the attempt's console: the job's log, and the log on the claim
    assert proc.returncode == 1 and "deadline (rayJob.activeDeadlineSeconds 600 s from its first attempt) has passed" \
        in proc.stdout
    assert calls.read_text().splitlines() == [
        f"python3 -m rl.launch deadline myrun --namespace rl --limit 600 --run-dir {data}/runs/myrun"]
    env, calls = stand_ins(tmp_path, deadline=1)
    (tmp_path / "bin" / "rl").write_text("#!/bin/bash\nexec sleep 30\n")  # a run that would outlive its deadline
    t0 = time.monotonic()
    proc = bash(script, env)
    assert proc.returncode == 124 and time.monotonic() - t0 < 20  # timeout's status: the attempt failed


def test_d11_launch_sh_uploads_the_newest_checkpoint_always_and_final_on_success(tmp_path):
    data = tmp_path / "data"
    sets = (f"storage.mountPath={data}", "storage.export.uri=gs://results/run", "storage.export.checkpoints=true",
            "storage.export.credentialsSecret=creds", "sandbox.enabled=false")
    script = run_configmap(render(sets=sets))["data"]["launch.sh"]
    run_dir = data / "runs" / "myrun"
    for status in (0, 1):
        env, calls = stand_ins(tmp_path)
        calls.unlink(missing_ok=True)
        assert bash(script, {**env, "TRAIN_STATUS": str(status)}).returncode == status
        box = f"python3 -m engines.model.io.upload_service request {run_dir}/.exports"
        ckpt = f"{box} {run_dir}/checkpoints gs://results/run/checkpoints --newest-checkpoint"
        final = f"{box} {run_dir}/final gs://results/run/final"
        assert calls.read_text().splitlines()[1:] == [ckpt, *([final] if status == 0 else [])]


# --- the pods' shell commands ---------------------------------------------------------------------------------------

def test_d2_a_worker_whose_memlock_is_not_unlimited_stops_with_one_line():
    docs = render(sets=("workerGroups[0].name=w", "workerGroups[0].replicas=1", "workerGroups[0].cpu=2000m",
                        "workerGroups[0].memory=16Gi", "workerGroups[0].memlock=node"))
    cmd = init_command(docs, "check-memlock", "ray-worker w")
    proc = subprocess.run(["sh", "-c", f"ulimit -l 64; exec {shlex.join(cmd)}"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "NODE_NAME": "gpu-3"})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "RLIMIT_MEMLOCK is 64 KiB on node gpu-3, not unlimited" in proc.stderr
    assert "LimitMEMLOCK=infinity" in proc.stderr


def test_d12_the_head_stops_on_a_volume_uid_1000_cannot_write():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to try the check as another uid")
    base = Path(tempfile.mkdtemp(prefix="rl-k8s-volume-", dir="/tmp"))
    try:
        base.chmod(0o755)
        volume = base / "data"
        volume.mkdir(mode=0o755)  # root's, as an NFS export that ignores fsGroup
        cmd = init_command(render(sets=(f"storage.mountPath={volume}",)), "check-volume")
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        # the init container's own environment: this process's may carry LD_PRELOAD (vLLM's CPU build sets one to a
        # library under the checkout, which uid 65534 may not read, and the loader's complaint is one more line)
        env = {"PATH": "/usr/bin:/bin"}
        proc = subprocess.run(as_nobody, capture_output=True, text=True, env=env)
        assert proc.returncode == 1 and "not writable by uid 65534 (owner: 0:0)" in proc.stderr
        assert "set storage.fixOwnership=true" in proc.stderr and proc.stderr.count("\n") == 1
        os.chown(volume, 65534, 65534)  # what the volume-owner init container does for uid 1000
        assert subprocess.run(as_nobody, capture_output=True, text=True, env=env).returncode == 0
    finally:
        shutil.rmtree(base)


def test_d9_the_head_stops_when_the_image_has_another_ray_than_ray_version():
    for version, status in ((ray.__version__, 0), ("2.49.0", 1)):
        cmd = init_command(render(sets=(f"rayJob.rayVersion={version}",)), "check-image")
        proc = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True)
        assert proc.returncode == status, proc.stderr
    assert f"the image colocated-rl:cpu has Ray {ray.__version__}, rayJob.rayVersion says 2.49.0" in proc.stderr


@pytest.mark.serial
def test_d6_prestop_asks_the_run_for_a_checkpoint_and_waits_while_it_lives(tmp_path):
    data = tmp_path / "data"
    cmd = head_spec(render(sets=(f"storage.mountPath={data}",)))["containers"][0]["lifecycle"]["preStop"]["exec"][
        "command"]
    run_dir = data / "runs" / "myrun"
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    assert subprocess.run(cmd, timeout=30).returncode == 0 and time.monotonic() - t0 < 5
    assert not (run_dir / "stop-requested").exists()  # no run: nothing asked, nothing waited for
    for answer in ("stop-requested", ".running"):  # the run checkpointed and answered, or it ended
        (run_dir / ".running").touch()

        def run_answers(name: str = answer) -> None:
            while not (run_dir / "stop-requested").exists():
                time.sleep(0.05)
            request = (run_dir / "stop-requested").read_text()
            assert request.split()[0] == os.uname().nodename
            time.sleep(1)
            (run_dir / name).unlink()

        thread = threading.Thread(target=run_answers)
        thread.start()
        t0 = time.monotonic()
        assert subprocess.run(cmd, timeout=60).returncode == 0
        thread.join()
        assert 1 <= time.monotonic() - t0 < 10
        (run_dir / "stop-requested").unlink(missing_ok=True)
        (run_dir / ".running").unlink(missing_ok=True)
    # N7: a .running left by a head that was killed (OOM) goes stale: no later pod's preStop waits out its grace on it
    (run_dir / ".running").touch()
    os.utime(run_dir / ".running", (time.time() - 120, time.time() - 120))
    t0 = time.monotonic()
    assert subprocess.run(cmd, timeout=30).returncode == 0 and time.monotonic() - t0 < 5
    assert not (run_dir / "stop-requested").exists()


def test_n10_a_ray_pods_logs_are_kept_on_the_claim_when_it_goes(tmp_path):
    """Ray's logs lived only in the kubelet's rotation, gone with the pod (KubeRay deletes every pod when the run ends):
    the preStop copies this pod's (files under 256 MB) to <run dir>/logs/ray/<pod>, whether or not a run lives."""
    data = tmp_path / "data"
    cmd = head_spec(render(sets=(f"storage.mountPath={data}",)))["containers"][0]["lifecycle"]["preStop"]["exec"][
        "command"]
    logs = tmp_path / "ray-logs"
    (logs / "old").mkdir(parents=True)
    (logs / "raylet.out").write_text("raylet started\n")
    (logs / "old" / "worker-1.err").write_text("Traceback: the NCCL timeout\n")
    with open(logs / "huge.log", "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MB long, nothing written
    run_dir = data / "runs" / "myrun"
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    assert subprocess.run(cmd, env={**os.environ, "RL_RAY_LOGS": str(logs)}, timeout=30).returncode == 0
    assert time.monotonic() - t0 < 5
    kept = run_dir / "logs" / "ray" / os.uname().nodename
    assert (kept / "raylet.out").read_text() == "raylet started\n"
    assert (kept / "old" / "worker-1.err").read_text() == "Traceback: the NCCL timeout\n"
    assert not (kept / "huge.log").exists()


@pytest.mark.serial
def test_n7_launch_sh_keeps_running_fresh_while_the_run_lives_and_removes_it_after(tmp_path):
    """The heartbeat that tells a preStop the run is alive: touched every 10 s by the attempt, gone when it ends."""
    data = tmp_path / "data"
    script = run_configmap(render(sets=(f"storage.mountPath={data}", "sandbox.enabled=false")))["data"]["launch.sh"]
    env, _ = stand_ins(tmp_path)
    marker = data / "runs" / "myrun" / ".running"
    (tmp_path / "bin" / "rl").write_text(f'#!/bin/bash\nsleep 1; a=$(stat -c %Y {marker}); sleep 11; '
                                         f'b=$(stat -c %Y {marker}); echo "beats $a $b"\n')
    proc = bash(script, env)
    assert proc.returncode == 0, proc.stderr
    a, b = map(int, proc.stdout.split("beats ")[1].split())
    assert b - a >= 9 and not marker.exists()  # touched while the run lived, removed when it ended


def test_n7_a_grace_period_too_short_for_one_save_is_refused():
    """preStop sized from the model's bytes and the storage's measured write rate (what the run prints per save)."""
    args = ["template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", "--set-json",
            "model.parametersBillions=8.2", "--set-json", "disruption.saveGBps=0.2"]
    proc = helm(*args, check=False)
    assert proc.returncode != 0 and ("disruption.terminationGracePeriodSeconds 300 leaves 290 s for the checkpoint a "
                                     "stopped pod asks for, but one of 8.2B parameters (about 90 GB") in proc.stderr
    assert "takes about 451 s: set terminationGracePeriodSeconds to at least 491" in proc.stderr
    assert helm(*args, "--set", "disruption.terminationGracePeriodSeconds=600").returncode == 0


def test_n7_each_save_says_its_rate(tmp_path):
    import io

    from rich.console import Console

    from rl.loop.controller import save_line

    (tmp_path / "iter_000004" / "trainer").mkdir(parents=True)
    (tmp_path / "iter_000004" / "trainer" / "__0_0.distcp").write_bytes(b"x" * 3_000_000)
    (tmp_path / "iter_000004" / "state.json").write_bytes(b"y" * 1_000_000)
    out = io.StringIO()
    save_line(tmp_path / "iter_000004", 2.0, Console(file=out, width=200))
    assert out.getvalue().strip() == "checkpoint iter_000004: 0.00 GB saved in 2.0 s (0.002 GB/s)"


# --- the API: deadline, operator, backend ---------------------------------------------------------------------------

@pytest.fixture
def api(tmp_path, monkeypatch):
    with KubeApiStandIn() as standin:
        kubeconfig(tmp_path, monkeypatch, standin.url)
        yield standin


def test_d18_the_deadline_counts_from_the_first_attempt_of_a_rayjob(api, tmp_path):
    api.seed(RAYJOBS, rayjob("quickstart"))
    kube = Kube("rl")
    assert seconds_left("quickstart", 600, tmp_path, kube=kube, now=1000.0) == 600
    assert seconds_left("quickstart", 600, tmp_path, kube=kube, now=1450.0) == 150  # a retry: the same origin
    api.objects.pop((RAYJOBS, "rl", "quickstart"))
    with pytest.raises(CommandFailed, match="no RayJob rl/quickstart"):
        seconds_left("quickstart", 600, tmp_path, kube=kube)
    api.seed(RAYJOBS, rayjob("quickstart"))  # rl launch --replace: a new RayJob, a new uid, a fresh limit
    assert seconds_left("quickstart", 600, tmp_path, kube=kube, now=5000.0) == 600
    proc = subprocess.run([sys.executable, "-m", "rl.launch", "deadline", "quickstart", "-n", "rl", "--limit", "600",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and int(proc.stdout) < -3000  # counted from 5000 s after the epoch
    proc = subprocess.run([sys.executable, "-m", "rl.launch", "deadline", "gone", "--limit", "60", "--run-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1 and proc.stderr.startswith("error: no RayJob rl/gone")


def test_d1_rl_launch_refuses_an_operator_namespace_where_no_operator_runs(api, capsys):
    """The head admits the operator from head.networkPolicy.operatorNamespace only; one named wrong would leave the
    RayJob without a status: rl launch looks where the operator's pods are."""
    labels = {"app.kubernetes.io/name": "kuberay-operator"}
    operator = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "kuberay-operator-0", "namespace": "kuberay", "labels": labels},
                "spec": {"containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}}
    api.seed("api/v1/pods", operator)
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl"]) == 2
    err = capsys.readouterr().err
    assert "head.networkPolicy.operatorNamespace is default, but the KubeRay operator's pods" in err
    assert "run in kuberay" in err and (RAYJOBS, "rl", "quickstart") not in api.objects


def test_n2_rl_launch_refuses_token_auth_that_the_installed_rayjob_crd_would_drop(api, capsys):
    """KubeRay 1.2.2's CRD has no authOptions: the API server would prune it without a word and the run's Jobs API
    would take no token. rl launch reads the installed CRD (the real ones, tests/data/crds) and refuses in one line;
    with KubeRay 1.7.0's it goes on (to the install, which needs a real API server)."""
    from tests.k8s_validation import CRD_DIR

    api.seed("api/v1/pods", operator_pod("default", {"app.kubernetes.io/name": "kuberay-operator"}))
    sets = ["--set", "rayJob.rayVersion=2.60.0"]  # token authentication on by default
    for release, refused in (("v1.2.2", True), ("v1.7.0", False)):
        with (CRD_DIR / "kuberay" / release / "ray.io_rayjobs.yaml").open() as f:
            crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        crd["metadata"]["namespace"] = ""
        api.seed("apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        code = rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl", *sets])
        err = capsys.readouterr().err.strip()
        if refused:
            assert code == 2 and "\n" not in err and err.startswith("error: Ray's token authentication is on") \
                and "has no authOptions (KubeRay < 1.6)" in err, err
        else:
            assert code == 1 and "helm install failed" in err, err
    # without token authentication nothing is read
    reads = len([r for r in api.requests if "customresourcedefinitions" in r.path])
    rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl"])
    assert len([r for r in api.requests if "customresourcedefinitions" in r.path]) == reads


def test_an_account_that_may_not_read_cluster_wide_gets_a_note_for_each_check_and_goes_on(api, capsys):
    """Listing pods in every namespace and reading a CRD are cluster-wide reads a namespaced account may lack: both
    checks say so and the launch goes on (to the install, which needs a real API server)."""
    api.forbidden.add(("GET", ""))  # every cluster-scoped read: all namespaces' pods, the CRD
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl", "--set", "rayJob.rayVersion=2.60.0"]) == 1
    captured = capsys.readouterr()
    assert "note: cannot list pods cluster-wide (forbidden) to check that the KubeRay operator" in captured.out
    assert "note: cannot read the RayJob CRD (forbidden)" in captured.out and "helm install failed" in captured.err


def test_n8_rl_launch_finds_a_kustomize_installed_operator_and_refuses_a_cluster_without_one(api, capsys):
    """KubeRay's kustomization labels its pods name=kuberay (component=kuberay-operator) in ray-system: the head's
    policy admits them there, and rl launch finds them; with no operator at all it refuses in one line (the RayJob
    would hold its GPUs and never start) where it only warned."""
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no KubeRay operator runs in this cluster (no pod labelled "
                          "app.kubernetes.io/name=kuberay-operator or app.kubernetes.io/component=kuberay-operator")
    assert "\n" not in err and (RAYJOBS, "rl", "quickstart") not in api.objects
    api.seed("api/v1/pods", operator_pod("ray-system", {"app.kubernetes.io/name": "kuberay",
                                                        "app.kubernetes.io/component": "kuberay-operator"}))
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl"]) == 2
    assert "head.networkPolicy.operatorNamespace is default, but the KubeRay operator's pods " \
           "(app.kubernetes.io/name=kuberay-operator or app.kubernetes.io/component=kuberay-operator) run in " \
           "ray-system" in capsys.readouterr().err
    # named there, the check passes: the install itself needs a real API server (helm's discovery)
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "-n", "rl", "--set",
                    "head.networkPolicy.operatorNamespace=ray-system"]) == 1
    assert "helm install failed" in capsys.readouterr().err


def _session_backend(api: KubeApiStandIn, namespace: str) -> KubernetesBackend:
    options = KubernetesOptions(namespace=namespace, agent_image="rl-runtime:test", default_image="task:default",
                                runtime_class="none", labels={"colocated-rl/run": "myrun",
                                                              "colocated-rl/run-namespace": "rl"})
    return KubernetesBackend(options=options, api_client=api.api_client(), reap_interval_s=0, ready_timeout_s=20)


def test_d5_the_backend_runs_sessions_under_the_charts_policy_and_makes_none(api):
    """The chart's Role lets the service read NetworkPolicies, not make them: the backend finds the chart's and
    starts sessions; with none there, it starts none."""
    docs = render()
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"].get("namespace")]
    api.forbidden.add(("POST", "networkpolicies"))
    backend = _session_backend(api, policy["metadata"]["namespace"])
    try:
        with pytest.raises(SandboxError, match="no NetworkPolicy in rl-myrun-sandbox denies"):
            backend.create_session()
        assert api.count("POST") == 0  # no pod without the policy
        api.policies[(policy["metadata"]["namespace"], policy["metadata"]["name"])] = policy
        session = backend.create_session()
        assert session.exec(["echo", "ok"], Limits()).stdout == b"ok\n"
        assert api.count("POST") == 1 and [r.method for r in api.requests if r.resource == "networkpolicies"] == [
            "GET", "POST", "GET"]  # listed, the create refused (403), listed again: found
    finally:
        backend.close()


def test_d4_an_expired_lease_is_collected_only_by_replicas_of_the_same_run(api):
    """Leases (and the pods they stand for) of a run of the same name in another namespace are not its own."""
    labels = {"colocated-rl/run": "myrun"}
    dead = OwnerLease(api.api_client(), "sessions", "a-0", {**labels, "colocated-rl/run-namespace": "team-a"}, 1)
    dead.renew()
    time.sleep(2.2)
    collected: list[str] = []
    other = OwnerLease(api.api_client(), "sessions", "b-0", {**labels, "colocated-rl/run-namespace": "team-b"}, 60)
    assert other.collect_orphans(lambda owner: collected.append(owner) or 0) == 0 and collected == []
    mate = OwnerLease(api.api_client(), "sessions", "a-1", {**labels, "colocated-rl/run-namespace": "team-a"}, 60)
    mate.collect_orphans(lambda owner: collected.append(owner) or 3)
    assert collected == ["a-0"]


# --- the admission policy -------------------------------------------------------------------------------------------

def _admits(vap: dict, pod: dict, user: str) -> list[str]:
    """The messages of the policy's validations that ``pod`` fails when ``user`` creates it ([] : admitted, or not
    matched), evaluated as the API server does: match conditions, then variables, then validations."""
    env = celpy.Environment()
    spec = vap["spec"]
    activation = {"object": celpy.json_to_cel(pod), "request": celpy.json_to_cel({"userInfo": {"username": user}})}
    if not all(env.program(env.compile(c["expression"])).evaluate(activation) for c in spec["matchConditions"]):
        return []
    variables = {}
    for v in spec.get("variables", []):
        variables[v["name"]] = env.program(env.compile(v["expression"])).evaluate(
            {**activation, "variables": celpy.json_to_cel(variables)})
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    return [v["message"] for v in spec["validations"]
            if not env.program(env.compile(v["expression"])).evaluate(activation)]


def _session_pod(docs: list[dict], image: str, **extra) -> dict:
    """A session pod as the chart's sandbox service would make it: the real backend's pod, from the service's
    --set=sandbox.kubernetes.* arguments (its namespace, agent image, labels, runtime class, tolerations)."""
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    given = dict(a.removeprefix("--set=sandbox.kubernetes.").split("=", 1) for a in args
                 if a.startswith("--set=sandbox.kubernetes."))
    return m.sandbox_pod(name="rl-sbx-1", namespace=given["namespace"], session_id="s1", owner="myrun-sandbox-0",
                         image=image, agent_image=given["agent_image"], labels=json.loads(given["labels"]),
                         runtime_class=given["runtime_class"], tolerations=json.loads(given.get("tolerations", "[]")),
                         **extra)


def test_d5_the_admission_policy_admits_the_backends_pods_and_nothing_that_reaches_a_secret():
    docs = render()
    vap = one(docs, "ValidatingAdmissionPolicy")
    pod = _session_pod(docs, "python:3.11-slim", token="t")
    service = "system:serviceaccount:rl:myrun-sandbox"
    assert _admits(vap, pod, service) == []
    secret_volume = {"name": "s", "secret": {"secretName": "registry-credentials"}}
    token_volume = {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}
    bad = {
        "a Secret volume": lambda p: p["spec"]["volumes"].append(secret_volume),
        "a projected token": lambda p: p["spec"]["volumes"].append(token_volume),
        "a service-account token": lambda p: p["spec"].pop("automountServiceAccountToken"),
        "another service account": lambda p: p["spec"].update(serviceAccountName="builder"),
        "a Secret in envFrom": lambda p: p["spec"]["containers"][0].update(envFrom=[{"secretRef": {"name": "x"}}]),
        "a Secret in env": lambda p: p["spec"]["initContainers"][0].update(
            env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}}]),
        "no session label": lambda p: p["metadata"]["labels"].pop(m.MANAGED_BY_LABEL),
        "privileged": lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True),
        "the node's network": lambda p: p["spec"].update(hostNetwork=True),
        "the node's kernel": lambda p: p["spec"].pop("runtimeClassName"),
        # N3: Pod Security's restricted profile, held by the policy whatever the namespace's labels
        "the node's processes": lambda p: p["spec"].update(hostPID=True),
        "the node's IPC": lambda p: p["spec"].update(hostIPC=True),
        "a host port": lambda p: p["spec"]["containers"][0]["ports"][0].update(hostPort=8000),
        "an added capability": lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"]),
        "capabilities kept": lambda p: p["spec"]["initContainers"][0]["securityContext"].pop("capabilities"),
        "root by uid": lambda p: p["spec"]["containers"][0]["securityContext"].update(runAsUser=0),
        "root allowed": lambda p: p["spec"]["initContainers"][0]["securityContext"].update(runAsNonRoot=False),
        "privilege escalation": lambda p: p["spec"]["containers"][0]["securityContext"].update(
            allowPrivilegeEscalation=True),
        "no seccomp": lambda p: [p["spec"]["securityContext"].pop("seccompProfile"),
                                 p["spec"]["containers"][0]["securityContext"].pop("seccompProfile")],
        "seccomp unconfined": lambda p: p["spec"]["initContainers"][0]["securityContext"].update(
            seccompProfile={"type": "Unconfined"}),
        "a node chosen": lambda p: p["spec"].update(nodeName="gpu-node-1"),
        "a toleration of every taint": lambda p: p["spec"].update(tolerations=[{"operator": "Exists"}]),
        "another agent image": lambda p: p["spec"]["initContainers"][0].update(image="attacker/agent:1"),
        "an image nobody allowed": lambda p: p["spec"]["containers"][0].update(image="docker:dind"),
    }
    for what, change in bad.items():
        evil = json.loads(json.dumps(pod))
        change(evil)
        assert len(_admits(vap, evil, service)) == 1, what
        assert _admits(vap, evil, "system:serviceaccount:rl-myrun-sandbox:default") == [], what  # not the service's
    # what the API server's DefaultTolerationSeconds plug-in adds before validating is admitted
    defaults = [{"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute",
                 "tolerationSeconds": 300} for k in ("not-ready", "unreachable")]
    assert _admits(vap, {**pod, "spec": {**pod["spec"], "tolerations": defaults}}, service) == []


def test_n3_the_policy_admits_what_the_chart_lets_sessions_run_and_their_tolerations():
    """Allowed images are the service's fnmatch patterns; the tolerations given to session pods are admitted."""
    sets = ("sandbox.pods.allowedImages={python:3.1?-*,registry.example.com/swe/*}",
            "sandbox.pods.tolerations[0].key=sandbox", "sandbox.pods.tolerations[0].operator=Exists",
            "sandbox.pods.tolerations[0].effect=NoSchedule")
    docs = render(sets=sets)
    vap = one(docs, "ValidatingAdmissionPolicy")
    service = "system:serviceaccount:rl:myrun-sandbox"
    for image, ok in (("python:3.11-slim", True), ("python:3.12-bookworm", True), ("python:3.9-slim", False),
                      ("registry.example.com/swe/django:4", True), ("registry.example.com/other", False),
                      ("python:3x11-slim", False)):  # the default's dot is a dot, not any character
        pod = _session_pod(docs, image)
        assert (_admits(vap, pod, service) == []) is ok, (image, _admits(vap, pod, service))
