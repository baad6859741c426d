"""Tensor parallelism inside one engine process: groups, the executor that drives every rank, communicators."""
