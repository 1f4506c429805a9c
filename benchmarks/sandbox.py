"""Sandbox benchmark: short Python programs through the sandbox service against the same programs as plain processes.

    python -m benchmarks.sandbox --json                    # 256 programs, 64 at a time, local backend
    python -m benchmarks.sandbox --n 512 --concurrency 64 --json

The service runs in its own process (``rl sandbox serve``, local bubblewrap backend, as many command
slots as the client's concurrency) and is called over gRPC on loopback through ``SandboxClient.run``:
each program gets a fresh sandbox (work directory, namespaces, uid, limits) that is deleted after it.
The baseline runs the same program with the same interpreter as a plain ``subprocess.run`` from the
same number of threads. Both sides get a warm-up, then alternate for ``--rounds`` rounds; the figures
are each side's best round. ``overhead`` = baseline_execs_per_s / execs_per_s (target ≤ 1.5 at
concurrency 64 on 2 cores, with the whole-sandbox limits on); ``p99_s`` is the 99th-percentile latency
of one request through the service (``baseline_p99_s`` of one plain process); ``failures`` counts
programs that did not print the right answer or ended with another verdict than ok. ``cpu_ms`` is the
CPU time one program cost in that round (the service and everything it started, plus the client),
``baseline_cpu_ms`` the same for a plain process (the client and its children), ``cpu_overhead`` their
ratio: less disturbed by other load on the machine than the throughput, and a little below it on an
idle one, since kernel threads working for the sandboxes (network namespace clean-up) are not counted.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from sandbox.backend import Limits, Verdict
from sandbox.client import SandboxClient

PROGRAM = "import sys\nn = int(sys.argv[1])\nprint(sum(i * i for i in range(n)))\n"


def expected(i: int) -> bytes:
    """What PROGRAM prints for argument ``1000 + i``."""
    n = 1000 + i
    return f"{sum(k * k for k in range(n))}\n".encode()


def start_service(concurrency: int) -> tuple[subprocess.Popen, str]:
    """``rl sandbox serve`` on a free loopback port; returns the process and its address."""
    cmd = [sys.executable, "-m", "rl.cli", "sandbox", "serve", "--port", "0", "--concurrency", str(concurrency),
           "--max-queue", str(4 * concurrency)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"the sandbox service did not start: {line!r}")
    return proc, m.group(1).rstrip(",")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time used so far by process ``pid`` and its reaped children (/proc), or by this process and its children."""
    if pid is None:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def timed_batch(fn, n: int, concurrency: int) -> tuple[float, list[float], int]:
    """Run ``fn(i)`` for i < n on ``concurrency`` threads: (wall seconds, per-call latencies, failures)."""
    def one(i: int) -> tuple[float, bool]:
        t0 = time.perf_counter()
        try:
            ok = fn(i)
        except Exception as e:  # a failed call is a failure of the run, counted rather than fatal
            print(f"call {i} failed: {e}", file=sys.stderr)
            ok = False
        return time.perf_counter() - t0, ok

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    return time.perf_counter() - t0, [r[0] for r in results], sum(not r[1] for r in results)


def p99(xs: list[float]) -> float:
    """The 99th percentile (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256, help="programs per round and side")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()

    python = os.path.join(sys.base_prefix, "bin", "python3")  # the interpreter the sandbox runs, for fairness
    limits = Limits(wall_s=60, cpu_s=30)
    proc, address = start_service(args.concurrency)
    client = SandboxClient(address)

    def sandboxed(i: int) -> bool:
        r = client.run(["python3", "prog.py", str(1000 + i)], {"prog.py": PROGRAM}, limits=limits)
        return r.verdict == Verdict.OK and r.stdout == expected(i)

    def plain(i: int) -> bool:
        r = subprocess.run([python, "-c", PROGRAM, str(1000 + i)], capture_output=True, timeout=60)
        return r.returncode == 0 and r.stdout == expected(i)

    try:
        timed_batch(sandboxed, args.concurrency, args.concurrency)  # warm-up: page cache, gRPC threads
        timed_batch(plain, args.concurrency, args.concurrency)
        best: dict[str, tuple[float, list[float], float]] = {}
        failures = {"sandbox": 0, "baseline": 0}
        for _ in range(args.rounds):
            for side, fn in (("baseline", plain), ("sandbox", sandboxed)):
                cpu0 = cpu_seconds() + (cpu_seconds(proc.pid) if side == "sandbox" else 0.0)
                wall, lat, fail = timed_batch(fn, args.n, args.concurrency)
                cpu = cpu_seconds() + (cpu_seconds(proc.pid) if side == "sandbox" else 0.0) - cpu0
                failures[side] += fail
                if side not in best or wall < best[side][0]:
                    best[side] = (wall, lat, cpu)
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
    execs = args.n / best["sandbox"][0]
    base = args.n / best["baseline"][0]
    # three decimals: on a loaded machine a side may run 2-3 execs/s, where one decimal is a 2 % error in the ratio
    out = {"execs_per_s": round(execs, 3), "baseline_execs_per_s": round(base, 3), "overhead": round(base / execs, 3),
           "p99_s": round(p99(best["sandbox"][1]), 4), "baseline_p99_s": round(p99(best["baseline"][1]), 4),
           "cpu_ms": round(1000 * best["sandbox"][2] / args.n, 1),
           "baseline_cpu_ms": round(1000 * best["baseline"][2] / args.n, 1),
           "cpu_overhead": round(best["sandbox"][2] / best["baseline"][2], 3),
           "failures": failures["sandbox"], "baseline_failures": failures["baseline"], "n": args.n,
           "concurrency": args.concurrency, "rounds": args.rounds, "backend": "local", "cores": os.cpu_count()}
    if not args.json:
        print(f"sandbox {execs:.1f} execs/s vs plain processes {base:.1f} execs/s: overhead {base / execs:.2f}x, "
              f"p99 {out['p99_s']:.3f} s, {out['failures']} failures")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
