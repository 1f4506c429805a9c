"""Uploads from a container of their own: the only one that holds the export's credentials.

A Kubernetes run's exports (``storage.export``) run in the Ray head's ``export`` container, which alone mounts
``storage.export.credentialsSecret``; the run's own container (its driver, and any code the Jobs API runs) never sees
the keys. The two share the run directory (on the claim), and talk through a directory in it:

- ``request(box, directory, uri)`` writes ``<id>.json`` (atomically) and waits for ``<id>.result``; it gives up, in
  one line, when the server's heartbeat (the file ``serving``, touched every ``HEARTBEAT_S``) is older than
  ``STALE_S``, or still missing that long after the request: no container is serving.
- ``serve(box, allow, root)`` loads the credentials and then answers every request: an upload of a directory under
  ``root`` to a prefix under ``allow`` (``engines.model.io.uploads``; with ``newest_checkpoint``, the newest complete
  checkpoint of the directory, to ``<uri>/iter_N``); anything else is refused in one line.

``python -m engines.model.io.upload_service serve BOX --allow URI --root DIR [--credentials-dir D]`` and
``... request BOX DIRECTORY URI [--newest-checkpoint]`` are what the chart's containers run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from engines.model.io.sources import SourceError, _write_json
from engines.model.io.uploads import UploadError, load_credentials, newest_checkpoint, upload_directory

HEARTBEAT = "serving"
HEARTBEAT_S = 2.0
STALE_S = 60.0
POLL_S = 0.5


def request(box: str | Path, directory: str | Path, uri: str, newest: bool = False,
            stale_s: float = STALE_S) -> tuple[int, str]:
    """Ask the serving container to upload ``directory`` to ``uri``; returns its (status, message): 0 when done."""
    box = Path(box)
    box.mkdir(parents=True, exist_ok=True)
    rid = uuid.uuid4().hex
    _write_json(box / f"{rid}.json", {"directory": str(directory), "uri": uri, "newest_checkpoint": newest})
    result, asked = box / f"{rid}.result", time.time()
    while not result.exists():
        beat = box / HEARTBEAT
        # a server still starting has no heartbeat yet: it gets as long as a stale one would
        age = time.time() - (beat.stat().st_mtime if beat.exists() else asked)
        if age > stale_s:
            (box / f"{rid}.json").unlink(missing_ok=True)
            heartbeat = f"{age:.0f} s old" if beat.exists() else f"missing after {age:.0f} s"
            return 1, (f"no export container serves {box} (its heartbeat is {heartbeat}): the upload of {directory} "
                       f"to {uri} was not made")
        time.sleep(POLL_S)
    answer = json.loads(result.read_text())
    result.unlink()
    return int(answer["status"]), str(answer["message"])


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def handle(spec: dict, allow: str, root: Path) -> tuple[int, str]:
    """One request: refused unless its directory is under ``root`` and its uri under ``allow``; else uploaded."""
    directory, uri = Path(os.path.realpath(spec["directory"])), str(spec["uri"]).rstrip("/")
    allow = allow.rstrip("/")
    if not _within(directory, Path(os.path.realpath(root))):
        return 1, f"refused: {spec['directory']} is not under the run directories {root}"
    if uri != allow and not uri.startswith(allow + "/"):
        return 1, f"refused: {uri} is not under storage.export.uri {allow}"
    try:
        if spec.get("newest_checkpoint"):
            newest = newest_checkpoint(directory)
            if newest is None:
                return 0, f"no complete checkpoint in {directory}: nothing to upload"
            directory, uri = newest, f"{uri}/{newest.name}"
        done = upload_directory(directory, uri)
    except (UploadError, SourceError, OSError) as e:
        return 1, f"error: {e}"
    return 0, f"{directory} -> {uri}: {done.sent} file(s) sent, {done.kept} there already"


def serve(box: str | Path, allow: str, root: str | Path, stop: threading.Event | None = None) -> None:
    """Answer the requests of ``box`` until ``stop`` is set (forever in the chart's container)."""
    box, stop = Path(box), stop or threading.Event()
    box.mkdir(parents=True, exist_ok=True)

    def beat() -> None:
        while not stop.is_set():
            (box / HEARTBEAT).touch()
            stop.wait(HEARTBEAT_S)
    threading.Thread(target=beat, daemon=True).start()
    while not stop.is_set():
        for path in sorted(box.glob("*.json")):
            try:
                spec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # withdrawn meanwhile
            status, message = handle(spec, allow, Path(root))
            print(message, file=sys.stderr, flush=True)
            _write_json(path.with_suffix(".result"), {"status": status, "message": message})
            path.unlink(missing_ok=True)
        stop.wait(POLL_S)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module); a request prints the server's line and exits with its status."""
    parser = argparse.ArgumentParser(prog="python -m engines.model.io.upload_service",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="answer upload requests (the container holding the credentials)")
    s.add_argument("box")
    s.add_argument("--allow", required=True, help="the prefix every upload must go under (storage.export.uri)")
    s.add_argument("--root", required=True, help="the directory every upload must come from (the run directories)")
    s.add_argument("--credentials-dir", help="a mounted Secret whose files are the credentials' variables")
    r = sub.add_parser("request", help="ask for an upload and wait for it")
    r.add_argument("box")
    r.add_argument("directory")
    r.add_argument("uri")
    r.add_argument("--newest-checkpoint", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.credentials_dir:
            load_credentials(args.credentials_dir)
        serve(args.box, args.allow, args.root)
        return 0
    status, message = request(args.box, args.directory, args.uri, args.newest_checkpoint)
    print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
