"""The one call the engine host makes: put smg's engine protocol on the engine's gRPC server."""

from __future__ import annotations

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from engine.config import EngineConfig
from services.engine_context import EngineContext
from services.smg.vllm_servicer import VllmEngineServicer

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


def add_smg_services(ctx: EngineContext, server: grpc.Server, service_names: list[str],
                     config: EngineConfig) -> VllmEngineServicer:
    """Register `vllm.grpc.engine.VllmEngine` beside ninfer.v1 on the same server (same interceptors,
    bearer token, limits and drain); `service_names` (what reflection lists) gains its name."""
    servicer = VllmEngineServicer(ctx, config)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    service_names.append(SERVICE_NAME)
    return servicer
