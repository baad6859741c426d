"""gRPC server plumbing the engine process and the gateway share: options and the server, TLS, auth, errors, limits, health and drain, Prometheus, OpenTelemetry."""
