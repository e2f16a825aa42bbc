"""What a store's content cannot make a load do, and what is not corruption.

A manifest is sealed, but a careless or hostile writer can seal anything: its declared sizes are checked
against the stored objects before anything is allocated, and its chunk size cannot turn a load into one request
per byte. A checkpoint whose bytes verify but that torch's ``weights_only`` refuses is not corrupted: no
fallback, the refusal itself, with a hint. A store that accepts conditional writes without enforcing them is
found out before the first write.
"""

from __future__ import annotations

import json
import pickle
import tracemalloc
import warnings
from pathlib import PosixPath

import pytest
import torch

from lightning_resilient import AtomicCheckpointIO, CheckpointCorruptedError, UnfencedStoreError
from lightning_resilient.io._sealed import seal
from lightning_resilient.io.manifest import MANIFEST_NAME, chunk_digests, object_digest
from lightning_resilient.io.reader import READ_SPAN
from lightning_resilient.io.store import PROTOCOL_DIR
from lightning_resilient.testing import StoreProxy

from .helpers import make_checkpoint, read_pointer


def _reseal(backend, edit):
    """Rewrite the latest commit's manifest with ``edit`` applied, sealed again: a document that verifies."""
    commit = read_pointer(backend).latest.commit
    path = backend.path(f"{commit}/{MANIFEST_NAME}")
    body = json.loads(backend.fs().cat_file(path))["body"]
    edit(body, commit)
    backend.fs().pipe_file(path, seal(body))
    return commit


def _two_saves(make_io, backend):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    io.save_checkpoint(make_checkpoint(2), backend.url("b.ckpt"))


def _skeleton_of(body):
    return body["objects"][body["skeleton"]]


@pytest.mark.parametrize("edit", ["tensor shape", "object size"])
def test_declared_sizes_are_checked_against_the_store_before_anything_is_allocated(backend, edit, make_io):
    _two_saves(make_io, backend)

    def lie(body, commit):
        if edit == "tensor shape":  # declared huge: a load would allocate (or view) it before reading a byte
            tensor = next(t for t in body["tensors"] if t["nbytes"])
            tensor["shape"] = [10**15]
        else:
            body["objects"][body["stream"][0]]["size"] += 4096

    _reseal(backend, lie)
    strict = make_io(backend, fallback_on_corruption=False)
    with pytest.raises(CheckpointCorruptedError, match=r"the manifest says|declares shape"):
        strict.load_checkpoint(backend.root)
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):  # and the fallback applies
        assert make_io(backend).load_checkpoint(backend.root)["global_step"] == 1


@pytest.mark.parametrize("what", ["skeleton", "tensor"])
def test_a_huge_declared_size_is_refused_before_anything_is_allocated(local_backend, what, make_io):
    """An object declared as 1e15 bytes (in one chunk: chunk_size 1e15), with a tensor of that size in it: a load
    that trusted the manifest would allocate it before reading a byte."""
    backend = local_backend
    _two_saves(make_io, backend)
    huge = 10**15

    def lie(body, commit):
        body["chunk_size"] = huge
        for obj in body["objects"]:
            obj["chunks"] = [obj["digest"]]  # one chunk per object now (its digest does not matter here)
        if what == "skeleton":
            _skeleton_of(body)["size"] = huge
        else:
            body["objects"][body["stream"][-1]]["size"] = huge
            body["tensors"][-1].update(offset=0, nbytes=huge, shape=[huge // 8], dtype="float64")

    _reseal(backend, lie)
    with pytest.raises(CheckpointCorruptedError, match=r"has \d+ bytes, the manifest says 1000000000000000"):
        make_io(backend, fallback_on_corruption=False).load_checkpoint(backend.root)


@pytest.mark.parametrize("size", [10**15, 2 * 10**6 * 16 * 2**20])
def test_a_huge_object_at_the_default_chunk_size_is_damage_found_before_any_per_chunk_structure(backend, size,
                                                                                                make_io):
    """1e15 bytes at the default chunk size (16 MiB) would be 6e7 chunk ranges: the digest count is compared with
    arithmetic, so the manifest is damaged at once (and the load falls back), with no per-chunk list built. The
    second size is small enough to show that without exhausting memory: 2e6 ranges would be ~200 MB."""
    _two_saves(make_io, backend)

    def lie(body, commit):
        assert body["chunk_size"] == 16 * 2**20
        body["objects"][body["stream"][0]]["size"] = size

    _reseal(backend, lie)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptedError, match=r"chunk digest\(s\) for \d+ bytes"):
            make_io(backend, fallback_on_corruption=False).load_checkpoint(backend.root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, peak  # nothing was built per chunk
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):  # damaged: the fallback applies
        assert make_io(backend).load_checkpoint(backend.root)["global_step"] == 1


def test_a_tiny_chunk_size_cannot_turn_a_load_into_a_request_per_byte(backend, make_io):
    io = make_io(backend)
    ckpt = make_checkpoint(1, size=256)  # ~16 kB of tensors: 16k one-byte chunks, one request per object
    io.save_checkpoint(ckpt, backend.url("a.ckpt"))

    def per_byte(body, commit):
        body["chunk_size"] = 1
        for obj in body["objects"]:
            data = backend.fs().cat_file(backend.path(obj["path"]))
            obj["chunks"] = chunk_digests([memoryview(data)], 1)
            obj["digest"] = object_digest(obj["chunks"])

    _reseal(backend, per_byte)
    reader = make_io(backend, fallback_on_corruption=False)
    loaded = reader.load_checkpoint(backend.root)
    assert torch.equal(loaded["state_dict"]["layer.weight"], ckpt["state_dict"]["layer.weight"])
    manifest = json.loads(backend.fs().cat_file(backend.path(f"{read_pointer(backend).latest.commit}/"
                                                             f"{MANIFEST_NAME}")))["body"]
    # Every byte was verified against its own digest, with one request per READ_SPAN bytes of each object.
    assert reader.last_load.requests == sum(-(-o["size"] // READ_SPAN) or 1 for o in manifest["objects"])


def test_a_weights_only_refusal_is_not_corruption_and_falls_back_to_nothing(backend, make_io):
    io = make_io(backend)
    io.save_checkpoint(make_checkpoint(1), backend.url("a.ckpt"))
    ckpt = make_checkpoint(2)
    ckpt["hyper_parameters"] = {"data_dir": PosixPath("/data/set")}  # not on torch's weights_only allow-list
    io.save_checkpoint(ckpt, backend.url("b.ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "corrupted" warning, no fallback to step 1
        with pytest.raises(pickle.UnpicklingError) as info:
            make_io(backend).load_checkpoint(backend.root)  # weights_only=None: torch's default, True
    assert any("add_safe_globals" in note and "verified" in note for note in info.value.__notes__)
    loaded = make_io(backend).load_checkpoint(backend.root, weights_only=False)  # the user's decision
    assert loaded["hyper_parameters"]["data_dir"] == PosixPath("/data/set")


def test_a_store_that_ignores_conditional_writes_is_found_out_before_the_first_write(s3_backend, plugins):
    for ignored in (False, True):
        with StoreProxy(s3_backend.endpoint, drop_conditions=ignored) as proxy:
            options = {"client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True}
            url = s3_backend.url(f"{'ignored' if ignored else 'enforced'}/a.ckpt")
            io = plugins.track(AtomicCheckpointIO(storage_options=options))
            if ignored:  # refused before anything of the save is written
                with pytest.raises(UnfencedStoreError, match=r"If-None-Match: \*\) replaced an existing object"):
                    io.save_checkpoint(make_checkpoint(1), url)
                assert not [p for p in s3_backend.fs().find(s3_backend.path("ignored")) if "probe" not in p]
            allowed = plugins.track(AtomicCheckpointIO(storage_options=options, allow_unfenced_store=True))
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                allowed.save_checkpoint(make_checkpoint(1), url)
                allowed.save_checkpoint(make_checkpoint(2), url)  # probed once per root
            fencing = [str(w.message) for w in seen if "writer fencing is OFF" in str(w.message)]
            if ignored:
                assert len(fencing) == 1 and "If-None-Match" in fencing[0], fencing
            else:
                assert fencing == []
    # The probe leaves nothing behind.
    assert not any("probe" in p for p in s3_backend.fs().find(s3_backend.path(f"enforced/{PROTOCOL_DIR}")))


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_fit_refuses_to_start_on_a_store_that_ignores_conditional_writes(request, monkeypatch, plugins, store):
    """Behind a proxy that strips S3's If-Match/If-None-Match or GCS's ifGenerationMatch, fencing cannot work: fit
    stops before its first step, in the store's own words; allow_unfenced_store=True trains, with a warning."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..models import TinyModel, tiny_loader

    backend = request.getfixturevalue(f"{store}_backend")
    # ModelCheckpoint lists its dirpath with a client of its own (straight to the server: listing is not the issue).
    monkeypatch.setenv("AWS_ENDPOINT_URL" if store == "s3" else "STORAGE_EMULATOR_HOST", backend.endpoint)
    steps: list[int] = []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, *args):
            steps.append(trainer.global_step)

    def fit(options, **kwargs):
        io = plugins.track(AtomicCheckpointIO(storage_options=options, **kwargs))
        trainer = Trainer(max_steps=2, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
                          enable_model_summary=False,
                          callbacks=[Steps(), ModelCheckpoint(dirpath=backend.root, every_n_train_steps=1)])
        trainer.fit(TinyModel(), tiny_loader())

    with StoreProxy(backend.endpoint, drop_conditions=True) as proxy:
        options = ({"client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True} if store == "s3" else
                   {**backend.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True})
        with pytest.raises(UnfencedStoreError) as refused:
            fit(options)
        message = str(refused.value)
        assert backend.root in message and "allow_unfenced_store=True" in message
        if store == "s3":
            assert "If-None-Match: *" in message and "If-Match" in message
        else:
            assert "ifGenerationMatch" in message and "If-Match" not in message and "If-None-Match" not in message
        assert steps == []  # before the first step
        assert not backend.fs().exists(backend.path(".lightning_resilient/latest.json"))  # nothing written
        with pytest.warns(RuntimeWarning, match="writer fencing is OFF"):
            fit(options, allow_unfenced_store=True)
    assert steps == [0, 1] and read_pointer(backend).latest.step == 2


def test_allow_unfenced_store_is_checked_at_construction():
    with pytest.raises(TypeError, match="allow_unfenced_store must be True or False"):
        AtomicCheckpointIO(allow_unfenced_store="yes")
