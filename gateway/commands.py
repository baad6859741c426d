"""The server commands of `ninfer` (engine, gateway, serve) and `generate --gateway`.

Every server listens on 127.0.0.1 unless told otherwise, reports NOT_SERVING until ready, and on
SIGTERM (or Ctrl-C) drains: new calls get UNAVAILABLE, streams in flight finish within
--drain-timeout seconds, then it exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import grpc

from engine.args import engine_config_from_args
from services.convert import stats_from_proto
from services.server import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions
from services.telemetry import build_tracer_provider

DEFAULT_GATEWAY_LISTEN = "127.0.0.1:50051"
DEFAULT_ENGINE_LISTEN = "127.0.0.1:50052"
DEFAULT_GATEWAY_METRICS = "127.0.0.1:9400"
DEFAULT_ENGINE_METRICS = "127.0.0.1:9401"
SIGNAL_CHECK_S = 0.2


# -- flags ----------------------------------------------------------------------------------------

def add_server_args(p: argparse.ArgumentParser, listen: str, metrics_listen: str) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--listen", default=listen, help=f"HOST:PORT to serve gRPC on (default {listen}; port 0 = any)")
    g.add_argument("--metrics-listen", default=metrics_listen,
                   help=f"HOST:PORT of the Prometheus /metrics endpoint (default {metrics_listen}; 'off' = none)")
    g.add_argument("--api-key", default=None,
                   help="bearer token every call but health must present (default: $NINFER_API_KEY, else none)")
    g.add_argument("--enable-reflection", action="store_true", help="serve gRPC server reflection")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest request message accepted (larger: RESOURCE_EXHAUSTED)")
    g.add_argument("--max-workers", type=int, default=256, help="server threads (one per open stream)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds streams in flight get to finish after SIGTERM")
    g.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/gRPC trace endpoint, e.g. http://127.0.0.1:4317 (default: $OTEL_EXPORTER_OTLP_ENDPOINT)")
    add_log_args(p, default_level="info")


def add_log_args(p: argparse.ArgumentParser, default_level: str) -> None:
    p.add_argument("--log-json", action="store_true", help="JSON log lines on stderr")
    p.add_argument("--log-level", default=default_level, help=f"debug, info, warning or error (default {default_level})")


def add_engine_service_args(p: argparse.ArgumentParser) -> None:
    """Flags of the engine's services (not of the engine itself: those are engine.args)."""
    g = p.add_argument_group("engine services")
    g.add_argument("--lease-seconds", type=float, default=60.0,
                   help="how long a prefilled handle keeps its KV without a decode attaching")
    g.add_argument("--retry-pushback-ms", type=int, default=1000,
                   help="grpc-retry-pushback-ms sent with RESOURCE_EXHAUSTED (queue full / queue timeout)")


def server_options(args: argparse.Namespace, service_name: str) -> ServerOptions:
    """Flags -> options; reads OTEL_* and NINFER_API_KEY now, at startup."""
    return ServerOptions(
        listen=args.listen, metrics_listen=None if args.metrics_listen in ("", "off") else args.metrics_listen,
        api_key=args.api_key or os.environ.get("NINFER_API_KEY") or None, enable_reflection=args.enable_reflection,
        max_workers=args.max_workers, max_message_bytes=args.max_message_bytes,
        retry_pushback_ms=getattr(args, "retry_pushback_ms", ServerOptions.retry_pushback_ms),
        drain_timeout_s=args.drain_timeout,
        tracer_provider=build_tracer_provider(service_name, args.otlp_endpoint))


# -- servers --------------------------------------------------------------------------------------

def cmd_engine(args: argparse.Namespace) -> int:
    from services.engine_host import EngineHost
    options = server_options(args, "ninfer-engine")
    host = EngineHost(engine_config_from_args(args, lease_s=args.lease_seconds), options)
    return _run(host, options, load=host.load)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server import GatewayServer
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    options = server_options(args, "ninfer-gateway")
    engine_key = args.engine_api_key or os.environ.get("NINFER_ENGINE_API_KEY") or None
    return _run(GatewayServer(engines, options, engine_api_key=engine_key), options)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeStack
    options = server_options(args, "ninfer")
    return _run(ServeStack(engine_config_from_args(args, lease_s=args.lease_seconds), options), options)


def _run(server, options: ServerOptions, load=None) -> int:
    """Start, wait for SIGTERM/SIGINT, drain, stop."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        if load is not None:
            load()
        # A short wait: when another thread (gRPC's, torch's) takes the signal, its Python handler
        # only runs once the main thread wakes up.
        while not stop.wait(SIGNAL_CHECK_S):
            pass
        server.drain()
        return 0
    finally:
        server.stop()
        options.tracer_provider.shutdown()


# -- a client ---------------------------------------------------------------------------------------

def cmd_generate_remote(args: argparse.Namespace) -> int:
    """Stream one completion from a running gateway to stdout."""
    from gateway.client import GatewayClient, SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    with GatewayClient(args.gateway, api_key=args.api_key or os.environ.get("NINFER_API_KEY")) as client:
        try:
            if args.wait_ready:
                client.wait_until_serving(args.wait_ready)
            for msg in client.generate(args.prompt, sampling=sampling, include_token_ids=args.json,
                                       timeout=args.timeout):
                if args.json:
                    print(json.dumps({"text": msg.text, "token_ids": list(msg.token_ids)}), flush=True)
                elif msg.text:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nninfer: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"ninfer: {e}", file=sys.stderr)
            return 1
    r = msg.result
    if args.json:
        g = r.gateway_timings
        print(json.dumps({"request_id": msg.request_id, "model": r.model, "engine": r.engine,
                          "finish_reason": stats_from_proto(r.stats)["finish_reason"], "stats": stats_from_proto(r.stats),
                          "gateway_timings": {"tokenize": g.tokenize_seconds, "prefill_call": g.prefill_call_seconds,
                                              "ttft": g.ttft_seconds, "inter_token": g.inter_token_seconds,
                                              "total": g.total_seconds}}), flush=True)
    else:
        print(flush=True)
    return 0
