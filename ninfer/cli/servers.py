"""`ninfer engine`, `ninfer gateway`, `ninfer serve`: start, serve until SIGTERM/SIGINT, drain, stop.

Every server listens on 127.0.0.1 unless told otherwise, reports NOT_SERVING until ready, and on
SIGTERM (or Ctrl-C) drains: new calls get UNAVAILABLE, streams in flight finish within
--drain-timeout seconds, then it exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from engine import envs
from ninfer.cli.flags import client_tls, engine_config_from_args, server_options

SIGNAL_CHECK_S = 0.2
EMBEDDED_MODEL_NOTICE = (
    "ninfer: serving the embedded tiny model: random weights, so its text is noise (it exercises the "
    "whole path, nothing more). For text, serve a Qwen3 checkpoint: ninfer serve --model DIR "
    "[--num-speculative-tokens 3 for its MTP head]. GPU kernels were run on H100/H200 (sm90) only.")


def cmd_engine(args: argparse.Namespace) -> int:
    from services.engine_host import EngineHost
    options = server_options(args, "ninfer-engine")
    host = EngineHost(engine_config_from_args(args), options)
    return _run(host, options, load=host.load)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.migration import MigrationPolicy
    from gateway.server import GatewayServer
    from services.server.tls import read_secret
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    options = server_options(args, "ninfer-gateway")
    engine_key = read_secret(args.engine_api_key, args.engine_api_key_file, envs.ENGINE_API_KEY,
                             envs.ENGINE_API_KEY_FILE, "--engine-api-key")
    engine_tls = client_tls(args.engine_tls_ca, args.engine_tls_cert, args.engine_tls_key, "--engine-tls")
    migration = MigrationPolicy(max_migrations=args.max_stream_migrations, stall_s=args.stream_stall_timeout,
                                probe_s=args.stream_stall_timeout)
    return _run(GatewayServer(engines, options, engine_api_key=engine_key, engine_tls=engine_tls,
                              migration=migration), options)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeStack
    options = server_options(args, "ninfer")
    if args.model is None:
        print(EMBEDDED_MODEL_NOTICE, flush=True)
    return _run(ServeStack(engine_config_from_args(args), options), options)


def _run(server, options, load=None) -> int:
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
        sys.stdout.flush()
