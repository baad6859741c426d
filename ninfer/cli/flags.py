"""Every flag of `ninfer`, in groups, and what they build (EngineConfig, ServerOptions, SamplingParams).

Spellings follow vLLM where vLLM has the flag (`--max-num-seqs`, `--gpu-memory-utilization`,
`--kv-cache-dtype`, `--num-speculative-tokens`, `--no-enable-prefix-caching`,
`-tp/--tensor-parallel-size`, `--max-model-len`, `--host`/`--port`); the earlier ninfer spelling stays
as an alias. Environment variables are read when a command runs, never at import.
"""

from __future__ import annotations

import argparse

from engine import envs
from engine.config import KV_ROLES, EngineConfig
from engine.sampling_params import SamplingParams
from services.server.address import join_host_port, split_host_port

DEFAULT_GATEWAY_LISTEN = "127.0.0.1:50051"
DEFAULT_ENGINE_LISTEN = "127.0.0.1:50052"
DEFAULT_GATEWAY_METRICS = "127.0.0.1:9400"
DEFAULT_ENGINE_METRICS = "127.0.0.1:9401"
ENGINE_GROUP = "engine"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help (not for flags without one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or isinstance(action, argparse._StoreFalseAction):
            return action.help or ""
        return super()._get_help_string(action)


# -- engine ---------------------------------------------------------------------------------------

def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig.__dataclass_fields__
    g = p.add_argument_group(ENGINE_GROUP, "the in-process engine (its model, memory, scheduling, speculation)")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory, or preset:NAME (random weights of a reference shape); "
                        "default: the embedded tiny model (random weights: it serves plumbing, not text)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients see and ask for (default: the model directory's name)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu or cuda[:N]")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA sm80+, float16 below: no bf16 there; float32 on CPU), bfloat16, float16, float32")
    g.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="auto", type=kv_cache_dtype_flag,
                   help="KV cache dtype: auto (= --dtype), int8 (per token and head scales), or a float dtype")
    g.add_argument("--block-size", type=int, default=d["block_size"].default, help="tokens per KV page")
    g.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"].default,
                   help="tokens per prefill step of the one prefill lane")
    g.add_argument("--kv-capacity", type=int, default=None,
                   help="KV capacity in tokens (default: what --gpu-memory-utilization leaves after the weights)")
    g.add_argument("--gpu-memory-utilization", "--memory-utilization", dest="memory_utilization", type=float,
                   default=d["memory_utilization"].default, help="share of device memory the engine may take")
    g.add_argument("--num-speculative-tokens", "--draft-tokens", dest="draft_tokens", type=draft_tokens_flag,
                   default=d["draft_tokens"].default, metavar="K|auto|auto:K",
                   help="MTP draft tokens per round, k (0 = no speculation; needs a checkpoint with mtp.* weights); "
                        f"auto = the engine picks each round's k in [0, {AUTO_MAX_DRAFT_TOKENS}] from the running "
                        "acceptance and the batch (auto:K: in [0, K])")
    g.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="checkpoint whose MTP head (mtp.* tensors) drafts, bf16 or quantized, for a model whose "
                        "checkpoint has none (quantizers drop it); its shape must match the model's")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s spelling of the two above: {"model": DIR, "num_speculative_tokens": K, "method": "mtp"}')
    g.add_argument("--quantization", "-q", default=None, choices=("fp8", "ptpc_fp8"),
                   help="quantize an unquantized checkpoint's linear layers to FP8 while loading (nothing is "
                        "written): fp8 = 128x128 block scales, ptpc_fp8 = one scale per output channel")
    g.add_argument("--adaptive-draft", action="store_true",
                   help="pick each round's k in [0, --num-speculative-tokens] (the same as auto:K)")
    g.add_argument("--draft-vocab", type=int, default=d["draft_vocab"].default,
                   help="draft over the first N token ids only (0 = the whole vocabulary)")
    g.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=d["max_batch"].default,
                   help="requests decoding together (the decode batch)")
    g.add_argument("--max-pending", type=int, default=d["max_pending"].default,
                   help="queued requests before new ones are refused (RESOURCE_EXHAUSTED)")
    g.add_argument("--pending-timeout-ms", type=int, default=d["pending_timeout_ms"].default,
                   help="queue wait before a request fails (RESOURCE_EXHAUSTED)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's)")
    g.add_argument("-tp", "--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int,
                   default=d["tensor_parallel_size"].default, help="GPUs to shard the model over (in one process)")
    g.add_argument("--tp-comm", default=d["tp_comm"].default, choices=("auto", "p2p", "nccl"),
                   help="TP all-reduce: one-shot peer-to-peer over NVLink, NCCL, or auto (p2p where it works)")
    g.add_argument("--enable-prefix-caching", dest="prefix_reuse", action=argparse.BooleanOptionalAction,
                   default=d["prefix_reuse"].default,
                   help="share KV blocks between requests with the same prefix (--no-enable-prefix-caching: never)")
    g.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--state-snapshots", type=int, default=d["state_snapshots"].default,
                   help="hybrid models: linear-attention states kept at block boundaries for prefix reuse "
                        "(each costs one request's state)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (slower decode; for debugging)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d["async_scheduling"].default,
                   help="plan and enqueue the next decode round while the GPU runs this one "
                        "(--no-async-scheduling: every round waits for the last)")
    g.add_argument("--lease-seconds", type=float, default=d["lease_seconds"].default,
                   help="how long a prefilled handle keeps its KV without a decode attaching")
    g.add_argument("--handoff-timeout", dest="handoff_timeout_seconds", type=float,
                   default=d["handoff_timeout_seconds"].default, metavar="SECONDS",
                   help="a prefilled handle no decode attached within this long gives its room to a queued "
                        "request (it keeps --lease-seconds only while no one waits)")
    g.add_argument("--seat-timeout", dest="seat_timeout_seconds", type=float,
                   default=d["seat_timeout_seconds"].default, metavar="SECONDS",
                   help="a prefilled request waits this long at most for a decode seat (then RESOURCE_EXHAUSTED "
                        "with retry pushback); 0 = no bound")


def add_kv_role_arg(p: argparse.ArgumentParser) -> None:
    """`ninfer engine` only: the engine's part in prefill/decode disaggregation (services/smg/pd.py)."""
    p.add_argument("--kv-role", choices=KV_ROLES, default=EngineConfig.__dataclass_fields__["kv_role"].default,
                   help="prefill/decode on different engines behind `smg launch --pd-disaggregation`: a producer "
                        "prefills and lends the prompt's KV blocks (kept --lease-seconds at most), a consumer pulls "
                        "them over NIXL and decodes; both = whole requests (docs/disaggregation.md)")
    p.add_argument("--kv-pull-timeout", dest="kv_pull_timeout_seconds", type=float, metavar="SECONDS",
                   default=EngineConfig.__dataclass_fields__["kv_pull_timeout_seconds"].default,
                   help="a consumer: a pull of a prompt's KV from its producer that takes longer fails the decode "
                        "leg with UNAVAILABLE (the READ is cancelled, nothing held)")


AUTO_MAX_DRAFT_TOKENS = 4
KV_CACHE_DTYPES = ("auto", "int8", "bfloat16", "float16", "float32")


def kv_cache_dtype_flag(text: str) -> str:
    if text in KV_CACHE_DTYPES:
        return text
    hint = (" (an FP8 KV cache is not implemented; int8 is the quantized KV cache)"
            if text.lower().startswith("fp8") else "")
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(KV_CACHE_DTYPES)}{hint}")


class AutoDraftTokens(int):
    """`--num-speculative-tokens auto[:K]`: the maximum k of an adaptive draft length."""


def draft_tokens_flag(text: str) -> int:
    if text == "auto" or text.startswith("auto:"):
        k = text[5:] or str(AUTO_MAX_DRAFT_TOKENS)
        if not k.isdigit() or int(k) < 1:
            raise argparse.ArgumentTypeError(f"auto:K needs an integer K >= 1, got {text!r}")
        return AutoDraftTokens(int(k))
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, auto or auto:K, got {text!r}") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
        block_size=args.block_size, prefill_chunk=args.prefill_chunk, kv_capacity=args.kv_capacity,
        memory_utilization=args.memory_utilization, draft_tokens=int(args.draft_tokens),
        adaptive_draft=args.adaptive_draft or isinstance(args.draft_tokens, AutoDraftTokens),
        draft_vocab=args.draft_vocab, max_batch=args.max_batch, max_pending=args.max_pending,
        pending_timeout_ms=args.pending_timeout_ms, max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size, tp_comm=args.tp_comm, prefix_reuse=args.prefix_reuse,
        state_snapshots=args.state_snapshots, enforce_eager=args.enforce_eager, lease_seconds=args.lease_seconds,
        handoff_timeout_seconds=args.handoff_timeout_seconds, seat_timeout_seconds=args.seat_timeout_seconds,
        async_scheduling=args.async_scheduling, quantization=args.quantization,
        speculative_model=args.speculative_model, speculative_config=args.speculative_config,
        kv_role=getattr(args, "kv_role", EngineConfig.kv_role),
        kv_pull_timeout_seconds=getattr(args, "kv_pull_timeout_seconds", EngineConfig.kv_pull_timeout_seconds))


def flag_of(parser: argparse.ArgumentParser, field: str) -> str | None:
    """The first option string of the flag whose value lands in `field` (an EngineConfig or
    SamplingParams field), to name it in an error; None when no flag sets it."""
    for action in parser._actions:
        if action.dest == field and action.option_strings and action.help is not argparse.SUPPRESS:
            return max(action.option_strings, key=len) if action.option_strings[0].startswith("-") else None
    return None


def engine_flags_given(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The engine flags that appear in `argv` (as typed: `--flag` or `--flag=value`)."""
    group = next(g for g in parser._action_groups if g.title == ENGINE_GROUP)
    options = {o for a in group._group_actions for o in a.option_strings}
    return [a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in options]


# -- servers --------------------------------------------------------------------------------------

def add_server_args(p: argparse.ArgumentParser, listen: str, metrics_listen: str) -> None:
    from services.server.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
    g = p.add_argument_group("server")
    g.add_argument("--listen", default=listen, metavar="HOST:PORT", help="address to serve gRPC on (port 0 = any)")
    g.add_argument("--host", default=None, help="host to serve on (overrides the host of --listen)")
    g.add_argument("--port", type=int, default=None, help="port to serve on (overrides the port of --listen)")
    g.add_argument("--metrics-listen", default=metrics_listen, metavar="HOST:PORT",
                   help="address of the Prometheus /metrics endpoint ('off' = none)")
    g.add_argument("--api-key", default=None,
                   help="bearer token every call but health must present; visible in `ps`: prefer --api-key-file "
                        "(default: $NINFER_API_KEY_FILE, then $NINFER_API_KEY, else none)")
    g.add_argument("--api-key-file", default=None, metavar="FILE", help="read the bearer token from FILE")
    g.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate chain: serve TLS (with --tls-key)")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="PEM CA: require client certificates it signed (mutual TLS; needs --tls-cert)")
    g.add_argument("--enable-reflection", action="store_true", help="serve gRPC server reflection")
    g.add_argument("--max-message-bytes", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest request message accepted (larger: RESOURCE_EXHAUSTED with retry pushback)")
    g.add_argument("--max-concurrent-rpcs", "--max-workers", dest="max_concurrent_rpcs", type=positive_int,
                   default=None, help="calls served at once; the next is refused at once (RESOURCE_EXHAUSTED "
                   "with retry pushback); health is exempt (default: what the engines admit, "
                   "2 x --max-num-seqs + --max-pending + 1 per engine)")
    g.add_argument("--receive-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                   help="a call's request message must arrive within this after its headers (else "
                        "DEADLINE_EXCEEDED); a call waiting for its message holds no thread and no seat")
    g.add_argument("--max-streams-per-connection", type=positive_int, default=None,
                   help="HTTP/2 streams one connection may have open (default: --max-concurrent-rpcs + 32)")
    g.add_argument("--max-connections", type=positive_int, default=1000,
                   help="connections at once; a new one past it is closed when accepted")
    g.add_argument("--connection-idle-timeout", type=nonnegative_float, default=300.0, metavar="SECONDS",
                   help="close a connection with no call for this long (GOAWAY; clients reconnect); 0 = never")
    g.add_argument("--max-connection-age", type=nonnegative_float, default=0.0, metavar="SECONDS",
                   help="ask a connection this old to go away (no new calls on it); 0 = no age limit")
    g.add_argument("--max-connection-age-grace", type=nonnegative_float, default=0.0, metavar="SECONDS",
                   help="the calls on an aged connection get this long to finish; 0 = as long as they need")
    g.add_argument("--drain-timeout", type=nonnegative_float, default=30.0,
                   help="seconds from SIGTERM to exit, in total: streams still running shortly before it "
                        "end UNAVAILABLE")
    g.add_argument("--retry-pushback-ms", type=int, default=1000,
                   help="grpc-retry-pushback-ms sent with RESOURCE_EXHAUSTED")
    g.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/gRPC trace endpoint, e.g. http://127.0.0.1:4317 (default: $OTEL_EXPORTER_OTLP_ENDPOINT)")
    add_log_args(p, default_level="info")


def add_log_args(p: argparse.ArgumentParser, default_level: str) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-json", action="store_true", help="JSON log lines on stderr")
    g.add_argument("--log-level", default=default_level, choices=("debug", "info", "warning", "error"),
                   help="least severe level logged")


def listen_address(args: argparse.Namespace) -> str:
    """--listen, with --host and --port (vLLM's spelling) overriding its parts."""
    host, port = split_host_port(args.listen)
    if args.host is not None:
        host = args.host
    if args.port is not None:
        port = args.port
    return join_host_port(host, port)


def server_options(args: argparse.Namespace, service_name: str):
    """Flags -> ServerOptions; reads OTEL_*, NINFER_API_KEY(_FILE) and the TLS files now, at startup."""
    from services.server.connections import ConnectionLimits
    from services.server.grpc_server import ServerOptions
    from services.server.telemetry import build_tracer_provider
    from services.server.tls import ServerTLS, read_secret
    if (args.tls_cert is None) != (args.tls_key is None):
        raise OSError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise OSError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if tls is not None:
        tls.credentials()                      # unreadable files: a message now, not at the first call
    return ServerOptions(
        listen=listen_address(args),
        metrics_listen=None if args.metrics_listen in ("", "off") else args.metrics_listen,
        api_key=read_secret(args.api_key, args.api_key_file, envs.API_KEY, envs.API_KEY_FILE, "--api-key"),
        enable_reflection=args.enable_reflection, max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_message_bytes=args.max_message_bytes, retry_pushback_ms=args.retry_pushback_ms,
        drain_timeout_s=args.drain_timeout, tls=tls, receive_timeout_s=args.receive_timeout,
        connections=ConnectionLimits(
            max_streams_per_connection=args.max_streams_per_connection, max_connections=args.max_connections,
            idle_timeout_s=args.connection_idle_timeout, max_age_s=args.max_connection_age,
            age_grace_s=args.max_connection_age_grace),
        tracer_provider=build_tracer_provider(service_name, args.otlp_endpoint))


def add_client_tls_args(g, prefix: str = "--", what: str = "the server") -> None:
    """--tls-ca/--tls-cert/--tls-key of a client (prefix "--engine-": the gateway's calls to engines)."""
    g.add_argument(f"{prefix}tls-ca", default=None, metavar="FILE",
                   help=f"PEM CA to trust: call {what} over TLS (default: plaintext)")
    g.add_argument(f"{prefix}tls-cert", default=None, metavar="FILE",
                   help=f"PEM client certificate for {what} (mutual TLS; with {prefix}tls-key)")
    g.add_argument(f"{prefix}tls-key", default=None, metavar="FILE", help=f"PEM private key of {prefix}tls-cert")


def client_tls(ca: str | None, cert: str | None, key: str | None, flag: str = "--tls"):
    """ClientTLS from the client flags; None (plaintext) when none is given."""
    from services.server.tls import ClientTLS
    if not (ca or cert or key):
        return None
    tls = ClientTLS(ca, cert, key)
    tls.credentials(flag)                      # unreadable files: a message now
    return tls


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


# -- sampling -------------------------------------------------------------------------------------

def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """`ninfer generate`'s sampling flags, vLLM's names. Its defaults are its own: greedy, 64 tokens."""
    d = SamplingParams.__dataclass_fields__
    g = p.add_argument_group("sampling")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; higher = more random")
    g.add_argument("--top-p", type=float, default=d["top_p"].default, help="nucleus sampling: keep the smallest set "
                   "of tokens whose probability reaches this")
    g.add_argument("--top-k", type=int, default=d["top_k"].default, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--min-p", type=float, default=d["min_p"].default,
                   help="drop tokens less likely than this times the most likely one (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--n", type=int, default=d["n"].default,
                   help="sequences from the one prompt (one prefill, shared KV); each printed in turn")
    g.add_argument("--presence-penalty", type=float, default=d["presence_penalty"].default,
                   help="subtracted once from every token already generated, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=d["frequency_penalty"].default,
                   help="subtracted per occurrence in the generated text, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=d["repetition_penalty"].default,
                   help="prompt and output tokens: positive logits divided, negative multiplied (1 = off)")
    g.add_argument("--min-tokens", type=int, default=d["min_tokens"].default,
                   help="no EOS, stop token or stop string before this many tokens")
    g.add_argument("--logit-bias", action="append", default=[], type=logit_bias_flag, metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]) to the token's logit (repeatable)")
    g.add_argument("--bad-word", dest="bad_words", action="append", default=[],
                   help="a word never to generate (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's logprob and the top N alternatives (N <= 20)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not part of the output")
    g.add_argument("--include-stop-str-in-output", action="store_true", help="keep the stop string in the output")
    g.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction,
                   default=d["skip_special_tokens"].default, help="leave special tokens out of the text")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def logit_bias_flag(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"TOKEN_ID=BIAS, got {text!r}") from None


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags as SamplingParams fields (the CLI's own defaults applied)."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.seed, n=args.n, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                min_tokens=args.min_tokens, logit_bias=dict(args.logit_bias) or None, bad_words=args.bad_words or None,
                logprobs=args.logprobs, stop=args.stop, include_stop_str_in_output=args.include_stop_str_in_output,
                skip_special_tokens=args.skip_special_tokens, ignore_eos=args.ignore_eos)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**sampling_kwargs(args))
