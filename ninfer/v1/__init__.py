"""Generated protobuf code for the ninfer.v1 API (tools/dev/gen_protos.py); do not edit."""
