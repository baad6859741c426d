"""Generated protobuf code for the ninfer.v1 API (tools/gen_protos.py); do not edit."""
