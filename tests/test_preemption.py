"""PreemptionCheckpoint: a notice (a signal, a metadata endpoint, a file) becomes an emergency checkpoint at the next
optimizer step, committed atomically, then a clean exit; the run resumed from it ends bit-identical.

Signals are real (``os.kill`` of this process, or of a training subprocess); metadata endpoints are loopback servers.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilient import AtomicCheckpointIO, PreemptionCheckpoint, ResumeStateCallback, find_latest_checkpoint
from lightning_resilient.io.pointer import POINTER_NAME, Pointer
from lightning_resilient.preemption import PreemptedExit
from lightning_resilient.testing import StoreProxy
from tests import procs

from .models import TinyModel

CHILD = Path(__file__).with_name("preemption_child.py")


class DropoutModel(TinyModel):
    """Randomness in every step (dropout) and a shuffled loader: a resume is exact only if every RNG is restored."""

    def __init__(self) -> None:
        super().__init__()
        self.net.insert(1, torch.nn.Dropout(0.3))


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


class SignalAt(Callback):
    """Sends ``signum`` to this process when batch ``batch`` (counted across the run) starts."""

    def __init__(self, batch: int, signum: int = signal.SIGTERM, times: int = 1) -> None:
        self.batch, self.signum, self.times, self.seen = batch, signum, times, 0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.batch + 1:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def run(root: str, *, max_steps: int = 20, accumulate: int = 1, ckpt_path: Any = None, extra: list[Any] | None = None,
        preemption: PreemptionCheckpoint | None = None, io: AtomicCheckpointIO | None = None) -> tuple[Trainer, Any]:
    seed_everything(0)
    model = DropoutModel()
    callbacks = [ResumeStateCallback(), *(extra or []), ModelCheckpoint(dirpath=root, every_n_train_steps=4,
                                                                        save_top_k=-1)]
    if preemption is not None:
        callbacks.insert(1, preemption)
    trainer = Trainer(max_steps=max_steps, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=[io or AtomicCheckpointIO()],
                      callbacks=callbacks)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model


def pointer(root: str) -> Pointer:
    return Pointer.from_bytes(Path(root, POINTER_NAME).read_bytes(), where=root)


@pytest.mark.parametrize(("accumulate", "batch"), [(1, 6), (2, 6), (2, 9)])  # 9: mid-accumulation
def test_sigterm_saves_at_the_next_optimizer_step_exits_143_and_the_resume_is_bit_identical(tmp_path, capsys, caplog,
                                                                                            accumulate, batch):
    caplog.set_level(logging.INFO)
    _, reference = run(str(tmp_path / "reference"), accumulate=accumulate)
    root = str(tmp_path / "ckpt")
    preemption = PreemptionCheckpoint()
    with pytest.raises(PreemptedExit) as exited:
        run(root, accumulate=accumulate, preemption=preemption, extra=[SignalAt(batch)])
    assert exited.value.code == 143
    step = (batch + accumulate) // accumulate  # the optimizer step the signalled batch completes, or the next
    assert preemption.saved == {**preemption.saved, "step": step, "committed": True}
    assert pointer(root).latest.name == "preemption.ckpt" and pointer(root).latest.step == step
    if (accumulate, batch) == (1, 6):
        from lightning_resilient.cli import main

        assert main(["ls", root]) == 0
        assert "| preemption.ckpt (latest) (emergency save: preemption) |" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is not preemption._on_signal  # handlers given back
    assert "weights_only" not in caplog.text  # Lightning's "`weights_only` was not set" for a save that did not say
    _, resumed = run(root, accumulate=accumulate, ckpt_path=find_latest_checkpoint(root))
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_second_sigterm_during_the_emergency_save_changes_nothing(tmp_path):
    root = str(tmp_path / "ckpt")

    class SignalDuringSave(Callback):
        def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the emergency checkpoint is being written

    preemption = PreemptionCheckpoint()
    with pytest.raises(PreemptedExit) as exited:
        run(root, preemption=preemption, extra=[SignalAt(2), SignalDuringSave()])
    assert exited.value.code == 143 and preemption.saved["committed"]
    assert pointer(root).latest.step == 3


def test_an_async_save_in_flight_is_committed_before_the_emergency_one(tmp_path):
    root = str(tmp_path / "ckpt")
    io = AtomicCheckpointIO(async_save=True)
    at_exit: list[str] = []

    class Latest(Callback):  # Lightning calls on_exception before its teardown (which would wait for any save)
        def on_exception(self, *args: Any) -> None:
            at_exit.append(pointer(root).latest.name)

    with pytest.raises(PreemptedExit):  # step 4's async save just began
        run(root, io=io, preemption=PreemptionCheckpoint(), extra=[SignalAt(4), Latest()])
    assert at_exit == ["preemption.ckpt"]  # committed when the callback let the process go, not only snapshotted
    assert [(s.name, s.step, s.committed) for s in io.save_stats] == [("epoch=0-step=4.ckpt", 4, True),
                                                                        ("preemption.ckpt", 5, True)]
    assert pointer(root).latest.name == "preemption.ckpt"


class SlowEmergencyIO(AtomicCheckpointIO):
    """The emergency save starts late on the wrapper's worker: a PreemptionCheckpoint that does not wait for it lets
    the process go with it not yet committed."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if str(path).endswith("preemption.ckpt"):
            time.sleep(0.5)  # (a slow store; nothing here asserts a time)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_behind_lightnings_async_wrapper_the_emergency_save_is_committed_before_exit(tmp_path, plugins):
    """``AsyncCheckpointIO(AtomicCheckpointIO())``: the emergency save runs on the wrapper's worker thread; the callback
    finds the plugin through the wrapper and waits for it (and estimates from the plugin's save timings)."""
    root = str(tmp_path / "ckpt")
    io = plugins.track(SlowEmergencyIO())
    at_exit: list[str] = []

    class Latest(Callback):  # before any teardown (which would wait for the wrapper's worker)
        def on_exception(self, *args: Any) -> None:
            at_exit.append(pointer(root).latest.name)

    seed_everything(0)
    trainer = Trainer(max_steps=20, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[AsyncCheckpointIO(io)],
                      callbacks=[PreemptionCheckpoint(), SignalAt(6), Latest(),
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1)])
    with pytest.raises(PreemptedExit):
        trainer.fit(DropoutModel(), loader())
    assert at_exit == ["preemption.ckpt"]  # committed when the callback let the process go
    assert [(s.name, s.committed) for s in io.save_stats] == [("epoch=0-step=4.ckpt", True), ("preemption.ckpt", True)]



class SignalInSanityCheck(Callback):
    """SIGTERM to this process as the sanity check's first batch starts (before any training step)."""

    def on_validation_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.sanity_checking and batch_index(args) == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def batch_index(args: tuple[Any, ...]) -> int:
    return int(args[2])  # (pl_module, batch, batch_idx, ...)


class Validated(DropoutModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


class SignalledWhileItsLoaderIsBuilt(DropoutModel):
    """SIGTERM to this process while Lightning asks for the training loader (after its signal handlers are set)."""

    def train_dataloader(self) -> DataLoader:
        os.kill(os.getpid(), signal.SIGTERM)
        return loader()


class Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("instant", ["sanity check", "training loader"])
def test_a_notice_before_training_starts_exits_non_zero_and_the_restart_resumes_where_the_fit_began(tmp_path,
                                                                                                    instant):
    """Between Lightning installing its signal handlers and training (the sanity check, the loaders being built), a
    SIGTERM used to end the fit through Lightning's SIGTERMException: exit status 0, a scheduler saw success. Lightning
    runs no sanity check on a resume, so that attempt starts fresh; the other resumes a previous attempt's step 4."""
    root = str(tmp_path / "ckpt")
    sanity = instant == "sanity check"
    if not sanity:
        run(root, max_steps=4)  # a previous attempt: committed up to step 4
    before = pointer(root).latest if not sanity else None
    preemption, steps = PreemptionCheckpoint(), Steps()
    seed_everything(0)
    trainer = Trainer(max_steps=8, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[AtomicCheckpointIO()], num_sanity_val_steps=2,
                      callbacks=[ResumeStateCallback(), preemption, steps, SignalInSanityCheck(),
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1)])
    with pytest.raises(PreemptedExit) as exited:
        if sanity:
            trainer.fit(Validated(), loader(), loader())
        else:
            trainer.fit(SignalledWhileItsLoaderIsBuilt(), ckpt_path=find_latest_checkpoint(root))
    assert exited.value.code == 124 and steps.steps == []  # non-zero, before any training step
    assert preemption.saved == {"step": 0 if sanity else 4, "path": None, "seconds": 0.0, "committed": False,
                                "earlier_error": None}
    assert signal.getsignal(signal.SIGTERM) is not preemption._on_signal  # handlers given back
    if sanity:
        assert not Path(root, POINTER_NAME).exists()  # nothing saved
        return
    assert pointer(root).latest == before  # nothing saved: the restart resumes where this fit began
    _, resumed = run(root, max_steps=8, ckpt_path=find_latest_checkpoint(root))
    _, reference = run(str(tmp_path / "reference"), max_steps=8)
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_an_earlier_failed_async_save_never_stops_the_emergency_one(tmp_path, plugins, caplog):
    """Step 4's background save fails for real (the pointer's bytes are damaged in the store while it uploads, so its
    pointer update is refused; they are put back before the notice); a SIGTERM follows. The emergency save is
    attempted and committed all the same (exit 143), and step 4's failure is reported beside it (it used to be raised
    by the emergency save: exit 1, nothing committed)."""
    root = tmp_path / "ckpt"
    pointer_file, kept = root / POINTER_NAME, []
    io = plugins.track(AtomicCheckpointIO(async_save=True))

    def settled() -> None:  # the background save in flight has committed or failed
        for _ in range(1200):
            if io.save_stats[-1].upload is not None:
                return
            threading.Event().wait(0.05)
        raise AssertionError("the background save did not end within a minute")

    class BlockStep4Save(Callback):
        def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 3:  # step 4 ends this batch, and its save begins
                settled()
                assert io.save_stats[-1].step == 2 and io.save_stats[-1].committed
                kept.append(pointer_file.read_bytes())
                pointer_file.write_bytes(b"damaged")
            elif batch_idx == 4:
                settled()
                assert io.save_stats[-1].step == 4 and not io.save_stats[-1].committed
                pointer_file.write_bytes(kept[0])

    preemption = PreemptionCheckpoint()
    caplog.set_level(logging.ERROR, logger="lightning_resilient")
    with pytest.raises(PreemptedExit) as exited:
        run_on(str(root), io, preemption, [BlockStep4Save(), SignalAt(4)], every=2)
    assert exited.value.code == 143 and preemption.saved["committed"] and preemption.saved["step"] == 5
    assert "latest.json" in preemption.saved["earlier_error"]  # what failed step 4's save
    assert "an earlier save had failed" in caplog.text
    latest = pointer(str(root)).latest
    assert latest.name == "preemption.ckpt" and latest.step == 5
    assert [e.step for e in pointer(str(root)).candidates()] == [5, 2]  # step 4 never committed


def run_on(root: str, io: AtomicCheckpointIO, preemption: PreemptionCheckpoint, extra: list[Any], *,
           every: int) -> None:
    seed_everything(0)
    trainer = Trainer(max_steps=20, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[io],
                      callbacks=[ResumeStateCallback(), preemption, *extra,
                                 ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1)])
    trainer.fit(DropoutModel(), loader())

class Metadata(http.server.ThreadingHTTPServer):
    """A loopback stand-in for the AWS (IMDSv2) and GCE metadata servers; ``preempted`` flips the answer."""

    def __init__(self) -> None:
        self.preempted = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                outer.requests.append(("PUT", self.path, dict(self.headers)))
                self._answer(200 if self.path == "/latest/api/token" else 404, "token-123")

            def do_GET(self) -> None:
                outer.requests.append(("GET", self.path, dict(self.headers)))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if outer.preempted and self.headers.get("X-aws-ec2-metadata-token") == "token-123":
                        self._answer(200, json.dumps({"action": "terminate", "time": "2026-12-03T12:00:00Z"}))
                    else:
                        self._answer(404, "")
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    ok = self.headers.get("Metadata-Flavor") == "Google"
                    self._answer(200 if ok else 403, "TRUE" if outer.preempted else "FALSE")
                else:
                    self._answer(404, "")

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    """A metadata server for one test, stopped (and its port closed) after it whatever its outcome."""
    server = Metadata()
    yield server
    server.shutdown()
    server.server_close()


class Flip(Callback):
    """Flips the metadata server to 'preempted' at batch ``batch`` and waits until the poller has seen it."""

    def __init__(self, server: Metadata, preemption: PreemptionCheckpoint, batch: int) -> None:
        self.server, self.preemption, self.batch, self.seen = server, preemption, batch, 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.batch + 1:
            self.server.preempted = True
            for _ in range(200):
                if self.preemption.notice is not None:
                    return
                threading.Event().wait(0.01)


@pytest.mark.parametrize("kind", ["aws", "gce"])
def test_a_metadata_endpoint_notice_from_a_loopback_server(tmp_path, kind, metadata):
    server = metadata
    url = server.url + ("/latest/meta-data/spot/instance-action" if kind == "aws"
                        else "/computeMetadata/v1/instance/preempted")
    preemption = PreemptionCheckpoint(signals=[], poll_seconds=0.02, **{"aws_spot" if kind == "aws" else "gce": url})
    with pytest.raises(PreemptedExit) as exited:
        run(str(tmp_path / "ckpt"), preemption=preemption, extra=[Flip(server, preemption, 5)])
    assert exited.value.code == 143
    assert preemption.notice.kind == kind and preemption.notice.deadline == (100.0 if kind == "aws" else 25.0)
    assert preemption.saved["step"] == 6 and preemption.saved["committed"]
    if kind == "aws":
        assert server.requests[0][:2] == ("PUT", "/latest/api/token", )  # IMDSv2: a session token first
    assert all(h.get("Host", "").startswith("127.0.0.1") for _, _, h in server.requests)


def test_a_notice_file(tmp_path):
    notice = tmp_path / "preempt-now"

    class Touch(Callback):
        def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 2 and not notice.exists():
                notice.write_text("")
                for _ in range(200):
                    if preemption.notice is not None:
                        break
                    threading.Event().wait(0.01)

    preemption = PreemptionCheckpoint(signals=[], notice_file=str(notice), poll_seconds=0.02, exit_code=0)
    with pytest.raises(PreemptedExit) as exited:
        run(str(tmp_path / "ckpt"), preemption=preemption, extra=[Touch()])
    assert exited.value.code == 0 and preemption.notice.kind == "file" and preemption.saved["step"] == 3


def test_a_deadline_too_short_keeps_the_previous_checkpoint_and_exits_124(s3_backend, monkeypatch):
    # Saves through a proxy that adds latency to every request: a save takes far longer than the deadline left.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_backend.endpoint)
    with StoreProxy(s3_backend.endpoint, latency=0.05) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}}
        preemption = PreemptionCheckpoint(deadline_seconds=0.05)
        with pytest.raises(PreemptedExit) as exited:
            run(s3_backend.root, preemption=preemption, io=AtomicCheckpointIO(storage_options=options),
                extra=[SignalAt(6)])
    assert exited.value.code == 124 and preemption.saved["committed"] is False
    latest = find_latest_checkpoint(s3_backend.root, s3_backend.storage_options)
    assert "/epoch=0-step=4.ckpt/" in latest  # the previous committed checkpoint stays the latest


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="signals: 'SIGNOPE'"):
        PreemptionCheckpoint(signals=["SIGNOPE"])
    with pytest.raises(ValueError, match="exit_code must be an exit status"):
        PreemptionCheckpoint(exit_code=300)
    with pytest.raises(ValueError, match="aws_spot must be True, False or an http"):
        PreemptionCheckpoint(aws_spot="169.254.169.254")
    with pytest.raises(ValueError, match="deadline_seconds must be"):
        PreemptionCheckpoint(deadline_seconds=0)
    assert PreemptionCheckpoint(signals=["USR1", "SIGTERM", 10]).signals == [signal.SIGUSR1, signal.SIGTERM, 10]


@pytest.mark.slow
def test_a_training_process_sigtermed_at_a_random_step_resumes_bit_identical(tmp_path, s3_backend, monkeypatch):
    """A real process, a real SIGTERM at a random batch (mid-accumulation included), on S3 during an async upload, then
    the same command again; against one uninterrupted run (the same code, run here). Local disk: the in-process tests
    above (real signals too)."""
    import random

    from . import preemption_child

    monkeypatch.setattr(sys, "argv", ["preemption_child", str(tmp_path / "ref"), str(tmp_path / "ref.pt"), "local"])
    preemption_child.main()
    want = torch.load(tmp_path / "ref.pt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "AWS_ENDPOINT_URL": s3_backend.endpoint}
    for store, root in (("s3", s3_backend.root),):
        batch = random.Random().randint(3, 30)
        out = tmp_path / f"{store}.pt"
        proc = procs.popen([sys.executable, str(CHILD), root, str(out), store], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("BATCH ") and int(line.split()[1]) == batch:
                proc.send_signal(signal.SIGTERM)
                break
        proc.wait(timeout=120)
        assert proc.returncode == 143, (store, batch, proc.stderr.read()[-3000:] if proc.stderr else "")
        done = procs.run([sys.executable, str(CHILD), root, str(out), store], env=env, capture_output=True,
                         text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        got = torch.load(out)
        for name in want:
            assert torch.equal(got[name], want[name]), (store, batch, name)



@pytest.mark.slow
@pytest.mark.parametrize("window", ["sanity", "loader"])
def test_a_training_process_sigtermed_before_training_starts_exits_124_not_0(tmp_path, window):
    """A real process, a real SIGTERM during the sanity check or while the training loader is built (Lightning's
    handlers in place, ours not yet): it exits with the unsaved status (non-zero: a scheduler restarts it), having
    written nothing, and says why."""
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "PREEMPTION_WINDOW": window}
    proc = procs.popen([sys.executable, str(CHILD), root, str(tmp_path / "out.pt"), "local"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            assert not line.startswith("BATCH"), "training started before the window"
            if line.startswith("WINDOW"):
                proc.send_signal(signal.SIGTERM)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 124, err[-3000:]
    assert "no training step was taken, so there is nothing new to save" in err
    assert not Path(root).exists() or not Path(root, POINTER_NAME).exists()  # nothing saved, nothing claimed

@pytest.mark.slow
def test_ddp_a_notice_to_rank_1_only_makes_both_ranks_save_one_step_and_exit(tmp_path):
    """Two DDP processes; SIGTERM reaches rank 1 alone: the ranks agree on one step, save it together, both exit."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = procs.popen([sys.executable, str(CHILD), root, str(tmp_path / "out.pt"), "ddp"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    pids: dict[int, int] = {}
    try:
        for line in proc.stdout:
            for rank, pid in re.findall(r"PID (\d+) (\d+)", line):
                pids[int(rank)] = int(pid)
            if re.search(r"\bBATCH 7\b", line) and 1 in pids:
                os.kill(pids[1], signal.SIGTERM)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, proc.stderr.read()[-3000:] if proc.stderr else ""
    latest = pointer(root).latest
    assert latest.name == "preemption.ckpt" and latest.step in (4, 5)  # the step batch 7 or 8 completes
    assert _gone(pids[1], timeout=30)  # rank 1 exited too (no process left waiting in a collective)


def _gone(pid: int, timeout: float) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True  # exited; its parent (the gone rank 0) never reaped it
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_save_still_running_at_the_deadline_ends_the_process_with_124_and_commits_nothing(tmp_path, s3_backend):
    """No earlier save to estimate from: the save starts, the store is slow, the deadline comes first."""
    with StoreProxy(s3_backend.endpoint, latency=0.4) as proxy:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "AWS_ENDPOINT_URL": proxy.url, "PREEMPTION_DEADLINE": "1.5"}
        proc = procs.popen([sys.executable, str(CHILD), s3_backend.root, str(tmp_path / "out.pt"), "s3"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("BATCH 1"):
                proc.send_signal(signal.SIGTERM)
                break
        proc.wait(timeout=120)
        err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 124, err[-3000:]
    assert "did not commit within 2 s" in err and "previous committed checkpoint stays the latest" in err
    assert find_latest_checkpoint(s3_backend.root, s3_backend.storage_options) is None  # nothing half-made loads
