"""The demo: train against an S3 server on loopback, SIGKILL the job in the middle of a save, rerun the
same command, and show that it resumes from the newest committed checkpoint.

``make demo`` runs ``python -m lightning_resilient.demo``. The training job itself is
``python -m lightning_resilient.demo train --root s3://...``; the demo launches it twice, identically.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time
from typing import Any

BUCKET = "lightning-resilient-demo"
ROOT = f"s3://{BUCKET}/run-1/checkpoints"


# -- the training job --------------------------------------------------------------------------------------------

def _announcer() -> Any:
    """Where the job reports save events for the driver: a pipe the driver passes in, else stdout."""
    fd = os.environ.get("LR_DEMO_EVENTS_FD")
    stream = os.fdopen(int(fd), "w", buffering=1) if fd else sys.stdout
    lock = threading.Lock()

    def announce(message: str) -> None:
        with lock:
            stream.write(f"@{message}\n")
            stream.flush()

    return announce


def train(root: str, max_steps: int, weights_out: str | None = None) -> None:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_resilient import AtomicCheckpointIO, ResumeStateCallback, find_latest_checkpoint, warmup_schedule

    class Regressor(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # ~2.3 M parameters: with Adam's state a checkpoint is ~27 MB, so a save takes a visible moment.
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 1500), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                           torch.nn.Linear(1500, 1500), torch.nn.ReLU(), torch.nn.Linear(1500, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=1e-3)
            # Warmup + cosine sized in real optimizer steps (max_steps, with 2 micro-batches per step).
            sched = warmup_schedule(opt, "cosine", trainer=self.trainer, warmup_steps=0.1, min_lr_ratio=0.05)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    announce = _announcer()

    class Announcing(AtomicCheckpointIO):
        # Tells the demo driver when a save starts and ends, so it can kill the job inside one.
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            announce(f"save-begin {checkpoint['global_step']} {path}")
            super().save_checkpoint(checkpoint, path, storage_options)
            announce(f"save-end {checkpoint['global_step']}")

    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    data = DataLoader(TensorDataset(x, x.sin().sum(1, keepdim=True)), batch_size=32, shuffle=True)
    # orphan_grace_seconds=0 only because the demo has a single job: in production keep the default (1 h),
    # which protects a save that another, concurrent job still has in progress.
    io = Announcing(keep_last=2, shard_size=4 * 2**20, orphan_grace_seconds=0, max_concurrency=2)
    store = io.root(root).store
    write = store.write

    def announced_write(rel: str, data: Any) -> None:
        write(rel, data)
        announce(f"object {rel}")

    store.write = announced_write  # type: ignore[method-assign]  # lets the driver kill mid-upload
    ckpt_path = find_latest_checkpoint(root)
    announce(f"resume {ckpt_path}")
    trainer = Trainer(max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                      enable_model_summary=False,
                      plugins=[io], callbacks=[ResumeStateCallback(),
                                               ModelCheckpoint(dirpath=root, every_n_train_steps=10, save_last=True)])
    trainer.fit(Regressor(), data, ckpt_path=ckpt_path)
    if weights_out:
        torch.save(trainer.lightning_module.state_dict(), weights_out)
    lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    announce(f"done {trainer.global_step} {lr!r}")


# -- the driver --------------------------------------------------------------------------------------------------

class Job:
    """The training command in a subprocess: its output goes to the terminal, its events to a pipe."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        events_r, events_w = os.pipe()
        env = {**env, "LR_DEMO_EVENTS_FD": str(events_w)}
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=(events_w,))
        os.close(events_w)
        self.events: list[tuple[float, str, list[str]]] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._pump, args=(events_r,), daemon=True)
        self.reader.start()

    def _pump(self, fd: int) -> None:
        with os.fdopen(fd, "r") as stream:
            for line in stream:
                kind, *rest = line.strip().split()
                with self.cond:
                    self.events.append((time.monotonic(), kind, rest))
                    self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait(self, kind: str, count: int = 1, timeout: float = 300) -> tuple[float, list[str]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                hits = [(t, rest) for t, k, rest in self.events if k == kind]
                if len(hits) >= count:
                    return hits[count - 1]
                if not self.reader.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the training job exited before printing {kind} (exit {self.proc.poll()})")
                self.cond.wait(0.5)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.reader.join()


def _start_s3() -> tuple[Any, str]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - the Makefile installs it
        raise SystemExit("the demo needs moto's S3 server: pip install 'lightning_resilient[demo]'") from exc
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log would drown the demo
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def _listing(root: str) -> list[str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    found = []
    for p in sorted(fs.find(path)):
        rel = p[len(path) + 1:]
        found.append(rel)
    return found


def _folders(root: str) -> dict[str, set[str]]:
    """commit folder -> names of the objects in it."""
    out: dict[str, set[str]] = {}
    for rel in _listing(root):
        parts = rel.split("/")
        if len(parts) == 3:
            out.setdefault("/".join(parts[:2]), set()).add(parts[2])
    return out


def _step_of(url: str | None) -> int | None:
    if url is None:
        return None
    from lightning_resilient import AtomicCheckpointIO

    return int(AtomicCheckpointIO(claim_on_load=False).load_checkpoint(url)["global_step"])


def run_demo(max_steps: int = 60, kill_step: int = 30) -> int:
    os.environ.update({"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    server, endpoint = _start_s3()
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # reaches s3fs here, in the job, and Lightning's own client
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    print(f"S3 server (moto) on {endpoint}; checkpoints go to {ROOT}\n")
    workdir = tempfile.mkdtemp(prefix="lightning-resilient-demo-")
    cmd = [sys.executable, "-m", "lightning_resilient.demo", "train", "--root", ROOT, "--max-steps", str(max_steps),
           "--weights-out", os.path.join(workdir, "resumed.pt")]
    print("$ " + " ".join(cmd[2:]).replace(sys.executable, "python"))
    try:
        job = Job(cmd, dict(os.environ))
        # Kill inside the upload of step kill_step's checkpoint: after a few of its objects are stored, before
        # its manifest and the pointer swap.
        job.wait("@save-begin", 2 * (kill_step // 10) - 1)
        deadline = time.monotonic() + 300
        while True:
            with job.cond:
                written = [r for _, k, r in job.events if k == "@object" and f"step={kill_step}.ckpt/" in r[0]]
                if len(written) >= 3 or time.monotonic() > deadline:
                    break
                job.cond.wait(0.05)
        job.kill()
        step = str(kill_step)
        finished = any(k == "@save-end" and rest[0] == step for _, k, rest in job.events)
        print(f"\n\n*** SIGKILL sent to the training job in the middle of uploading the checkpoint of step {step}"
              f" ({len(written)} objects stored, {'but the save had finished' if finished else 'no manifest yet'})"
              " ***\n")

        from lightning_resilient import find_latest_checkpoint
        from lightning_resilient.io.manifest import MANIFEST_NAME

        folders = _folders(ROOT)
        partial = [f for f, names in folders.items() if MANIFEST_NAME not in names]
        latest = find_latest_checkpoint(ROOT)
        print("What the store holds after the kill:")
        for folder, names in sorted(folders.items()):
            state = "committed" if MANIFEST_NAME in names else "PARTIAL (no manifest: invisible to resume)"
            print(f"  {folder:60s} {len(names):3d} objects  {state}")
        print(f"\nNewest committed checkpoint: {latest}\n")

        print("$ " + " ".join(cmd[2:]) + "     # the same command again")
        job2 = Job(cmd, dict(os.environ))
        _, resumed = job2.wait("@resume")
        _, done = job2.wait("@done", timeout=600)
        job2.proc.wait()

        reference = ROOT.replace("run-1", "run-uninterrupted")
        print(f"\n\n$ ... train --root {reference}     # the same training, never interrupted, for comparison")
        job3 = Job([*cmd[:5], reference, *cmd[6:-1], os.path.join(workdir, "uninterrupted.pt")], dict(os.environ))
        job3.wait("@done", timeout=600)
        job3.proc.wait()
        import torch

        resumed_w = torch.load(os.path.join(workdir, "resumed.pt"))
        plain_w = torch.load(os.path.join(workdir, "uninterrupted.pt"))
        same = resumed_w.keys() == plain_w.keys() and all(torch.equal(resumed_w[k], plain_w[k]) for k in plain_w)
        after = _folders(ROOT)
        print("\n\nReport")
        print(f"  killed during the upload of step {step}: {len(written)} objects stored, save"
              f" {'finished' if finished else 'interrupted before its manifest'}")
        print(f"  partial folders left by the kill: {len(partial)}"
              + (f" ({', '.join(partial)})" if partial else ""))
        print(f"  restart found and resumed from:   {resumed[0]} (step {_step_of(latest)})")
        print(f"  resumed run finished at step:     {done[0]} (of {max_steps}), LR {float(done[1]):.2e} = the"
              " cosine schedule's end (5% of 1e-3), reached at the last optimizer step")
        print(f"  partial folders collected since:  {sum(1 for f in partial if f not in after)} of {len(partial)}")
        print(f"  folders kept: {sorted({f.split('/')[0] for f in after})} (keep_last=2; the data of the checkpoint"
              " this run resumed from is never deleted by it)")
        print(f"  killed + resumed vs uninterrupted: {'bit-identical' if same else 'DIFFERENT'} final weights"
              f" (torch.equal on all {len(plain_w)} tensors; ResumeStateCallback restored the RNGs and the"
              " shuffled loader's position)")
        ok = resumed[0] == latest and int(done[0]) == max_steps and abs(float(done[1]) - 5e-5) < 1e-12 and same
        print("\nDEMO OK" if ok else "\nDEMO FAILED")
        return 0 if ok else 1
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_resilient.demo", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    t = sub.add_parser("train", help="the training job (what the demo launches)")
    t.add_argument("--root", required=True)
    t.add_argument("--max-steps", type=int, default=60)
    t.add_argument("--weights-out", default=None, help="write the final weights here")
    args = parser.parse_args(argv)
    if args.command == "train":
        train(args.root, args.max_steps, args.weights_out)
        return 0
    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
