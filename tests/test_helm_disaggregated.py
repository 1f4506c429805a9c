"""The chart's disaggregated runs (issue 57, item 7): worker groups with a role (trainer | rollout) render one run
whose trainer ranks go to the trainer pods and whose replicas go to the rollout pods, with the weight transfer's
settings, and refuse what could not run, in one line each. What the policies let through is in
tests/test_k8s_policy.py (the examples' matrix), the examples' CRD validation in tests/test_helm_chart.py; the
placement on a real multi-node Ray cluster is tests/test_ray_multinode.py."""

from __future__ import annotations

import pytest
import yaml

from rl.errors import UserError
from rl.launch import CHART, LaunchOptions, chart_settings, launch
from tests.test_helm_chart import HELM, QUICKSTART, helm, one, overrides, render, run_configmap, train_args

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")
CPU = CHART / "examples" / "cpu-disaggregated.yaml"
GPU = CHART / "examples" / "gpu-disaggregated.yaml"
GPU_CONFIG = QUICKSTART.parent / "qwen3-8b-gpu.yaml"


def refused(tmp_path, groups: list[dict], *sets: str) -> str:
    """helm template's error for worker groups (and --set values) the chart must refuse."""
    f = tmp_path / "groups.yaml"
    f.write_text(yaml.safe_dump({"workerGroups": groups}))
    args = [x for s in sets for x in ("--set", s)]
    proc = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", "--values",
                str(f), *args, check=False)
    assert proc.returncode != 0, "rendered, but should have been refused"
    return proc.stderr


def group(name: str, role: str, **extra) -> dict:
    return {"name": name, "role": role, "replicas": 1, "cpu": "2", "memory": "4Gi", "shmSize": "1Gi", **extra}


def test_the_cpu_example_is_one_disaggregated_run_placed_by_role():
    docs = render(CPU)
    sets = overrides(train_args(docs))
    assert (sets["cluster.placement"], sets["cluster.workers"], sets["cluster.rollout_workers"]) == \
        ("disaggregated", "1", "2")
    argv = train_args(docs)  # what rl launch validates: the chart's --set arguments, in order
    assert chart_settings(yaml.safe_dump_all(docs)) == [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    job = one(docs, "RayJob")
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert groups["trainer"]["rayStartParams"]["resources"] == '"{\\"rl_worker\\": 1}"'
    assert groups["rollout"]["rayStartParams"]["resources"] == '"{\\"rl_rollout\\": 1}"'
    assert groups["rollout"]["replicas"] == 2
    for g in groups.values():
        labels, env = g["template"]["metadata"]["labels"], g["template"]["spec"]["containers"][0]["env"]
        assert labels["colocated-rl/role"] == g["groupName"]
        # the run's bundles take the slot of their side even before the pods have joined
        assert {"name": "RL_WORKER_SLOTS", "value": "rl_worker,rl_rollout"} in [
            {k: e[k] for k in ("name", "value")} for e in env if "value" in e]
    assert "colocated-rl/role" not in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]


def test_the_notes_say_how_many_of_each_side_run():
    notes = helm("install", "--dry-run=client", "myrun", str(CHART), "-n", "rl", "--set-file",
                 f"runConfig={QUICKSTART}", "--values", str(CPU)).stdout.split("NOTES:", 1)[1]
    assert "(disaggregated: 1 trainer worker(s) and 2 rollout replica(s); checkpoints in /data/runs/myrun" in notes


def test_the_gpu_example_renders_but_rl_launch_stops_at_the_runs_own_refusal():
    """The GPU layout renders and validates (tests/test_helm_chart.py) with its rollout build and both sides' GPUs;
    the run refuses GPU workers in disaggregated placement, and rl launch says so before anything is installed."""
    docs = render(GPU, config=GPU_CONFIG)
    groups = {g["groupName"]: g for g in one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert groups["rollout"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/colocated-rl:0.1.0-cuda-vllm"
    assert groups["train"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/colocated-rl:0.1.0-cuda"
    sets = overrides(train_args(docs))
    assert (sets["cluster.workers"], sets["cluster.rollout_workers"], sets["cluster.gpus_per_worker"]) == \
        ("16", "32", "1")
    with pytest.raises(UserError, match="disaggregated runs on CPU workers for now"):
        launch(str(GPU_CONFIG), LaunchOptions(values=[str(GPU)], dry_run=True))
    assert "cluster.placement=disaggregated" in launch(str(QUICKSTART), LaunchOptions(values=[str(CPU)],
                                                                                      dry_run=True))


@pytest.mark.parametrize(("groups", "sets", "says"), [
    ([group("t", "trainer"), group("r", "rollout"), group("c", "colocated")], (),
     "workerGroups[c] is colocated beside trainer and rollout groups"),
    ([group("t", "trainer")], (), "needs a group of role rollout too"),
    ([group("r", "rollout"), group("r2", "rollout")], (), "needs a group of role trainer too"),
    ([group("t", "trainer"), group("r", "rollout", hostNetwork=True)],
     ("networkPolicy.nodeCIDRs={10.0.0.0/16}", "rayJob.rayVersion=2.60.0", "storage.accessMode=ReadWriteMany"),
     "workerGroups[1].hostNetwork with role rollout: weightTransfer.fabric is pod"),
    ([group("t", "trainer"), group("r", "rollout")], ("weightTransfer.ports.first=20000",
                                                      "weightTransfer.ports.last=20500"), "needs at least 1024 ports"),
    ([group("t", "trainer"), group("r", "rollout")], ("weightTransfer.ports.first=15000",
                                                      "weightTransfer.ports.last=25000"),
     "overlaps Ray's ports 10001-19999"),
    ([group("t", "trainer"), group("r", "rollout")], ("weightTransfer.ports.first=51000",
                                                      "weightTransfer.ports.last=53000"),
     "overlaps Ray's ports 52365-52365"),
    ([group("t", "trainer"), group("r", "rollout", image={"repository": "r.example.com/x"})], (),
     "workerGroups[1].image.repository r.example.com/x needs a tag or a digest"),
    ([group("t", "trainer"), group("r", "rollout", gpus=1)], ("storage.accessMode=ReadWriteMany",),
     "workerGroups mix GPU groups"),
])
def test_what_a_disaggregated_run_cannot_be_is_refused_in_one_line(tmp_path, groups, sets, says):
    err = refused(tmp_path, groups, *sets)
    assert says in err, err


def test_a_colocated_run_is_unchanged_by_roles():
    """No group with a role: no placement, no rollout slot, no sysctl, no rollout budget or policy."""
    docs = render()
    sets = overrides(train_args(docs))
    assert "cluster.placement" not in sets and "cluster.rollout_workers" not in sets
    assert not [d for d in docs if d["metadata"]["name"] in ("myrun-rollout", "myrun-ray-rollout")]
    [g] = one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert "sysctls" not in g["template"]["spec"]["securityContext"]
    assert "rl_rollout" not in run_configmap(docs)["data"]["launch.sh"]
