"""The served drafter before and after the window: its acceptance length, measured while the server
serves, so that a window that leaves the drafter wrong is never silent.

SGLang 0.5.23 brings the target's weights back from a `weights` release but not the draft model's
(sglang PR #31674, open; docs/sglang.md): outputs stay correct, the acceptance length falls to about
1, and nothing errors. So before the window (`acceptance`, after the cache) a few cached prompts are
replayed through the server, greedy, and SGLang's `meta_info.spec_accept_length` is read; once the
server is back (`drafter`, after the restart or the continue) the same prompts again. A fall beyond
`DRAFTER_MARGIN` ends the run degraded (`EXIT_DEGRADED`), both figures said, and offers the remedy: a
restart of the server, which loads the drafter again. A server that does not decode speculatively
gets one line and passes.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation
from console.procedure.crosscheck import speculative_settings
from console.procedure.outcomes import Found, Refused, Skip, StepFailed
from console.procedure.steps import stop
from console.procedure.steps.remedy_restart import DRAFTER_RESTART, begin_down_period, end_down_period
from console.service.control import ReadyTimeout, ServiceError
from console.service.sglang_api import ServerAnswerError, ServerUnreachable
from console.session import service_name
from console.ssh.hosts import HostError

if TYPE_CHECKING:
    from console.procedure.window import Window

# A fall of more than a quarter of the acceptance measured before the window. The same greedy prompts
# replayed on a healthy server give the same figure up to batching noise (a few percent); a drafter
# that came back wrong falls to about 1 from the 3 to 6 a working one reaches: far beyond the margin.
DRAFTER_MARGIN = 0.25
LOST = 1.0  # the acceptance length of a drafter whose weights came back wrong: no draft token taken
PROMPTS = 4  # cached prompts replayed each time: a few seconds of the server's time, while it serves
MAX_TOKENS = 64  # new tokens per replayed prompt (enough verify steps for a stable figure)
# A server under its users' load queues the replayed prompts behind their requests: on the H100 under
# bench/loadgen.py's load the first ones waited past the client's 10 s default and the check was lost
# (docs/gpu-results/bench-window-weights-gpu-h100.txt). Its answer is measured, not its speed: the
# prompts go together (one wait in the queue, batched as users' are) and may take this long.
REPLAY_TIMEOUT_S = 90.0
NOT_SPECULATIVE = "the server does not decode speculatively: no drafter to check"
REMEDY = "a restart of the server loads the drafter again"
RESTART_ERRORS = (ServiceError, ReadyTimeout, HostError, TimeoutError, StepFailed, ServerAnswerError, ServerUnreachable)


async def measure(window: Window) -> float | None:
    """The served acceptance length (mean of `spec_accept_length` over the first PROMPTS cached
    prompts), None when the server does not decode speculatively."""
    server = await window.hosts.server()
    if not speculative_settings(await server.server_info()):
        return None
    wdir = await window.dir_on(window.config.service.host)
    cached = json.loads(await window.hosts.read_text(window.config.service.host, f"{wdir}/completions.json"))
    answers = await asyncio.gather(*(
        server.generate(record["prompt_ids"], min(MAX_TOKENS, len(record["completion_ids"])), REPLAY_TIMEOUT_S)
        for record in cached["prompts"][:PROMPTS]))
    figures = []
    for answer in answers:
        figure = (answer.get("meta_info") or {}).get("spec_accept_length")
        if isinstance(figure, int | float) and not isinstance(figure, bool):
            figures.append(float(figure))
    if not figures:
        raise ValueError("the server decodes speculatively but its answers carry no meta_info.spec_accept_length")
    return sum(figures) / len(figures)


async def measured(window: Window) -> tuple[float | None, str | None]:
    """(the acceptance length, None) or (None, why it could not be measured): the check is a courtesy
    to the operator, so whatever stops it (an unreachable server, an odd answer) is said, never fatal."""
    try:
        return await measure(window), None
    except Exception as exc:  # noqa: BLE001 - said by the caller; the run goes on
        return None, str(exc) or type(exc).__name__


def fallen(before: float, after: float) -> bool:
    return after < before * (1 - DRAFTER_MARGIN)


def telling(before: float) -> bool:
    """Whether a lost drafter would show: one accepts about LOST (the verify step's own token), so an
    acceptance before the window within the margin of it leaves nothing to fall (the GPU drill's
    random 1.7 B target, which no drafter predicts, measured 1.04)."""
    return fallen(before, LOST)


def why_blind(before: float) -> str:
    """Why the check cannot tell a lost drafter (`telling` false), in the words the release's question
    and the check's own line share."""
    return f"a lost drafter accepts about {LOST:.0f}, within {DRAFTER_MARGIN:.0%} of {before:.2f}"


def _record(window: Window) -> dict[str, Any]:
    return window.state.facts.setdefault("drafter", {})


# --- acceptance: before the window ------------------------------------------------------------------

async def check_acceptance(window: Window) -> Skip | None:
    said = _record(window).get("before_line")
    return Found(f"measured before the window: {said}") if said else None


async def run_acceptance(window: Window) -> str:
    record = _record(window)
    before, why = await measured(window)
    if why is not None:  # the window goes on without the check, saying so
        record.update(before=None, before_line=f"not measured ({why}): the drafter is not checked after the window")
        window.run.save()
        return record["before_line"]
    record.update(before=before, speculative=before is not None,
                  before_line=NOT_SPECULATIVE if before is None else f"acceptance length {before:.2f}")
    window.run.save()
    return record["before_line"]


# --- drafter: once the server is back ---------------------------------------------------------------

async def check_drafter(window: Window) -> Skip | None:
    said = _record(window).get("line")
    if said and "window_service" in _record(window):  # a console died during the restart offered: finished now
        await stop.restart_service(window, reason="the served drafter came back degraded")  # (none if started)
        end_down_period(window, _record(window), DRAFTER_RESTART)
        _record(window)["remedy"] = "restarted (the console that began the restart died; the next finished it)"
        window.run.save()
    return Found(said) if said else None


async def run_drafter(window: Window) -> str:
    record = _record(window)
    before = record.get("before")
    if before is None:  # not speculative, or not measured before the window: its line says which
        return _said(window, record.get("before_line") or NOT_SPECULATIVE)
    after, why = await measured(window)
    if why is not None:
        return _said(window, f"the drafter could not be measured after the window ({why}); before: {before:.2f}",
                      "warning")
    if after is None:
        return _said(window, f"the server no longer decodes speculatively after the window (before: {before:.2f})",
                      "warning")
    record["after"] = after
    if not fallen(before, after) and not telling(before):
        return _said(window, f"the served drafter's check cannot tell: acceptance length {before:.2f} before the "
                             f"window, {after:.2f} after, but {why_blind(before)}", "warning")
    if not fallen(before, after):
        return _said(window, f"the served drafter is intact: acceptance length {before:.2f} before the window, "
                             f"{after:.2f} after")
    record["degraded"] = True
    line = _said(window, degraded_line(before, after), "error")
    await offer_restart(window, before, after)
    window.run.save()
    return f"{line}; {_record(window).get('remedy') or 'not restarted'}"


def _said(window: Window, line: str, level: str | None = None) -> str:
    """The check's outcome: kept (the report, `runs`, a resume's check), journalled when it warns."""
    _record(window)["line"] = line
    if level is not None:
        window.journal("drafter", line, level=level)
    window.run.save()
    return line


def degraded_line(before: float, after: float) -> str:
    return (f"the served drafter came back DEGRADED: acceptance length {before:.2f} before the window, {after:.2f} "
            f"after (a fall beyond {DRAFTER_MARGIN:.0%}); outputs stay correct but speculative decoding gains "
            f"nothing; {REMEDY}")


async def offer_restart(window: Window, before: float, after: float) -> None:
    """The remedy, asked: the server stopped and started by the stop route's restart path, then measured again."""
    record = _record(window)
    service = window.config.service
    if window.unattended:  # as the weights' remedy (pause_weights.offer_restart): an operator's yes
        record["remedy"] = (f"not asked under --yes (a restart of production is an operator's yes): the server serves "
                            f"on with the degraded drafter; {REMEDY}")
        window.journal("drafter", record["remedy"], level="error", host=service.host)
        return
    manager = await window.hosts.service_manager(window.connect_s)
    impact = (f"{service_name(window.config)} on {service.host} goes down and is started again ({REMEDY}): its "
              f"acceptance length fell from {before:.2f} to {after:.2f} after the window; no means it serves on "
              f"with the degraded drafter until its next restart")
    if not await window.ask(Confirmation("drafter", "restart the server to reload its drafter", service.host,
                                         tuple(manager.stop_argv()), impact, True,
                                         window.earlier.get("restart"), "earlier restarts")):
        record["remedy"] = "refused: the server serves on with the degraded drafter until its next restart"
        return
    begin_down_period(window, record)
    try:
        await manager.stop()
        window.journal("drafter", "stop command ran (to reload the drafter)", host=service.host,
                       argv=list(manager.stop_argv()))
        window.crash_point("drafter-stopped")
        await stop.restart_service(window, reason="the served drafter came back degraded")
    except RESTART_ERRORS as exc:
        record["remedy"] = f"the restart failed: {exc}"
        window.journal("drafter", record["remedy"], level="error")
        return
    except Refused:  # the start refused after the stop: the run ends with the service down (exit 3)
        record["remedy"] = "the start was refused: the server is down, the drafter not reloaded"
        return
    end_down_period(window, record, DRAFTER_RESTART)
    again, why = await measured(window)
    record["restarted"] = again
    record["remedy"] = f"restarted: acceptance length {again:.2f} now" if again is not None else \
        f"restarted; the acceptance length could not be measured again ({why or NOT_SPECULATIVE})"
    window.journal("drafter", record["remedy"], host=service.host)


def degraded_end(facts: dict[str, Any]) -> str | None:
    """The run's degraded ending, when the window left the served drafter degraded: both figures and
    what the remedy did; None otherwise."""
    record = facts.get("drafter") or {}
    if not record.get("degraded"):
        return None
    said = (f"the served drafter came back degraded: acceptance length {record['before']:.2f} before the window, "
            f"{record['after']:.2f} after")
    return f"{said}; {record.get('remedy') or REMEDY}"
