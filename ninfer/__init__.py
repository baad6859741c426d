"""ninfer: an LLM inference server for gRPC. `ninfer.cli` is the command line (`ninfer`, `python -m
ninfer`); `ninfer.v1` is the generated code of the public protocol (tools/dev/gen_protos.py)."""
