"""Globally unique ids: time-ordered 16-byte entity ids and integer sequences."""

from __future__ import annotations

from bagstore.ids.newid import id_time, new_id
from bagstore.ids.sequence import (
    Sequence,
    TicketSequence,
    advance_sequence,
    close_sequences,
    list_sequences,
    open_sequence,
)

__all__ = [
    "Sequence",
    "TicketSequence",
    "advance_sequence",
    "close_sequences",
    "id_time",
    "list_sequences",
    "new_id",
    "open_sequence",
]
