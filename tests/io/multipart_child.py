"""A writer SIGKILLed in the middle of a multipart upload (tests/io/test_s3_uploads.py):
``python multipart_child.py ROOT ENDPOINT``. Commits ``a.ckpt`` (one small object), prints ``COMMITTED``, then saves
``b.ckpt``, whose 6 MiB tensors go up as multipart uploads of 5 MiB parts through ENDPOINT (a slow proxy), and is
killed there by the test."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_resilient import AtomicCheckpointIO
from lightning_resilient.io.store import s3 as s3_store
from tests.io.helpers import make_checkpoint

s3_store.MULTIPART_THRESHOLD = s3_store.PART_SIZE = 5 * 2**20  # S3's smallest parts: multipart above 5 MiB

root, endpoint = sys.argv[1], sys.argv[2]
io = AtomicCheckpointIO(storage_options={"client_kwargs": {"endpoint_url": endpoint}}, shard_size=12 * 2**20,
                        max_concurrency=2)
io.save_checkpoint(make_checkpoint(1), f"{root}/a.ckpt")
print("COMMITTED", flush=True)
big = make_checkpoint(2)
big["state_dict"]["big"] = torch.randn(6 * 2**20 // 4 * 2)  # 12 MiB: two objects, each a multipart upload
io.save_checkpoint(big, f"{root}/b.ckpt")
print("SAVED b.ckpt: the test meant to kill it before", flush=True)
