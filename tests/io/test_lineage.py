"""Lineage: a rollback (run B resumes from an earlier checkpoint of run A) abandons A's later checkpoints.

Latest, the fallback when a checkpoint is damaged, ``keep_last``, the scan of a root without a pointer,
``repair_pointer``, ``ls`` and ``gc --abandoned`` all follow B's lineage, on every store.
"""

from __future__ import annotations

import json
import warnings

import pytest

from lightning_resilient import CheckpointCorruptedError, RunExistsError, find_latest_checkpoint, repair_pointer
from lightning_resilient.cli import main
from lightning_resilient.io.lineage import Lineage, Origin
from lightning_resilient.io.manifest import MANIFEST_NAME
from lightning_resilient.io.pointer import POINTER_NAME, Entry

from .helpers import make_checkpoint, read_pointer


def _entry(epoch: int, step: int, created: float = 0.0) -> Entry:
    return Entry(f"e{epoch}s{step}", f"x/c{epoch}{step}", step, 0, created, epoch, ())


def test_lineage_follows_origins_and_bounds_each_epoch_at_its_resume_step():
    origins = {1: Origin(None), 2: Origin("a/c", 1, 250), 3: Origin("b/c", 2, 270)}
    lineage = Lineage(origins, 3)
    assert lineage.contains(_entry(3, 10**6)) and lineage.contains(_entry(2, 270)) and lineage.contains(_entry(1, 250))
    assert not lineage.contains(_entry(2, 280))  # epoch 3 resumed from 270: 280 is abandoned
    assert not lineage.contains(_entry(1, 260))  # epoch 2 resumed from 250
    records = [_entry(1, 100), _entry(1, 300), _entry(2, 260), _entry(2, 280), _entry(3, 290)]
    assert [(e.writer_epoch, e.step) for e in lineage.members(records)] == [(3, 290), (2, 260), (1, 100)]
    # A fresh start ends the lineage; a lineage below one checkpoint is what resuming it falls back to.
    assert [(e.writer_epoch, e.step) for e in Lineage({1: Origin(None), 2: Origin(None)}, 2).members(records)] == \
        [(2, 280), (2, 260)]
    assert [(e.writer_epoch, e.step) for e in Lineage.below(origins, _entry(2, 260)).members(records)] == \
        [(2, 260), (1, 100)]
    # Roots from before lineage was recorded: an unknown origin continues every older epoch (the old order).
    assert Lineage({}, 2).members(records) == sorted([r for r in records if r.writer_epoch <= 2],
                                                     key=lambda e: (e.writer_epoch, e.step), reverse=True)


def test_an_origin_lists_the_chain_it_continues_so_pruned_origins_stay_known():
    # 2 started fresh; 3 resumed 2 at step 30 and was abandoned by 4, which resumed 2 at step 20; 5 resumed 4 at 40.
    full = {1: Origin(None), 2: Origin(None), 3: Origin("b/c", 2, 30), 4: Origin("b/d", 2, 20)}
    fifth = Origin("d/c", 4, 40).with_ancestors(full)
    assert fifth.ancestors == ((4, 40), (2, 20))
    assert Origin(None).with_ancestors(full).ancestors == ()  # a fresh start (or a fork) continues nothing
    assert Origin("b/c", 2, 30).with_ancestors({}).ancestors is None  # an epoch without origin: unknown below
    assert Origin.from_json(json.loads(json.dumps(fifth.to_json()))).ancestors == fifth.ancestors
    assert Origin.from_json({"commit": None, "writer_epoch": 0, "step": 0}).ancestors is None  # an older record
    # The origins of epochs 1..4 pruned (no cataloged checkpoint of theirs left): the chain is still exact.
    lineage = Lineage({5: fifth}, 5)
    assert lineage.legacy_below is None and lineage.bounds == {5: float("inf"), 4: 40, 2: 20}
    assert lineage.holds(2, 20) and not lineage.holds(2, 25)
    assert not lineage.holds(3, 10) and not lineage.holds(1, 5)  # the abandoned epoch 3 and the older fresh start
    # A resume below it caps the chain's bounds where it resumed.
    assert Lineage({6: Origin("d/b", 5, 50), 5: fifth}, 6, 15).bounds == {6: 15, 5: 15, 4: 15, 2: 15}
    # Origins recorded before they listed their chain: the rule for older roots (every older epoch) still applies.
    older = Lineage({5: Origin("d/c", 4, 40)}, 5)
    assert older.legacy_below == 4 and older.holds(3, 10) and older.holds(1, 5)


def _rollback(make_io, backend, *, keep_last=None):
    """Run A saves steps 100..300; run B resumes A's step 250 and saves 260, 270. Returns the commits by label."""
    a = make_io(backend)
    commits = {}
    for step in (100, 200, 250, 270, 300):
        a.save_checkpoint(make_checkpoint(step, seed=1), backend.url(f"step={step}.ckpt"))
        commits[f"A{step}"] = read_pointer(backend).latest.commit
    b = make_io(backend, keep_last=keep_last, claim_on_load=True)  # a job that trains (outside Trainer.fit here)
    b.load_checkpoint(backend.url(commits["A250"]))  # the rollback: an explicit, earlier checkpoint
    for step in (260, 270):
        b.save_checkpoint(make_checkpoint(step, seed=2), backend.url(f"b-step={step}.ckpt"))
        commits[f"B{step}"] = read_pointer(backend).latest.commit
    return b, commits


def _damage(backend, rel):
    fs = backend.fs()
    data = bytearray(fs.cat_file(backend.path(rel)))
    data[len(data) // 2] ^= 1
    fs.pipe_file(backend.path(rel), bytes(data))


def test_a_rollback_never_resumes_the_abandoned_branch(backend, make_io):
    _, commits = _rollback(make_io, backend)
    url = backend.url
    assert find_latest_checkpoint(backend.root, backend.storage_options) == url(commits["B270"])
    # B's newest damaged: the fallback is B's previous, then A's 250 (what B resumed from), never A's 270 or 300.
    _damage(backend, f"{commits['B270']}/skeleton.pt")
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):
        assert make_io(backend).load_checkpoint(backend.root)["global_step"] == 260
    _damage(backend, f"{commits['B260']}/skeleton.pt")
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):
        loaded = make_io(backend).load_checkpoint(backend.root)
    assert loaded["global_step"] == 250 and loaded["callbacks"] == make_checkpoint(250, seed=1)["callbacks"]
    # find_latest_checkpoint with B's newest manifest damaged skips to B's previous, not to A's 300.
    backend.fs().pipe_file(backend.path(f"{commits['B270']}/{MANIFEST_NAME}"), b"{}")
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert find_latest_checkpoint(backend.root, backend.storage_options) == url(commits["B260"])


def test_keep_last_counts_the_current_lineage_only(backend, make_io):
    b, commits = _rollback(make_io, backend, keep_last=2)
    pointer = read_pointer(backend)
    # B's two checkpoints are the two newest of its lineage; A's 270 and 300 (abandoned) neither count nor go.
    assert {e.commit for e in pointer.candidates()} == {commits["B260"], commits["B270"], commits["A250"]}
    assert {e.commit for e in pointer.abandoned()} == {commits["A270"], commits["A300"]}
    b.save_checkpoint(make_checkpoint(280, seed=2), backend.url("b-step=280.ckpt"))
    names = sorted(read_pointer(backend).checkpoints)
    assert "b-step=270.ckpt" in names and "b-step=280.ckpt" in names and "b-step=260.ckpt" not in names
    assert "step=300.ckpt" in names and "step=270.ckpt" in names  # abandoned: kept until gc --abandoned


def test_scan_and_repair_follow_the_lineage_recorded_in_the_manifests(backend, make_io):
    _, commits = _rollback(make_io, backend)
    backend.fs().rm(backend.path(POINTER_NAME))
    with pytest.warns(RuntimeWarning, match="is missing"):
        assert find_latest_checkpoint(backend.root, backend.storage_options) == backend.url(commits["B270"])
    assert repair_pointer(backend.root, backend.storage_options) == backend.url(commits["B270"])
    pointer = read_pointer(backend)
    assert {e.commit for e in pointer.abandoned()} == {commits["A270"], commits["A300"]}
    assert make_io(backend).load_checkpoint(backend.root)["global_step"] == 270


def test_ls_marks_the_abandoned_branch_and_gc_abandoned_deletes_it(backend, capsys, make_io):
    _rollback(make_io, backend)
    options = ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []
    assert main(["ls", backend.root, "--quick", *options]) == 0
    out = capsys.readouterr().out
    assert "step=300.ckpt (abandoned branch)" in out and "step=270.ckpt (abandoned branch)" in out
    assert "step=250.ckpt (abandoned" not in out and "2 checkpoint(s) belong to an abandoned branch" in out
    assert main(["gc", backend.root, *options]) == 0  # without --abandoned: nothing of it goes
    assert "of an abandoned branch" not in capsys.readouterr().out
    assert main(["gc", backend.root, "--abandoned", "--dry-run", *options]) == 0
    assert main(["gc", backend.root, "--abandoned", *options]) == 0
    out = capsys.readouterr().out
    assert out.count("of an abandoned branch") == 4  # listed by the dry run, then deleted
    manifests = {p.rsplit("/", 3)[-3] for p in backend.fs().find(backend.path()) if p.endswith(MANIFEST_NAME)}
    assert manifests == {"step=100.ckpt", "step=200.ckpt", "step=250.ckpt", "b-step=260.ckpt", "b-step=270.ckpt"}
    assert make_io(backend).load_checkpoint(backend.root)["global_step"] == 270


def test_a_fresh_start_abandons_what_was_there_and_deletes_none_of_it(local_backend, make_io):
    backend = local_backend
    old = make_io(backend)
    old.save_checkpoint(make_checkpoint(90), backend.url("step=90.ckpt"))
    fresh = make_io(backend)  # a job started without a checkpoint to resume: its lineage starts empty
    fresh.save_checkpoint(make_checkpoint(5), backend.url("step=5.ckpt"))
    pointer = read_pointer(backend)
    assert pointer.latest.name == "step=5.ckpt" and [e.name for e in pointer.abandoned()] == ["step=90.ckpt"]
    assert make_io(backend).load_checkpoint(backend.url("step=90.ckpt"))["global_step"] == 90  # still there


def test_every_manifest_damaged_is_an_error_not_a_fresh_start(backend, make_io):
    io = make_io(backend)
    for step in (1, 2):
        io.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    for entry in read_pointer(backend).candidates():
        backend.fs().pipe_file(backend.path(f"{entry.commit}/{MANIFEST_NAME}"), b"not a manifest")
    with pytest.warns(RuntimeWarning, match="skipping"), \
            pytest.raises(CheckpointCorruptedError, match=r"no committed checkpoint .* has a valid manifest"):
        find_latest_checkpoint(backend.root, backend.storage_options)
    backend.fs().rm(backend.path(POINTER_NAME))  # the same through the scan of a root without a pointer
    with pytest.raises(CheckpointCorruptedError, match="has a valid manifest"):
        find_latest_checkpoint(backend.root, backend.storage_options)


def test_a_rebuilt_pointer_names_each_shared_name_after_the_current_lineage():
    """A name both branches used (``last.ckpt``) catalogs the lineage's commit of it, not the abandoned one."""
    from lightning_resilient.io.lineage import Origin
    from lightning_resilient.io.manifest import Manifest
    from lightning_resilient.io.pointer import Pointer

    def manifest(name, epoch, step, origin):
        return Manifest(name=name, commit=f"{name}/c{epoch}{step:012d}-e{epoch}-00000000", step=step, epoch=0,
                        created=float(step), writer_epoch=epoch, chunk_size=1, skeleton=0, origin=origin)

    a = [manifest("step=250.ckpt", 1, 250, Origin(None)), manifest("last.ckpt", 1, 300, Origin(None))]
    b = [manifest("last.ckpt", 2, 270, Origin(a[0].commit, 1, 250))]
    for order in (a + b, b + a):
        pointer = Pointer.rebuilt(order, max_epoch=2)
        assert pointer.checkpoints["last.ckpt"].commit == b[0].commit and pointer.latest.commit == b[0].commit


def test_an_evaluation_load_is_no_origin_for_a_later_fresh_fit(local_backend, plugins):
    """validate(ckpt_path=...) then a fresh fit with the same plugin: the fit starts a lineage of its own."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_resilient import AtomicCheckpointIO

    from ..models import TinyModel, tiny_loader

    class Validated(TinyModel):
        def validation_step(self, batch, batch_idx):
            pass

    def trainer(io, steps):
        return Trainer(max_steps=steps, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=local_backend.root)])

    trainer(plugins.track(AtomicCheckpointIO()), 4).fit(Validated(), tiny_loader())  # the old run
    io = plugins.track(AtomicCheckpointIO(new_run=True))  # the fit below starts a new run over it, on purpose
    again = trainer(io, 2)
    again.validate(Validated(), tiny_loader(), ckpt_path=find_latest_checkpoint(local_backend.root), verbose=False)
    again.fit(Validated(), tiny_loader())  # from scratch, the same plugin
    pointer = read_pointer(local_backend)
    assert pointer.origins[pointer.writer_epoch] == Origin(None)
    assert [e.name for e in pointer.candidates()] == ["epoch=0-step=2.ckpt"]  # the old run is not its lineage


def _pointer_at(root, options):
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **options)
    fs.invalidate_cache()
    return fs.cat_file(f"{path.rstrip('/')}/{POINTER_NAME}")


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_fork_into_another_root_never_claims_the_root_it_forked_from(request, monkeypatch, plugins, capsys, store):
    """fit(ckpt_path=<an older checkpoint of root X>) with ModelCheckpoint(dirpath=Y) writes Y only: X's pointer is
    not touched (its job keeps saving, nothing of it becomes abandoned, a restart of X resumes X's newest), and Y
    records that its run came from X's checkpoint (no "started from scratch")."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_resilient import AtomicCheckpointIO
    from lightning_resilient.io.pointer import Pointer

    from ..models import TinyModel, tiny_loader

    backend = request.getfixturevalue(f"{store}_backend")
    if backend.endpoint:  # ModelCheckpoint lists its dirpath with a client of its own, as a user's would
        monkeypatch.setenv("AWS_ENDPOINT_URL", backend.endpoint)
    options = backend.storage_options
    x, y = backend.url("x"), backend.url("y")

    def trainer(root, steps):
        io = plugins.track(AtomicCheckpointIO(storage_options=options))
        return Trainer(max_steps=steps, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False,
                       callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)])

    x_job = trainer(x, 4)
    x_job.fit(TinyModel(), tiny_loader())  # X's job: steps 2 and 4, still alive
    before = _pointer_at(x, options)
    step2 = next(e for e in Pointer.from_bytes(before, where=x).entries() if e.step == 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(y, 6).fit(TinyModel(), tiny_loader(), ckpt_path=f"{x}/{step2.commit}")  # the fork: saves 4, 6 in Y
    assert not [str(w.message) for w in seen if "started from scratch" in str(w.message)]
    assert _pointer_at(x, options) == before  # X's pointer: not one byte changed
    x_job.save_checkpoint(f"{x}/after-the-fork.ckpt")  # X's own job is not fenced
    pointer_x = Pointer.from_bytes(_pointer_at(x, options), where=x)
    assert pointer_x.abandoned() == [] and [e.step for e in pointer_x.candidates()][:2] == [4, 4]
    assert find_latest_checkpoint(x, options).endswith(pointer_x.latest.commit)  # a restart of X resumes step 4
    opts = ["--storage-options", json.dumps(options)] if options else []
    assert main(["gc", x, "--abandoned", "--grace", "0", *opts]) == 0
    assert "abandoned branch" not in capsys.readouterr().out  # nothing of X is deleted
    pointer_y = Pointer.from_bytes(_pointer_at(y, options), where=y)
    assert pointer_y.origins[pointer_y.writer_epoch] == Origin(step2.commit, step2.writer_epoch, 2, root=x)
    assert [e.step for e in pointer_y.candidates()] == [6, 4]
    assert find_latest_checkpoint(y, options).endswith(pointer_y.latest.commit) and pointer_y.latest.step == 6


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_second_fit_that_continues_training_is_the_same_job(request, monkeypatch, plugins, store):
    """fit to step 4, then fit again on the same Trainer and model to step 8: one job, one writer epoch and one
    lineage (no "started from scratch"), so with fit 2's checkpoints damaged a resume falls back to step 4, bit for
    bit. A fit with another model on the same Trainer is a new run: it starts a lineage of its own."""
    import copy

    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_resilient import AtomicCheckpointIO

    from ..models import TinyModel, tiny_loader

    backend = request.getfixturevalue(f"{store}_backend")
    if backend.endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", backend.endpoint)
    io = plugins.track(AtomicCheckpointIO(storage_options=backend.storage_options))
    trainer = Trainer(max_steps=4, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=backend.root, every_n_train_steps=2, save_top_k=-1)])
    model = TinyModel()
    trainer.fit(model, tiny_loader())
    at_4 = copy.deepcopy(model.state_dict())
    epoch = read_pointer(backend).writer_epoch
    trainer.fit_loop.epoch_loop.max_steps = 8
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model, tiny_loader())  # continues from its own state in memory: step 4 -> 8
    assert trainer.global_step == 8
    assert not [str(w.message) for w in seen if "started from scratch" in str(w.message)]
    pointer = read_pointer(backend)
    assert pointer.writer_epoch == epoch and pointer.abandoned() == []
    assert [e.step for e in pointer.candidates()] == [8, 6, 4, 2]
    for entry in pointer.candidates()[:2]:  # fit 2's checkpoints
        _damage(backend, f"{entry.commit}/skeleton.pt")
    with pytest.warns(RuntimeWarning, match="corrupted and was NOT loaded"):
        loaded = plugins.track(AtomicCheckpointIO(storage_options=backend.storage_options)).load_checkpoint(
            backend.root)
    assert loaded["global_step"] == 4
    for name, tensor in at_4.items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    # Another model on the same Trainer: a new run, whatever the step counter says. It resumes nothing over the
    # run, so it stops at its start unless the plugin is told it is a new run.
    trainer.fit_loop.epoch_loop.max_steps = 10
    other = TinyModel(width=4)
    with pytest.raises(RunExistsError, match="holds a committed run"):
        trainer.fit(other, tiny_loader())
    assert other.losses == [] and read_pointer(backend).writer_epoch == epoch  # no step, no claim
    io.new_run = True
    with pytest.warns(RuntimeWarning, match="started from scratch"):
        trainer.fit(other, tiny_loader())
    pointer = read_pointer(backend)
    assert pointer.writer_epoch == epoch + 1 and pointer.origins[pointer.writer_epoch] == Origin(None)
    assert [e.step for e in pointer.candidates()] == [10]
