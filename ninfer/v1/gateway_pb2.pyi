from ninfer.v1 import common_pb2 as _common_pb2
from ninfer.v1 import engine_info_pb2 as _engine_info_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("include_token_ids", "continuous_usage_stats")
    INCLUDE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_USAGE_STATS_FIELD_NUMBER: _ClassVar[int]
    include_token_ids: bool
    continuous_usage_stats: bool
    def __init__(self, include_token_ids: _Optional[bool] = ..., continuous_usage_stats: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "prompt_token_ids", "sampling", "model", "stream_options", "parse_special_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    prompt_token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    model: str
    stream_options: StreamOptions
    parse_special_tokens: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., parse_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "usage", "result", "index", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    usage: _common_pb2.Usage
    result: GenerateResult
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("stats", "gateway_timings", "model", "engine", "migrations")
    STATS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    stats: _common_pb2.RequestStats
    gateway_timings: GatewayTimings
    model: str
    engine: str
    migrations: int
    def __init__(self, stats: _Optional[_Union[_common_pb2.RequestStats, _Mapping]] = ..., gateway_timings: _Optional[_Union[GatewayTimings, _Mapping]] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., migrations: _Optional[int] = ...) -> None: ...

class GatewayTimings(_message.Message):
    __slots__ = ("tokenize_seconds", "prefill_call_seconds", "ttft_seconds", "inter_token_seconds", "total_seconds")
    TOKENIZE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokenize_seconds: float
    prefill_call_seconds: float
    ttft_seconds: float
    inter_token_seconds: float
    total_seconds: float
    def __init__(self, tokenize_seconds: _Optional[float] = ..., prefill_call_seconds: _Optional[float] = ..., ttft_seconds: _Optional[float] = ..., inter_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class GetEngineMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineMetricsEntry(_message.Message):
    __slots__ = ("engine", "serving", "in_flight", "metrics")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    serving: bool
    in_flight: int
    metrics: _engine_info_pb2.EngineMetrics
    def __init__(self, engine: _Optional[str] = ..., serving: _Optional[bool] = ..., in_flight: _Optional[int] = ..., metrics: _Optional[_Union[_engine_info_pb2.EngineMetrics, _Mapping]] = ...) -> None: ...

class GetEngineMetricsResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineMetricsEntry]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineMetricsEntry, _Mapping]]] = ...) -> None: ...
