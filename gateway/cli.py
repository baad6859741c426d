"""`ninfer` command line."""

from __future__ import annotations

import argparse
import json
import sys

from engine.args import add_engine_args, engine_config_from_args
from engine.errors import EngineError
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


def cmd_generate(args: argparse.Namespace) -> int:
    """Offline: load the engine in this process and stream one completion to stdout."""
    from engine.core import EngineCore
    from engine.loop import EngineLoop
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import IncrementalDetokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    loop = EngineLoop(EngineCore(engine_config_from_args(args))).start()
    try:
        tokenizer = loop.core.tokenizer
        prompt_ids = tokenizer.encode(args.prompt)
        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        stream = loop.submit(prompt_ids, params)
        final = None
        for out in stream:
            delta = detok.push(out.new_token_ids)
            if out.finished:
                delta += detok.flush()
                if out.text is not None:         # a stop string cut the text short
                    delta = delta[:max(0, len(out.text) - (len(detok.text) - len(delta)))]
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
    gen = sub.add_parser("generate", help="stream one completion (offline, in this process)")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(json_logs=getattr(args, "log_json", False), level=getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except EngineError as e:
        print(f"ninfer: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
