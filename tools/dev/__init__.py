"""Development scripts: the GPU machine's check, sweep and profile runners, A/B helpers, protobuf generation."""
