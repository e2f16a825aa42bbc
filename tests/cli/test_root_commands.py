"""``lightning-resilient ls | verify | gc`` on local disk and S3 (moto): output, exit codes, errors."""

from __future__ import annotations

import json

import pytest

from lightning_resilient.cli import main
from lightning_resilient.io.manifest import MANIFEST_NAME

from ..io.helpers import make_checkpoint, put, read_pointer
from ..io.test_protocol import commits_on_store


@pytest.fixture(params=["local", "s3"])
def filled(request, make_io):
    """A root with three committed checkpoints (one save_last sharing data), a crashed save's folder, and a new job
    that resumed the latest (so the crashed save's writer is fenced off)."""
    backend = request.getfixturevalue(f"{request.param}_backend")
    io = make_io(backend, shard_size=4096)
    for step in (1, 2, 3):
        io.save_checkpoint(make_checkpoint(step, size=512), backend.url(f"epoch=0-step={step}.ckpt"))
    io.save_checkpoint(make_checkpoint(3, size=512), backend.url("last.ckpt"))
    put(backend, "epoch=0-step=4.ckpt/c1700000000000-e1-0badf00d/shard-00000.bin", b"half an upload")
    resumed = make_io(backend)
    resumed.root(backend.root).claim(resumed_from=read_pointer(backend).latest)
    return backend


def run(backend, *argv: str) -> int:
    options = ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []
    return main([*argv, *options])


def corrupt(backend, rel: str) -> None:
    fs = backend.fs()
    data = bytearray(fs.cat_file(backend.path(rel)))
    data[len(data) // 2] ^= 0x40
    fs.pipe_file(backend.path(rel), bytes(data))


def test_ls_shows_pointer_checkpoints_and_leftovers(filled, capsys):
    assert run(filled, "ls", filled.root) == 0
    out = capsys.readouterr().out
    pointer = read_pointer(filled)
    assert f"writer epoch {pointer.writer_epoch}" in out and "latest last.ckpt (step 3)" in out
    for name, step in (("last.ckpt (latest) (resumed from)", 3), ("epoch=0-step=3.ckpt", 3),
                       ("epoch=0-step=1.ckpt", 1)):
        assert any(line.startswith(f"| {name} | {step} |") and line.endswith("| yes |") for line in out.splitlines())
    assert "1 folder(s) without a manifest" in out


def test_ls_shows_what_each_commit_stored_itself_beside_what_it_references(local_backend, make_io, capsys):
    """With dedup, a commit's size is what a load reads; 'stored here' is what it wrote (the frozen base is the
    first commit's)."""
    import torch

    io = make_io(local_backend, dedup=True)
    base, adapter = torch.randn(1024, 1024), torch.zeros(64)  # 4 MiB frozen, 256 bytes trained
    for step in (1, 2, 3):
        adapter.add_(1.0)
        io.save_checkpoint({"base": base, "adapter": adapter, "global_step": step},
                           local_backend.url(f"step={step}.ckpt"))
    assert run(local_backend, "ls", local_backend.root) == 0
    out = capsys.readouterr().out
    rows = {line.split(" |")[0][2:].split(" (")[0]: [c.strip() for c in line.split("|")[1:-1]]
            for line in out.splitlines() if line.startswith("| step=")}
    header = next(line for line in out.splitlines() if line.startswith("| name |"))
    columns = [c.strip() for c in header.split("|")[1:-1]]
    size, here = columns.index("size"), columns.index("stored here")
    assert rows["step=1.ckpt"][here] == rows["step=1.ckpt"][size]  # the first stores everything
    for name in ("step=2.ckpt", "step=3.ckpt"):
        assert rows[name][size].endswith(" MB") and rows[name][here].endswith((" kB", " B")), rows[name]
    assert "2 checkpoint(s) reference objects another commit stored" in out


def test_ls_and_verify_report_corruption_with_exit_status_1(filled, capsys):
    commit = read_pointer(filled).checkpoints["epoch=0-step=2.ckpt"].commit
    shard = next(p for p in filled.fs().find(filled.path(commit)) if "shard-" in p)
    corrupt(filled, f"{commit}/{shard.rsplit('/', 1)[-1]}")
    assert run(filled, "ls", filled.root) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("| epoch=0-step=2.ckpt |") and "| NO: " in line and "checksum" in line
               for line in out.splitlines())
    assert run(filled, "ls", filled.root, "--quick") == 0  # sizes alone cannot see a flipped bit
    assert run(filled, "verify", filled.root, "--no-progress") == 0  # the latest is intact
    assert "OK" in capsys.readouterr().out
    assert run(filled, "verify", filled.root, "epoch=0-step=2.ckpt", "--no-progress") == 1
    assert "FAILED" in capsys.readouterr().out
    assert run(filled, "verify", filled.root, "--all", "--no-progress") == 1
    out = capsys.readouterr().out
    assert out.count("OK ") == 3 and out.count("FAILED") == 1


def test_verify_accepts_a_commit_folder_and_draws_progress(filled, capsys):
    commit = read_pointer(filled).latest.commit
    assert run(filled, "verify", filled.root, commit) == 0
    captured = capsys.readouterr()
    assert f"OK     {filled.url(commit)}" in captured.out and "verify last.ckpt" in captured.err


def test_gc_dry_run_lists_then_gc_deletes(filled, capsys, make_io):
    assert run(filled, "gc", filled.root, "--dry-run", "--grace", "0", "--keep-last", "2") == 0
    out = capsys.readouterr().out
    # two training states: steps 3 (under two names, last.ckpt too) and 2
    assert "would delete checkpoint epoch=0-step=1.ckpt" in out and "epoch=0-step=2.ckpt" not in out
    assert "c1700000000000-e1-0badf00d" in out
    assert sorted(read_pointer(filled).checkpoints) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt",
                                                        "epoch=0-step=3.ckpt", "last.ckpt"]  # nothing changed
    assert run(filled, "gc", filled.root, "--grace", "0", "--keep-last", "2") == 0
    assert "deleted checkpoint epoch=0-step=1.ckpt" in capsys.readouterr().out
    pointer = read_pointer(filled)
    assert sorted(pointer.checkpoints) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]
    remaining = {p.split("/")[-3] for p in filled.fs().find(filled.path()) if p.endswith(MANIFEST_NAME)}
    assert remaining == {"epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"}
    assert not any("0badf00d" in p for p in filled.fs().find(filled.path()))
    assert make_io(filled, claim_on_load=False).load_checkpoint(filled.root)["global_step"] == 3
    assert run(filled, "gc", filled.root, "--grace", "0") == 0
    assert "nothing to delete" in capsys.readouterr().out


def test_gc_grace_counts_the_stores_time_not_the_name(filled, capsys):
    assert run(filled, "gc", filled.root, "--dry-run") == 0  # default grace: an hour
    assert "nothing to delete" in capsys.readouterr().out  # its name says 2023, but the store wrote it just now
    assert run(filled, "gc", filled.root, "--dry-run", "--grace", "0") == 0
    assert "0badf00d" in capsys.readouterr().out


def test_bad_input_exits_2_with_a_message(s3_backend, local_backend, tmp_path, capsys, monkeypatch, make_io):
    assert main(["ls", "nosuchproto://x/y"]) == 2
    assert "cannot open 'nosuchproto://x/y'" in capsys.readouterr().err
    options = json.dumps({"client_kwargs": {"endpoint_url": s3_backend.endpoint}})
    assert main(["ls", "s3://no-such-bucket-zz/run", "--storage-options", options]) == 2
    assert "bucket 'no-such-bucket-zz' does not exist" in capsys.readouterr().err
    assert main(["ls", str(tmp_path), "--storage-options", "{not json"]) == 2
    assert "--storage-options is not valid JSON" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    make_io(local_backend).save_checkpoint(make_checkpoint(1), local_backend.url("a.ckpt"))
    assert main(["verify", local_backend.root, "b.ckpt"]) == 2
    assert "committed names: ['a.ckpt']" in capsys.readouterr().err
    assert main(["gc", local_backend.root, "--keep-last", "0"]) == 2
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_cache = json.dumps({"client_kwargs": {"endpoint_url": s3_backend.endpoint}, "skip_instance_cache": True})
    assert main(["ls", s3_backend.root, "--storage-options", no_cache]) == 2
    assert "no credentials" in capsys.readouterr().err


def test_empty_root_is_not_an_error(local_backend, capsys):
    assert main(["ls", local_backend.root]) == 0
    assert "no checkpoints" in capsys.readouterr().out


def test_verify_takes_a_checkpoint_as_export_and_load_checkpoint_take_it(filled, capsys):
    pointer = read_pointer(filled)
    named = pointer.checkpoints["epoch=0-step=2.ckpt"]
    for target in (filled.url("epoch=0-step=2.ckpt"), filled.url(named.commit)):  # ROOT/NAME, a commit folder URL
        assert run(filled, "verify", target, "--no-progress") == 0
        assert f"OK     {filled.url(named.commit)}:" in capsys.readouterr().out
    assert run(filled, "verify", filled.root, "--no-progress") == 0  # the root: its latest, as before
    assert f"OK     {filled.url(pointer.latest.commit)}:" in capsys.readouterr().out
    assert run(filled, "verify", filled.url("epoch=0-step=9.ckpt"), "--no-progress") == 2
    assert "No committed checkpoint is named 'epoch=0-step=9.ckpt'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_ls_and_gc_given_a_checkpoint_name_the_root_to_run_them_on(filled, capsys, command):
    commit = read_pointer(filled).checkpoints["epoch=0-step=2.ckpt"].commit
    for target in (filled.url("epoch=0-step=2.ckpt"), filled.url(commit)):
        assert run(filled, command, target) == 2
        assert capsys.readouterr().err == (f"lightning-resilient {command}: {target} is a checkpoint in the root"
                                           f" {filled.root}, not a root: run `lightning-resilient {command}"
                                           f" {filled.root}`\n")


def test_what_ls_says_of_abandoned_checkpoints_gc_abandoned_deletes_each_once(request, make_io, capsys):
    """A rollback abandons a top-k checkpoint and the last.ckpt that shares its data (one folder, two names): ls
    names the command, whose dry run lists every folder once, and which then deletes them."""
    backend = request.getfixturevalue("s3_backend")
    old = make_io(backend, shard_size=4096)
    for step in (1, 2):
        old.save_checkpoint(make_checkpoint(step, size=512), backend.url(f"epoch=0-step={step}.ckpt"))
    old.save_checkpoint(make_checkpoint(2, size=512), backend.url("last.ckpt"))  # shares step 2's shards
    pointer = read_pointer(backend)
    step2, last = pointer.checkpoints["epoch=0-step=2.ckpt"], pointer.checkpoints["last.ckpt"]
    assert step2.commit in last.folders
    rollback = make_io(backend)
    rollback.root(backend.root).claim(resumed_from=pointer.checkpoints["epoch=0-step=1.ckpt"])
    assert run(backend, "ls", backend.root) == 0
    out = capsys.readouterr().out
    assert (f"2 checkpoint(s) belong to an abandoned branch (a later job started fresh or resumed an earlier"
            f" checkpoint): never resumed; `lightning-resilient gc {backend.root} --abandoned` deletes them") in out
    assert run(backend, "gc", backend.root, "--abandoned", "--dry-run") == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("would delete")]
    assert sorted(listed) == sorted(f"would delete {backend.url(folder)}: checkpoint {name} (step 2) of an abandoned"
                                    " branch" for folder, name in ((step2.commit, "epoch=0-step=2.ckpt"),
                                                                   (last.commit, "last.ckpt")))
    assert run(backend, "gc", backend.root, "--abandoned") == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("deleted")]) == 2
    assert not commits_on_store(backend) & {step2.commit, last.commit}
    assert run(backend, "ls", backend.root) == 0
    assert "abandoned" not in capsys.readouterr().out


def test_what_a_dead_job_retired_is_named_with_the_gc_that_deletes_it(local_backend, make_io, plugins, capsys):
    """A job killed after its last save (no end of fit) leaves a retired folder that no commit will delete: ls says
    gc deletes it once the pointer has stood still for --grace, and so it does."""
    backend = local_backend
    job = make_io(backend, keep_last=1)
    for step in (1, 2):
        job.save_checkpoint(make_checkpoint(step), backend.url(f"step={step}.ckpt"))
    plugins.abandoned(job)  # killed: its fit never ends
    retired = next(c for c in commits_on_store(backend) if c.startswith("step=1.ckpt/"))
    assert run(backend, "ls", backend.root) == 0
    assert ("1 folder(s) retired by retention (no longer checkpoints; deleted at the next commit of the job writing"
            " the root, or when its fit ends): they are deleted by gc once the pointer has not changed for --grace"
            " seconds (default: an hour)") in capsys.readouterr().out
    assert run(backend, "gc", backend.root, "--dry-run") == 0
    assert "nothing to delete" in capsys.readouterr().out  # the pointer changed just now
    assert run(backend, "gc", backend.root, "--grace", "0") == 0
    assert f"deleted {backend.url(retired)}: retired by retention" in capsys.readouterr().out
    assert retired not in commits_on_store(backend) and not read_pointer(backend).retired
    assert run(backend, "ls", backend.root) == 0
    assert "folder(s) retired" not in capsys.readouterr().out


def test_ls_says_what_gc_does_with_folders_without_a_manifest(filled, capsys):
    assert run(filled, "ls", filled.root) == 0
    assert ("1 folder(s) without a manifest (interrupted saves, or a save in progress; never loadable): they are"
            " saves of the job writing the root (never collected while it writes) or younger than --grace") \
        in capsys.readouterr().out
    assert run(filled, "gc", filled.root, "--dry-run") == 0
    assert "nothing to delete" in capsys.readouterr().out
    assert run(filled, "gc", filled.root, "--dry-run", "--grace", "0") == 0
    assert "0badf00d" in capsys.readouterr().out


def test_ls_prints_what_an_attempt_record_says_escaped_and_names_a_damaged_one(local_backend, capsys):
    """Issue 39: a record's texts (how the attempt ended, its audit line) printed as they are could add rows to the
    attempts table, or clear the terminal; a record whose header names another attempt (here with a newline and
    ``|`` in it) is reported as unreadable, escaped too."""
    from lightning_resilient.io.retry import RetryPolicy
    from lightning_resilient.io.store import open_store
    from lightning_resilient.state.attempts import AttemptRecord, AuditResult, record_name

    store = open_store(local_backend.root, {}, RetryPolicy())
    forged_row = "\n| a000009-ffffff | 1 s ago | 2 | fresh start | 9 | finished | identical |"
    ended = AttemptRecord("a000001-abcdef", 0, 1, 1_700_000_000.0, ended=f"stopped by RuntimeError: boom{forged_row}",
                          audit=AuditResult("nothing", f"resume audit: nothing to compare: \x1b[2J{forged_row}", 0))
    store.write(record_name(ended.attempt, 0), ended.to_bytes())
    hostile = AttemptRecord(f"a000002-abcdef{forged_row}", 0, 1, 1_700_000_000.0)
    store.write(record_name("a000002-abcdef", 0), hostile.to_bytes())
    assert main(["ls", local_backend.root]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and not [line for line in out.splitlines() if line.startswith("| a000009")]
    rows = [line for line in out.splitlines() if line.startswith("| a0")]
    assert len(rows) == 2 and all(row.count("|") - row.count("\\|") == 8 for row in rows), rows  # 7 cells each
    assert "| stopped by RuntimeError: boom\\n\\| a000009-ffffff \\| 1 s ago \\|" in rows[0]
    assert "\\x1b[2J\\n\\| a000009-ffffff" in rows[0]
    assert rows[1].startswith("| a000002-abcdef | | | | | | unreadable, skipped: attempt record ") and (
        "attempt is an attempt id" in rows[1]), rows[1]
