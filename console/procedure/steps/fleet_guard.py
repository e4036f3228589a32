"""The fleet checked again at the moment it matters (issue 41, section 2): the preflight's choice is
minutes old when the drain comes, and the other replicas carry every request while the window lasts.

- `recheck`, right before the router is asked to remove the replica (after the operator's yes): the
  same rules as the preflight's choice (`fleet_choice.choose`: every replica listed healthy, never the
  last healthy one, the load absorbed by the others); a refusal fails the drain with nothing changed.
- `watch`, from the replica's removal until its rejoin begins: every `WATCH_S` the router's /health
  and listing. The moment the router does not answer, lists no healthy worker, or lists another
  replica unhealthy (or not at all), the console says so (an error in the journal: every view and the
  event log show it) and offers to end the window early and rejoin. Said again when it recovers; a
  new trouble after a no is offered again.
- `end_early`: the yes. Recorded in the run's state (`ServiceState.ended_early`: why and when) before
  anything else, so a console that dies now still ends the window early on resume. An extraction
  running is told to stop after the prompt in hand (its `stop` file, as the budget's offer): every
  prompt extracted is kept, verified, and the engine ends the run paused after the rejoin, naming why
  (`run --resume` extracts only the rest, on a replica chosen again). Before the extraction began,
  the engine ends the window at the next step (`cut`, raising `EndedEarly`), and a long wait under
  way (the drain's for the replica's requests, free-vram's for the GPUs) is cut at once
  (`unless_ended`): the compensation brings the server back and rejoins, and the run ends paused with
  the same words.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation, FleetAtRisk
from console.procedure.outcomes import StepFailed
from console.procedure.steps.fleet_choice import FLEET_ERRORS, choose, measure, router_of

if TYPE_CHECKING:
    from console.config.fleet import ReplicaConfig
    from console.procedure.window import Window

WATCH_S = 2.0  # how often the other replicas are read while the window lasts (a router health check's pace)
# The steps that go deeper into the window: once it is ended early, none of them begins.
INSIDE = ("stop", "pause", "release", "free-vram", "extract")
SETTLED = ("done", "skipped", "left-out")  # (the engine's: a step so recorded is not run again)


class EndedEarly(StepFailed):
    """The operator ended the window early (the fleet degraded): the engine's compensation brings the
    server back and rejoins; the run then ends paused, resumable (`ending.end`)."""


def _via(window: Window) -> Any:
    return window.hosts if getattr(getattr(window, "hosts", None), "router_client", None) is not None else None


async def recheck(window: Window, replica: ReplicaConfig) -> str:
    """The preflight's rules again, right before the removal: StepFailed("drain") naming what changed,
    nothing changed; else the numbers, journalled."""
    keep = f"{replica.name} stays in the router; nothing was changed"
    try:
        loads = await measure(window.config.fleet, _via(window))
    except FLEET_ERRORS as exc:
        raise StepFailed("drain", f"the fleet, checked again before the removal: {exc}; {keep}") from None
    choice = choose(loads, {replica.name})
    if choice.replica != replica.name:
        raise StepFailed("drain", f"the fleet changed since preflight: {choice.why}; {keep}")
    window.journal("drain", f"the fleet checked again right before the removal: {choice.why}")
    return choice.why


async def trouble(window: Window, replica: ReplicaConfig) -> str | None:
    """What puts the users' requests at risk now that `replica` is out, or None: the router down or
    unreadable, no healthy worker listed, another replica unhealthy or missing from its listing."""
    fleet = window.config.fleet
    router = router_of(window)
    try:
        status = await router.health()
        if status != 200:
            return f"the router {fleet.router} answers GET /health {status}"
        workers = await router.workers()
    except (*FLEET_ERRORS, OSError, ValueError) as exc:
        return f"the router {fleet.router} cannot be read: {exc}"
    mine = replica.worker_url.rstrip("/")
    if any(w.url.rstrip("/") == mine for w in workers):  # a router restarted from a configuration that lists it
        return (f"the router {fleet.router} lists {replica.name} again while its window lasts (restarted with it in "
                f"its configuration?): requests may reach it")
    if not any(w.healthy for w in workers if w.url.rstrip("/") != mine):
        return f"the router {fleet.router} lists no healthy worker: the requests through it fail"
    said = []
    for other in fleet.replicas:
        if other.name == replica.name:
            continue
        listed = next((w for w in workers if w.url.rstrip("/") == other.worker_url.rstrip("/")), None)
        if listed is None or not listed.healthy:
            said.append(f"{other.name} ({'not listed' if listed is None else listed.status or 'unhealthy'})")
    if said:
        return f"another replica is unhealthy in the router {fleet.router}: {', '.join(said)}"
    return None


def watch(window: Window, replica: ReplicaConfig) -> None:
    """Watch the other replicas while `replica` is out (once: a second call changes nothing)."""
    task = getattr(window, "fleet_watch", None)
    if window.config.fleet is None or (task is not None and not task.done()):
        return
    window.fleet_watch = asyncio.create_task(_watch(window, replica), name="fleet-watch")


def stop_watch(window: Window) -> str | None:
    """The rejoin begins (or the run ends): the watch and any offer it holds open end. Returns what
    the run's end says if the watch ended the window early (`early_words`), else None: with the
    watch stopped, nothing can end it early any more."""
    task = getattr(window, "fleet_watch", None)
    if task is not None:
        window.fleet_watch = None
        task.cancel()
    return early_words(window.state)


async def _watch(window: Window, replica: ReplicaConfig) -> None:
    said: str | None = None
    offer: asyncio.Task | None = None  # the open (or answered) offer to end the window early
    try:
        while window.state.service.ended_early is None:
            try:
                now = await trouble(window, replica)
            except Exception as exc:  # never the end of the watch: said, and read again
                now = f"the fleet cannot be read: {type(exc).__name__}: {exc}"
            if now is not None and now != said:  # at once: every view, the event log and the notifier
                window.journal("fleet", f"THE FLEET IS AT RISK while {replica.name} is out: {now}", level="error")
                bus = getattr(window, "bus", None)
                if bus is not None:
                    bus.publish(FleetAtRisk(window.run.run_id, replica.name, now, time.time()))
            elif now is None and said is not None:
                window.journal("fleet", f"the fleet is healthy again ({replica.name} still out for its window)",
                               level="warning")
            said = now
            if now is None and offer is not None and offer.done():
                offer = None  # healthy again: a new trouble is offered again (a no was to the last one)
            elif now is not None and offer is None and not _ending(window):
                offer = asyncio.create_task(_offer(window, replica, now), name="fleet-end-early")
            if offer is not None and offer.done() and _yes(offer):
                return
            await asyncio.sleep(WATCH_S)
    finally:
        if offer is not None and not offer.done():  # the rejoin began, or the run ends: the offer is moot
            offer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await offer


def _yes(offer: asyncio.Task) -> bool:
    return not offer.cancelled() and offer.exception() is None and offer.result() is True


async def _offer(window: Window, replica: ReplicaConfig, why: str) -> bool:
    """Ask to end the window early. The work goes on while it is asked (holds=False), as the budget's
    offer. Under `--yes` (and every decider that says yes) the window ends early: with the fleet's
    capacity at risk, the safe default is the replica back serving, the extraction's done part kept."""
    fleet = window.config.fleet
    svc = window.state.service
    back = "give the server its memory back" if window.route == "pause" else "restart the service"
    extracting = _extracting(window)
    argv = await _stop_argv(window) if extracting else []  # nothing sent by this yes itself
    impact = (f"{why}. The window on {replica.name} ends now: "
              + ("the extraction stops after the prompt in hand; " if extracting else "")
              + f"{back if svc.began() else 'nothing more is stopped'}, {replica.name} back in the router "
              f"{fleet.router}; every prompt extracted is kept and `run --resume` extracts the rest")
    approved = await window.ask(Confirmation("fleet", f"end the window on {replica.name} early and rejoin it",
                                             window.config.target.host if extracting else fleet.router_host or
                                             "console", tuple(argv), impact, False), holds=False)
    if approved:
        await end_early(window, why)
    return approved


def _ending(window: Window) -> bool:
    """The window ends by itself already: the extraction gave the GPUs back (the server's return has
    begun), or it ended. Ending it early would gain nothing: the risk is said, nothing is offered."""
    extraction = window.state.extraction
    return extraction.gpu_released_at is not None or bool(extraction.partial) or extraction.complete


def _extracting(window: Window) -> bool:
    extraction = window.state.extraction
    return extraction.begun_at is not None and extraction.gpu_released_at is None and not extraction.partial


async def _stop_argv(window: Window) -> list[str]:
    wdir = await window.dir_on(window.config.target.host)
    return ["sh", "-c", f"umask 077; : > {shlex.quote(wdir + '/stop')}"]


async def end_early(window: Window, why: str) -> None:
    """Recorded first; then an extraction running is told to stop after the prompt in hand."""
    svc = window.state.service
    if svc.ended_early is not None:
        return
    svc.ended_early = {"why": why, "at": time.time()}
    window.run.save()
    event = getattr(window, "ended_early", None)
    if event is not None:
        event.set()  # a long wait of the window's (the drain's requests) ends now: `unless_ended`
    window.journal("fleet", f"the window ends early: {why}", level="warning")
    if _extracting(window):
        host = window.config.target.host
        window.state.extraction.stop_asked_at = time.time()
        window.run.save()
        try:
            await window.hosts.run(host, await _stop_argv(window))
        except Exception as exc:  # the extraction then runs to its end; the window ends after it
            window.journal("extract", f"the extraction could not be told to stop ({exc}): it runs to its end, then "
                                      f"the window ends", host=host, level="error")
            return
        window.journal("extract", "the extraction stops after the prompt in hand (the window ends early)",
                       host=host, level="warning")


def early_words(state: Any) -> str | None:
    """"the window ended early: <why>; ...": what the run's end says, or None."""
    early = state.service.ended_early
    if not early:
        return None
    return (f"the window ended early: {early['why']}; every prompt extracted is kept, and `run --resume "
            f"{state.run_id}` extracts the rest (on a replica chosen again)")


async def unless_ended(window: Window, step: str, work: Any) -> Any:
    """`work`'s result, unless the window is ended early first: then `work` is cancelled and
    EndedEarly raised (the drain's wait for the replica's requests, up to `drain_timeout_s`, is not
    waited out: the replica rejoins, its requests still running)."""
    event = getattr(window, "ended_early", None)
    if event is None:
        return await work
    task, ended = asyncio.ensure_future(work), asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ended(window, step)
    return task.result()


def cut(window: Window, step: str) -> None:
    """Before each of the route's steps: once the window was ended early, none that goes deeper into it
    begins (an extraction begun is stopped by its `stop` file instead, and followed to its end)."""
    state = window.state
    if state.service.ended_early is None or step not in INSIDE or state.status_of(step) in SETTLED:
        return  # (a resumed run passes the steps it had done before the window was ended early)
    if step == "extract" and state.extraction.begun_at is not None:
        return
    raise _ended(window, step)


def _ended(window: Window, step: str) -> EndedEarly:
    """The window ended before its extraction began: its prompts all still to do (the run's `partial`,
    so that `run --resume` opens the next window), and the error that ends it."""
    state = window.state
    if not state.extraction.partial:
        earlier = (state.windows[-1].get("extraction") or {}).get("partial") if state.windows else None
        missing = [str(x) for x in (earlier or {}).get("missing") or state.facts.get("prompt_ids", [])]
        done = [str(x) for x in state.facts.get("prompt_ids", []) if str(x) not in missing]
        state.extraction.partial = {"done": done, "missing": missing}
        window.run.save()
    return EndedEarly(step, early_words(state) or "the window ended early")
