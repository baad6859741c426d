"""`ninfer generate`: stream one completion to stdout, from an engine in this process or from a
running gateway (`--gateway`). Text goes to stdout; logs (warnings and up) go to stderr.

With --n > 1 the sequences' texts are printed one after the other once all have finished (each
under a `--- sequence i ---` line); with --json every delta is a line with its sequence `index`
(and, with --logprobs, its tokens' logprobs)."""

from __future__ import annotations

import argparse
import json
import sys

from engine import envs
from ninfer.cli.flags import engine_config_from_args, sampling_from_args, sampling_kwargs


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
        texts = [StreamingText(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output, params.min_tokens,
                               params.skip_special_tokens, params.spaces_between_special_tokens)
                 for _ in range(params.n)]
        out_lines = _Printer(args.json, params.n)
        finals = {}
        for out in loop.submit(prompt_ids, params):
            delta = texts[out.index].push(out.new_token_ids, final=out.finished)
            if out.finished:
                finals[out.index] = out
            out_lines.delta(out.index, delta, out.new_token_ids, _logprobs_json(out.logprobs))
        out_lines.end()
        if args.json:
            for i in sorted(finals):
                print(json.dumps({"index": i, "finish_reason": finals[i].finish_reason.value,
                                  "stats": finals[i].stats.to_dict()}), flush=True)
        return 0
    finally:
        loop.shutdown()


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from gateway.client import GatewayClient
    from services.convert import logprobs_from_proto, sampling_to_proto, stats_from_proto

    sampling = sampling_to_proto(sampling_from_args(args))
    from ninfer.cli.flags import client_tls
    from services.server.tls import read_secret
    api_key = read_secret(args.api_key, args.api_key_file, envs.API_KEY, envs.API_KEY_FILE, "--api-key")
    tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    printer = _Printer(args.json, sampling_kwargs(args)["n"])
    finals = {}
    with GatewayClient(args.gateway, api_key=api_key, tls=tls) as client:
        try:
            if args.wait_ready:
                client.wait_until_serving(args.wait_ready)
            for msg in client.generate(args.prompt, sampling=sampling, include_token_ids=args.json,
                                       timeout=args.timeout):
                printer.delta(msg.index, msg.text, list(msg.token_ids), _logprobs_json(logprobs_from_proto(msg.logprobs)))
                if msg.HasField("result"):
                    finals[msg.index] = msg
        except grpc.RpcError as e:
            print(f"\nninfer: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"ninfer: {e}", file=sys.stderr)
            return 1
    printer.end()
    if args.json:
        for i in sorted(finals):
            msg = finals[i]
            r = msg.result
            stats = stats_from_proto(r.stats)
            g = r.gateway_timings
            print(json.dumps({"index": i, "request_id": msg.request_id, "model": r.model, "engine": r.engine,
                              "finish_reason": stats.finish_reason.value if stats.finish_reason else None,
                              "stats": stats.to_dict(),
                              "gateway_timings": {"tokenize": g.tokenize_seconds, "prefill_call": g.prefill_call_seconds,
                                                  "ttft": g.ttft_seconds, "inter_token": g.inter_token_seconds,
                                                  "total": g.total_seconds}}), flush=True)
    return 0


def _logprobs_json(logprobs) -> list | None:
    if not logprobs:
        return None
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
             "top": [{"token_id": t, "logprob": v} for t, v in lp.top]} for lp in logprobs]


class _Printer:
    """Text to stdout as it comes (one sequence), or each sequence's whole text at the end (n > 1);
    with --json one line per delta."""

    def __init__(self, as_json: bool, n: int):
        self.as_json, self.n = as_json, n
        self.texts: dict[int, list[str]] = {}

    def delta(self, index: int, text: str, token_ids: list[int], logprobs: list | None) -> None:
        if self.as_json:
            line = {"text": text, "token_ids": token_ids}
            if self.n > 1:
                line["index"] = index
            if logprobs is not None:
                line["logprobs"] = logprobs
            print(json.dumps(line), flush=True)
        elif self.n == 1:
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
        else:
            self.texts.setdefault(index, []).append(text)

    def end(self) -> None:
        if self.as_json:
            return
        if self.n > 1:
            for i in range(self.n):
                print(f"--- sequence {i} ---")
                print("".join(self.texts.get(i, [])))
        else:
            print(flush=True)
