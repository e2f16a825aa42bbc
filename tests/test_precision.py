"""select_precision's decision table, real detection, and AutoPrecision inside a Trainer (scaler state, resume
across a precision switch, the LightningCLI form)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_resilient import AtomicCheckpointIO, AutoPrecision, select_precision
from lightning_resilient import precision as precision_module

from .models import TinyModel, tiny_loader


@pytest.mark.parametrize("gpu, capability, expected", [
    ("P100", (6, 0), "32-true"),
    ("V100", (7, 0), "16-mixed"),
    ("T4", (7, 5), "16-mixed"),
    ("A100", (8, 0), "bf16-mixed"),
    ("A10/L4", (8, 6), "bf16-mixed"),
    ("H100/H200", (9, 0), "bf16-mixed"),
    ("B200", (10, 0), "bf16-mixed"),
])
def test_cuda_table(gpu, capability, expected):
    assert select_precision(accelerator="cuda", capability=capability) == expected, gpu


@pytest.mark.parametrize("arch, expected", [
    ("gfx90a:sramecc+:xnack-", "bf16-mixed"), ("gfx942", "bf16-mixed"), ("gfx1100", "bf16-mixed"),
    ("gfx908", "16-mixed"), ("gfx906", "32-true"),
])
def test_rocm_table(arch, expected):
    assert select_precision(accelerator="rocm", arch=arch) == expected


@pytest.mark.parametrize("facts, expected", [
    ({"accelerator": "cpu", "cpu_flags": {"avx2", "avx512f", "avx512_bf16"}}, "bf16-mixed"),
    ({"accelerator": "cpu", "cpu_flags": {"avx2", "amx_bf16"}}, "bf16-mixed"),
    ({"accelerator": "cpu", "cpu_flags": {"fp", "asimd", "bf16"}}, "bf16-mixed"),  # Arm with BF16
    ({"accelerator": "cpu", "cpu_flags": {"avx2", "avx512f"}}, "32-true"),
    ({"accelerator": "cpu", "cpu_flags": set()}, "32-true"),
    ({"accelerator": "xla"}, "bf16-true"),
    ({"accelerator": "mps", "mps_bf16": True}, "bf16-mixed"),
    ({"accelerator": "mps", "mps_bf16": False}, "32-true"),
])
def test_other_accelerators(facts, expected):
    assert select_precision(**facts) == expected


def test_allow_list_falls_back_to_what_the_hardware_does_well():
    assert select_precision(accelerator="cuda", capability=(9, 0), allow=["16-mixed", "32-true"]) == "16-mixed"
    assert select_precision(accelerator="cuda", capability=(7, 5), allow=["bf16-mixed", "32-true"]) == "32-true"
    with pytest.raises(ValueError, match="none of allow=\\['bf16-mixed'\\] runs well"):
        select_precision(accelerator="cuda", capability=(7, 0), allow=["bf16-mixed"])
    with pytest.raises(ValueError, match="allow must name some of"):
        select_precision(accelerator="cpu", cpu_flags=set(), allow=["fp8"])
    with pytest.raises(TypeError, match="not the string"):
        select_precision(accelerator="cpu", cpu_flags=set(), allow="32-true")


def test_bad_facts_are_clear_errors():
    with pytest.raises(ValueError, match="accelerator must be one of"):
        select_precision(accelerator="gpu")
    with pytest.raises(ValueError, match="needs capability"):
        select_precision(accelerator="cuda")


def test_real_detection_on_this_cpu():
    facts = precision_module.detect_facts("cpu")
    with open("/proc/cpuinfo") as f:
        native = any(flag in f.read().split() for flag in ("avx512_bf16", "amx_bf16", "bf16"))
    assert facts["accelerator"] == "cpu"
    assert select_precision(device="cpu") == ("bf16-mixed" if native else "32-true")


# -- inside a Trainer --------------------------------------------------------------------------------------------

def trainer(**kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                   **kwargs)


def test_plugin_applies_the_choice_and_logs_one_line(caplog):
    plugin = AutoPrecision(precision=None, allow=None)
    t = trainer(max_steps=2, plugins=[plugin], enable_checkpointing=False)
    with caplog.at_level("INFO"):
        t.fit(TinyModel(), tiny_loader())
    expected = select_precision(device="cpu")
    assert plugin.precision == t.precision == expected
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AutoPrecision:")]
    assert len(lines) == 1 and lines[0].startswith(f"AutoPrecision: {expected} on cpu (")
    assert isinstance(plugin._inner, MixedPrecision if expected != "32-true" else Precision)


def test_precision_argument_and_plugin_together_is_lightnings_error():
    with pytest.raises(ValueError, match=r"Received both `precision=.*` and `plugins="):
        trainer(precision="bf16-mixed", plugins=[AutoPrecision()])


def test_fsdp_needs_its_own_precision_class():
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    # The check Lightning's accelerator connector runs when it hands the plugin to the strategy (a Trainer
    # with FSDP cannot be built without a GPU).
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy().precision_plugin = AutoPrecision()
    fsdp = AutoPrecision.for_fsdp(device="cpu")
    assert isinstance(fsdp, FSDPPrecision) and fsdp.precision == select_precision(device="cpu")


class Overflowing(TinyModel):
    """Its first few fp16 steps overflow, so the GradScaler's scale moves away from its initial value."""

    def on_after_backward(self) -> None:
        if self.global_step < 3:
            self.net[0].weight.grad[0, 0] = float("inf")


def test_fp16_scaler_state_is_saved_and_restored(memory_backend):
    root = memory_backend.root
    plugin = AutoPrecision(precision="16-mixed", init_scale=1024.0)
    t = trainer(max_steps=5, plugins=[plugin, AtomicCheckpointIO()],
                callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=5)])
    t.fit(Overflowing(), tiny_loader())
    scale = plugin.scaler.get_scale()
    assert scale == 1024.0 / 8  # three skipped (overflowing) steps halved it three times
    saved = AtomicCheckpointIO(claim_on_load=False).load_checkpoint(root)["AutoPrecision"]
    assert saved["precision"] == "16-mixed" and saved["scaler"]["scale"] == scale

    resumed = AutoPrecision(precision="16-mixed", init_scale=1024.0)
    t2 = trainer(max_steps=6, plugins=[resumed, AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=root)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="resuming a")
        t2.fit(TinyModel(), tiny_loader(), ckpt_path=root)
    assert resumed.scaler.get_scale() == scale


@pytest.mark.parametrize("first, second, message", [
    ("16-mixed", "bf16-mixed", "GradScaler state .* was dropped"),
    ("bf16-mixed", "16-mixed", "the loss scale starts fresh at 1024"),
    ("32-true", "16-mixed", "the loss scale starts fresh"),
])
def test_resume_across_a_precision_switch(memory_backend, first, second, message):
    root = memory_backend.root
    t = trainer(max_steps=2, plugins=[AutoPrecision(precision=first, init_scale=1024.0), AtomicCheckpointIO()],
                callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2)])
    t.fit(TinyModel(), tiny_loader())
    plugin = AutoPrecision(precision=second, init_scale=1024.0)
    t2 = trainer(max_steps=4, plugins=[plugin, AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=root)])
    expected = f"resuming a {first} checkpoint under {second}: .*" + message.split(".*")[-1]
    with pytest.warns(RuntimeWarning, match=expected):
        t2.fit(TinyModel(), tiny_loader(), ckpt_path=root)
    assert t2.global_step == 4 and plugin.precision == second


def test_stock_mixed_precision_checkpoint_keeps_its_loss_scale(memory_backend):
    root = memory_backend.root
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    t = trainer(max_steps=5, plugins=[stock, AtomicCheckpointIO()],
                callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=5)])
    t.fit(Overflowing(), tiny_loader())
    plugin = AutoPrecision(precision="16-mixed", init_scale=1024.0)
    t2 = trainer(max_steps=6, plugins=[plugin, AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=root)])
    t2.fit(TinyModel(), tiny_loader(), ckpt_path=root)
    assert plugin.scaler.get_scale() == stock.scaler.get_scale() == 128.0


@pytest.mark.parametrize("kwargs, error", [
    ({"precision": "fp8"}, "precision must be one of"),
    ({"allow": ["fp4"]}, "allow must name some of"),
    ({"init_scale": 0}, "init_scale must be a positive number"),
])
def test_constructor_validation(kwargs, error):
    with pytest.raises(ValueError, match=error):
        AutoPrecision(**kwargs)


def test_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n  max_steps: 2\n  logger: false\n  enable_progress_bar: false\n"
        "  enable_checkpointing: false\n"
        "  plugins:\n"
        "    - class_path: lightning_resilient.AutoPrecision\n"
        "      init_args:\n        allow: [bf16-mixed, 32-true]\n        init_scale: 256.0\n"
    )
    cli = LightningCLI(TinyModel, datamodule_class=None, run=False, args=["--config", str(config)],
                       save_config_callback=None)
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, AutoPrecision) and plugin.allow == ("bf16-mixed", "32-true")
    cli.trainer.fit(cli.model, tiny_loader())
    assert plugin.precision in ("bf16-mixed", "32-true")


# -- under the standalone pytorch_lightning namespace ----------------------------------------------------------------

def _pl_fit(root: str, **kwargs: Any) -> tuple[Any, list[str]]:
    """A pytorch_lightning fit of a pytorch_lightning module; returns the trainer and the hooks the module saw."""
    pl = pytest.importorskip("pytorch_lightning")

    class PLModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.seen: list[str] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # called by the precision plugin's closure
            self.seen.append(str(self.net[0].weight.grad.dtype))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = PLModel()
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=4)], **kwargs)
    trainer.fit(model, tiny_loader())
    return trainer, model


@pytest.mark.parametrize("choice", ["bf16-mixed", "16-mixed", "32-true"])
def test_a_pytorch_lightning_trainer_takes_the_plugin_and_trains_as_with_its_own_precision(tmp_path, choice):
    # It was refused with Lightning's "Found invalid type for plugin": its Precision is another namespace's class.
    from pytorch_lightning.plugins.precision import MixedPrecision as PLMixedPrecision
    from pytorch_lightning.plugins.precision import Precision as PLPrecision

    plugin = AutoPrecision(precision=choice)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|GradScaler).*")
        auto, auto_model = _pl_fit(str(tmp_path / "auto"), plugins=[plugin])
        if choice == "16-mixed":  # Trainer(precision="16-mixed") turns into bf16 on a CPU: build its plugin
            scaler = torch.amp.GradScaler("cpu", init_scale=plugin.init_scale)
            _, stock_model = _pl_fit(str(tmp_path / "stock"), plugins=[PLMixedPrecision(choice, "cpu", scaler)])
        else:
            _, stock_model = _pl_fit(str(tmp_path / "stock"), precision=choice)
    assert auto.precision_plugin is plugin and auto.precision == choice
    assert isinstance(plugin._inner, PLMixedPrecision if choice != "32-true" else PLPrecision)  # pl's own classes
    assert auto_model.seen == stock_model.seen and len(auto_model.seen) == 4
    for a, b in zip(auto_model.state_dict().values(), stock_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved = torch.load(str(tmp_path / "auto" / "epoch=0-step=4.ckpt"), weights_only=True)
    assert saved["AutoPrecision"]["precision"] == choice
    assert (saved["AutoPrecision"]["scaler"] is not None) == (choice == "16-mixed")


def test_made_where_pytorch_lightning_is_imported_it_still_trains_resumes_and_pickles_under_lightning_pytorch(
        memory_backend):
    pytest.importorskip("pytorch_lightning")
    import copy
    import pickle

    from pytorch_lightning.plugins.precision import Precision as PLPrecision

    plugin = AutoPrecision(precision="16-mixed", init_scale=256.0)
    assert isinstance(plugin, AutoPrecision) and isinstance(plugin, Precision) and isinstance(plugin, PLPrecision)
    assert type(plugin).__qualname__ == "AutoPrecision"  # the key of its state in a checkpoint
    for clone in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):  # ddp_spawn, deepcopy of a Trainer
        assert type(clone) is type(plugin) and clone.init_scale == 256.0 and clone.precision == "16-mixed"
    root = memory_backend.root
    first = trainer(max_steps=2, plugins=[plugin, AtomicCheckpointIO()],
                    callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GradScaler.*")
        first.fit(Overflowing(), tiny_loader())
    scale = plugin.scaler.get_scale()
    assert scale < 256.0  # the overflowing steps moved it
    plain = object.__new__(AutoPrecision)  # the class a program without pytorch_lightning makes
    plain.__init__(precision="16-mixed", init_scale=256.0)  # type: ignore[misc]
    resumed = trainer(max_steps=2, plugins=[plain, AtomicCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath=root)])
    resumed.fit(Overflowing(), tiny_loader(), ckpt_path=root)
    assert plain.scaler.get_scale() == scale  # either class resumes the other's checkpoint


@pytest.mark.slow
def test_made_without_pytorch_lightning_it_imports_it_not_and_lightnings_log_settings_stay_in_force():
    # A process of its own: importing pytorch_lightning routes Lightning's rank-zero log lines through its logger, so
    # a program that quieted the lightning.pytorch logger would get them again.
    import subprocess
    import sys

    script = """
import logging, sys
import lightning.pytorch as L
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
from lightning_resilient import AutoPrecision
plugin = AutoPrecision()
L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, plugins=[plugin])
print(type(plugin).__mro__[1].__module__, "pytorch_lightning" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["lightning.pytorch.plugins.precision.precision", "False"]
    assert "GPU available" not in done.stderr  # the user's logging settings held
