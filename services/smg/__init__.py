"""The engine protocols of PyPI `smg-grpc-proto`, served beside ninfer.v1 so that Shepherd Model
Gateway (PyPI `smg`) routes to ninfer engines unchanged. See vllm_servicer.py for the choice."""

from services.smg.register import add_smg_services

__all__ = ["add_smg_services"]
