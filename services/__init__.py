"""The engine process over gRPC: PrefillService, DecodeService and EngineInfoService around one
EngineLoop, and what every ninfer server shares (errors, auth, health and drain, tracing, metrics)."""
