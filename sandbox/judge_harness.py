"""The judge of a code task, run inside the sandbox: the tests run in one process, the solution in another.

Started as ``python3 -I -c <this file> judge`` with a JSON object on stdin: ``{"nonce", "tests"}``; the solution
is ``solution.py`` in the working directory. The judge (trusted) reads stdin to the end, makes itself undumpable
(so that no process of the same uid can read its memory or open its descriptors), then starts the solution's
process (untrusted), which runs ``solution.py`` as ``__main__`` and answers calls over two pipes. The judge
executes the tests with a proxy for every top-level function of the solution; a call sends the arguments and gets
back the return value (or the exception), encoded as tagged JSON that decodes only into plain data (None, bool,
int, float, complex, str, bytes, list, tuple, dict, set, frozenset), so no object of the solution ever reaches the
tests: an object that claims to equal anything cannot exist on the judge's side.

So the solution cannot end the tests early (an exit is a failed call), cannot read them (never sent, not on disk,
the judge undumpable, ptrace refused by the sandbox's seccomp filter), cannot patch what they use (``unittest``,
``assert``, ``sys.exit``: its patches live in its own process), and cannot forge the result: the judge writes it
as one line ``<nonce> <json>`` on its stdout, which the solution does not inherit, and the nonce is known only to
the judge and to the service. The solution's own output goes to the sandbox's stderr; what the tests print is
returned in the result.

Stdlib only; this file is sent as the sandbox command's source, so the sandbox needs no copy of the project.
"""

from __future__ import annotations

import base64
import builtins
import ctypes
import io
import json
import math
import os
import subprocess
import sys
import traceback
import types

MAX_MESSAGE = 64 << 20  # bytes of one encoded call or answer
MAX_DEPTH = 100  # nesting of an encoded value
MAX_PRINTED = 64 << 10  # what the tests printed, returned with the result
SOLUTION = "solution.py"  # in the command's working directory (the session's work directory, on any backend)


# ---- the value codec (both sides) -------------------------------------------------------------------------------

def encode(value, depth: int = 0):
    """Plain data as tagged JSON; anything else raises TypeError (subclasses become their builtin base)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        v = float.__float__(value)
        return v if math.isfinite(v) else {"f": repr(v)}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, complex):
        return {"c": [encode(value.real), encode(value.imag)]}
    d = depth + 1
    if isinstance(value, tuple):
        return {"t": [encode(v, d) for v in tuple.__iter__(value)]}
    if isinstance(value, list):
        return {"l": [encode(v, d) for v in list.__iter__(value)]}
    if isinstance(value, frozenset):
        return {"fs": [encode(v, d) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"s": [encode(v, d) for v in set.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, d), encode(v, d)] for k, v in dict.items(value)]}
    raise TypeError(f"a {type(value).__name__} cannot be passed between the tests and the solution (plain data "
                    "only: None, bool, int, float, complex, str, bytes, list, tuple, dict, set)")


def decode(obj, depth: int = 0):
    """Tagged JSON back to plain data; anything unexpected raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed value")
    (tag, v), = obj.items()
    d = depth + 1
    if tag == "f" and v in ("nan", "inf", "-inf"):
        return float(v)
    if tag == "b" and type(v) is str:
        return base64.b64decode(v, validate=True)
    if type(v) is not list:
        raise ValueError("malformed value")
    if tag == "c" and len(v) == 2:
        return complex(decode(v[0], d), decode(v[1], d))
    if tag in ("t", "l", "s", "fs"):
        items = [decode(x, d) for x in v]
        return {"t": tuple, "l": list, "s": set, "fs": frozenset}[tag](items)
    if tag == "d":
        out = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed value")
            out[decode(pair[0], d)] = decode(pair[1], d)
        return out
    raise ValueError("malformed value")


def _send(f, obj) -> None:
    f.write(json.dumps(obj).encode() + b"\n")
    f.flush()


def _receive(f):
    line = f.readline(MAX_MESSAGE + 1)
    if not line:
        raise EOFError
    if len(line) > MAX_MESSAGE:
        raise ValueError("message too large")
    return json.loads(line)


# ---- the solution's side (untrusted) ----------------------------------------------------------------------------

def _builtin_base(exc: BaseException) -> str:
    """The name of the first builtin exception class in the exception's hierarchy."""
    for cls in type(exc).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


def serve(requests: int, answers: int, path: str) -> None:
    """Run the solution at ``path`` as __main__, then answer calls until the judge closes the pipe."""
    import runpy

    req, out = os.fdopen(requests, "rb"), os.fdopen(answers, "wb")
    try:
        namespace = runpy.run_path(path, run_name="__main__")
    except BaseException as e:  # SystemExit included: the solution ended before the tests
        _send(out, {"load_error": f"{type(e).__name__}: {e}"[:1000]})
        raise
    functions = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("__"))
    data = {}
    for k, v in namespace.items():
        if not k.startswith("__") and not callable(v) and type(v).__name__ != "module":
            try:
                enc = encode(v)
                if len(json.dumps(enc)) < 1 << 20:
                    data[k] = enc
            except (TypeError, ValueError, RecursionError):
                pass
    _send(out, {"ready": functions, "data": data})
    while True:
        try:
            msg = _receive(req)
        except EOFError:
            return
        try:
            fn = namespace[msg["call"]]
            value = fn(*decode(msg["args"]), **decode(msg["kwargs"]))
            answer = {"value": encode(value)}
        except Exception as e:  # the function's exception goes to the tests, which may expect it
            answer = {"raise": [_builtin_base(e), f"{type(e).__name__}: {e}"[:2000]]}
        _send(out, answer)


# ---- the judge's side (trusted) ---------------------------------------------------------------------------------

class SolutionGone(BaseException):
    """The solution's process ended or broke the protocol; a BaseException so that no test can catch it."""


class Channel:
    """The judge's end of the pipes to the solution's process."""

    def __init__(self, proc: subprocess.Popen, requests, answers):
        self.proc, self.requests, self.answers = proc, requests, answers

    def gone(self, when: str) -> SolutionGone:
        try:
            code = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        how = "is still running" if code is None else f"exited with status {code}"
        return SolutionGone(f"the solution's process {how} {when}")

    def first(self) -> dict:
        try:
            msg = _receive(self.answers)
        except (EOFError, ValueError, OSError):
            raise self.gone("before the tests ran") from None
        if "load_error" in msg:
            raise SolutionGone(f"the solution failed before the tests ran: {str(msg['load_error'])[:500]}")
        if not isinstance(msg.get("ready"), list) or not isinstance(msg.get("data"), dict):
            raise SolutionGone("the solution's process broke the protocol")
        return msg

    def call(self, name: str, args: tuple, kwargs: dict):
        try:
            _send(self.requests, {"call": name, "args": encode(args), "kwargs": encode(kwargs)})
            msg = _receive(self.answers)
        except (EOFError, BrokenPipeError, OSError):
            raise self.gone(f"during a call of {name}()") from None
        except ValueError as e:
            raise SolutionGone(f"the answer of {name}() is not plain data: {e}") from None
        if type(msg) is not dict:
            raise SolutionGone(f"the answer of {name}() broke the protocol")
        if "raise" in msg and type(msg["raise"]) is list and len(msg["raise"]) == 2:
            base, text = (str(x) for x in msg["raise"])
            cls = getattr(builtins, base, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = RuntimeError
            raise cls(f"raised in the solution: {text}")
        try:
            return decode(msg["value"])
        except (KeyError, ValueError, TypeError, RecursionError) as e:
            raise SolutionGone(f"the answer of {name}() is not plain data: {e}") from None


def _undumpable() -> None:
    """PR_SET_DUMPABLE 0: processes of the same uid can no longer read our memory or open our descriptors."""
    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def judge() -> int:
    """Read the job, run the tests against the solution, write ``<nonce> <json>`` on the saved stdout."""
    job = json.loads(sys.stdin.buffer.read())
    nonce, tests = str(job["nonce"]), str(job["tests"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    result_fd = os.dup(1)  # the result channel, never inherited: dup sets close-on-exec
    os.dup2(2, 1)  # anything else written to our stdout goes to stderr
    _undumpable()
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    workdir = os.getcwd()
    proc = subprocess.Popen([sys.executable, "-c", _own_source(), "serve", str(req_r), str(ans_w),
                             os.path.join(workdir, SOLUTION)],
                            pass_fds=(req_r, ans_w), stdin=subprocess.DEVNULL, stdout=2, stderr=2, cwd=workdir)
    os.close(req_r)
    os.close(ans_w)
    channel = Channel(proc, os.fdopen(req_w, "wb"), os.fdopen(ans_r, "rb"))
    printed = io.StringIO()
    passed, reason = False, ""
    try:
        ready = channel.first()
        # the tests run as a script would: their own __main__ module (unittest.main() looks there), a plain argv
        main = types.ModuleType("__main__")
        sys.modules["__main__"], sys.argv = main, ["tests"]
        namespace = main.__dict__
        for name, value in ready["data"].items():
            namespace[str(name)] = decode(value)
        for name in ready["ready"]:
            namespace[str(name)] = _proxy(channel, str(name))
        sys.stdout = printed
        try:
            exec(compile(tests, "<tests>", "exec"), namespace)
        finally:
            sys.stdout = sys.__stdout__
        passed = True
    except SolutionGone as e:
        reason = str(e)
    except SystemExit as e:  # the tests' own exit: 0 or None is a pass, as for a test script
        passed, reason = e.code in (0, None), f"the tests exited with status {e.code}"
    except BaseException as e:
        traceback.print_exc()  # the tests' own failure, for whoever reads the run's stderr
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f" (tests line {f.lineno})" for f in reversed(tb) if f.filename == "<tests>"), "")
        reason = f"{type(e).__name__}{where}: {e}"[:1000]
    finally:
        try:
            channel.requests.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = {"passed": passed, "reason": "" if passed else reason, "printed": printed.getvalue()[-MAX_PRINTED:]}
    os.write(result_fd, f"{nonce} {json.dumps(result)}\n".encode())
    return 0 if passed else 1


def _proxy(channel: Channel, name: str):
    def call(*args, **kwargs):
        return channel.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _own_source() -> str:
    """This program's source, from its own command line (``python3 -I -c SOURCE judge``)."""
    argv = getattr(sys, "orig_argv", None)
    if argv is None:  # Python < 3.10
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0")]
    return argv[argv.index("-c") + 1]


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif mode == "judge":
        sys.exit(judge())
    else:
        sys.exit("usage: python3 -I -c SOURCE judge")
