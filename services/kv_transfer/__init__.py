"""Prefill/decode disaggregation across engines: the transfer engine (NIXL) and the hand-off smg relays."""
