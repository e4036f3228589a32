"""What the pause route reads of the server's GPU memory, and how a release or a resume whose answer
was lost is settled (issue 40): never resent on a guess. Only a telemetry sample taken after the
reconnect and the request's worst case (`settle_after_s`: 3 x the H200 figures) counts, weighed
against /server_info's `memory_usage` (what the tags hold; SGLang fixes it at start-up, so it never
says whether they are released); where that evidence is missing or disagrees the operator is asked,
shown what is known, and a refusal (or `--yes`, which never answers it) leaves the server paused,
the run exiting 3. Used by console/procedure/steps/pause.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation, TelemetrySample
from console.procedure.outcomes import Refused, StepFailed
from console.service.memory_saver import CUDA_GRAPH, KV_CACHE, WEIGHTS

if TYPE_CHECKING:
    from console.procedure.window import Window

from console.procedure.steps.pause_process import same_server


def service_url(window: Window, path: str) -> str:
    return window.config.service.url.rstrip("/") + path


def request_argv(window: Window, path: str, body: dict[str, Any]) -> tuple[str, ...]:
    """The literal request, as the Decider shows it: POST http://…/release_memory_occupation {"tags": [...]}."""
    return ("POST", service_url(window, path), json.dumps(body))


def service_gpus(window: Window, sample: TelemetrySample) -> list[int]:
    return list(window.config.service.gpus) or [g.index for g in sample.gpus]


def used_mib(window: Window, sample: TelemetrySample | None) -> dict[str, int]:
    """Used MiB per service GPU in `sample` (keys as strings: the state is JSON)."""
    if sample is None:
        return {}
    gpus = service_gpus(window, sample)
    return {str(g.index): int(g.mem_used_mib) for g in sample.gpus if g.index in gpus and g.mem_used_mib is not None}


def latest_sample(window: Window) -> TelemetrySample | None:
    return window.hosts.telemetry(window.config.service.host).telemetry.latest


# Issue 26's measurements on an H200 (torch_memory_saver 0.0.10): the basis until this host has its own.
MEASURED_H200 = {"release": {KV_CACHE: 0.06, CUDA_GRAPH: 0.06, WEIGHTS: 20.0},
                 "resume": {KV_CACHE: 0.17, CUDA_GRAPH: 0.17, WEIGHTS: 7.0}}


MEASURED_H200_WEIGHTS_BYTES = 48 * 2**30  # the weights those figures released and resumed


MEMORY_BACK_SHARE = 0.8  # of what the release freed, seen used again after the resume


# A release or resume whose answer was lost is settled only from evidence taken after the request's
# worst case: MEASURED_H200 (the weights scaled to this model's size) times this margin, at least
# SETTLE_FLOOR_S, counted from when it was sent (`memory_request_sent_at`), and after the reconnect.
SETTLE_MARGIN = 3.0


SETTLE_FLOOR_S = 2.0


SETTLE_SAMPLE_S = 10.0  # beyond that moment, the wait for one telemetry sample with GPU readings


SETTLE_LANDED_MIB = 1024  # without /server_info's figures: moved by at least this on every GPU


# The windows (one per console) whose operator refused to settle a lost request: fresh evidence is
# still gathered again (the compensation's give-back), but the same console never asks twice.
_settle_refused: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclasses.dataclass
class SettleEvidence:
    """What is known of a release or resume whose answer was lost: the GPUs' used MiB before the
    release, after it (when measured), and now (a sample taken after `after_s` past the reconnect,
    or nothing: `stale` says what the latest sample was), and what /server_info says the tags hold
    per GPU (SGLang's `memory_usage`, fixed at start-up: it says how much a release moves, never
    whether one happened). `verdict`: True landed, False not landed, None not decisive."""

    kind: str
    tags: list[str]
    before: dict[str, int]
    after: dict[str, int]
    now: dict[str, int]
    after_s: float
    basis: str
    sampled_at: float | None = None
    stale: str | None = None
    server_mib: int | None = None
    server_said: str = ""
    verdict: bool | None = None
    why: str = ""

    def words(self) -> str:
        used = f"GPU memory used before the release {mib_words(self.before)}"
        if self.after and self.kind == "resume":
            used += f", after it {mib_words(self.after)}"
        if self.now:
            at = time.strftime("%H:%M:%S", time.localtime(self.sampled_at or time.time()))
            used += (f", now {mib_words(self.now)} (sampled at {at}, over {self.after_s:.1f} s after the reconnect: "
                     f"{self.basis})")
        else:
            used += f"; no GPU sample taken {self.after_s:.1f} s after the reconnect ({self.basis}): {self.stale}"
        return f"{used}; {self.server_said}; {self.why}"


async def landed_or_asked(window: Window, step: str, kind: str, tags: list[str]) -> tuple[bool, SettleEvidence, str]:
    """Whether the lost `kind` ("release" or "resume") of `tags` landed: the evidence's verdict
    (`settle_evidence`), else the operator's answer (`ask_settle`); with the evidence and whose word
    it is."""
    evidence = await settle_evidence(window, kind, tags)
    window.crash_point("settle-evidence")
    if evidence.verdict is not None:
        return evidence.verdict, evidence, "seen"
    return await ask_settle(window, step, kind, tags, evidence), evidence, "the operator's word"


async def settle_releasing(window: Window, step: str = "release") -> None:
    """A release whose answer was never seen (the link dropped, the console died): whether the memory
    left is settled from evidence, never guessed (a tag resumed that was not released, or released
    twice, ends SGLang's scheduler; a continue over released memory fails the requests it lets run).
    The evidence is `settle_evidence`'s: a telemetry sample taken after the reconnect and after the
    request's worst case, weighed against what /server_info says the tags hold. Decisive, it is
    settled; else the operator is asked (`ask_settle`)."""
    svc = window.state.service
    tags = list(svc.releasing)
    landed, evidence, how = await landed_or_asked(window, step, "release", tags)
    if landed:
        svc.released, svc.released_tags = list(tags), list(tags)
        svc.released_at = svc.released_at or time.time()
        if evidence.now:
            svc.used_after_release_mib = evidence.now
        window.journal("release", f"the release of {', '.join(tags)} had landed ({how}: {evidence.words()})",
                       level="warning", host=window.config.service.host)
    else:
        window.journal("release", f"the release of {', '.join(tags)} had not landed ({how}: {evidence.words()})",
                       level="warning", host=window.config.service.host)
    svc.releasing = []
    window.run.save()
    window.crash_point("settled")


def mib_words(used: dict[str, int]) -> str:
    return ", ".join(f"GPU{g} {mib} MiB" for g, mib in sorted(used.items())) if used else "unknown"


def settle_after_s(window: Window, kind: str, tags: list[str]) -> tuple[float, str]:
    """How long after it was sent a lost release or resume of `tags` has surely ended, and the
    basis: issue 26's H200 figures (MEASURED_H200, the weights scaled to this model's size) times
    SETTLE_MARGIN, at least SETTLE_FLOOR_S."""
    model = window.facts.probes.get(window.config.target.host, {}).get("model", {})
    scale = max(1.0, int(model.get("tensor_bytes") or 0) / MEASURED_H200_WEIGHTS_BYTES)
    measured = sum(MEASURED_H200[kind][t] * (scale if t == WEIGHTS else 1.0) for t in tags)
    seconds = max(SETTLE_FLOOR_S, SETTLE_MARGIN * measured)
    return seconds, (f"its worst case: {SETTLE_MARGIN:g} x the {measured:.2f} s measured on an H200 (issue 26), "
                     f"at least {SETTLE_FLOOR_S:g} s")


async def settle_evidence(window: Window, kind: str, tags: list[str]) -> SettleEvidence:
    """The evidence on a lost `kind` ("release" or "resume") of `tags`: one telemetry sample with GPU
    readings taken after both the reconnect (now) and the request's worst case counted from its send
    time (`memory_request_sent_at`; from now when a run did not record it), waited for on the
    telemetry stream: never an older sample (one taken before the link dropped, or while a weights
    release still ran, says nothing); and /server_info's per-tag figures, where it answers them. The
    verdict compares what moved on every service GPU with what the tags hold (with the measured
    release itself for a resume, else SETTLE_LANDED_MIB)."""
    svc = window.state.service
    wait_s, basis = settle_after_s(window, kind, tags)
    stream = window.hosts.telemetry(window.config.service.host)
    # From the request's send time where the run recorded it (its worst case may be past already: a
    # console that comes back a minute later waits no more), else from now; never a sample before now.
    sent = svc.memory_request_sent_at
    left_s = wait_s if sent is None else min(wait_s, max(0.0, sent + wait_s - time.time()))
    moment = time.monotonic() + left_s
    evidence = SettleEvidence(kind, tags, dict(svc.used_before_release_mib), dict(svc.used_after_release_mib), {},
                              wait_s, basis)
    try:
        sample = await stream.wait_for(lambda s: bool(used_mib(window, s)), left_s + SETTLE_SAMPLE_S, after=moment)
    except TimeoutError:
        latest = stream.telemetry.latest
        if latest is None:
            evidence.stale = "the host's agent sent no sample"
        elif not used_mib(window, latest):
            evidence.stale = "the host's agent reports no GPU memory readings"
        else:
            evidence.stale = (f"the latest, at {time.strftime('%H:%M:%S', time.localtime(latest.t))}, was taken "
                              f"before that: it says nothing of the request")
    else:
        evidence.now, evidence.sampled_at = used_mib(window, sample), sample.t
    try:
        saver = await (await window.hosts.server()).memory_saver()
        gib = saver.memory_gib
    except Exception as exc:  # its answer is evidence where it has one; nothing is sent on its account
        gib, evidence.server_said = None, f"/server_info did not answer ({str(exc) or type(exc).__name__})"
    if gib is not None:
        evidence.server_mib = int(sum(gib.get(t, 0.0) for t in tags) * 1024)
        evidence.server_said = (f"/server_info says {', '.join(tags)} hold {evidence.server_mib} MiB per GPU "
                                f"(its start-up figures: they say how much moves, not whether it did)")
    elif not evidence.server_said:
        evidence.server_said = "/server_info reports no memory usage"
    evidence.verdict, evidence.why = verdict(evidence)
    return evidence


def verdict(e: SettleEvidence) -> tuple[bool | None, str]:
    """Landed, not landed, or None (asked), from what moved on every service GPU."""
    if not e.now:
        return None, "no fresh GPU reading: whether it landed cannot be seen"
    if e.kind == "release":
        if not e.before:
            return None, "no GPU reading from before the release to compare with"
        moved = {g: e.before.get(g, used) - used for g, used in e.now.items()}
    else:
        after = e.after or ({g: b - e.server_mib for g, b in e.before.items()} if e.server_mib else {})
        if not after:
            return None, "no GPU reading from after the release to compare with"
        moved = {g: used - after.get(g, used) for g, used in e.now.items()}
    expected = e.server_mib
    if expected is None and e.kind == "resume" and e.before and e.after:
        expected = max(e.before[g] - e.after.get(g, e.before[g]) for g in e.before)  # what the release freed
    if expected:
        if all(m >= MEMORY_BACK_SHARE * expected for m in moved.values()):
            return True, f"{mib_words(moved)} moved, as the tags hold"
        if all(m <= (1 - MEMORY_BACK_SHARE) * expected for m in moved.values()):
            return False, f"{mib_words(moved)} moved: nothing like the {expected} MiB the tags hold"
        return None, (f"{mib_words(moved)} moved, which disagrees with the {expected} MiB per GPU the tags hold: "
                      f"neither landed nor not landed can be read from it")
    if all(m >= SETTLE_LANDED_MIB for m in moved.values()):
        return True, f"{mib_words(moved)} moved"
    if all(m < SETTLE_LANDED_MIB for m in moved.values()):
        return False, f"{mib_words(moved)} moved: the GPUs hold what they held"
    return None, f"{mib_words(moved)} moved: the GPUs disagree"


async def ask_settle(window: Window, step: str, kind: str, tags: list[str], evidence: SettleEvidence) -> bool:
    """The operator settles a lost `kind` the evidence does not: shown what is known, asked first
    whether it landed, then whether it did not; each answer leads to the one request (or none) that
    is right for it, never a resend on a guess. Both refused: Refused, the server left paused (the
    run exits 3, THE SERVER IS STILL PAUSED); not asked again by the same console (the next one, `run
    --resume`, gathers its own evidence and asks). `--yes` settles nothing on its own: StepFailed, paused."""
    svc = window.state.service
    known = evidence.words()
    body = {"tags": tags}
    if window.unattended:
        raise StepFailed(step, f"the {kind} of {', '.join(tags)} was sent but its answer never came, and the evidence "
                               f"does not settle it ({known}); --yes never settles it on a guess: the server stays "
                               f"paused for an operator (run --resume, and answer whether it landed)")
    if window in _settle_refused:
        raise Refused(step, f"settle the lost {kind} of {', '.join(tags)} (refused earlier by this console's "
                            f"operator; {known})")
    resume = request_argv(window, "/resume_memory_occupation", body)
    cont = request_argv(window, "/continue_generation", {})
    if kind == "release":
        # Asked by the release step (the window goes on) or by the give-back (the resume and continue follow).
        going_on = step == "release"
        yes = Confirmation(step, f"settle the lost release: {', '.join(tags)} WERE released ("
                           + ("the window goes on: the extraction, then their resume)" if going_on
                              else "the resume follows)"), window.config.service.host, resume,
                           f"{known}. Yes: they are recorded released and resumed once"
                           + (" after the extraction" if going_on else ", then the requests run again")
                           + ". A resume of memory not released ends SGLang's scheduler", True,
                           leaves="asked next whether they were NOT released")
        no = Confirmation(step, f"settle the lost release: {', '.join(tags)} were NOT released ("
                          + ("the release is asked again)" if going_on else "no resume: the continue follows)"),
                          window.config.service.host,
                          request_argv(window, "/release_memory_occupation", body) if going_on else cont,
                          f"{known}. Yes: nothing is resumed. "
                          + ("A second release of released memory ends SGLang's scheduler" if going_on
                             else "A continue over released memory fails the requests it lets run"), True,
                          leaves="the server stays PAUSED for a human to look at it")
    else:
        yes = Confirmation(step, f"settle the lost resume: {', '.join(tags)} ARE back (no second resume)",
                           window.config.service.host, cont,
                           f"{known}. Yes: nothing is resumed again; the requests run again. A continue over "
                           f"released memory fails the requests it lets run", True,
                           leaves="asked next whether they are NOT back")
        no = Confirmation(step, f"settle the lost resume: {', '.join(tags)} are NOT back (resumed again)",
                          window.config.service.host, resume,
                          f"{known}. Yes: the resume is sent again. A second resume of memory already back ends "
                          f"SGLang's scheduler", True, leaves="the server stays PAUSED for a human to look at it")
    if await window.ask(yes):
        return True
    if await window.ask(no):
        return False
    svc.give_back_error = f"the lost {kind} of {', '.join(tags)} left unsettled by the operator"
    window.run.save()
    _settle_refused.add(window)
    raise Refused(step, f"settle the lost {kind} of {', '.join(tags)}")


def memory_back(window: Window, sample: TelemetrySample | None) -> bool | None:
    """Whether the released memory is seen used again on the GPUs; None when nothing tells."""
    svc = window.state.service
    before, after = svc.used_before_release_mib, svc.used_after_release_mib
    now = used_mib(window, sample)
    freed = {g: before[g] - after.get(g, before[g]) for g in before}
    if not before or not after or not now or sum(freed.values()) <= 0:
        return None
    return all(now.get(g, 0) >= after.get(g, 0) + int(MEMORY_BACK_SHARE * max(0, f)) for g, f in freed.items())


async def settle_resuming(window: Window, step: str = "resume") -> None:
    """A resume whose answer was never seen: whether it landed is settled from evidence taken after
    the reconnect and the resume's worst case (`settle_evidence`), else by the operator
    (`ask_settle`): a tag resumed twice ends SGLang's scheduler (KeyError in `offload_tags.remove`),
    a continue over released memory fails the requests it lets run."""
    svc = window.state.service
    tags = list(svc.resuming)
    landed, evidence, how = await landed_or_asked(window, step, "resume", tags)
    if landed:
        svc.released = []
        svc.resumed_at = svc.resumed_at or time.time()
        window.journal("resume", f"the resume of {', '.join(tags)} had landed ({how}: {evidence.words()})",
                       level="warning", host=window.config.service.host)
    else:
        window.journal("resume", f"the resume of {', '.join(tags)} had not landed ({how}: {evidence.words()}): "
                                 f"sent again", level="warning", host=window.config.service.host)
    svc.resuming = []
    window.run.save()
    window.crash_point("settled")


async def settle(window: Window, step: str) -> None:
    """A release or resume whose answer was never seen, settled from evidence taken after the
    reconnect and the request's worst case, else by the operator (`settle_releasing`,
    `settle_resuming`): only on the process paused (a restarted one's GPUs say nothing of this run's
    requests)."""
    svc = window.state.service
    if (svc.releasing or svc.resuming) and not await same_server(window, step):
        return
    if svc.releasing:
        await settle_releasing(window, step)
    if svc.resuming:
        await settle_resuming(window, step)
