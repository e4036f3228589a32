"""A replica's own requests, as SGLang itself reports them: `GET /v1/loads` (SGLang 0.5.23,
`entrypoints/v1_loads.py`), never the `/metrics` gauges.

Why not `/metrics`: SGLang sets `sglang:num_running_reqs` when it logs a prefill batch and every
`--decode-log-interval` (40) decode steps, so a request that reached the replica just before it left
the router can read as 0 there. `/v1/loads` is each scheduler's load snapshot (`LoadSnapshot`,
`managers/load_snapshot.py`): `num_running_reqs` (the running batch), `num_waiting_reqs` (its waiting
queue), `queues.grammar` (requests waiting for a grammar), and the `timestamp` it was taken at (the
replica's clock). A scheduler publishes one at every prefill batch, every
`--load-snapshot-publish-interval` (15) decode steps and whenever it is idle (each loop, or each
second with `--sleep-on-idle`): a snapshot taken after another is newer, never older. So "idle since
X" is a snapshot newer than the one read at X that counts no request (`Loads.newer_than`), whatever
the two machines' clocks say. Facts and sources: docs/sglang.md, "Router".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

LOADS_PATH = "/v1/loads?include=core,queues"


class LoadsUnreadable(Exception):
    """The replica's /v1/loads cannot be read (absent: an SGLang without it; or not its shape); the
    message names the replica, the route and what came back."""


@dataclass(frozen=True)
class Loads:
    """One reading of a replica's /v1/loads, summed over its DP ranks."""

    running: int  # num_running_reqs
    queued: int  # num_waiting_reqs + queues.grammar
    taken: dict[int, float] = field(default_factory=dict)  # dp_rank -> the snapshot's timestamp
    max_running: int | None = None  # max_running_requests summed over ranks (None: not said)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.queued == 0

    def newer_than(self, earlier: Loads) -> bool:
        """Every rank's snapshot was taken after `earlier`'s of the same rank (published since)."""
        return bool(self.taken) and all(rank in self.taken and self.taken[rank] > ts
                                        for rank, ts in earlier.taken.items())


def _excerpt(body: bytes, limit: int = 200) -> str:
    text = body.decode(errors="replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def parse_loads(where: str, body: bytes) -> Loads:
    """The answer of GET /v1/loads; LoadsUnreadable when it is not SGLang's shape."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        data = None
    loads = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(loads, list) or not loads or not all(isinstance(x, dict) for x in loads):
        raise LoadsUnreadable(f"{where}: expected {{'loads': [one object per DP rank]}}, got {_excerpt(body)}")
    running = queued = 0
    taken: dict[int, float] = {}
    caps: list[int] = []
    for load in loads:
        if not isinstance(load.get("num_running_reqs"), int):
            raise LoadsUnreadable(f"{where}: a load without 'num_running_reqs': {_excerpt(json.dumps(load).encode())}")
        running += _count(load["num_running_reqs"])
        queues = load.get("queues") if isinstance(load.get("queues"), dict) else {}
        queued += _count(load.get("num_waiting_reqs")) + _count(queues.get("grammar"))
        stamp = load.get("timestamp")
        if isinstance(stamp, int | float) and not isinstance(stamp, bool):
            taken[_count(load.get("dp_rank"))] = float(stamp)
        if _count(load.get("max_running_requests")) > 0:
            caps.append(load["max_running_requests"])
    return Loads(running, queued, taken, sum(caps) if len(caps) == len(loads) else None)


async def read_loads(replica: Any) -> Loads:
    """`replica`'s /v1/loads (a `SglangClient`, or anything with its `get` and `base_url`);
    LoadsUnreadable when it has none (404: SGLang before /v1/loads, e.g. 0.4.6) or answers otherwise."""
    where = f"replica {replica.base_url}: GET /v1/loads"
    answer = await replica.get(LOADS_PATH)
    if answer.status == 404:
        raise LoadsUnreadable(f"{where}: HTTP 404: it serves no load snapshot (SGLang 0.5.23 does; "
                              f"0.4.6 does not), so its own requests cannot be seen to end")
    if answer.status != 200:
        raise LoadsUnreadable(f"{where}: HTTP {answer.status}: {_excerpt(answer.body)}")
    return parse_loads(where, answer.body)
