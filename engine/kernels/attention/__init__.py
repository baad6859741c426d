"""Attention kernels: the paged KV write and attention (prefill, decode, verify), the TMA prefill, int8 pages."""
