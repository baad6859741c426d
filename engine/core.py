"""The engine core: one model, one scheduler, one step at a time. Not thread-safe; `engine.loop`
drives it from its own thread, `LLM.generate` from the caller's."""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
import uuid
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import structlog
import torch

from engine.platform import engine_paths
from engine.worker.memory_plan import plan_memory
from engine.config import EngineConfig
from engine.loading.embedded_model import DEFAULT_MODEL_NAME, build_default_tokenizer, build_default_weights, DEFAULT_CONFIG
from engine.errors import InvalidArgumentError, RequestNotFoundError, UnsupportedError
from engine.cache.block_manager import KVCacheManager
from engine.cache import kv_landing
from engine.cache.kv_leases import KVLease, KVLeaseTable
from engine.loading.checkpoint import MTP_PREFIX, RandomWeights, check_dtypes, check_tensors, read_model_dir
from engine.loading.pooling import Pooling, embedder_weights, read_pooling
from engine.engine_info import EngineInfo, WarmupReport
from engine.metrics import EngineMetrics
from engine.models.registry import model_class
from engine.loading.presets import PREFIX as PRESET_PREFIX, preset
from engine.sched.request import PhaseTimes, Request, RequestStatus, SpecStats
from engine.distributed.executor import Executor
from engine.sampling_params import SamplingParams
from engine.sched.admission import admit_options
from engine.worker.async_rounds import InflightRound, TokenReadback, plan_ahead, why_synchronous
from engine.sched.scheduler import ModelOutput, Scheduler, SchedulerConfig, SchedulerOutput
from engine.loading.hybrid_config import state_slot_counts
from engine.cache.state_slots import StateSlotPool
from engine.cache.state_snapshots import StateSnapshots
from engine.sampling_params import TokenLogprob
from engine.request_stats import FinishReason, RequestStats
from engine.structured.grammars import Grammars
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, stop_cut

log = structlog.get_logger(__name__)


def _shapes(weights, model_config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor shapes as `checkpoint_shapes` states them (quantized layouts normalized,
    fused expert stacks stated per expert)."""
    found = weights.shapes()
    if model_config.is_moe:
        from engine.layers.moe_experts import per_expert_shapes, refuse_quantized_fused
        if hasattr(weights, "dtypes"):
            refuse_quantized_fused(weights.dtypes())
        found = per_expert_shapes(found)
    if model_config.quant is None:
        return found
    from engine.quant.scheme import normalize_found
    return normalize_found(found, model_config.quant)


def _quantize_at_load(config: EngineConfig, model_config, weights):
    """`--quantization`: the model config with every linear layer of the (unquantized) checkpoint in FP8."""
    from engine.quant.online import online_scheme
    from engine.quant.scheme import check_header_dtypes
    shapes = (weights.without(MTP_PREFIX) if config.speculative_model is not None else weights).shapes()
    scheme = online_scheme(config.quantization, model_config, shapes)
    if hasattr(weights, "dtypes"):
        check_header_dtypes(weights.dtypes(), scheme)
    log.info("quantize_at_load", method=config.quantization, linear_layers=len(scheme.modules))
    return replace(model_config, quant=scheme)


@dataclass
class RequestOutput:
    """What one step produced for one sequence of a request (`index` among its n; 0 when n = 1).
    `finished`: this sequence finished; the request is done once all n have."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    # Set when finished, and on the first output of a request parked after its prefill (then the
    # figures of its prefill phase, taken on the engine thread in the step that parked it).
    stats: RequestStats | None = None
    text: str | None = None                      # final text when a stop string ended it
    logprobs: list[TokenLogprob] | None = None   # one per new token (SamplingParams.logprobs set)
    # with the request's first output (SamplingParams.prompt_logprobs set): one per prompt token,
    # None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0
    embedding: list[float] | None = None         # an embedding request's vector (engine.core.EngineCore.add_embedding)


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of an n > 1 request: sequence 0 keeps the request's, the others a
    fixed function of (seed, index), so every sequence has its own stream and a seeded request replays."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def logs_to_stderr() -> None:
    """structlog prints to stdout unless configured: where no entry point configured it (the Python
    API, a script), the engine's logs go to stderr, leaving the user's stdout to the user."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


class EngineCore:
    def __init__(self, config: EngineConfig, clock=time.monotonic):
        logs_to_stderr()
        self.config = config
        self.clock = clock
        self.pooling: Pooling | None = None      # an embedding checkpoint's pooling (engine.loading.pooling)
        if config.speculative_model is not None and (config.model is None or config.model.startswith(PRESET_PREFIX)):
            raise InvalidArgumentError("speculative_model", "needs a checkpoint directory as the model")
        if config.model is None:
            self.model_name = DEFAULT_MODEL_NAME
            model_config, weights, self.tokenizer = DEFAULT_CONFIG, build_default_weights(), build_default_tokenizer()
        elif config.model.startswith(PRESET_PREFIX):
            if config.quantization is not None:
                raise InvalidArgumentError("quantization", "presets choose their format by name (preset:NAME-fp8)")
            # a reference shape with random weights, made on the device (benchmarks)
            self.model_name = config.model[len(PRESET_PREFIX):]
            model_config = preset(config.model)
            device = "cpu" if config.device == "cpu" else config.device
            if model_config.quant is not None:
                from engine.quant.random_weights import RandomQuantWeights
                weights = RandomQuantWeights.for_model(model_config, device)
            else:
                with torch.device("meta"):
                    shapes = model_class(model_config)(model_config, with_mtp=True).checkpoint_shapes()
                weights = RandomWeights(shapes, device)
            self.tokenizer = build_default_tokenizer()
        else:
            md = read_model_dir(config.model)
            self.model_name = md.path.name
            model_config, weights = md.config, md.weights
            self.tokenizer = Tokenizer.from_file(md.tokenizer_file, model_config.eos_token_ids)
            if model_config.quant is not None:
                from engine.quant.scheme import resolve_checkpoint
                model_config = replace(model_config, quant=resolve_checkpoint(model_config.quant, weights))
            self.pooling = read_pooling(md.path)
            if self.pooling is not None:
                weights = embedder_weights(weights)
                if "lm_head.weight" not in weights.shapes():       # an embedder's head is never read
                    model_config = replace(model_config, tie_word_embeddings=True)
        if config.quantization is not None:
            model_config = _quantize_at_load(config, model_config, weights)
        if config.speculative_model is not None:
            from engine.loading.speculative import read_mtp_head, with_mtp_head
            head = read_mtp_head(config.speculative_model, model_config)
            model_config, weights = with_mtp_head(model_config, weights, head, config.quantization)
        self.model_config = model_config
        found = _shapes(weights, model_config)
        has_mtp = any(n.startswith(MTP_PREFIX) for n in found)
        k = config.draft_tokens
        if k > 0 and not has_mtp:
            log.warning("speculation_off", reason="checkpoint has no mtp.* weights", draft_tokens=k)
            k = 0
        if not has_mtp or k == 0:
            weights = weights.without(MTP_PREFIX)
            found = _shapes(weights, model_config)
        self.draft_tokens = k
        with torch.device("meta"):
            expected = model_class(model_config)(model_config, with_mtp=k > 0).checkpoint_shapes()
        check_tensors(expected, found, self.model_name)
        if model_config.quant is None and hasattr(weights, "dtypes"):
            check_dtypes(weights.dtypes(), self.model_name)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            # the RoPE of these checkpoints is unscaled (ModelConfig.from_hf refuses a scaled one): a
            # longer context would run positions the model never saw
            raise InvalidArgumentError(
                "max_model_len", f"{self.max_model_len} exceeds the model's max_position_embeddings "
                f"{model_config.max_position_embeddings} (its config has no RoPE scaling that would allow it)")
        if config.served_model_name:
            self.model_name = config.served_model_name
        if config.draft_vocab > model_config.vocab_size:
            raise InvalidArgumentError("draft_vocab", f"must be <= vocab_size {model_config.vocab_size}")
        # the kernel family of each operation on this device; "auto" dtype means float16 where there is no bf16
        self.kernel_paths = engine_paths(config, model_config)
        if config.dtype == "auto" and self.kernel_paths.dtype != config.torch_dtype_name:
            config.dtype = self.kernel_paths.dtype
        log.info("kernel_paths", **self.kernel_paths.as_dict())
        self.memory = plan_memory(config, model_config, k, self.max_model_len, paths=self.kernel_paths)
        log.info("memory_plan", plan=self.memory.describe(), model=self.model_name, draft_tokens=k)
        t0 = time.perf_counter()
        self.executor = Executor(config, model_config, weights, self.memory.num_blocks, k, self.max_model_len)
        log.info("weights_loaded", model=self.model_name, ranks=self.executor.num_ranks,
                 seconds=round(time.perf_counter() - t0, 2))
        # hybrids: a cached prefix is used only up to a linear-attention state snapshot at its end
        seats, snapshots = state_slot_counts(config, model_config)
        prefix_reuse = config.prefix_reuse and (snapshots > 0 or not model_config.is_hybrid)
        self.kv = KVCacheManager(self.memory.num_blocks, config.block_size, prefix_reuse)
        self.states = StateSlotPool(seats) if seats else None
        self.snapshots = StateSnapshots(seats, snapshots) if seats and prefix_reuse else None
        self.scheduler = Scheduler(SchedulerConfig(
            max_batch=config.max_batch, max_pending=config.max_pending,
            pending_timeout_s=config.pending_timeout_ms / 1000.0, prefill_chunk=config.prefill_chunk,
            draft_tokens=k, max_model_len=self.max_model_len,
            lease_s=config.lease_seconds, handoff_timeout_s=config.handoff_timeout_seconds,
            seat_timeout_s=config.seat_timeout_seconds or None, adaptive_draft=config.adaptive_draft and k > 0), self.kv, clock,
            states=self.states, snapshots=self.snapshots)
        # a producer's leases on lent KV: a lease's word is zeroed before its request's blocks are freed
        self.kv_leases = KVLeaseTable() if config.kv_role == "producer" else None
        if self.kv_leases is not None:
            self.scheduler.on_free = self.kv_leases.close
        self.metrics = EngineMetrics(interval_s=config.stats_interval_s)
        self.last_step_idle = False
        self.warmup_report = WarmupReport(done=False, no_graphs_reason="not warmed up")
        # async scheduling (engine.worker.async_rounds): the decode round enqueued and not read yet
        self.sync_reason = why_synchronous(config)
        self.async_scheduling = not self.sync_reason
        self._inflight: InflightRound | None = None
        self._readback = TokenReadback(config.max_batch, k + 1, self.executor.driver.device)
        log.info("scheduling", overlapped=self.async_scheduling, why_synchronous=self.sync_reason or None)
        self._stops: dict[str, IncrementalDetokenizer] = {}
        self._stop_text: dict[str, str] = {}
        self._pooled: dict[str, list[torch.Tensor]] = {}      # embedding requests: their last hidden rows
        # structured output: the grammar compiler (built at the first constrained request)
        self.grammars = Grammars(self.tokenizer.to_json, model_config.vocab_size, model_config.eos_token_ids)
        # n > 1: request id -> the ids of its sequences (0 first), until every one has finished
        self._groups: dict[str, list[str]] = {}
        self._landings: set[str] = set()        # whole PD landings in flight (each holds a hidden-state row)

    def warmup(self) -> WarmupReport:
        """What every entry point runs before it serves: one short request through the split path
        (prefill, park, resume, decode: every kernel compiles), then the decode CUDA graphs.

        Services report NOT_SERVING until this returns. Leaves no trace in metrics or the prefix cache."""
        start = time.perf_counter()
        if self.has_work:
            raise RuntimeError("warm up before serving requests")
        prompt = list(range(1, min(self.max_model_len - 8, 2 * self.config.block_size + 3) + 1))
        req = self.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                               request_id=f"warmup-{uuid.uuid4().hex}", park_after_prefill=True)
        while req.status is not RequestStatus.PARKED and not req.finished:
            self.step()
        if not req.finished:
            self.resume(req.request_id)
        while self.has_work:
            self.step()
        buckets: list[int] = []
        graph_s = 0.0
        if self.executor.driver.device.type != "cuda":
            why = "CPU engine: CUDA graphs need a CUDA device"
        elif self.config.enforce_eager:
            why = "--enforce-eager"
        else:
            from engine.worker.cuda_graphs import default_buckets
            buckets = default_buckets(self.config.max_batch)
            log.info("cuda_graphs_capturing", buckets=buckets, ranks=self.executor.num_ranks)
            graph_s = max(self.executor.run_all(lambda runner: runner.capture_graphs(buckets)))
            why = ""
        self.kv.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        self.metrics = EngineMetrics(interval_s=self.config.stats_interval_s)
        self.warmup_report = WarmupReport(done=True, seconds=time.perf_counter() - start, cuda_graphs=bool(buckets),
                                          graph_buckets=tuple(buckets), graph_capture_seconds=graph_s,
                                          no_graphs_reason=why)
        log.info("engine_warm", **self.warmup_report.log_fields())
        return self.warmup_report

    # -- requests -------------------------------------------------------------------------------

    def grammar_future(self, params: SamplingParams) -> Future | None:
        """Future of the request's compiled grammar (None when unconstrained), compiling off the engine
        thread (a front door waits for it before it hands the request to the engine thread). Raises
        GrammarError (INVALID_ARGUMENT) naming the field at once for a bad shape, UnsupportedError without
        xgrammar; a grammar that does not compile (or not in time) fails the future with a GrammarError."""
        if params.structured_output is None:
            return None
        return self.grammars.compile(params.structured_output)

    def compile_grammar(self, params: SamplingParams):
        """The request's compiled grammar (None when unconstrained), waited for on the calling thread."""
        future = self.grammar_future(params)
        return future.result() if future is not None else None

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    park_after_prefill: bool = False, arrival: float | None = None,
                    prefix_cache: bool = True, output_token_ids: list[int] | None = None,
                    grammar=None) -> Request:
        """`output_token_ids`: a request resumed from another engine (a migrated stream): the tokens it
        generated there. Its prefill covers prompt + those and samples nothing; decoding continues
        after them with the same seed and output counters (engine.sched.scheduler: resumed requests).
        `grammar`: the compiled grammar of params.structured_output (compile_grammar), compiled here
        -- on the calling thread -- when not given; each of the n sequences gets a matcher of its own."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidArgumentError("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError("prompt_token_ids", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        resumed = list(output_token_ids or ())
        if resumed:
            bad = [t for t in resumed if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise InvalidArgumentError("output_token_ids", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
            if len(resumed) >= params.max_tokens:
                raise InvalidArgumentError("output_token_ids", f"{len(resumed)} tokens already generated leave "
                                           f"nothing to do under max_tokens={params.max_tokens}")
            if params.n > 1:
                raise InvalidArgumentError("output_token_ids", "a resumed request continues one sequence (n = 1)")
        checked = admit_options(params, vocab, self.tokenizer, self.config.max_batch, self.max_model_len)
        if checked.truncate_to is not None:
            ids = ids[-checked.truncate_to:]
        k_r = self.draft_tokens if params.draft_tokens is None else min(params.draft_tokens, self.draft_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.model_config.eos_token_ids)
        if params.structured_output is not None:
            grammar = grammar if grammar is not None else self.compile_grammar(params)
            matchers = [self.grammars.matcher(grammar, sorted(stop_ids)) for _ in range(params.n)]
            if resumed and matchers[0].accept_tokens(resumed) != len(resumed):
                raise InvalidArgumentError("output_token_ids", "the tokens already generated do not follow "
                                                               "the request's structured_output")
        else:
            matchers = [None] * params.n
        req = Request(
            request_id=request_id or uuid.uuid4().hex, prompt_token_ids=ids, sampling=params,
            seed=params.seed if params.seed is not None else secrets.randbits(63),
            times=PhaseTimes(arrival=self.clock() if arrival is None else arrival),
            draft_tokens=k_r, park_after_prefill=park_after_prefill,
            spec=SpecStats(draft_tokens=k_r, accepted_per_position=[0] * k_r),
            stop_token_ids=frozenset(stop_ids), grammar=matchers[0],
            # prompt logprobs need every prompt position computed: a cached prefix would skip some
            prefix_cache=prefix_cache and params.prompt_logprobs is None,
            bad_words_token_ids=checked.bad_words_token_ids, output_token_ids=resumed, resuming=bool(resumed))
        req.forks = [replace(req, request_id=f"{req.request_id}#{i}", seed=sequence_seed(req.seed, i), index=i,
                             times=PhaseTimes(arrival=req.times.arrival), output_token_ids=[], block_ids=[],
                             spec=SpecStats(draft_tokens=k_r, accepted_per_position=[0] * k_r),
                             prompt_logprobs=[], forks=[], grammar=matchers[i]) for i in range(1, params.n)]
        self.scheduler.add_request(req)
        members = [req, *req.forks]
        if params.n > 1:
            self._groups[req.request_id] = [m.request_id for m in members]
        if params.stop:
            for m in members:
                detok = self._stops[m.request_id] = IncrementalDetokenizer(
                    self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens)
                if resumed:
                    detok.push(resumed)      # a stop string may span the tokens sent before the migration
                    detok.flush()
        return req

    def add_embedding(self, prompt: str | list[int], request_id: str | None = None,
                      arrival: float | None = None) -> Request:
        """An embedding request (embedding checkpoints only): one prefill; its final output carries the
        last prompt token's final-normed hidden state, L2-normalised when the pipeline says so.
        A text prompt is tokenized with the tokenizer's special tokens (Qwen3-Embedding appends EOS)."""
        self.check_embedding()
        ids = self.tokenizer.inner.encode(prompt, add_special_tokens=True).ids if isinstance(prompt, str) else prompt
        req = self.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), request_id, arrival=arrival)
        self._pooled[req.request_id] = self.executor.collect_last_hidden(req.request_id)
        return req

    def check_embedding(self) -> None:
        """UnsupportedError unless this engine serves an embedding checkpoint it can pool."""
        if self.pooling is None:
            raise UnsupportedError(
                f"embeddings: {self.model_name} is a generative model (its directory has no sentence-transformers "
                "pooling in modules.json); serve an embedding checkpoint such as Qwen3-Embedding")
        if not self.pooling.last_token:
            raise UnsupportedError(f"embeddings: {self.model_name} pools by {', '.join(self.pooling.modes) or 'nothing'}; "
                                   "ninfer embeds by last-token pooling (Qwen3-Embedding)")

    def _embedding(self, request_id: str) -> list[float] | None:
        rows = self._pooled.pop(request_id, None)
        if rows is None:
            return None
        self.executor.stop_collecting(request_id)
        if not rows:                     # finished before its prefill ended (aborted)
            return None
        vector = rows[-1].float()                                                   # [hidden]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput:
        """End a request (every sequence of it); -> sequence 0's final output (`abort_all`: every one)."""
        return self.abort_all(request_id, reason)[0]

    def abort_all(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[RequestOutput]:
        """End every unfinished sequence of a request; -> their final outputs (sequence order)."""
        members = [rid for rid in self._groups.get(request_id, [request_id]) if rid in self.scheduler.requests]
        if not members:
            raise RequestNotFoundError(f"no request {request_id!r}")
        finished = [self.scheduler.finish(rid, reason) for rid in members if rid in self.scheduler.requests]
        finished += self.scheduler.take_cascaded()
        return [self._finished_output(req, []) for req in sorted(finished, key=lambda r: r.index)]

    def resume(self, request_id: str) -> Request:
        """Attach a decode to a parked request: every parked sequence of it joins the decode batch."""
        members = self._groups.get(request_id, [request_id])
        parked = [rid for rid in members if self.scheduler.is_parked(rid)]
        if not parked:
            return self.scheduler.resume(request_id)             # RequestNotFoundError, as before
        return [self.scheduler.resume(rid) for rid in parked][0]

    # -- prefill/decode disaggregation: a request's whole state lands from a producer (engine.cache.kv_landing)

    def lent(self, request_id: str) -> tuple[kv_landing.Lent, int, KVLease | None]:
        """What a parked request lends a consumer, its hidden-state row (-1 without MTP) and the lease it is
        lent under (a producer's: its word is zeroed before the request's blocks, slot and row are freed;
        None when no lease word is free, or on an engine that keeps no leases). NOT_FOUND when it is not
        parked (any more)."""
        if not self.scheduler.is_parked(request_id):
            raise RequestNotFoundError(f"no parked request {request_id!r} (unknown, released or expired)")
        lease = self.kv_leases.open(request_id) if self.kv_leases is not None else None
        runner = self.executor.driver
        if runner.device.type == "cuda":
            # the prefill's hidden-row write is enqueued after its sampling's host read: done before a peer reads
            torch.cuda.synchronize(runner.device)
        row = runner.hidden.rows[request_id] if runner.hidden is not None else -1
        return kv_landing.lent(self.kv, self.scheduler.requests[request_id]), row, lease

    def reserve_landing(self, request_id: str, token_ids: list[int], num_blocks: int,
                        whole: bool) -> kv_landing.KVLanding | None:
        """Room for a pull: blocks; whole, also a state slot (hybrids) and a hidden-state row (MTP).
        None when any of them is short now."""
        # a whole landing becomes an attached request: it counts among the parked and attached, whose bound
        # keeps a hidden-state row for every request the prefill lane admits
        if whole and len(self._landings) >= self.scheduler.parked_room:
            return None
        landing = kv_landing.reserve(self.kv, request_id, token_ids, num_blocks, self.states if whole else None,
                                     whole)
        hidden = self.executor.driver.hidden
        if landing is not None and whole and hidden is not None:
            row = hidden.take(landing.request_id)
            if row is None:
                kv_landing.drop(self.kv, landing, self.states)
                return None
            landing.hidden_row = row
        if landing is not None and whole:
            self._landings.add(landing.request_id)
        return landing

    def drop_landing(self, landing: kv_landing.KVLanding) -> None:
        self._landings.discard(landing.request_id)
        kv_landing.drop(self.kv, landing, self.states)
        if landing.hidden_row >= 0:
            self.executor.driver.hidden.release([landing.request_id])
            landing.hidden_row = -1

    def add_pulled(self, landing: kv_landing.KVLanding, prompt: list[int], params: SamplingParams,
                   first_token_id: int, request_id: str | None = None, arrival: float | None = None,
                   grammar=None) -> tuple[Request, list[RequestOutput]]:
        """Admit a request whose prompt a producer prefilled and whose state landed whole: it decodes from
        the pulled KV, state and hidden row with the producer's first token, computing no prompt token.
        -> the request and the first token's output. The landing is the request's afterwards."""
        if not kv_landing.lands_whole(params):
            raise InvalidArgumentError("n", "a request admitted over pulled state continues one sequence, "
                                            "without prompt logprobs or logprobs (its first token's are not moved)")
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise InvalidArgumentError("kv_transfer_params_json.first_token_id",
                                       f"{first_token_id} is outside the vocabulary [0, {self.model_config.vocab_size})")
        if list(prompt) != landing.token_ids:
            raise InvalidArgumentError("prompt", "is not the prompt whose state landed (truncate it before the pull)")
        req = self.add_request(prompt, params, request_id, arrival=arrival, grammar=grammar)
        self._landings.discard(landing.request_id)
        if req.prompt_token_ids != landing.token_ids:          # truncate_prompt_tokens cut it at admission
            self.abort_all(req.request_id)
            raise InvalidArgumentError("truncate_prompt_tokens", "apply it before the pull: the landed state is "
                                       f"the state of all {len(landing.token_ids)} prompt tokens")
        runner = self.executor.driver
        if landing.hidden_row >= 0:
            runner.hidden.rename(landing.request_id, req.request_id)
            landing.hidden_row = -1
        event = self.scheduler.admit_pulled(req, landing, first_token_id)
        if params.adjusts_logits:       # the option slot's history: the prompt and the first token
            runner.options.fill(req.request_id, req.prompt_token_ids, list(req.output_token_ids), params,
                                req.stop_token_ids, req.bad_words_token_ids)
        self.metrics.record_step(self.clock(), 0, 0, len(req.prompt_token_ids))     # all of it a cache hit
        return req, self._outputs(SchedulerOutput(prefills=[], decode=[], finished_request_ids=[]), [], [event])

    def is_unclaimed(self, request_id: str) -> bool:
        """A split request no decode has attached to (see Scheduler.is_unclaimed), by its sequence 0."""
        return self.scheduler.is_unclaimed(request_id)

    @property
    def has_work(self) -> bool:
        # requests that left (an aborted or released parked one) free their runner rows in a step of their own
        return self.scheduler.has_work or self._inflight is not None or self.scheduler.has_leavers

    # -- one step -------------------------------------------------------------------------------

    def expire(self) -> list[RequestOutput]:
        """Finish requests past the pending timeout or their lease (also called by an idle loop)."""
        return [self._finished_output(r, []) for r in self.scheduler.expire()]

    def num_sequences(self, request_id: str) -> int:
        return len(self._groups.get(request_id, (request_id,)))

    def step(self) -> list[RequestOutput]:
        """One round. With async scheduling a decode round is enqueued here and its tokens come out of
        the next step, which enqueues the round after it first (engine.worker.async_rounds)."""
        outputs = self.expire()
        if self._inflight is not None:
            ahead = plan_ahead(self.scheduler, self._inflight)
            landing, self._inflight = self._inflight, (self._launch(ahead) if ahead is not None else None)
            outputs += self._land(landing)
            if self._inflight is not None or not self.scheduler.has_work:
                self.last_step_idle = False
                return outputs
        sched = self.scheduler.schedule()
        # nothing could run (queued requests wait for KV or a batch seat held by parked ones)
        self.last_step_idle = sched.empty
        if self.async_scheduling and sched.decode and not sched.prefills:
            self._inflight = self._launch(sched)
            return outputs
        prefilling = list(self.scheduler.lane.requests)
        # an empty step still runs when requests left: the runner frees their state (hidden-pool rows)
        if not sched.empty or sched.finished_request_ids:
            with self._grammar_masks(sched):
                result = self.executor.execute(sched)
        else:
            result = ModelOutput()
        return outputs + self._outputs(sched, prefilling, self.scheduler.update(sched, result))

    def _launch(self, sched: SchedulerOutput) -> InflightRound:
        with self._grammar_masks(sched):
            host, arrived = self._readback.start(self.executor.launch(sched))
        return InflightRound(sched, [self.scheduler.requests[w.request_id] for w in sched.decode], host, arrived)

    @contextmanager
    def _grammar_masks(self, sched: SchedulerOutput):
        """Structured output: the step's mask rows filled from the matchers before it is enqueued; the
        matchers rolled back to their accepted tokens after (its drafts advanced them)."""
        reqs = self.scheduler.requests
        decode = [reqs[w.request_id].grammar for w in sched.decode]
        prefill = [reqs[p.request_id].grammar for p in sched.prefills if p.sample]
        if not any(g is not None for g in decode) and not any(g is not None for g in prefill):
            yield
            return
        masks = self.executor.masks
        masks.begin(decode, prefill)
        try:
            yield
        finally:
            masks.end()

    def _land(self, inflight: InflightRound) -> list[RequestOutput]:
        """Round N's bookkeeping, once its tokens arrived (rows of requests gone since are dropped)."""
        result = inflight.result()
        sched = inflight.live(self.scheduler)
        return self._outputs(sched, [], self.scheduler.update(sched, result))

    def _outputs(self, sched: SchedulerOutput, prefilling: list[Request], events) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for ev in events:
            self._advance_grammar(ev.request, ev.new_token_ids)
        for ev in events:                # tokens past a stop string are neither delivered nor counted
            ev.new_token_ids = self._apply_stop_strings(ev.request, ev.new_token_ids)
            if ev.logprobs is not None:
                ev.logprobs = ev.logprobs[:len(ev.new_token_ids)]
        self._record(sched, prefilling, events)
        for ev in events:
            req = ev.request
            if req.finished:
                out = self._finished_output(req, ev.new_token_ids)
            else:
                parked = req.status is RequestStatus.PARKED
                out = RequestOutput(req.group_id, ev.new_token_ids, False, stats=(
                    req.stats(self.config.prefill_chunk) if parked else None), index=req.index)
            out.logprobs = ev.logprobs
            if req.sampling.prompt_logprobs is not None and req.index == 0 and not req.prompt_logprobs_sent:
                out.prompt_logprobs = [None, *req.prompt_logprobs]
                req.prompt_logprobs_sent = True
            outputs.append(out)
        return outputs

    @staticmethod
    def _advance_grammar(req: Request, tokens: list[int]) -> None:
        """Structured output: the matcher accepts the tokens the request just appended (each was sampled
        under its mask, so a refusal is a bug: logged, and the request is left to its limits)."""
        if req.grammar is None or not tokens:
            return
        taken = req.grammar.accept_tokens(tokens)
        if taken != len(tokens):
            log.error("grammar_refused_token", request_id=req.request_id, token=tokens[taken])

    def _apply_stop_strings(self, req: Request, tokens: list[int]) -> list[int]:
        detok = self._stops.get(req.request_id)
        if detok is None or not tokens:
            return tokens
        params = req.sampling
        first = len(req.output_token_ids) - len(tokens)          # output index of tokens[0]
        for i, tok in enumerate(tokens):
            before = len(detok.text)
            detok.push([tok])
            if first + i + 1 <= params.min_tokens:               # stop strings count after min_tokens (vLLM)
                continue
            cut = stop_cut(detok.text, params.stop, before, params.include_stop_str_in_output)
            if cut is not None:
                kept = tokens[:i + 1]
                del req.output_token_ids[first + i + 1:]
                self._stop_text[req.request_id] = detok.text[:cut]
                if not req.finished:
                    self.scheduler.finish(req.request_id, FinishReason.STOP)
                else:
                    req.finish_reason = FinishReason.STOP
                return kept
        return tokens

    def _finished_output(self, req: Request, tokens: list[int]) -> RequestOutput:
        self._stops.pop(req.request_id, None)
        stats = req.stats(self.config.prefill_chunk)
        self.metrics.record_request(stats)
        group = self._groups.get(req.group_id)
        if group is not None and all(rid not in self.scheduler.requests for rid in group):
            del self._groups[req.group_id]
        return RequestOutput(req.group_id, tokens, True, req.finish_reason, stats,
                             self._stop_text.pop(req.request_id, None), index=req.index,
                             embedding=self._embedding(req.request_id))

    def _record(self, sched, prefilling: list[Request], events) -> None:
        prefill = sum(len(p.token_ids) for p in sched.prefills)
        # prefix-cache hits count once, in the step of a request's first chunk
        lane = {r.request_id: r for r in prefilling}
        hits = 0
        for piece in sched.prefills:
            req = lane.get(piece.request_id)
            if req is not None and req.num_preemptions == 0 and piece.start == req.num_cached_tokens:
                hits += req.num_cached_tokens
        decoding = {w.request_id for w in sched.decode}
        decode = sum(len(ev.new_token_ids) for ev in events if ev.request.request_id in decoding)
        if prefill or decode:
            self.metrics.record_step(self.clock(), prefill, decode, hits)

    def snapshot(self) -> dict[str, Any]:
        """The metrics contract (history / last / performance), KV (with its reference counters) and queue."""
        kv = {"num_blocks": self.kv.num_blocks, "free_blocks": self.kv.num_free_blocks,
              "block_size": self.kv.block_size, "capacity_tokens": self.kv.capacity_tokens,
              "usage": self.kv.usage, "refs_taken": self.kv.refs_taken, "refs_dropped": self.kv.refs_dropped}
        if self.states is not None:                  # hybrids: one linear-attention state per admitted request
            kv["state_slots"] = self.states.num_slots
            kv["state_slots_used"] = self.states.num_slots - self.states.num_free
        hidden = self.executor.driver.hidden
        kv["mtp_hidden_rows_used"] = len(hidden.rows) if hidden is not None else 0
        s = self.scheduler
        queue = {"waiting": len(s.waiting), "prefilling": len(s.lane),
                 "running": len(s.running) + len(s.attached),   # attached: decoding once a seat frees
                 "parked": len(s.parked), "awaiting_seat": len(s.attached), **s.waits()}
        return self.metrics.snapshot(self.clock(), kv, queue)

    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            model=self.model_name, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            kv_capacity_tokens=self.kv.capacity_tokens, block_size=c.block_size, prefill_chunk=c.prefill_chunk,
            draft_tokens=self.draft_tokens, eos_token_ids=tuple(self.model_config.eos_token_ids),
            tokenizer_json=self.tokenizer.to_json(), device=c.device, dtype=c.torch_dtype_name,
            kv_dtype=c.kv_dtype_name, tensor_parallel_size=self.executor.num_ranks, lease_seconds=c.lease_seconds,
            warmup=self.warmup_report, max_num_seqs=c.max_batch, max_pending=c.max_pending,
            kernel_paths=tuple(self.kernel_paths.as_dict().items()), embedding=self.pooling is not None)

    @torch.inference_mode()
    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits [P, vocab] at every prompt position, computed by the engine's chunked prefill.
        The prefix cache is not used: a cached prefix would skip the logits of its positions."""
        req = self.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), prefix_cache=False)
        with self.executor.collect_prompt_logits(req.request_id) as chunks:
            while not req.finished:
                self.step()
        return torch.cat(chunks)[-len(req.prompt_token_ids):]

    def shutdown(self) -> None:
        """Release the model, KV and graphs on every rank (the core is unusable afterwards)."""
        self.grammars.shutdown()
        self.executor.shutdown()
