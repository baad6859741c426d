"""Scheduling, torch-free: requests, FIFO admission, the prefill lane, the decode batch, the draft policy."""
