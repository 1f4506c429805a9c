"""``rl``: the command line. Errors end with one message and no traceback: exit code 2 for a usage error (bad
arguments, config or values), 1 for a command that failed at run time (a cluster unreachable, a run missing)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rl.errors import CommandFailed, UserError

EXIT_USER_ERROR = 2  # bad input: config, flags, paths
EXIT_FAILED = 1  # a command that failed at run time (a non-finite update, failing environments, a full disk, a cluster)


def _cmd_train(args: argparse.Namespace) -> None:
    from rl.api import run
    from rl.config import load_config
    from rl.loop.checkpoint import list_checkpoints, remove_stale

    resume = bool(args.resume)
    if args.auto_resume and (args.resume or not args.config or not args.run_dir):
        raise UserError("--auto-resume needs CONFIG and --run-dir RUN_DIR, and no --resume: rl train CONFIG "
                        "--run-dir RUN_DIR --auto-resume")
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
        if args.auto_resume:  # a job that may be a retry: continue from a complete checkpoint, else start afresh
            resume = bool(list_checkpoints(run_dir))
            if not resume:
                removed = remove_stale(run_dir, incomplete=True)
                gone = f" (removed {', '.join(removed)}: saves that did not finish)" if removed else ""
                print(f"--auto-resume: no complete checkpoint in {run_dir}{gone}; starting afresh", flush=True)
        elif (run_dir / "checkpoints").exists():
            raise UserError(f"--run-dir {run_dir} already holds a run; use --resume {run_dir} to continue it "
                            "(or --auto-resume)")
    try:
        summary = run(cfg, run_dir, resume=resume)  # inside the trackers of metrics.loggers
    except OSError as e:  # a full or read-only disk while the run writes: checkpoints are written atomically
        raise CommandFailed(f"cannot write to {e.filename or run_dir}: {e.strerror or e}; the last checkpoint in "
                         f"{run_dir}/checkpoints is intact (resume with --resume {run_dir})") from None
    from rl.loop.held_out import summary_line

    print(f"run directory: {run_dir}")
    print(f"{summary_line(summary)} in {summary['iterations']} iterations, {summary['wall_s']:.0f} s")


def _cmd_check(args: argparse.Namespace) -> None:
    from rl.config import dump_config, load_config
    from rl.setup.memory import check_fits, estimate_run, kv_shortfall
    from rl.setup.warmstart import model_dir_here

    cfg = load_config(args.config, args.set)
    print(dump_config(cfg), end="")
    for warning in cfg.warnings():
        print(f"# warning: {warning}")
    here = model_dir_here(cfg)
    if cfg.model.path is not None and here is None:  # a hub repository or a bucket, not in the model cache
        print(f"# memory per worker: not estimated, {cfg.model.path} is not on this machine, fetched at start")
        return
    if cfg.cluster.ray_address is not None and here is not None and not here.exists():
        # a run for a remote cluster (rl launch): its model directory lives there, not here
        print(f"# memory per worker: not estimated, {cfg.model.path} is not on this machine "
              "(the run checks it at start)")
        return
    est, settings = estimate_run(cfg)
    for key, value, why in settings.choices:
        print(f"# {key}: {value} ({why})")
    print(f"# memory per worker ({cfg.cluster.workers} workers; activations estimated from the layer shapes):")
    print("\n".join(f"#{line}" for line in est.table().splitlines()))
    if (shortfall := kv_shortfall(cfg, est)) is not None:
        print(f"# warning: {shortfall}")
    print(f"# run directory (the claim): {est.checkpoint / 2**30:.3f} GiB per checkpoint (model and trainer state), "
          f"{est.run_dir / 2**30:.3f} GiB at most ({cfg.run.keep_checkpoints} kept, one being written, best/, final/)")
    check_fits(cfg, est)


def _cmd_fetch_model(args: argparse.Namespace) -> None:
    from engines.model.io.sources import FetchError, SourceError, fetch_model

    if args.cache is None:
        from rl.setup.warmstart import model_cache

        args.cache = model_cache()
    try:
        print(fetch_model(args.source, Path(args.cache)))
    except SourceError as e:
        raise UserError(f"rl fetch-model: {e}") from None
    except FetchError as e:
        raise CommandFailed(f"rl fetch-model: {e}") from None


def _cmd_memory_plan(args: argparse.Namespace) -> None:
    from rl.config import parse_config
    from rl.settings import model_arch
    from rl.setup.colocation import PRESETS, Colocation, colocation_plan, preset

    if args.model in PRESETS:
        arch = preset(args.model)
    elif not Path(args.model, "config.json").is_file():
        raise UserError(f"rl memory-plan: {args.model} is neither a preset ({', '.join(PRESETS)}) nor a model "
                        "directory (no config.json)")
    else:  # a native family, or any model transformers implements (described on the meta device)
        try:
            arch, _ = model_arch(parse_config({}), args.model)
        except UserError as e:
            raise UserError(f"rl memory-plan: {e}") from None
    try:
        plan = colocation_plan(arch, Colocation(gpus=args.gpus, gpu_bytes=int(args.gpu_gib * 2**30),
                                                inference_gpus=args.inference_gpus, master_dtype=args.master_dtype,
                                                compute_dtype=args.compute_dtype, rollout_dtype=args.rollout_dtype,
                                                micro_batch_tokens=args.micro_batch_tokens,
                                                activation_checkpointing=not args.no_activation_checkpointing,
                                                sleep_level=args.sleep_level, expert_parallel=args.expert_parallel,
                                                lora_rank=args.lora, quantize_base=args.qlora),
                               name=args.model)
    except ValueError as e:
        raise UserError(f"rl memory-plan: {e}") from None
    print(plan.table())


def _cmd_envs(args: argparse.Namespace) -> None:
    from envs.registry import describe

    rows = describe()
    width = max(len(name) for name, _, _ in rows)
    for name, kind, doc in rows:
        print(f"{name:<{width}}  {kind:<8}  {doc}")


def _cmd_serve(args: argparse.Namespace) -> None:
    from engines.inference.factory import VllmUnavailableError
    from engines.inference.server import serve
    from engines.model.io.hf_io import ModelDirError

    try:
        serve(args.model_dir, host=args.host, port=args.port, name=args.served_model_name, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_mb << 20, engine=args.engine,
              tensor_parallel_size=args.tensor_parallel_size, device=args.device, max_seq_len=args.max_seq_len,
              adapter=args.adapter)
    except (ModelDirError, FileNotFoundError, ValueError, VllmUnavailableError) as e:
        raise UserError(f"rl serve: {e}") from None


def _cmd_sandbox_serve(args: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from rl.config import format_errors, load_config, parse_config
    from sandbox.backend import SandboxError
    from sandbox.heap import fix_mmap_threshold
    from sandbox.server import server_from_config

    cfg = load_config(args.config, args.set) if args.config else parse_config({}, "(defaults)", args.set)
    # each flag is the section's key of that name (--max-queue: max_queue); the ones given replace the config's
    keys = ("host", "port", "backend", "concurrency", "max_queue", "max_sessions", "metrics_port", "advertise_address")
    flags = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    try:
        sc = cfg.sandbox.override(**flags)
    except ValidationError as e:
        raise UserError(format_errors(e, "(rl sandbox serve flags)", prefix="sandbox")) from None
    fix_mmap_threshold()  # this process is the service: large payloads go back to the system when freed
    try:
        server = server_from_config(sc)
    except SandboxError as e:
        raise UserError(f"rl sandbox serve: {e}") from None
    metrics = f", metrics on :{server.metrics_port}/metrics" if server.metrics_port is not None else ""
    print(f"sandbox service ({sc.backend} backend, {sc.concurrency} at once) listening on {server.address}{metrics}",
          flush=True)
    backend = server.service.backend
    if hasattr(backend, "describe"):
        print(f"enforced: {backend.describe()}", flush=True)
        for warning in backend.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    # SIGTERM (how Kubernetes, systemd and scripts stop a service) stops it as Ctrl-C does: the finally below closes
    # the sessions and removes the backend's directories, mounts and cgroups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.environ.get("RL_SANDBOX_PARENT_PID")
    if parent:  # a run's own service: it ends with the run (rl.rollout.sandbox_service)
        threading.Thread(target=_end_with, args=(int(parent),), daemon=True).start()
    try:
        server.wait()
    finally:
        server.stop()


def _cmd_sandbox_release(args: argparse.Namespace) -> None:
    from rl.launch import release_sandbox

    release_sandbox(args.deployment, namespace=args.namespace)


def _end_with(parent: int) -> None:
    """SIGTERM this process once ``parent`` is gone (its children are then adopted by another process)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _cmd_sandbox_run(args: argparse.Namespace) -> None:
    from sandbox.backend import Limits, SandboxError
    from sandbox.client import connect

    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        raise UserError("rl sandbox run needs a command after --, e.g. rl sandbox run -- python3 -c 'print(1)'")
    files = {Path(f).name: Path(f).read_bytes() for f in args.file}
    try:
        client = connect(args.address)
        r = client.run(args.command, files, limits=Limits().merged(wall_s=args.wall_s))
    except SandboxError as e:
        raise UserError(f"rl sandbox run: {e}") from None
    sys.stdout.buffer.write(r.stdout)
    sys.stderr.buffer.write(r.stderr)
    print(f"verdict: {r.verdict.value}, exit code {r.exit_code}, {r.wall_s:.3f} s"
          + (f" ({r.detail})" if r.detail else ""), file=sys.stderr)


def _cmd_filter(args: argparse.Namespace) -> None:
    from rl.config import load_config
    from rl.setup.difficulty import filter_by_difficulty

    cfg = load_config(args.config, args.set)
    r = filter_by_difficulty(cfg, Path(args.out), k=args.k, min_pass=args.min_pass, max_pass=args.max_pass,
                             limit=args.limit, seed=args.seed)
    print(f"kept {r['kept']} of {r['prompts']} prompts (pass rate over {r['k']} samples in "
          f"[{args.min_pass}, {args.max_pass}]; {r['too_easy']} too easy, {r['too_hard']} too hard) -> {r['out']}")


def _cmd_launch(args: argparse.Namespace) -> None:
    from rl.launch import LaunchOptions, launch

    out = launch(args.k8s, LaunchOptions(values=args.values, sets=args.set, name=args.name, namespace=args.namespace,
                                         dry_run=args.dry_run, replace=args.replace))
    print(out, end="")


def _cmd_status(args: argparse.Namespace) -> None:
    from rl.launch import status

    print(status(args.name, args.namespace))


def _cmd_logs(args: argparse.Namespace) -> None:
    from rl.launch import logs

    logs(args.name, args.namespace, args.follow)


def _cmd_delete(args: argparse.Namespace) -> None:
    from rl.launch import delete

    delete(args.name, namespace=args.namespace, delete_data=args.delete_data)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    p = argparse.ArgumentParser(prog="rl", description="RL post-training with colocated engines.",
                                epilog="exit codes: 0 ok, 1 the command failed, 2 usage error")
    try:
        release = version("colocated-rl")
    except PackageNotFoundError:  # run from a checkout that is not installed
        release = "unknown (not installed)"
    p.add_argument("--version", action="version", version=f"rl (colocated-rl) {release}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run (or resume) an RL run from a YAML config")
    t.add_argument("config", nargs="?", help="YAML run config, e.g. configs/quickstart.yaml")
    t.add_argument("--run-dir", help="where outputs go (default runs/NAME-TIMESTAMP)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last complete checkpoint")
    t.add_argument("--auto-resume", action="store_true",
                   help="with CONFIG and --run-dir: continue from the run directory's newest complete checkpoint if "
                        "it has one, else start afresh there (what a retried job runs)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set run.iterations=10 (repeatable)")
    t.set_defaults(func=_cmd_train)

    c = sub.add_parser("check-config", help="validate a config, print it with defaults filled in and the memory "
                                            "each worker needs; refuses one that cannot fit")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(func=_cmd_check)

    fm = sub.add_parser("fetch-model", help="download a model (hub id, s3://, gs://) into a cache once, checked and "
                                            "resumable; prints its local directory")
    fm.add_argument("source", help="a local directory, org/name or hf://org/name[@revision], s3://bucket/prefix or "
                                   "gs://bucket/prefix (credentials: HF_TOKEN, AWS_*, GOOGLE_HMAC_*)")
    fm.add_argument("--cache", help="cache directory (default $RL_MODEL_CACHE, else models/ in the rl cache)")
    fm.set_defaults(func=_cmd_fetch_model)

    mp = sub.add_parser("memory-plan", help="per-GPU memory of training + inference colocation for a model (a "
                                            "preset such as llama-7b or kimi-k2, or a model directory), on paper")
    mp.add_argument("model", help="llama-7b, qwen2.5-7b, kimi-k2, or a Hugging Face model directory")
    mp.add_argument("--gpus", type=int, default=8, help="GPUs of the run (one trainer rank each)")
    mp.add_argument("--gpu-gib", type=float, default=80, help="memory of one GPU in GiB")
    mp.add_argument("--inference-gpus", type=int, default=1,
                    help="GPUs per inference replica (1: a full replica per GPU, what the engine does today)")
    mp.add_argument("--expert-parallel", type=int, default=1,
                    help="trainer.expert_parallel: GPUs splitting each MoE layer's routed experts in training "
                         "(each computes 1/N of them and stores about 1/GPUs of them whole, the rest sharded over "
                         "all GPUs; default 1: FSDP2 alone)")
    mp.add_argument("--micro-batch-tokens", type=int, default=16384)
    mp.add_argument("--no-activation-checkpointing", action="store_true")
    mp.add_argument("--master-dtype", default="float32", choices=["float32", "bfloat16"])
    mp.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    mp.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    mp.add_argument("--sleep-level", type=int, default=2, choices=[0, 1, 2],
                    help="what the inference engine frees while the trainer runs (2: KV cache and weights)")
    mp.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="train LoRA adapters of this rank (alpha 2·rank, attention and MLP projections, AdamW) on the "
                         "frozen base (in --rollout-dtype): gradients and optimizer state of the adapters only")
    mp.add_argument("--qlora", choices=["nf4", "int8"],
                    help="with --lora on one GPU: the adapted weights quantized in the trainer "
                         "(model.lora.quantize_base)")
    mp.set_defaults(func=_cmd_memory_plan)

    s = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    s.add_argument("model_dir", help="Hugging Face-format model directory (config.json, safetensors, tokenizer.json)")
    s.add_argument("--adapter", metavar="ADAPTER_DIR",
                   help="a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) to serve on top of "
                        "MODEL_DIR, its original base: merged into the native engine's weights, vLLM's LoRA on "
                        "--engine vllm. A LoRA run's final/ is already merged: serve it without --adapter")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", help="model id clients send (default: the directory's name)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--max-num-seqs", type=int, default=256, help="most sequences decoded together")
    s.add_argument("--kv-cache-mb", type=int, default=512, help="KV-cache memory budget in MiB")
    s.add_argument("--engine", default="native", choices=["native", "vllm"], help="inference engine")
    s.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per replica (vllm)")
    s.add_argument("--device", choices=["cpu", "cuda"], help="where the native engine runs (default: cuda if present)")
    s.add_argument("--max-seq-len", type=int, help="prompt + completion tokens per sequence (default: the model's "
                                                   "context); a request without max_tokens gets the room left")
    s.set_defaults(func=_cmd_serve)

    f = sub.add_parser("filter-tasks", help="keep the training prompts of moderate difficulty for the current model "
                                            "(pass rate over k samples)")
    f.add_argument("config", help="run config: its environments' training prompts and its model")
    f.add_argument("--out", required=True, help="task file to write (.jsonl or .parquet)")
    f.add_argument("--k", type=int, default=8, help="samples per prompt")
    f.add_argument("--min-pass", type=float, default=0.125, help="drop prompts solved less often than this")
    f.add_argument("--max-pass", type=float, default=0.875, help="drop prompts solved more often than this")
    f.add_argument("--limit", type=int, help="look at the first N training prompts only")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    f.set_defaults(func=_cmd_filter)

    sub.add_parser("plan-update", add_help=False, help="predict Kimi K2's weight-update time and memory on a GPU "
                                                       "cluster (see rl plan-update --help)")

    g = sub.add_parser("swe-generate", help="make SWE tasks by injecting bugs into a pure-Python package (see "
                                            "python -m envs.swe_smith --help)", add_help=False)
    g.add_argument("args", nargs=argparse.REMAINDER)

    sb = sub.add_parser("sandbox", help="the sandbox service that runs untrusted code")
    sbs = sb.add_subparsers(dest="sandbox_command", required=True)
    sv = sbs.add_parser("serve", help="start the gRPC sandbox service (flags override the config's sandbox section)")
    sv.add_argument("--config", help="run config whose `sandbox` section to use (default: built-in defaults)")
    sv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    sv.add_argument("--host", help="address to bind (default 127.0.0.1)")
    sv.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks a free one)")
    sv.add_argument("--backend", choices=["local", "kubernetes"], help="bubblewrap here, or one pod per session")
    sv.add_argument("--concurrency", type=int, help="commands running at once (default 8)")
    sv.add_argument("--max-queue", type=int, help="waiting commands before requests are refused (default 256)")
    sv.add_argument("--max-sessions", type=int, help="open sessions allowed (default 256)")
    sv.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    sv.add_argument("--advertise-address", help="host:port clients reach this replica at, when several replicas "
                                                "serve one name (sessions stay on the replica that made them)")
    sv.set_defaults(func=_cmd_sandbox_serve)
    sd = sbs.add_parser("release", help="scale the sandbox service's Deployment to zero (a Kubernetes run's script "
                                        "does it once the run ended for good)")
    sd.add_argument("deployment", help="the sandbox service's Deployment, e.g. RELEASE-sandbox")
    sd.add_argument("-n", "--namespace", help="its namespace (default: kubectl's, or the pod's own)")
    sd.set_defaults(func=_cmd_sandbox_release)
    sr = sbs.add_parser("run", help="run one command in a fresh sandbox and print its output and verdict")
    sr.add_argument("--address", help="host:port of a running service (default: start a local one)")
    sr.add_argument("--file", action="append", default=[], help="copy this file into the sandbox (repeatable)")
    sr.add_argument("--wall-s", type=float, default=10.0, help="wall-clock limit in seconds")
    sr.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    sr.set_defaults(func=_cmd_sandbox_run)

    la = sub.add_parser("launch", help="launch a run on Kubernetes (KubeRay) with the Helm chart in helm/")
    la.add_argument("--k8s", required=True, metavar="CONFIG", help="the run config to launch")
    la.add_argument("--values", action="append", default=[], metavar="FILE",
                    help="chart values, e.g. helm/colocated-rl/examples/gpu-cluster.yaml (repeatable)")
    la.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one chart value (repeatable)")
    la.add_argument("--name", help="release and RayJob name (default: the config's run.name)")
    la.add_argument("-n", "--namespace", help="Kubernetes namespace (default: kubectl's current one)")
    la.add_argument("--dry-run", action="store_true", help="print the manifests instead of installing them")
    la.add_argument("--replace", action="store_true", help="if a run of this name exists, delete it first (its "
                                                           "checkpoints stay: the new run resumes from them)")
    la.set_defaults(func=_cmd_launch)
    st = sub.add_parser("status", help="the state of a run launched with rl launch (its RayJob and pods)")
    st.add_argument("name", help="the release name rl launch printed")
    st.add_argument("-n", "--namespace", help="Kubernetes namespace (default: kubectl's current one)")
    st.set_defaults(func=_cmd_status)
    lg = sub.add_parser("logs", help="the console of a run launched with rl launch")
    lg.add_argument("name")
    lg.add_argument("-n", "--namespace")
    lg.add_argument("-f", "--follow", action="store_true", help="keep streaming until the run ends")
    lg.set_defaults(func=_cmd_logs)
    de = sub.add_parser("delete", help="remove a run launched with rl launch: its Ray cluster, sandbox service and "
                                       "session pods (the run storage stays unless --delete-data)")
    de.add_argument("name")
    de.add_argument("-n", "--namespace")
    de.add_argument("--delete-data", action="store_true", help="also delete the run storage claim the chart made "
                                                               "(checkpoints, metrics)")
    de.set_defaults(func=_cmd_delete)

    e = sub.add_parser("envs", help="list the environments: name, built-in or plug-in, what it rewards")
    e.set_defaults(func=_cmd_envs)
    return p


def _own(e: Exception) -> Exception:
    """The error itself, where a Ray worker raised it: Ray passes it on wrapped, its text led by Ray's traceback."""
    cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError: an instance of the worker's error class too
    return cause if isinstance(cause, (UserError, CommandFailed)) else e


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["swe-generate"]:  # its own parser, options included
        from envs.swe_smith import main as generate

        return generate(argv[1:])
    if argv[:1] == ["plan-update"]:  # its own parser, options included
        from rl.setup.update_cost import main as plan_update

        command = lambda: plan_update(argv[1:])  # noqa: E731
    else:
        args = build_parser().parse_args(argv)
        command = lambda: args.func(args)  # noqa: E731
    try:
        command()
    except UserError as e:
        print(f"error: {_own(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except CommandFailed as e:
        print(f"error: {_own(e)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint is intact (resume with --resume RUN_DIR)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
