"""A CPU trainer's glibc settings (``engines.device.CPU_TRAINER_MALLOC``): freed blocks of a training step's size are
reused by the next step instead of being unmapped and faulted in again."""

import json
import os
import subprocess
import sys

from engines.device import CPU_TRAINER_MALLOC

# a step's worth of large tensors (a 64 MB logit chunk and its gradient): allocated, filled and freed,
# ten times and then four more
STEPS = """
import json, resource, torch
torch.set_num_threads(1)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # the first steps grow the heap (glibc settles within about six)
    x = torch.ones(16 << 20); y = torch.ones(16 << 20); del x, y
before = faults()
for _ in range(4):
    x = torch.ones(16 << 20); y = torch.ones(16 << 20); del x, y
print(json.dumps(faults() - before))
"""


def _faults(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_cpu_trainer_reuses_freed_memory_instead_of_faulting_it_in_again():
    plain = {k: v for k, v in os.environ.items() if k not in CPU_TRAINER_MALLOC and k != "GLIBC_TUNABLES"}
    pages = 4 * 2 * (64 << 20) // 4096  # every page of every step
    default = _faults(plain)
    tuned = _faults({**plain, **CPU_TRAINER_MALLOC})
    assert default > pages // 2, f"glibc's default faulted only {default} pages: the test shows nothing"
    assert tuned < pages // 10, f"{tuned} faults of {pages} pages (glibc's default: {default}): freed blocks were " \
        "not reused"

