"""What can be checked of the runtime images without building them (no Docker here): docker/Dockerfile.cpu and
docker/Dockerfile.cuda parse, install the project the README's way, put the venv on PATH, carry what KubeRay and the
sandbox's Kubernetes backend need, and .dockerignore keeps the host's venv and generated files out of the context."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

from sandbox import k8s_manifests as m

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "cuda": ROOT / "docker" / "Dockerfile.cuda"}
KNOWN = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "EXPOSE", "CMD", "ENTRYPOINT", "LABEL",
         "SHELL", "HEALTHCHECK", "VOLUME", "STOPSIGNAL", "ONBUILD"}
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


# --- a small Dockerfile reader --------------------------------------------------------------------------------------

@dataclass
class Instruction:
    cmd: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their arguments; a trailing backslash continues a line, comment lines (also inside a
    continuation, as Docker reads them) and blank lines are dropped."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue
        if not parts:
            start = n
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].rstrip())
            continue
        parts.append(stripped)
        joined = " ".join(p for p in parts if p)
        parts = []
        cmd, _, args = joined.partition(" ")
        out.append(Instruction(cmd.upper(), args.strip(), start))
    assert not parts, "the file ends inside a continued line"
    return out


_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def substitute(text: str, env: dict[str, str]) -> str:
    """``$VAR`` and ``${VAR}`` replaced by their values; unknown ones left as they are (a shell's own variables)."""
    return _VAR.sub(lambda mo: env.get(mo.group(1) or mo.group(2), mo.group(0)), text)


def _key_values(args: str) -> dict[str, str]:
    """``ENV``/``ARG`` arguments: ``K=V K2="V 2"`` or the legacy ``K V``."""
    words = shlex.split(args)
    if "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


@dataclass
class Image:
    """The effect of a single-stage Dockerfile's instructions, with ARG defaults and ENV values substituted."""

    base: str = ""
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    runs: list[tuple[str, str]] = field(default_factory=list)  # (workdir, shell command)
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, absolute destination)
    steps: list[tuple[str, str]] = field(default_factory=list)  # ("RUN" | "COPY" | "ENV", text) in order
    user: str = "root"
    cmd: list[str] | None = None
    stages: int = 0


def read_image(path: Path) -> Image:
    img = Image()
    global_args: dict[str, str] = {}
    args: dict[str, str] = {}
    for ins in parse_dockerfile(path.read_text()):
        assert ins.cmd in KNOWN, f"{path.name}:{ins.line}: unknown instruction {ins.cmd}"
        scope = {**args, **img.env}
        if ins.cmd == "ARG":
            name, _, default = ins.args.partition("=")
            if img.stages == 0:
                global_args[name] = default
            else:  # a global ARG is visible in a stage only when declared again there
                args[name] = default if "=" in ins.args else global_args.get(name, "")
        elif ins.cmd == "FROM":
            img.stages += 1
            img.base = substitute(ins.args.split()[0], global_args)
        elif ins.cmd == "ENV":
            for k, v in _key_values(ins.args).items():
                img.env[k] = substitute(v, scope)
                img.steps.append(("ENV", f"{k}={img.env[k]}"))
        elif ins.cmd == "WORKDIR":
            img.workdir = str(PurePosixPath(img.workdir) / substitute(ins.args, scope))
        elif ins.cmd == "RUN":
            command = substitute(ins.args, scope)
            img.runs.append((img.workdir, command))
            img.steps.append(("RUN", command))
        elif ins.cmd in ("COPY", "ADD"):
            words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            *sources, dest = (substitute(w, scope) for w in words)
            dest_path = str(PurePosixPath(img.workdir) / dest)
            img.copies.append((sources, dest_path))
            img.steps.append(("COPY", f"{' '.join(sources)} -> {dest_path}"))
        elif ins.cmd == "USER":
            img.user = ins.args
        elif ins.cmd == "CMD":
            img.cmd = json.loads(ins.args)
    return img


def _makefile_default(name: str) -> str:
    match = re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"the Makefile sets no default for {name}"
    return match.group(1).strip()


def _step_index(img: Image, kind: str, pattern: str) -> int:
    """The position of the first step of ``kind`` whose text matches ``pattern``."""
    for i, (k, text) in enumerate(img.steps):
        if k == kind and re.search(pattern, text):
            return i
    raise AssertionError(f"no {kind} step matches {pattern!r}")


def _apt_packages(img: Image) -> set[str]:
    pkgs: set[str] = set()
    for _, command in img.runs:
        for mo in re.finditer(r"apt-get install ([^&;|]+)", command):
            pkgs |= {w for w in mo.group(1).split() if not w.startswith("-")}
    return pkgs


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def image(request) -> tuple[str, Image]:
    return request.param, read_image(DOCKERFILES[request.param])


# --- the reader itself ----------------------------------------------------------------------------------------------

def test_reader_joins_continuations_skips_comments_and_resolves_args(tmp_path):
    df = tmp_path / "Dockerfile"
    df.write_text("# syntax=docker/dockerfile:1\nARG BASE=python:3.12-slim\nFROM ${BASE}\nARG V=1.0\n"
                  "WORKDIR /app\nENV PATH=/app/.venv/bin:$PATH\nRUN echo a \\\n    # a comment inside\n"
                  "    && pip install x==$V\nCOPY . .\nCMD [\"rl\", \"--help\"]\n")
    img = read_image(df)
    assert img.base == "python:3.12-slim"
    assert img.runs == [("/app", "echo a && pip install x==1.0")]
    assert img.env["PATH"] == "/app/.venv/bin:$PATH"
    assert img.copies == [(["."], "/app")]
    assert img.cmd == ["rl", "--help"]


# --- the Dockerfiles ------------------------------------------------------------------------------------------------

def test_single_stage_with_a_non_secret_default_command(image):
    _, img = image
    assert img.stages == 1
    assert img.cmd and img.cmd[0] == "rl", "the default CMD should show the CLI, not start a job"
    assert not any(re.search(r"(?i)(token|password|secret)=", v) for v in img.env.values())


def test_installs_the_project_with_make_setup_from_the_copied_tree(image):
    kind, img = image
    setups = [(wd, c) for wd, c in img.runs if re.search(r"\bmake setup\b", c)]
    assert len(setups) == 1, f"{kind}: the project is installed once, by `make setup`"
    workdir, command = setups[0]
    assert workdir == "/app"
    copy_all = _step_index(img, "COPY", rf"^\. -> {workdir}$")
    assert copy_all < _step_index(img, "RUN", r"\bmake setup\b"), "`make setup` needs the whole tree"
    # the same torch pin as the Makefile (the tests' version), whatever build it is
    spec = re.search(r"TORCH_SPEC=\"?([^\"\s]+)", command)
    assert spec is None or spec.group(1) == _makefile_default("TORCH_SPEC")


def test_torch_is_preinstalled_into_the_venv_that_make_setup_uses(image):
    kind, img = image
    venv = _makefile_default("VENV")
    torch_spec = _makefile_default("TORCH_SPEC")
    torch_step = _step_index(img, "RUN", rf"{re.escape(venv)}/bin/pip install .*{re.escape(torch_spec)}")
    assert _step_index(img, "RUN", rf"-m venv {re.escape(venv)}\b") <= torch_step
    assert torch_step < _step_index(img, "RUN", r"\bmake setup\b")
    index = re.search(r"--index-url \"?([^\"\s]+)", img.steps[torch_step][1])
    if kind == "cpu":  # PyPI's Linux torch is the CUDA build: several GB this image would never use
        assert index and index.group(1) == CPU_TORCH_INDEX
    else:
        assert index is None or index.group(1) != CPU_TORCH_INDEX


def test_the_venv_comes_first_on_path_also_in_login_shells(image):
    _, img = image
    venv_bin = str(PurePosixPath("/app") / _makefile_default("VENV") / "bin")
    assert img.env["PATH"].split(":")[0] == venv_bin
    # KubeRay before 1.4 runs `bash -lc`, whose /etc/profile resets PATH and then reads /etc/profile.d/*.sh
    profile = [c for _, c in img.runs if "/etc/profile.d/" in c]
    assert profile and f"export PATH={venv_bin}:" in profile[0]


def test_system_packages_for_the_sandbox_and_kuberay(image):
    kind, img = image
    pkgs = _apt_packages(img)
    # bubblewrap, libseccomp2: the local sandbox backend; bash and wget: KubeRay's `bash -c` commands and wget probes
    # g++: the native engine's CPU decode kernel, built on first use
    needed = {"make", "bubblewrap", "libseccomp2", "bash", "wget", "g++"}
    assert needed <= pkgs, f"{kind}: missing {sorted(needed - pkgs)}"
    if not img.base.startswith("python:"):
        assert {"python3", "python3-venv"} <= pkgs, "`make setup` runs `python3 -m venv`"
    assert _step_index(img, "RUN", r"apt-get install") < _step_index(img, "RUN", r"\bmake setup\b")


def test_gpu_image_can_compile_kernels_and_defaults_to_cuda_12(image):
    """Triton builds its launcher with a C compiler and Python.h on the first torch.compile (flex_attention in the
    trainer); CUDA 12 by default, since CUDA 13 wheels need a driver (R580+) many clusters do not have yet."""
    kind, img = image
    if kind != "cuda":
        pytest.skip("the CPU image compiles nothing on a GPU")
    assert {"gcc", "libc6-dev", "python3-dev"} <= _apt_packages(img)
    assert re.match(r"nvidia/cuda:12\.", img.base), img.base
    torch_step = _step_index(img, "RUN", r"pip install --index-url")
    index = re.search(r"--index-url \"?([^\"\s]+)", img.steps[torch_step][1]).group(1)
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", index), index
    # vLLM from PyPI is built for CUDA 13: not installed by default beside a CUDA 12 torch
    setup = img.steps[_step_index(img, "RUN", r"\bmake setup\b")][1]
    assert 'VLLM_SPEC=""' in setup, setup


def test_gpu_image_has_the_rdma_userspace_nccl_loads(image):
    """NCCL's InfiniBand/RoCE transport dlopens libibverbs (with a provider for the NIC, mlx5 among them) and
    librdmacm; without them it falls back to TCP sockets for FSDP2 and the weight broadcast."""
    kind, img = image
    if kind != "cuda":
        pytest.skip("the CPU image runs no NCCL")
    assert {"libibverbs1", "ibverbs-providers", "librdmacm1", "rdma-core"} <= _apt_packages(img)


def _efa_step(img: Image) -> str:
    return img.steps[_step_index(img, "RUN", r"efa_installer\.sh")][1]


def test_gpu_image_efa_variant_is_a_build_argument(image, tmp_path):
    """EFA needs libfabric and the aws-ofi-nccl plugin, from AWS's installer: only when EFA_INSTALLER_VERSION is
    given. The step itself runs here with the default (empty) argument and must do nothing."""
    kind, img = image
    if kind != "cuda":
        pytest.skip("EFA is for the GPU image")
    step = _efa_step(img)
    assert _step_index(img, "RUN", r"efa_installer\.sh") < _step_index(img, "RUN", r"\bmake setup\b")
    # the default build: bash runs the step as Docker would, and nothing happens
    proc = subprocess.run(["bash", "-c", step], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == "" and not list(tmp_path.iterdir())
    # with a version: AWS's installer of that version, no kernel module (the node has it), and the build stops when
    # the installer brought no NCCL plugin
    text = DOCKERFILES["cuda"].read_text()
    [raw] = [i.args for i in parse_dockerfile(text) if i.cmd == "RUN" and "efa_installer.sh" in i.args]
    versioned = substitute(raw, {"EFA_INSTALLER_VERSION": "1.38.0"})
    assert "https://efa-installer.amazonaws.com/aws-efa-installer-1.38.0.tar.gz" in versioned
    assert "--skip-kmod" in versioned and "libnccl-net" in versioned and "exit 1" in versioned
    assert subprocess.run(["bash", "-n", "-c", versioned], timeout=60).returncode == 0
    library_path = img.env["LD_LIBRARY_PATH"].split(":")
    assert "/opt/amazon/ofi-nccl/lib" in library_path and "/opt/amazon/efa/lib" in library_path
    assert library_path[-1] == "${LD_LIBRARY_PATH}", "the base image's own entries (the driver's) stay"


def test_bases(image):
    kind, img = image
    if kind == "cpu":
        assert img.base.startswith("python:3.")
    else:
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", img.base), img.base


def test_ray_default_at_the_installed_ray_version(image):
    _, img = image
    step = _step_index(img, "RUN", r"ray\[default\]==\$\{?ray_version")
    assert _step_index(img, "RUN", r"\bmake setup\b") <= step
    assert re.search(r"ray_version=.*version\(.ray.\)", img.steps[step][1]), "pinned to the installed ray"


def test_runs_as_a_numeric_non_root_user(image):
    _, img = image
    assert img.user.isdigit() and img.user != "0", "runAsNonRoot needs a numeric uid"
    assert any(f"--uid {img.user}" in c for _, c in img.runs), "the user exists, with a home"


def test_cpu_image_is_the_default_agent_image():
    from rl.config import KubernetesSandboxConfig

    tag = re.search(r"docker build -f docker/Dockerfile\.cpu -t (\S+) \.", DOCKERFILES["cpu"].read_text())
    assert tag and tag.group(1) == KubernetesSandboxConfig().agent_image


# --- the sandbox pod's init container against the image layout ------------------------------------------------------

def _init_container() -> dict:
    pod = m.sandbox_pod(name="p", namespace="ns", session_id="s", owner="o", image="python:3.11-slim",
                        agent_image="colocated-rl:cpu")
    (init,) = pod["spec"]["initContainers"]
    return init


def _module_file(name: str) -> str:
    """A module's file, relative to the repository root."""
    path = name.replace(".", "/")
    return f"{path}/__init__.py" if (ROOT / path).is_dir() else f"{path}.py"


def _agent_modules() -> set[str]:
    """The files of the ``sandbox`` modules (and their packages) the in-pod agent imports, transitively."""
    seen: set[str] = set()
    todo = ["sandbox.agent"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [name.rsplit(".", 1)[0]] if "." in name else []
        tree = ast.parse((ROOT / _module_file(name)).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sandbox"):
                todo.append(node.module)
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("sandbox")]
    return {_module_file(name) for name in seen}


def test_init_container_command_resolves_in_the_image(image):
    _, img = image
    init = _init_container()
    exe = init["command"][0]
    assert exe == "python3", "the init container relies on python3 on the image's PATH"
    venv_bin = img.env["PATH"].split(":")[0]
    assert any(re.search(rf"python3 -m venv {re.escape(str(PurePosixPath(venv_bin).parent.relative_to('/app')))}\b",
                         c) for _, c in img.runs), "the venv (with bin/python3) is made where PATH points"
    # `import sandbox` finds the copied tree: the repository goes to /app and the agent's modules are not ignored
    assert any(dest == "/app" and "." in srcs for srcs, dest in img.copies)
    assert {"sandbox/__init__.py", "sandbox/agent.py"} <= _agent_modules()
    ignored = sorted(path for path in _agent_modules() if dockerignored(path))
    assert not ignored, f"the agent needs {ignored}, which .dockerignore leaves out"


def test_init_container_copy_gives_an_importable_stdlib_only_agent(tmp_path):
    """Runs the init container's own command (its destination moved to a temporary directory) with this venv's
    python3, then imports the agent from the copy the way the task image does: PYTHONPATH, no site-packages."""
    init = _init_container()
    script = init["command"][2]
    dst = f"{m.AGENT_ROOT}/sandbox"
    assert dst in script and init["volumeMounts"][0]["mountPath"] == m.AGENT_ROOT
    root = tmp_path / "agent"
    subprocess.run([sys.executable, "-c", script.replace(repr(dst), repr(str(root / "sandbox")))], check=True,
                   cwd=tmp_path, timeout=60)
    assert not list(root.rglob("__pycache__")), "bytecode of another Python must not reach the task image"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-S", "-c", "import sandbox.agent as a; print(a.__file__)"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(root)
    (main,) = m.sandbox_pod(name="p", namespace="ns", session_id="s", owner="o", image="i",
                            agent_image="a")["spec"]["containers"]
    assert {"name": "PYTHONPATH", "value": m.AGENT_ROOT} in main["env"]


# --- .dockerignore --------------------------------------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore syntax (Go filepath.Match plus ``**``), relative to the context root."""
    pattern = str(PurePosixPath(pattern.strip().lstrip("/")))
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((negated, _pattern_regex(line.lstrip("!"))))
    return rules


def dockerignored(path: str) -> bool:
    """Whether ``path`` (relative to the context) stays out of the build context: the last rule matching the path
    or one of its parent directories decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    out = False
    for negated, rx in _ignore_rules():
        if any(rx.fullmatch(c) for c in candidates):
            out = not negated
    return out


@pytest.mark.parametrize("path", [".venv/bin/python", ".venv", "runs/quickstart/metrics.jsonl", ".git/HEAD",
                                  "sandbox/proto/sandbox_pb2.py", "sandbox/proto/sandbox_pb2_grpc.py",
                                  "sandbox/proto/sandbox_pb2.pyi", "rl/__pycache__/cli.cpython-312.pyc",
                                  "colocated_rl.egg-info/PKG-INFO", ".pytest_cache/v/cache/nodeids"])
def test_dockerignore_keeps_host_state_out(path):
    assert dockerignored(path)


def test_dockerignore_keeps_every_tracked_file_the_install_needs():
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True,
                                 timeout=30).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout: {e}")
    # the files `make setup`'s rules depend on (pyproject.toml, setup.py, the .proto, ...), the README that
    # pyproject.toml names, and the packages with their data
    makefile = (ROOT / "Makefile").read_text()
    prerequisites = {w for line in re.findall(r"^[^\s#=]+:(?!=)([^\n]*)", makefile, re.M) for w in line.split()}
    needed = {w for w in prerequisites if (ROOT / w).is_file()} | {"README.md"}
    assert {"pyproject.toml", "setup.py", "sandbox/proto/sandbox.proto"} <= needed
    packages = ("rl/", "engines/", "checkpoint_engine/", "envs/", "benchmarks/", "sandbox/", "configs/")
    wanted = needed | {p for p in tracked if p.startswith(packages)}
    assert [p for p in sorted(wanted) if dockerignored(p)] == []
