"""`nanoserve` command line: serve a model repository with tritonserver, run the demo, build the tiny model.

    nanoserve serve --model-repository DIR [--http-port 8000 ...] [-- extra tritonserver args]
    nanoserve demo [--model-repository DIR] [--prompt TEXT]
    nanoserve build-tiny-model OUT_DIR
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from nanoserve import tiny_model
from nanoserve.serving import launcher, supervisor


def _serve(args, extra: list[str]) -> int:
    server = launcher.TritonServer(
        args.model_repository, args.http_port, args.grpc_port, args.metrics_port, host=args.host,
        log_verbose=args.log_verbose, exit_timeout_secs=args.exit_timeout_secs,
        disable_auto_complete_config=args.disable_auto_complete_config, extra_args=extra)
    print(f"nanoserve: tritonserver on {args.host} (HTTP {args.http_port}, gRPC {args.grpc_port}, "
          f"metrics {args.metrics_port}); Ctrl-C stops it, a dead model stub restarts it", file=sys.stderr, flush=True)
    return supervisor.serve_until_signal(server)


def _stream_module():
    root = launcher.repo_root()
    if root is None:
        raise SystemExit("nanoserve demo: needs a source checkout (client/stream.py)")
    sys.path.insert(0, str(root))
    from client import stream

    return stream


def _demo(args, _extra) -> int:
    stream = _stream_module()
    cache = Path(args.cache_dir) if args.cache_dir else launcher.default_cache_dir()
    with tempfile.TemporaryDirectory(prefix="nanoserve-demo-") as tmp:
        repository = args.model_repository
        if repository is None:
            print(f"nanoserve: using the random-weight tiny model in {cache}", file=sys.stderr)
            repository = launcher.make_model_repository(Path(tmp) / "model_repository", launcher.tiny_model(cache),
                                                        models=[args.model])
        log = cache / "demo-tritonserver.log"
        with launcher.TritonServer(repository, *launcher.free_ports(3), log_file=log) as server:
            print(f"nanoserve: starting tritonserver (log: {log})", file=sys.stderr, flush=True)
            server.wait_ready(args.timeout, models=[args.model])
            print(f"nanoserve: {args.model} ready on gRPC {server.url_grpc}\n\n{args.prompt}", end="", flush=True)
            params = stream.sampling_parameters(args.max_tokens, args.temperature, seed=args.seed)
            result = stream.stream_grpc(server.url_grpc, args.model, args.prompt, params,
                                        on_text=lambda text: print(text, end="", flush=True))
            print("\n")
            print(stream.format_stats(result, result.num_output_tokens), file=sys.stderr)
    return 0


def _build_tiny_model(args, _extra) -> int:
    return tiny_model.main([args.out_dir, "--arch", args.arch, "--seed", str(args.seed)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run tritonserver with the nanoserve backend")
    serve.add_argument("--model-repository", required=True)
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--log-verbose", type=int, default=0)
    serve.add_argument("--exit-timeout-secs", type=int, default=10)
    serve.add_argument("--disable-auto-complete-config", action="store_true")
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo", help="serve the tiny model (or a repository) and stream one completion")
    demo.add_argument("--model-repository", help="default: the tiny model in a copy of model_repository/")
    demo.add_argument("--model", default="nanoserve")
    demo.add_argument("--prompt", default="The future of AI is")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--seed", type=int)
    demo.add_argument("--cache-dir", help="where the tiny model is built once (default ~/.cache/nanoserve)")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the model to load")
    demo.set_defaults(run=_demo)

    tiny = commands.add_parser("build-tiny-model", help="write the random-weight demo checkpoint to OUT_DIR")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", choices=tiny_model.ARCHS, default="qwen3")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_build_tiny_model)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # passed through to tritonserver
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(argv)
    if extra and args.command != "serve":
        build_parser().error("extra tritonserver arguments after -- only go with `serve`")
    try:
        return args.run(args, extra)
    except KeyboardInterrupt:  # the server (if any) is already stopped by its context manager
        return 130


if __name__ == "__main__":
    sys.exit(main())
