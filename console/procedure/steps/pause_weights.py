"""The weights are checked, not guessed (issue 40): before a release of the `weights`, SGLang's
`/weights_checker` checksum of the target's weights is taken (kept in the run's state) and after the
resume it must be the same. Only where the server has no such checksum (SGLang before 0.5.23), and
for a release that leaves the weights resident, a greedy `/generate` sent before the pause must
answer the same tokens after the continue; it is not batch-invariant under load, so a mismatch is
asked once more, alone, before it fails anything. Used by console/procedure/steps/pause.py.

A checksum that differs offers the remedy, a restart of the server (it loads the weights again), as
a destructive confirm; a no, or `--yes` (never a restart of production on its own), fails the window
naming both checksums, the server serving on as it is, the remedy said (`offer_restart`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation
from console.procedure.outcomes import Refused, StepFailed
from console.procedure.steps import stop
from console.procedure.steps.remedy_restart import WEIGHTS_RESTART, begin_down_period, end_down_period
from console.service.memory_saver import WEIGHTS
from console.service.sglang_api import WEIGHTS_CHECKER, NoWeightsChecksum
from console.session import service_name

if TYPE_CHECKING:
    from console.procedure.window import Window


PROBE_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # any valid ids: the same greedy request before the pause and after


PROBE_TOKENS = 8


# The greedy probe waits behind the requests ahead of it (after the continue: every request that was
# held), so it gets a deadline of its own, longer than a control request's: it is a check, never
# downtime (before the pause the server serves; after the continue it serves again).
PROBE_WAIT_S = 60.0


PROBE_SETTLE_S = 1.0  # before the probe is asked once more, alone, after a mismatch


async def take_weights_reference(window: Window, server: Any, tags: list[str]) -> None:
    """Before the pause, what the resumed server must answer again, chosen once per window (kept in
    the run's state: a resumed run or a console killed meanwhile still has it). A release of the
    `weights`: SGLang's /weights_checker checksum of the target's weights (0.5.23:
    `SglangClient.weights_checksum`); a server without one (404, 405, or 0.5.6's checker, which has
    no checksum) falls back to the greedy probe, said in the journal. A release that leaves the
    weights resident (the KV cache and CUDA graphs) needs no weights check: the greedy probe, as a
    check that the server answers as before."""
    svc = window.state.service
    if svc.weights_check is None:
        if WEIGHTS in tags:
            try:
                svc.weights_checksum_before = await server.weights_checksum()
            except NoWeightsChecksum as exc:
                svc.weights_check = "probe"
                window.journal("pause", f"{exc}: the weights are checked after the resume by the greedy probe "
                                        f"instead", level="warning", host=window.config.service.host)
            else:
                svc.weights_check = "checksum"
                window.journal("pause", f"{WEIGHTS_CHECKER} checksum of the target's weights before the release: "
                                        f"{svc.weights_checksum_before}", host=window.config.service.host)
        else:
            svc.weights_check = "probe"
        window.run.save()
    if svc.weights_check == "probe" and svc.probe_tokens is None:  # the greedy answer to give again
        svc.probe_tokens = list((await server.generate(PROBE_IDS, PROBE_TOKENS, PROBE_WAIT_S))["output_ids"])
        window.run.save()


async def compare_checksums(window: Window, server: Any) -> None:
    svc = window.state.service
    before = svc.weights_checksum_before
    try:
        after = await server.weights_checksum()
    except NoWeightsChecksum as exc:
        raise StepFailed("continue", f"the weights cannot be checked: {exc}, though the server gave their checksum "
                                     f"before the release ({before}); look at it before trusting its answers") from None
    svc.weights_checksum_after = after
    window.run.save()
    if after != before:
        window.journal("continue", f"weights checksum {after} after the resume, {before} before the release: "
                                   f"the weights did not come back whole", level="error",
                       host=window.config.service.host)
        await offer_restart(window, before, after)
        return
    window.journal("continue", f"weights checked: the {WEIGHTS_CHECKER} checksum after the resume is the one "
                               f"before the release ({after})", host=window.config.service.host)


# --- the remedy: a restart of the server loads its weights again -------------------------------------

WEIGHTS_CRASH_POINTS = ("weights-stopped",)  # the weights' restart: the stop ran, the start not yet
RESTART_REASON = "the server's weights did not come back whole from the release"


def _record(window: Window) -> dict[str, Any]:
    return window.state.facts.setdefault(WEIGHTS_RESTART, {})


def mismatch_words(before: str | None, after: str | None) -> str:
    return (f"the server's weights did not come back whole: {WEIGHTS_CHECKER} checksum {after} after the resume, "
            f"{before} before the release (the target's weights); its answers cannot be trusted")


async def offer_restart(window: Window, before: str | None, after: str) -> None:
    """The weights came back other than they went: the remedy, a restart of the server (which loads
    them again from disk), asked as a destructive confirm (Cancel focused). Yes: stopped and started
    by the service's own restart path (`stop.restart_service`, one start per down period), its
    down period recorded apart from the window's (`remedy_restart.begin_down_period`), the checksum taken
    again and compared with the one before the release. No, or `--yes` (which never restarts
    production on its own): StepFailed naming both checksums, the server left serving as it is, the
    remedy stated."""
    service = window.config.service
    record = _record(window)
    record.update(before=before, after=after)
    failure = mismatch_words(before, after)
    leaves = (f"the server serves on as it is, with the weights the resume brought back; the remedy: restart "
              f"{service_name(window.config)} (a restart loads its weights again)")
    if window.unattended:
        record["remedy"] = "not asked under --yes (a restart of production is an operator's yes)"
        window.run.save()
        window.journal("continue", f"the restart that reloads the weights is not asked under --yes: {leaves}",
                       level="error", host=service.host)
        raise StepFailed("continue", f"{failure}; --yes never restarts the server on its own: {leaves}")
    manager = await window.hosts.service_manager(window.connect_s)
    impact = (f"{service_name(window.config)} on {service.host} goes down and is started again (a restart loads "
              f"its weights again): {WEIGHTS_CHECKER} checksum {after} after the resume, {before} before the "
              f"release; no means it serves on as it is, its answers untrusted, until its next restart")
    if not await window.ask(Confirmation("continue", "restart the server to reload its weights", service.host,
                                         tuple(manager.stop_argv()), impact, True, window.earlier.get("restart"),
                                         "earlier restarts", leaves=leaves)):
        record["remedy"] = "refused"
        window.run.save()
        raise StepFailed("continue", f"{failure}; the restart was refused: {leaves}")
    begin_down_period(window, record)
    await manager.stop()
    window.journal("continue", "stop command ran (to reload the weights)", host=service.host,
                   argv=list(manager.stop_argv()))
    window.crash_point("weights-stopped")
    await finish_restart(window)


async def finish_restart(window: Window) -> None:
    """The restart's start (asked, once per down period: a started one is waited for), its down period
    ended, and the weights' checksum taken again: the one before the release, or the window fails
    naming both. Run by `offer_restart`, and by a resumed run whose console died after the stop."""
    record = _record(window)
    try:
        await stop.restart_service(window, reason=RESTART_REASON)
    except Refused:
        record["remedy"] = "the start was refused: the server is down, its weights not reloaded"
        window.run.save()
        raise
    end_down_period(window, record, WEIGHTS_RESTART)
    server = await window.hosts.server()
    before = window.state.service.weights_checksum_before
    try:
        again = await server.weights_checksum()
    except NoWeightsChecksum as exc:
        record["remedy"] = f"restarted; the checksum could not be taken again ({exc})"
        window.run.save()
        raise StepFailed("continue", f"restarted to reload the weights, but {record['remedy']}: look at it before "
                                     f"trusting its answers") from None
    record["restarted"] = again
    if again != before:
        record["remedy"] = f"restarted, and the checksum is {again}, still not {before}"
        window.run.save()
        raise StepFailed("continue", f"{mismatch_words(before, record.get('after'))}; {record['remedy']}: the "
                                     f"weights on disk are not the ones it served before the window")
    record["remedy"] = f"restarted: the {WEIGHTS_CHECKER} checksum is {again} again, as before the release"
    window.run.save()
    window.journal("continue", f"the server was restarted with the operator's yes to reload its weights "
                               f"({record['after']} after the resume): {record['remedy']}", level="warning",
                   host=window.config.service.host)


async def check_restart(window: Window) -> bool:
    """A resumed run whose console died in the weights' restart (the stop ran): the start finished and
    the checksum compared now. True when there was one to finish."""
    if "window_service" not in _record(window):
        return False
    await finish_restart(window)
    return True


async def probe_again(window: Window, server: Any, expected: list[int]) -> None:
    """The greedy probe after the continue. Greedy decoding is not batch-invariant under load (the
    held requests run again beside it): a near-tie can turn one token, so a mismatch is asked once
    more, alone (nothing else sent meanwhile), after `PROBE_SETTLE_S`, before it fails the window."""
    got = list((await server.generate(PROBE_IDS, PROBE_TOKENS, PROBE_WAIT_S))["output_ids"])
    if got == expected:
        window.journal("continue", f"weights checked by the greedy probe: the same {len(got)} tokens as before "
                                   f"the pause", host=window.config.service.host)
        return
    window.journal("continue", f"the greedy probe answered {got} after the continue, {expected} before the pause: "
                               f"asked once more, alone, in {PROBE_SETTLE_S:g} s (a near-tie under load can turn "
                               f"a greedy token)", level="warning", host=window.config.service.host)
    await asyncio.sleep(PROBE_SETTLE_S)
    again = list((await server.generate(PROBE_IDS, PROBE_TOKENS, PROBE_WAIT_S))["output_ids"])
    if again == expected:
        window.journal("continue", f"weights checked by the greedy probe: asked again alone, the same "
                                   f"{len(again)} tokens as before the pause", host=window.config.service.host)
        return
    raise StepFailed("continue", f"the server answers other greedy tokens than before the pause, twice ({got}, "
                                 f"then alone {again}; {expected} before): its weights may not have come back whole")
