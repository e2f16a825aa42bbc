"""HTTP(S): read-only, for loading checkpoints a web server serves (a static file server, a CDN in front of a bucket).

An HTTP server answers GET and HEAD only, so a root served over HTTP can be loaded, verified and listed, never
written (a write fails in fsspec's own words). What differs from the generic backend is how servers answer:

- a folder listing is the server's HTML index: names come URL-quoted (``epoch%3D1-step%3D4.ckpt``) and without sizes
  (unknown, asked with a HEAD when needed: see ``ObjectInfo``), and a folder URL cannot be told from a file's;
- a server may ignore ``Range`` requests (Python's ``http.server`` does) and send the whole object: a ranged read
  then keeps the range it asked for, at the price of transferring the object once per range.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from urllib.parse import unquote

from lightning_resilient.io.store.base import Store

__all__ = ["HTTPStore"]

log = logging.getLogger(__name__)


class HTTPStore(Store):
    """A root served over HTTP(S), for reading."""

    _warned_ranges = False

    def _name(self, listed: str) -> str:
        return unquote(super()._name(listed))

    def root_is_file(self) -> bool:
        return False  # a server answers a folder's URL with its index page, which fsspec takes for a file

    def _range_pieces(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        if end <= start:
            return
        data = memoryview(self.fs.cat_file(path, start=start, end=end))
        if len(data) > end - start:
            # The server ignored the Range header and sent the whole object (a 200, not a 206).
            if not self._warned_ranges:
                self._warned_ranges = True
                log.warning("the server behind %s ignores Range requests: each ranged read transfers the whole"
                            " object", self.root_url)
            data = data[start:end]
        yield data
