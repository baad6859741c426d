"""`ninfer generate`: stream one completion to stdout, from an engine in this process or from a
running gateway (`--gateway`). Text goes to stdout; logs (warnings and up) go to stderr."""

from __future__ import annotations

import argparse
import json
import sys

from engine import envs
from ninfer.cli.flags import engine_config_from_args, sampling_from_args


def cmd_generate(args: argparse.Namespace) -> int:
    if args.gateway:
        return _generate_remote(args)
    from engine.core import EngineCore
    from engine.loop import EngineLoop
    from gateway.text import StreamingText

    params = sampling_from_args(args)
    loop = EngineLoop(EngineCore(engine_config_from_args(args))).start()
    try:
        loop.warmup()
        tokenizer = loop.tokenizer
        prompt_ids = tokenizer.encode(args.prompt)
        # the gateway's text stream: holds back what could still become a stop string
        text = StreamingText(tokenizer, prompt_ids, args.stop)
        final = None
        for out in loop.submit(prompt_ids, params):
            delta = text.push(out.new_token_ids, final=out.finished)
            if out.finished:
                final = out
            _emit(args.json, delta, out.new_token_ids)
        if args.json:
            print(json.dumps({"finish_reason": final.finish_reason.value, "stats": final.stats.to_dict()}), flush=True)
        else:
            print(flush=True)
        return 0
    finally:
        loop.shutdown()


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from gateway.client import GatewayClient, SamplingParams
    from services.convert import stats_from_proto

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    msg = None
    from ninfer.cli.flags import client_tls
    from services.server.tls import read_secret
    api_key = read_secret(args.api_key, args.api_key_file, envs.API_KEY, envs.API_KEY_FILE, "--api-key")
    tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    with GatewayClient(args.gateway, api_key=api_key, tls=tls) as client:
        try:
            if args.wait_ready:
                client.wait_until_serving(args.wait_ready)
            for msg in client.generate(args.prompt, sampling=sampling, include_token_ids=args.json,
                                       timeout=args.timeout):
                _emit(args.json, msg.text, list(msg.token_ids))
        except grpc.RpcError as e:
            print(f"\nninfer: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"ninfer: {e}", file=sys.stderr)
            return 1
    r = msg.result
    if args.json:
        stats = stats_from_proto(r.stats)
        g = r.gateway_timings
        print(json.dumps({"request_id": msg.request_id, "model": r.model, "engine": r.engine,
                          "finish_reason": stats.finish_reason.value if stats.finish_reason else None,
                          "stats": stats.to_dict(),
                          "gateway_timings": {"tokenize": g.tokenize_seconds, "prefill_call": g.prefill_call_seconds,
                                              "ttft": g.ttft_seconds, "inter_token": g.inter_token_seconds,
                                              "total": g.total_seconds}}), flush=True)
    else:
        print(flush=True)
    return 0


def _emit(as_json: bool, text: str, token_ids: list[int]) -> None:
    if as_json:
        print(json.dumps({"text": text, "token_ids": token_ids}), flush=True)
    elif text:
        sys.stdout.write(text)
        sys.stdout.flush()
