"""Writers for the randomized protocol test: each one job's saves through the storage protocol, no Lightning.

``python protocol_worker.py`` is a zygote: it imports everything once (a couple of seconds), prints ``ZYGOTE``,
then for each line ``spawn IN OUT`` (two named pipes) forks a writer process, in a session of its own, and prints
``PID <pid>``; the parent SIGKILLs writers at any instant, and a new one costs a fork, not an import.

A writer reads from IN one line ``ROOT OPTIONS_JSON KEEP_LAST TAG ORIGIN_URL`` naming the root and where this
job's training comes from (a commit URL to resume, or ``-`` for a fresh start), loads that commit and writes
``READY <step>`` to OUT. Then each line ``save <step> <name>`` saves the checkpoint :func:`content` gives for
(TAG, step) as ``name`` (its first save claims the root), writing ``BEGIN <step>`` before and ``END <commit>`` (or
``ERROR <message>``) after.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch


def content(tag: str, step: int) -> dict[str, Any]:
    """The checkpoint a job tagged ``tag`` saves at ``step``: its bytes tell which job and step wrote it."""
    seed = int.from_bytes(hashlib.sha256(f"{tag}/{step}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    # The frozen weights: the same bytes at every step and in every job (what an incremental save references, not
    # rewrites: a resumed job's first save finds them by digest among the objects of the checkpoint it loaded).
    frozen = torch.Generator().manual_seed(20261206)
    return {"global_step": step, "epoch": 0, "job": tag,
            "state_dict": {"w": torch.randn(3000, generator=g), "b": torch.randn(64, generator=g).double(),
                           "frozen": torch.randn(2048, generator=frozen)},
            "loops": {"step": step}}


def writer(lines: IO[str], out: IO[str]) -> None:
    from lightning_resilient.io.catalog import normalize, resolve
    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.root import CheckpointRoot, RootSettings
    from lightning_resilient.io.store import open_store

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    root_url, options, keep_last, tag, origin = lines.readline().split()
    # Every other writer saves incrementally (its frozen tensor referenced across steps by digest: a fresh tensor
    # every save), so a SIGKILL also lands in saves that reference other commits' objects.
    settings = RootSettings(keep_last=int(keep_last), shard_size=4096, orphan_grace_seconds=0.0,
                            fallback_on_corruption=True, chunk_size=2048, max_concurrency=4,
                            dedup=int(tag.lstrip("j") or 0) % 2 == 0)
    root = CheckpointRoot(open_store(normalize(root_url), json.loads(options), RetryPolicy(3, 0.01, 0.1)), settings,
                          lambda: ThreadPoolExecutor(4))
    step = 0
    if origin != "-":
        found = resolve(normalize(origin), lambda _: root)
        assert found is not None
        loaded = root.load(found.entry.commit, map_location=None, weights_only=True)
        root.resumed(found.entry)
        root.remember_loaded(loaded)  # as the plugin's load does: a dedup writer references its unchanged objects
        step = loaded.checkpoint["global_step"]
    say(f"READY {step}")
    for line in lines:
        command, arg, name = line.split()
        assert command == "save", line
        say(f"BEGIN {arg}")
        try:
            entry = root.save(content(tag, int(arg)), name)
        except Exception as exc:  # reported to the parent, which decides
            say(f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "))
        else:
            say(f"END {entry.commit}")


def zygote() -> None:
    # Everything a writer needs, imported once; no thread is started before a fork (s3fs starts its own in each).
    import lightning_resilient.io.catalog
    import lightning_resilient.io.root  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # writers are reaped by the kernel
    print("ZYGOTE", flush=True)
    for line in sys.stdin:
        _, fifo_in, fifo_out = line.split()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                with open(fifo_in) as lines, open(fifo_out, "w") as out:
                    writer(lines, out)
            finally:
                os._exit(0)
        print(f"PID {pid}", flush=True)


if __name__ == "__main__":
    zygote()
