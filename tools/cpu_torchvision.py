"""Install a torchvision that imports beside a CPU build of torch, with nothing but pip and the standard library.

PyPI's x86_64 torchvision wheels are built against CUDA torch: their compiled ops (``_C.so``, ``image.so``) link
``libtorch_cuda.so``, which a CPU torch does not ship, and ``import torchvision`` then stops at
``operator torchvision::nms does not exist``. vLLM's vision models and transformers' image processors need only
torchvision's Python (``transforms.v2``), so this script takes PyPI's wheel of the release made for the installed
torch and repacks it without the compiled parts: ``_C.so``, ``image.so`` and the CUDA/JPEG libraries they bundle
are dropped, and the fake-tensor and autograd registrations of those ops run only when the ops exist (torchvision
already checks ``extension._has_ops()`` before any op is called, raising its own message). Detection ops (nms,
roi_align, deform_conv2d) and torchvision's own JPEG/PNG decoding are therefore unavailable; images are decoded
with Pillow.

The repacked wheel is cached under ``$XDG_CACHE_HOME/colocated-rl`` (default ``~/.cache/colocated-rl``) and
installed with ``pip install --no-deps``. A no-op when torchvision already imports (a CUDA torch with its own
torchvision, or a second run).

Usage: ``python tools/cpu_torchvision.py`` with the venv's python (``make setup`` runs it).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: files of the wheel that link CUDA torch (dropped), by path prefix inside the wheel
COMPILED = ("torchvision/_C.so", "torchvision/image.so", "torchvision.libs/")
#: the registrations of the compiled ops, imported in torchvision/__init__.py, made conditional on the ops existing
REGISTRATIONS = "    _autograd_registrations,\n    _meta_registrations,\n"
GUARDED = ("if extension._has_ops():  # repacked for a CPU torch (tools/cpu_torchvision.py): no compiled ops\n"
           "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n\n")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colocated-rl"


def torchvision_imports() -> bool:
    """Whether ``import torchvision`` works in this interpreter (checked in a child: a failed import leaves
    half-registered state behind)."""
    return subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0


def matching_release(torch_version: str) -> str:
    """The torchvision release built for ``torch_version``: torch 2.N pairs with torchvision 0.(N+15), the same
    patch level."""
    m = re.match(r"2\.(\d+)\.(\d+)", torch_version)
    if not m:
        raise SystemExit(f"cpu_torchvision: cannot pair torchvision with torch {torch_version}")
    return f"0.{int(m.group(1)) + 15}.{m.group(2)}"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(wheel: Path, out_dir: Path) -> Path:
    """``wheel`` without its compiled ops, the registrations guarded and RECORD rewritten; written to ``out_dir``
    under the same file name (the version is unchanged: it is that release's Python)."""
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        names = [n for n in src.namelist() if not n.startswith(COMPILED)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        files: dict[str, bytes] = {}
        for n in names:
            if n == record:
                continue
            data = src.read(n)
            if n == "torchvision/__init__.py":
                text = data.decode()
                if REGISTRATIONS not in text or "try:\n    from .version" not in text:
                    raise SystemExit(f"cpu_torchvision: {wheel.name}'s __init__.py is not laid out as expected")
                text = text.replace(REGISTRATIONS, "").replace("try:\n    from .version",
                                                               GUARDED + "try:\n    from .version", 1)
                data = text.encode()
            files[n] = data
    lines = [_record_line(n, d) for n, d in files.items()] + [f"{record},,"]
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for n, d in files.items():
            dst.writestr(n, d)
        dst.writestr(record, "\n".join(lines) + "\n")
    tmp.replace(out)
    return out


def main() -> None:
    if torchvision_imports():
        return
    import torch

    if torch.version.cuda is not None:
        raise SystemExit("cpu_torchvision: torchvision does not import beside a CUDA torch; install the "
                         "torchvision release built for it (pip install torchvision)")
    release = matching_release(torch.__version__)
    cache = cache_dir() / "cpu-torchvision"
    cache.mkdir(parents=True, exist_ok=True)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    cached = sorted(cache.glob(f"torchvision-{release}-{tag}-*.whl"))
    if not cached:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                            f"torchvision=={release}", "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("torchvision-*.whl"))
            cached = [repack(wheel, cache)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--force-reinstall", str(cached[0])], check=True)
    if not torchvision_imports():
        raise SystemExit(f"cpu_torchvision: torchvision {release} still does not import after the repack")
    print(f"cpu_torchvision: torchvision {release} (Python only, repacked for CPU torch {torch.__version__})")


if __name__ == "__main__":
    main()
