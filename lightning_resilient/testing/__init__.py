"""Helpers for testing and benchmarking against real stores: a loopback proxy that injects faults and models
an object store's latency and per-connection bandwidth, and a reader of a child process's lines."""

from lightning_resilient.testing.lines import LineReader
from lightning_resilient.testing.proxy import StoreProxy

__all__ = ["LineReader", "StoreProxy"]
