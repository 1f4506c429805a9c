"""A reference reward endpoint for the ``endpoint`` environment (envs/reward_endpoint.py), on the standard library.

Run it, then point a run at it::

    python examples/reward_server.py --port 8900
    # config: envs: [{name: endpoint, kwargs: {url: "http://127.0.0.1:8900/reward"}, train_tasks: tasks.jsonl}]

It answers ``POST /reward`` with the schema of envs/reward_endpoint.py: the body ``{"items": [{"id", "prompt",
"messages", "response", "answer", "meta"}, ...]}`` gets ``{"rewards": [...], "infos": [...], "errors": [...]}``,
one entry per item in order. The reward here is exact match: 1.0 when the last number in the response equals the
item's answer, else 0.0; an item without an answer gets no reward (null) and an error saying why. Replace
``reward`` with your reward model or verifier.
"""

from __future__ import annotations

import argparse
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(item: dict[str, Any]) -> tuple[float | None, dict[str, Any], str | None]:
    """(reward or None, info, error) of one item."""
    if not item.get("answer"):
        return None, {}, "the item has no answer to compare with"
    numbers = NUMBER.findall(item["response"])
    got = numbers[-1] if numbers else None
    return float(got is not None and float(got) == float(item["answer"])), {"extracted": got}, None


class RewardHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if self.path != "/reward":
            return self._reply(404, {"error": f"no endpoint {self.path}; POST /reward"})
        try:
            items = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))["items"]
            if not isinstance(items, list):
                raise ValueError("'items' must be a list")
        except (ValueError, KeyError, TypeError) as e:
            return self._reply(400, {"error": f"bad request: {e}"})
        out = [reward(item) for item in items]
        return self._reply(200, {"rewards": [r for r, _, _ in out], "infos": [i for _, i, _ in out],
                                 "errors": [e for _, _, e in out]})

    def log_message(self, *args: Any) -> None:  # quiet: one line per request would flood a run's console
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900, help="0: any free port")
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), RewardHandler)
    print(f"reward endpoint on http://{args.host}:{server.server_address[1]}/reward", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
