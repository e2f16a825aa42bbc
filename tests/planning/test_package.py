"""The package surface: every public name importable, sorted ``__all__``, docstring examples that run."""

from __future__ import annotations

import doctest
import importlib

import pytest

import lightning_resilient.planning as planning

MODULES = ["audit", "cadence", "cost", "tiers"]


def test_public_names_import_and_all_is_sorted():
    assert planning.__all__ == sorted(planning.__all__)
    for name in planning.__all__:
        assert getattr(planning, name) is not None
    for module in MODULES:
        mod = importlib.import_module(f"lightning_resilient.planning.{module}")
        assert mod.__all__ == sorted(mod.__all__), module


@pytest.mark.parametrize("module", ["cadence", "cost", "tiers"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"lightning_resilient.planning.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
