"""LineReader: lines of a pipe read by their own thread, waited for with a timeout (a real os.pipe, in-process)."""

from __future__ import annotations

import os
import threading

from lightning_resilient.testing.lines import LineReader


def _pipe() -> tuple[LineReader[str], object]:
    r, w = os.pipe()
    return LineReader(os.fdopen(r), str.strip), os.fdopen(w, "w", buffering=1)


def test_a_line_written_later_is_waited_for_and_found():
    reader, writer = _pipe()
    threading.Timer(0.1, lambda: writer.write("STEP 3\n")).start()
    assert reader.wait_for(lambda line: line.startswith("STEP"), timeout=30) == "STEP 3"
    writer.write("END 3\n")
    writer.close()
    reader.join(timeout=30)
    assert reader.items() == ["STEP 3", "END 3"] and reader.closed


def test_a_closed_stream_or_the_timeout_ends_the_wait_without_an_item():
    reader, writer = _pipe()
    assert reader.wait_for(lambda line: line == "never", timeout=0.1) is None  # timeout, stream still open
    writer.write("other\n")
    writer.close()
    assert reader.wait_for(lambda line: line == "never", timeout=30) is None  # closed: no 30 s wait
    assert reader.items() == ["other"]


def test_a_test_may_look_at_every_item_and_each_item_is_handed_on_as_read():
    r, w = os.pipe()
    handed: list[int] = []
    reader = LineReader(os.fdopen(r), int, on_item=handed.append)
    with os.fdopen(w, "w") as writer:
        writer.write("1\n2\n3\n")
    assert reader.wait_for(lambda _: sum(reader.items()) >= 6, timeout=30) is not None
    reader.join(timeout=30)
    assert handed == [1, 2, 3]
