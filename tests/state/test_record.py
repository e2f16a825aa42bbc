"""ResumeStateCallback's stored record: the same plain dict in and out, its format checked, its kind a str Enum."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from lightning_resilient import ResumeStateCallback
from lightning_resilient.errors import CheckpointCorruptedError, UnsupportedFormatError
from lightning_resilient.state._loader import LoaderKind
from lightning_resilient.state._record import FORMAT, RankRecord
from lightning_resilient.state.rng import capture_rng


def stored(**changes: Any) -> dict[str, Any]:
    """A record as ResumeStateCallback stores it (every key, in its order)."""
    raw: dict[str, Any] = {
        "kind": "map", "epoch": 1, "consumed": 3, "samples": 12, "epoch_done": False, "mid_epoch": True,
        "batches": 10, "batch_size": 4, "num_workers": 0, "sampler": {"seed": 0}, "loader_state": None,
        "epoch_rng": capture_rng(), "now_rng": capture_rng(), "epoch_generators": [], "order_rng": capture_rng(),
        "order_generators": [], "now_generators": [], "validation_follows": True, "validation_draws": 1}
    raw.update(changes)
    return raw


def test_a_stored_record_reads_back_to_the_same_dict_in_the_same_order():
    raw = stored()
    record = RankRecord.from_dict(raw)
    assert record.kind is LoaderKind.MAP and record.mid_epoch
    assert list(record.to_dict()) == list(raw) and record.to_dict() == raw
    at_end = stored(epoch_done=True, mid_epoch=False, order_draws=2, order_generator_draws=0)
    assert list(RankRecord.from_dict(at_end).to_dict()) == list(at_end)


def test_the_epoch_s_order_and_its_stepped_samples_round_trip_and_are_optional():
    order = {"kind": "distributed", "n": 40, "seed": 0, "epoch": 1, "shuffle": True, "drop_last": False,
             "replicas": 2, "layout": "rest", "start": 16, "dataset": 40}
    raw = stored(order=order, step_samples=8)
    record = RankRecord.from_dict(raw)
    assert record.to_dict() == raw and record.reads_a_rest and record.step_samples == 8
    assert not RankRecord.from_dict(stored(order={**order, "layout": "sampler"})).reads_a_rest
    why = RankRecord.from_dict(stored(order="the sampler Weighted is not one whose order can be drawn again"))
    assert isinstance(why.order, str) and not why.reads_a_rest
    older = RankRecord.from_dict(stored())  # written before elastic resume
    assert older.order is None and older.step_samples is None and "order" not in older.to_dict()


def test_the_kind_is_stored_as_a_plain_string_that_loads_with_weights_only():
    out = RankRecord.from_dict(stored(kind="loader")).to_dict()
    assert type(out["kind"]) is str and out["kind"] == LoaderKind.LOADER == "loader"
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["kind"] == "loader"


def test_keys_added_to_format_2_later_are_optional_and_an_unknown_kind_is_kept():
    old = {k: v for k, v in stored(kind="future").items()
           if k not in ("order_rng", "order_generators", "validation_follows", "validation_draws")}
    record = RankRecord.from_dict(old)
    assert record.kind == "future" and record.order_rng is None and record.validation_draws == 0
    assert not record.validation_follows and record.order_draws is None


def test_a_record_without_a_key_every_format_2_record_has_is_a_clear_error():
    raw = stored()
    del raw["now_rng"]
    with pytest.raises(CheckpointCorruptedError, match="has no 'now_rng'"):
        RankRecord.from_dict(raw)


@pytest.mark.parametrize(("found", "says"), [(FORMAT + 1, "newer version. Upgrade lightning_resilient"),
                                             (1, "format 2 only .* resume without ResumeStateCallback"),
                                             (None, "format None, .* resume without ResumeStateCallback")])
def test_a_state_of_another_format_is_refused_saying_what_to_do(found, says):
    state = {"world_size": 1, "ranks": [stored()]}
    if found is not None:
        state["format"] = found
    with pytest.raises(UnsupportedFormatError, match=says):
        ResumeStateCallback().load_state_dict(state)
