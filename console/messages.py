"""What the core publishes: small frozen dataclasses that the TUI and the CLI render.

Nothing here does I/O; a message is a snapshot of state at the time it was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

HostStatus = Literal["connecting", "connected", "reconnecting", "down"]


@dataclass(frozen=True)
class HostState:
    """The connection state of one host, as its supervisor last saw it.

    connecting    first attempt in progress, never connected yet
    connected     link up; `latency_s` is the last measured round trip
    reconnecting  the link was lost at `since` and the supervisor is trying again
    down          no link and no recent one: never reached, or refused for a reason retrying cannot
                  fix by itself (unknown host key, authentication); `last_error` says why. The
                  supervisor still retries, slowly, so a fixed known_hosts is picked up.
    """

    host: str
    status: HostStatus
    since: float  # unix time the host entered this status
    latency_s: float | None = None
    last_error: str | None = None
    attempts: int = 0  # failed attempts since the last successful connection

    @property
    def is_connected(self) -> bool:
        return self.status == "connected"

