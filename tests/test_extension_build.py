"""A C++ extension build killed midway must not block the next process that loads the extension
(engines.inference.extension_build; the CPU decode kernel is built this way).

A real build is killed: a process loads a small extension through a compiler wrapper that holds the compile step,
and is killed (with its ninja and compiler) while the compiler runs, leaving PyTorch's build lock behind; the next
process must then build and load the extension normally, in seconds. A private ``TORCH_EXTENSIONS_DIR`` keeps the
machine's shared extension cache out of it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.inference.extension_build import BATON, build_directory, load_extension

ROOT = Path(__file__).resolve().parents[1]
#: a module that needs only Python's headers: it compiles in about a second
SOURCE = """#include <Python.h>
#define CAT(a, b) a##b
#define INIT(name) CAT(PyInit_, name)
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""
LOAD = """import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from engines.inference.extension_build import load_extension
mod = load_extension("colocated_rl_build_test", Path(sys.argv[1]), [], [])
print("loaded", mod.__file__, flush=True)
"""


def _run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), **extra}


@pytest.mark.skipif(sys.platform != "linux", reason="flock and the compiler wrapper are POSIX shell")
@pytest.mark.serial
def test_a_build_killed_midway_does_not_block_the_next_load(tmp_path, monkeypatch, caplog):
    source = tmp_path / "tiny.cpp"
    source.write_text(SOURCE)
    started = tmp_path / "compiling"
    wrapper = tmp_path / "slow-c++"
    # the compile step (not the loader's compiler probes) writes its pid, then takes its time
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo $$ > {started}; exec sleep 300;; esac\n'
                       'exec c++ "$@"\n')
    wrapper.chmod(0o755)
    first = subprocess.Popen([sys.executable, "-c", LOAD, str(source)], env=_run_env(tmp_path, CXX=str(wrapper)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text().strip()):
            assert first.poll() is None, first.stdout.read().decode()
            assert time.monotonic() < deadline, "the first build never reached its compile step"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the loader and its ninja: killed mid-build
        first.wait()
        # ninja runs each command in a process group of its own: the compile step is killed by its pid
        if started.exists() and started.read_text().strip():
            os.kill(int(started.read_text()), signal.SIGKILL)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    where = build_directory("colocated_rl_build_test", source, [], [])
    assert str(where).startswith(str(tmp_path))
    assert (where / BATON).exists()  # what made every later load wait forever

    began = time.monotonic()
    second = subprocess.run([sys.executable, "-c", LOAD, str(source)], env=_run_env(tmp_path), capture_output=True,
                            text=True, timeout=180)
    took = time.monotonic() - began
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"loaded {where}" in second.stdout
    stale = [line for line in second.stderr.splitlines() if "stale build lock" in line]
    assert len(stale) == 1 and stale[0].startswith("WARNING"), second.stderr
    assert not (where / BATON).exists()
    assert took < 120, f"the next load took {took:.0f} s"

    # loaded again, here: built already, nothing to remove or to say
    with caplog.at_level(logging.INFO, logger="engines.inference.extension_build"):
        mod = load_extension("colocated_rl_build_test", source, [], [])
    assert mod.__file__.startswith(str(where)) and not caplog.records
