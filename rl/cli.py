"""``rl``: the command line. User errors end with one message and a non-zero exit, no traceback."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rl.errors import UserError

EXIT_USER_ERROR = 2


def _cmd_train(args: argparse.Namespace) -> None:
    from rl.config import load_config
    from rl.controller import train

    if args.resume:
        run_dir = Path(args.resume)
        cfg_path = run_dir / "config.yaml"
        if not cfg_path.is_file():
            raise UserError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
        cfg = load_config(args.config or cfg_path, args.set)
    else:
        if not args.config:
            raise UserError("rl train needs a CONFIG file (or --resume RUN_DIR)")
        cfg = load_config(args.config, args.set)
        run_dir = Path(args.run_dir or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run_dir / "checkpoints").exists():
            raise UserError(f"--run-dir {run_dir} already holds a run; use --resume {run_dir} to continue it")
    summary = train(cfg, run_dir, resume=bool(args.resume))
    print(f"run directory: {run_dir}")
    print(f"held-out accuracy {summary['initial_accuracy']:.3f} -> {summary['final_accuracy']:.3f} "
          f"in {summary['iterations']} iterations, {summary['wall_s']:.0f} s")


def _cmd_check(args: argparse.Namespace) -> None:
    from rl.config import dump_config, load_config

    print(dump_config(load_config(args.config, args.set)), end="")


def _cmd_envs(args: argparse.Namespace) -> None:
    from envs import registered

    print("\n".join(registered()))


def _cmd_serve(args: argparse.Namespace) -> None:
    from engines.hf_io import ModelDirError
    from engines.server import serve

    try:
        serve(args.model_dir, host=args.host, port=args.port, name=args.served_model_name, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_mb << 20)
    except (ModelDirError, FileNotFoundError, ValueError) as e:
        raise UserError(f"rl serve: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rl", description="RL post-training with colocated engines.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run (or resume) an RL run from a YAML config")
    t.add_argument("config", nargs="?", help="YAML run config, e.g. configs/quickstart.yaml")
    t.add_argument("--run-dir", help="where outputs go (default runs/NAME-TIMESTAMP)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set run.iterations=10 (repeatable)")
    t.set_defaults(func=_cmd_train)

    c = sub.add_parser("check-config", help="validate a config and print it with defaults filled in")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(func=_cmd_check)

    s = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    s.add_argument("model_dir", help="Hugging Face-format model directory (config.json, safetensors, tokenizer.json)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", help="model id clients send (default: the directory's name)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--max-num-seqs", type=int, default=256, help="most sequences decoded together")
    s.add_argument("--kv-cache-mb", type=int, default=512, help="KV-cache memory budget in MiB")
    s.set_defaults(func=_cmd_serve)

    e = sub.add_parser("envs", help="list registered environments")
    e.set_defaults(func=_cmd_envs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint is intact (resume with --resume RUN_DIR)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
