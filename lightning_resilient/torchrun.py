"""torchrun's in-job restarts: each attempt's process group keeps its keys in torchrun's store apart from those of
the attempts before it, so a restarted rank never connects to a peer of the attempt that was killed.

Under torchrun the agent hosts the TCPStore the workers create their process group through
(``TORCHELASTIC_USE_AGENT_STORE=True``: always with the default static rendezvous, and with ``--rdzv-backend c10d``
unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and that store outlives the workers. When ``--max-restarts``
restarts the group, the store still holds what the killed attempt's ranks published, under the very keys the new
attempt uses (torch 2.13 names them by group and rank only). Creating the process group, each rank publishes its
own address and reads its peers': a rank of the new attempt that reads before a slower peer has published gets that
peer's address from the killed attempt, a port nobody listens on any more. gloo then fails after a few quick retries
(their number is fixed: a longer timeout does not help) with ``Gloo connectFullMesh failed ... timed out connecting:
SO_ERROR: Connection refused``, which spends one of torchrun's restarts; or both sides wait for the other until the
timeout (gloo picks which side connects by comparing ports). NCCL's unique id goes through the store the same way.
How often it happens depends on how far apart the ranks of the new attempt reach ``init_process_group``: seldom on an
idle node, every other restart on a loaded one.

Here each attempt creates its default process group under a prefix of its own,
``lightning_resilient/attempt-<TORCHELASTIC_RESTART_COUNT>/init-<n>/`` (``n`` counts the process groups this process
created, for a script that destroys one and creates another), so a rank waits for its peers of the same attempt.
Every rank must name the attempt alike: the ranks of one torchrun agent (``GROUP_WORLD_SIZE`` 1: one node) share its
restart count. The agents of several nodes need not (with ``--rdzv-backend c10d`` a node restarted because another
failed keeps its count), so with several agents the store is left as torch makes it; launch them with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which gives every rendezvous round a store of its own (docs/restarts.md).

How: Lightning creates the process group in ``Strategy.setup_environment`` (every strategy) with
``torch.distributed.init_process_group``, passing neither ``store`` nor ``init_method``, and neither Lightning nor
torch has a setting that prefixes the keys. :func:`scope_process_group` makes the Trainer's strategy run its next
``setup_environment`` inside :func:`attempt_scoped_init`, during which ``init_process_group`` is given the store torch
would have made itself (``torch.distributed.rendezvous("env://")``, the agent's), under this attempt's prefix;
nothing else changes, and the wrapper removes itself after that call. The fit-start check's entry point
(``io/fit_check.py``) calls it for every Trainer whose checkpoint plugin is ``AtomicCheckpointIO``, while the Trainer
is built: the last moment before ``fit`` creates the group that a plugin or a callback is given.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["attempt_prefix", "attempt_scoped_init", "scope_process_group"]

log = logging.getLogger(__name__)

# The process groups this process created inside attempt_scoped_init: every rank of an attempt runs the same script,
# so the n-th group of one rank meets the n-th group of the others.
_INITS = itertools.count()


def attempt_prefix(environ: Mapping[str, str] | None = None) -> str | None:
    """The store prefix of this torchrun attempt's process groups, or None where no prefix is wanted: not under
    torchrun's shared store, or under several agents (which may count restarts differently; see the module)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"lightning_resilient/attempt-{restart}" if restart.isdigit() else None


@contextlib.contextmanager
def attempt_scoped_init(prefix: str) -> Iterator[None]:
    """Within the block, ``torch.distributed.init_process_group`` called without ``store`` and with ``env://`` (the
    default) rendezvous through the store torch would use, under ``prefix/init-<n>/`` (see the module). A call that
    names its own store or another ``init_method``, or no rank and world size, is passed on unchanged."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    original = dist.init_process_group

    def init_process_group(backend: Any = None, init_method: str | None = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, **kwargs: Any) -> None:
        if store is None and init_method in (None, "env://") and rank >= 0 and world_size > 0:
            timeout = timeout if timeout is not None else default_pg_timeout
            # As init_process_group makes it: the env:// rendezvous (under torchrun: a client of the agent's store),
            # its timeout, and "default_pg" to keep the group's keys apart from others in the same store.
            client, rank, world_size = next(rendezvous("env://", rank, world_size, timeout=timeout))
            client.set_timeout(timeout)
            scope = f"{prefix}/init-{next(_INITS)}"
            log.debug("creating the process group under %r of torchrun's store", scope)
            store, init_method = PrefixStore(f"{scope}/default_pg", client), None
        original(backend, init_method, timeout, world_size, rank, store, **kwargs)

    # setattr: the wrapper passes torch's later parameters on as **kwargs, which mypy does not take for its signature.
    setattr(dist, "init_process_group", init_process_group)  # noqa: B010
    try:
        yield
    finally:
        setattr(dist, "init_process_group", original)  # noqa: B010


class _ScopedSetup:
    """``strategy.setup_environment`` for one call: the strategy's own, inside :func:`attempt_scoped_init`; then
    gone (what the instance held before comes back). A class, not a closure, so the strategy stays picklable."""

    def __init__(self, strategy: Any, prefix: str) -> None:
        self.strategy, self.prefix = strategy, prefix
        self.before = strategy.__dict__.get("setup_environment")  # None: the class's method

    def __call__(self) -> Any:
        strategy, before = self.strategy, self.before
        if before is None:
            del strategy.setup_environment  # the class's method again
        else:
            strategy.setup_environment = before
        setup: Callable[[], Any] = strategy.setup_environment
        with attempt_scoped_init(self.prefix):
            return setup()


def scope_process_group(trainer: Any) -> None:
    """Make ``trainer``'s strategy create its process group under this torchrun attempt's prefix (see the module);
    outside torchrun's shared store, or with several agents, do nothing."""
    prefix = attempt_prefix()
    strategy = getattr(trainer, "strategy", None)
    if prefix is None or strategy is None or not hasattr(strategy, "__dict__"):
        return
    if isinstance(strategy.__dict__.get("setup_environment"), _ScopedSetup):
        return  # a second Trainer built around the same strategy
    strategy.setup_environment = _ScopedSetup(strategy, prefix)
