"""`ninfer` command line."""

from __future__ import annotations

import argparse
import json
import sys

from engine.args import add_engine_args, engine_config_from_args
from engine.errors import EngineError
from gateway import commands
from gateway.logs import configure_logging


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="JSON lines: one per delta, then the final stats")
    g = p.add_argument_group("through a gateway")
    g.add_argument("--gateway", default=None, metavar="HOST:PORT",
                   help="stream from a running gateway (`ninfer serve` / `ninfer gateway`) instead of in-process")
    g.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the gateway's health to say SERVING")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="deadline of the call")
    g.add_argument("--api-key", default=None, help="bearer token for the gateway (default: $NINFER_API_KEY)")


def cmd_generate(args: argparse.Namespace) -> int:
    """Offline: load the engine in this process and stream one completion to stdout.
    With --gateway: stream it from a running gateway instead."""
    if args.gateway:
        return commands.cmd_generate_remote(args)
    from engine.core import EngineCore
    from engine.loop import EngineLoop
    from engine.sampling_params import SamplingParams
    from gateway.text import StreamingText

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    loop = EngineLoop(EngineCore(engine_config_from_args(args))).start()
    try:
        tokenizer = loop.core.tokenizer
        prompt_ids = tokenizer.encode(args.prompt)
        # the gateway's text stream: holds back what could still become a stop string
        text = StreamingText(tokenizer, prompt_ids, args.stop)
        stream = loop.submit(prompt_ids, params)
        final = None
        for out in stream:
            delta = text.push(out.new_token_ids, final=out.finished)
            if out.finished:
                final = out
            _emit(args.json, delta, out.new_token_ids)
        if args.json:
            print(json.dumps({"finish_reason": final.finish_reason, "stats": final.stats}), flush=True)
        else:
            print(flush=True)
        return 0
    finally:
        loop.shutdown()


def _emit(as_json: bool, text: str, token_ids: list[int]) -> None:
    if as_json:
        print(json.dumps({"text": text, "token_ids": token_ids}), flush=True)
    elif text:
        sys.stdout.write(text)
        sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion (in this process, or from --gateway)")
    add_engine_args(gen)
    _add_sampling_args(gen)
    commands.add_log_args(gen, default_level="warning")
    gen.set_defaults(func=cmd_generate)

    engine = sub.add_parser("engine", help="serve PrefillService and DecodeService over one engine")
    add_engine_args(engine)
    commands.add_engine_service_args(engine)
    commands.add_server_args(engine, commands.DEFAULT_ENGINE_LISTEN, commands.DEFAULT_ENGINE_METRICS)
    engine.set_defaults(func=commands.cmd_engine)

    gateway = sub.add_parser("gateway", help="serve the public Gateway API in front of engine processes")
    gateway.add_argument("--engine", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                         help="engine endpoints; each request goes to the least loaded one")
    gateway.add_argument("--engine-api-key", default=None,
                         help="bearer token the engines expect (default: $NINFER_ENGINE_API_KEY)")
    commands.add_server_args(gateway, commands.DEFAULT_GATEWAY_LISTEN, commands.DEFAULT_GATEWAY_METRICS)
    gateway.set_defaults(func=commands.cmd_gateway)

    serve = sub.add_parser("serve", help="engine and gateway in one process (the embedded model unless --model)")
    add_engine_args(serve)
    commands.add_engine_service_args(serve)
    commands.add_server_args(serve, commands.DEFAULT_GATEWAY_LISTEN, commands.DEFAULT_GATEWAY_METRICS)
    serve.set_defaults(func=commands.cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(json_logs=getattr(args, "log_json", False), level=getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except (EngineError, OSError) as e:
        print(f"ninfer: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
