from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "kv_capacity_tokens", "block_size", "prefill_chunk", "draft_tokens", "eos_token_ids", "tokenizer_json", "tokenizer_sha256", "device", "dtype", "kv_dtype", "tensor_parallel_size", "lease_seconds", "warmup", "max_num_seqs", "max_pending", "kernel_paths")
    class KernelPathsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_FIELD_NUMBER: _ClassVar[int]
    KERNEL_PATHS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    prefill_chunk: int
    draft_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_json: str
    tokenizer_sha256: str
    device: str
    dtype: str
    kv_dtype: str
    tensor_parallel_size: int
    lease_seconds: float
    warmup: Warmup
    max_num_seqs: int
    max_pending: int
    kernel_paths: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_json: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., warmup: _Optional[_Union[Warmup, _Mapping]] = ..., max_num_seqs: _Optional[int] = ..., max_pending: _Optional[int] = ..., kernel_paths: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Warmup(_message.Message):
    __slots__ = ("done", "seconds", "cuda_graphs", "graph_buckets", "graph_capture_seconds", "no_graphs_reason")
    DONE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_GRAPHS_REASON_FIELD_NUMBER: _ClassVar[int]
    done: bool
    seconds: float
    cuda_graphs: bool
    graph_buckets: _containers.RepeatedScalarFieldContainer[int]
    graph_capture_seconds: float
    no_graphs_reason: str
    def __init__(self, done: _Optional[bool] = ..., seconds: _Optional[float] = ..., cuda_graphs: _Optional[bool] = ..., graph_buckets: _Optional[_Iterable[int]] = ..., graph_capture_seconds: _Optional[float] = ..., no_graphs_reason: _Optional[str] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsHistory(_message.Message):
    __slots__ = ("interval_seconds", "prefill_tokens", "decode_tokens", "cache_hit_tokens")
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: _containers.RepeatedScalarFieldContainer[float]
    prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    decode_tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, interval_seconds: _Optional[_Iterable[float]] = ..., prefill_tokens: _Optional[_Iterable[int]] = ..., decode_tokens: _Optional[_Iterable[int]] = ..., cache_hit_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class MetricsLast(_message.Message):
    __slots__ = ("prompt_tokens", "computed_prefill_tokens", "completion_tokens", "prefill_tok_s", "decode_tok_s", "ttft_s", "peak_prefill_tok_s", "peak_tok_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOK_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_PREFILL_TOK_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_TOK_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    computed_prefill_tokens: int
    completion_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float
    peak_prefill_tok_s: float
    peak_tok_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., computed_prefill_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prefill_tok_s: _Optional[float] = ..., decode_tok_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., peak_prefill_tok_s: _Optional[float] = ..., peak_tok_s: _Optional[float] = ...) -> None: ...

class MetricsPerformance(_message.Message):
    __slots__ = ("requests", "rounds", "accepted_per_position", "acceptance_per_position", "mean_prefill_tok_s", "mean_decode_tok_s")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_PREFILL_TOK_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.ScalarMap[str, int]
    rounds: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    acceptance_per_position: _containers.RepeatedScalarFieldContainer[float]
    mean_prefill_tok_s: float
    mean_decode_tok_s: float
    def __init__(self, requests: _Optional[_Mapping[str, int]] = ..., rounds: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., acceptance_per_position: _Optional[_Iterable[float]] = ..., mean_prefill_tok_s: _Optional[float] = ..., mean_decode_tok_s: _Optional[float] = ...) -> None: ...

class KvCacheState(_message.Message):
    __slots__ = ("num_blocks", "free_blocks", "block_size", "capacity_tokens", "usage", "refs_taken", "refs_dropped", "state_slots", "state_slots_used", "mtp_hidden_rows_used")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REFS_TAKEN_FIELD_NUMBER: _ClassVar[int]
    REFS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    MTP_HIDDEN_ROWS_USED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    free_blocks: int
    block_size: int
    capacity_tokens: int
    usage: float
    refs_taken: int
    refs_dropped: int
    state_slots: int
    state_slots_used: int
    mtp_hidden_rows_used: int
    def __init__(self, num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., usage: _Optional[float] = ..., refs_taken: _Optional[int] = ..., refs_dropped: _Optional[int] = ..., state_slots: _Optional[int] = ..., state_slots_used: _Optional[int] = ..., mtp_hidden_rows_used: _Optional[int] = ...) -> None: ...

class QueueState(_message.Message):
    __slots__ = ("waiting", "prefilling", "running", "parked", "awaiting_seat", "oldest_parked_s", "oldest_awaiting_seat_s")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    AWAITING_SEAT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_PARKED_S_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AWAITING_SEAT_S_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    prefilling: int
    running: int
    parked: int
    awaiting_seat: int
    oldest_parked_s: float
    oldest_awaiting_seat_s: float
    def __init__(self, waiting: _Optional[int] = ..., prefilling: _Optional[int] = ..., running: _Optional[int] = ..., parked: _Optional[int] = ..., awaiting_seat: _Optional[int] = ..., oldest_parked_s: _Optional[float] = ..., oldest_awaiting_seat_s: _Optional[float] = ...) -> None: ...

class EngineMetrics(_message.Message):
    __slots__ = ("history", "last", "performance", "kv", "queue")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PERFORMANCE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    history: MetricsHistory
    last: MetricsLast
    performance: MetricsPerformance
    kv: KvCacheState
    queue: QueueState
    def __init__(self, history: _Optional[_Union[MetricsHistory, _Mapping]] = ..., last: _Optional[_Union[MetricsLast, _Mapping]] = ..., performance: _Optional[_Union[MetricsPerformance, _Mapping]] = ..., kv: _Optional[_Union[KvCacheState, _Mapping]] = ..., queue: _Optional[_Union[QueueState, _Mapping]] = ...) -> None: ...
