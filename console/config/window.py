"""`[window]` and `[notify]`: the downtime window's budget and route, and who is told about it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from console.config.checks import Checker, is_number, is_positive_number, is_text


@dataclass(frozen=True)
class WindowConfig:
    """The downtime window's budget: the run refuses the stop when the forecast downtime exceeds
    `max_downtime_s` (None: no budget)."""

    max_downtime_s: float | None = None
    route: str | None = None  # the route a run is made for when `run --route` is not given (None: window)


WINDOW_ROUTES = ("window", "pause", "zero-downtime", "auto")

# What a notification can be sent for (`[notify] events`); console/notify/ says what each one carries.
NOTIFY_EVENTS: tuple[str, ...] = ("stop-approved", "overrun", "service-back", "run-ended", "left-down", "console-gone",
                                  "fleet-at-risk")


@dataclass(frozen=True)
class NotifyConfig:
    """Who is told about the window (apprise URLs: Slack, Matrix, ntfy, e-mail, webhooks), about which
    events, and when an overrun is worth saying: the downtime past its forecast by `overrun_margin_s`."""

    urls: tuple[str, ...] = ()
    events: tuple[str, ...] = NOTIFY_EVENTS
    overrun_margin_s: float = 60


WINDOW_KEYS = tuple(f.name for f in fields(WindowConfig))
NOTIFY_KEYS = tuple(f.name for f in fields(NotifyConfig))


def parse_window(c: Checker, data: Mapping[str, Any]) -> WindowConfig:
    """Check the `[window]` table; raise the first problem."""
    raw = c.table(data, "window", "window", required=False) or {}
    c.keys(raw, "window", WINDOW_KEYS)
    return WindowConfig(
        max_downtime_s=c.get(raw, "max_downtime_s", "window", is_positive_number, "a positive number of seconds"),
        route=c.get(raw, "route", "window", lambda v: v in WINDOW_ROUTES, " or ".join(f'"{r}"' for r in WINDOW_ROUTES)),
    )


def _notify_url(v: Any) -> bool:
    """A URL apprise has a plugin for (it parses it the way it will send to it)."""
    if not is_text(v):
        return False
    import apprise  # only when there is a [notify] table: the rest of the config needs no apprise

    return apprise.Apprise.instantiate(v, suppress_exceptions=True) is not None


def parse_notify(c: Checker, data: Mapping[str, Any]) -> NotifyConfig:
    """Check the `[notify]` table (each URL as apprise reads it); raise the first problem."""
    raw = c.table(data, "notify", "notify", required=False) or {}
    p = "notify"
    c.keys(raw, p, NOTIFY_KEYS)
    urls = c.get(raw, "urls", p, lambda v: isinstance(v, list), "an array of notification URLs", [])
    for i, url in enumerate(urls):
        if not _notify_url(url):
            raise c.wrong(f"{p}.urls[{i}]", "a notification URL apprise knows (json://, ntfy://, slack://, "
                                            "matrix://, mailto://, ...: see apprise's list of services)", url)
    events = c.get(raw, "events", p, lambda v: isinstance(v, list) and bool(v),
                   f"a non-empty array of events ({', '.join(NOTIFY_EVENTS)})", list(NOTIFY_EVENTS))
    for i, event in enumerate(events):
        if event not in NOTIFY_EVENTS:
            raise c.wrong(f"{p}.events[{i}]", f"one of {', '.join(NOTIFY_EVENTS)}", event)
    return NotifyConfig(
        urls=tuple(urls),
        events=tuple(dict.fromkeys(events)),
        overrun_margin_s=c.get(raw, "overrun_margin_s", p, lambda v: is_number(v) and v >= 0,
                               "a number of seconds, 0 or more", 60),
    )
