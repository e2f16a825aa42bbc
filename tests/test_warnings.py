"""The package's warnings are shown at the user's line (``lightning_resilient/_warnings.py``), not under a file of
Lightning's or of this package: a warning raised in a callback hook during ``trainer.fit`` names the ``fit`` call."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, IterableDataset

from lightning_resilient import ResumeStateCallback
from lightning_resilient._warnings import warn

from .models import TinyModel


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        for _ in range(8):
            x = torch.randn(8, generator=g)
            yield x, x.sum(0, keepdim=True)


def test_a_warning_raised_in_a_callback_hook_is_shown_at_the_users_fit_call(tmp_path):
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, callbacks=[ResumeStateCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), DataLoader(Stream(), batch_size=4))  # the line the warning names
    ours = [w for w in caught if "ResumeStateCallback cannot make a resume of this run exact" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert {w.filename for w in ours} == {__file__}, [(w.filename, w.lineno) for w in ours]


def test_a_warning_with_no_user_frame_names_the_line_that_raised_it():
    def inside() -> None:
        warn("from here", RuntimeWarning)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inside()
    (w,) = caught
    assert w.filename == __file__ and w.category is RuntimeWarning  # (this test is the user here)
    assert w.lineno == inside.__code__.co_firstlineno + 1  # the line that called warn: no frame is inside
