"""Helpers for testing and benchmarking against real stores: a loopback proxy that injects faults and models
an object store's latency and per-connection bandwidth."""

from lightning_resilient.testing.proxy import StoreProxy

__all__ = ["StoreProxy"]
