"""The one call the engine host makes: put smg's engine protocol on the engine's gRPC server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from services.smg.vllm_servicer import VllmEngineServicer

if TYPE_CHECKING:
    from services.engine_host import EngineHost

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


def add_smg_services(host: "EngineHost") -> VllmEngineServicer:
    """Register `vllm.grpc.engine.VllmEngine` beside ninfer.v1 (same server: same interceptors, auth,
    limits and drain); reflection lists it when enabled."""
    servicer = VllmEngineServicer(host)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, host.server)
    host.service_names.append(SERVICE_NAME)
    return servicer
