"""Result types of the data operations (``ItemResult`` of the ``*_many`` calls lives in
:mod:`.fanout`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoreResult"]


@dataclass(frozen=True)
class StoreResult:
    """What one ``store`` did, with the same meaning on SHM and inline-data servers.

    Only whole chunks are stored: ``total_chunks = len(tokens) // chunk_size``
    and the ``ignored_tokens`` past the last full chunk are not sent.
    ``written_chunks`` were newly written by this call; ``skipped_chunks`` were
    not (already cached, or the server had no room for them).
    """

    total_chunks: int
    written_chunks: int
    chunk_size: int
    ignored_tokens: int

    @property
    def skipped_chunks(self) -> int:
        """Chunks not written: already cached or no room on the server."""
        return self.total_chunks - self.written_chunks

    @property
    def stored_tokens(self) -> int:
        """Tokens covered by chunks newly written by this call."""
        return self.written_chunks * self.chunk_size
