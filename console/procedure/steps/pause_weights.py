"""The weights are checked, not guessed (issue 40): before a release of the `weights`, SGLang's
`/weights_checker` checksum of the target's weights is taken (kept in the run's state) and after the
resume it must be the same. Only where the server has no such checksum (SGLang before 0.5.23), and
for a release that leaves the weights resident, a greedy `/generate` sent before the pause must
answer the same tokens after the continue; it is not batch-invariant under load, so a mismatch is
asked once more, alone, before it fails anything. Used by console/procedure/steps/pause.py.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from console.procedure.outcomes import StepFailed
from console.service.memory_saver import WEIGHTS
from console.service.sglang_api import WEIGHTS_CHECKER, NoWeightsChecksum

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
        raise StepFailed("continue", f"the server's weights did not come back whole: {WEIGHTS_CHECKER} checksum "
                                     f"{after} after the resume, {before} before the release (the target's "
                                     f"weights); its answers cannot be trusted: restart it to load them again")
    window.journal("continue", f"weights checked: the {WEIGHTS_CHECKER} checksum after the resume is the one "
                               f"before the release ({after})", host=window.config.service.host)


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
