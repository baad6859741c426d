"""The `ninfer` parser: one subcommand per job, every flag with its help and default."""

from __future__ import annotations

import argparse
import sys

from engine.errors import EngineError, InvalidArgumentError
from ninfer.cli import flags
from ninfer.cli.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="LLM inference over gRPC",
                                     formatter_class=flags.HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=flags.HelpFormatter)
        p.set_defaults(func=func, parser=p)
        return p

    gen = command("generate", "stream one completion (in this process, or from --gateway)", _generate)
    flags.add_engine_args(gen)
    flags.add_sampling_args(gen)
    g = gen.add_argument_group("through a gateway (the engine flags do not apply)")
    g.add_argument("--gateway", default=None, metavar="HOST:PORT",
                   help="stream from a running gateway (`ninfer serve` / `ninfer gateway`) instead of in-process")
    g.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the gateway's health to say SERVING")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="deadline of the call")
    g.add_argument("--api-key", default=None, help="bearer token for the gateway; visible in `ps`: prefer "
                   "--api-key-file (default: $NINFER_API_KEY_FILE, then $NINFER_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="FILE", help="read the gateway's bearer token from FILE")
    flags.add_client_tls_args(g, "--", "the gateway")
    gen.add_argument("--json", action="store_true", help="JSON lines: one per delta, then the final stats")
    flags.add_log_args(gen, default_level="warning")

    engine = command("engine", "serve PrefillService and DecodeService over one engine", _servers("cmd_engine"))
    flags.add_engine_args(engine)
    flags.add_kv_role_arg(engine)
    flags.add_server_args(engine, flags.DEFAULT_ENGINE_LISTEN, flags.DEFAULT_ENGINE_METRICS)

    gateway = command("gateway", "serve the public Gateway API in front of engine processes", _servers("cmd_gateway"))
    gateway.add_argument("--engine", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                         help="engine endpoints; each request goes to the least loaded one")
    gateway.add_argument("--max-stream-migrations", type=int, default=2, metavar="N",
                         help="times a stream may move to another engine when its engine dies or stops answering "
                              "(0 = never)")
    gateway.add_argument("--stream-stall-timeout", type=float, default=2.0, metavar="SECONDS",
                         help="a stream with no message this long probes its engine's health; no answer within "
                              "as long again: the engine is lost and the stream moves")
    gateway.add_argument("--engine-api-key", default=None,
                         help="bearer token the engines expect; visible in `ps`: prefer --engine-api-key-file "
                              "(default: $NINFER_ENGINE_API_KEY_FILE, then $NINFER_ENGINE_API_KEY)")
    gateway.add_argument("--engine-api-key-file", default=None, metavar="FILE",
                         help="read the engines' bearer token from FILE")
    flags.add_client_tls_args(gateway.add_argument_group("calls to the engines"), "--engine-", "the engines")
    flags.add_server_args(gateway, flags.DEFAULT_GATEWAY_LISTEN, flags.DEFAULT_GATEWAY_METRICS)

    serve = command("serve", "engine and gateway in one process (the embedded model unless --model)",
                    _servers("cmd_serve"))
    flags.add_engine_args(serve)
    flags.add_server_args(serve, flags.DEFAULT_GATEWAY_LISTEN, flags.DEFAULT_GATEWAY_METRICS)

    from engine.quant.quantize import build_parser as add_quantize_args
    quantize = command("quantize", "write an FP8 (128x128 blocks) or NVFP4 (ModelOpt) copy of a bf16 checkpoint",
                       _quantize)
    add_quantize_args(quantize)
    return parser


def _servers(name: str):
    def run(args: argparse.Namespace) -> int:
        from ninfer.cli import servers
        return getattr(servers, name)(args)
    return run


def _generate(args: argparse.Namespace) -> int:
    from ninfer.cli.generate import cmd_generate
    if args.gateway:
        given = flags.engine_flags_given(args.parser, sys.argv[1:] if args.argv is None else args.argv)
        if given:
            args.parser.error(f"{', '.join(given)}: engine flags do not apply with --gateway "
                              "(the gateway's engines were started with their own)")
    return cmd_generate(args)


def _quantize(args: argparse.Namespace) -> int:
    from engine.quant.quantize import run
    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    configure_logging(json_logs=getattr(args, "log_json", False), level=getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except InvalidArgumentError as e:
        # name the flag the user typed, not the engine's field behind it
        flag = flags.flag_of(args.parser, e.field)
        message = str(e)[len(e.field) + 2:] if str(e).startswith(f"{e.field}: ") else str(e)
        print(f"ninfer: {flag or e.field}: {message}", file=sys.stderr)
        return 2
    except (EngineError, OSError) as e:
        print(f"ninfer: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
