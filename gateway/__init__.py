"""ninfer's public side: the gRPC gateway, its client and the `ninfer` command line."""
