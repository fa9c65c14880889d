"""The settings the scripts are called with, in one frozen place.

Built once from the transport options (or given to :class:`ScriptLibrary` directly) and
held by the library; every operation that needs a deadline, a limit or a cap reads it
from here, so no setting travels through the code a second way.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bounds import MAX_DURATION_MS, MAX_LIMIT, MAX_STREAM_LENGTH
from .durability import Durability


@dataclass(frozen=True)
class Policy:
    visibility_ms: int = 300_000  # how long a delivery may stay unacked
    delivery_limit: int | None = 20  # delivery attempts before a dead letter; None or 0: no limit
    dead_letter_maxlen: int = 10_000  # approximate cap of dead:{Q}; 0 deletes outright
    durability: Durability | None = None  # confirm publishes and acks by WAIT/WAITAOF (opt-in)

    def __post_init__(self) -> None:
        if isinstance(self.visibility_ms, bool) or not isinstance(self.visibility_ms, int) \
                or not 0 < self.visibility_ms <= MAX_DURATION_MS:
            raise ValueError(f"visibility_ms must be an integer in 1..{MAX_DURATION_MS}, "
                             f"got {self.visibility_ms!r}")
        if self.delivery_limit is not None and (isinstance(self.delivery_limit, bool) or not isinstance(
                self.delivery_limit, int) or not 0 <= self.delivery_limit <= MAX_LIMIT):
            raise ValueError(f"delivery_limit must be an integer in 0..{MAX_LIMIT} or None, "
                             f"got {self.delivery_limit!r}")
        if isinstance(self.dead_letter_maxlen, bool) or not isinstance(self.dead_letter_maxlen, int) \
                or not 0 <= self.dead_letter_maxlen <= MAX_STREAM_LENGTH:
            raise ValueError(f"dead_letter_maxlen must be an integer in 0..{MAX_STREAM_LENGTH}, "
                             f"got {self.dead_letter_maxlen!r}")

    @property
    def heartbeat_seconds(self) -> float:
        """In-flight deadlines are pushed forward this often (a third of the visibility)."""
        return self.visibility_ms / 3000
