"""The window's downtime: forecast before the stop, projected during it, measured after it.

Pure (no I/O): the engine gathers the inputs and publishes what comes back.

    forecast(inputs)               -> Forecast: four phases, each saying what it is based on
    refusal(forecast, inputs)      -> None, or the budget's refusal naming what would fit
    project(forecast, inputs, ...) -> WindowProjection: when the service is expected back
    ExtractionProgress             the extraction's tokens done / total and their rate
    measured_phases(state)         -> the phases as a run measured them
    against(state)                 -> per phase forecast vs measured (report, `runs`)
    error_of(state)                -> the downtime's row and the answers' time: the error (`runs`, Window tab)
    forecast_errors(states)        -> the forecast's error across runs (bench/window.py)
    to_state / from_state          `state.json`'s `forecast`

The phases tile the downtime, on the stamps the engine keeps in the run's state:
stop (service.stopped_at -> stop_returned_at), free-vram (-> vram_free_at), extract
(-> extraction.gpu_released_at: the worker's start when cold, the copy to the GPU, the forward,
the release) and start (-> service.ready_at).

Where each phase comes from, best first: earlier runs on the same hosts (median, with their
spread); the systemd unit's own history (its last stop; its last start to the server's ready
line); the probe's measured speeds (pinned host-to-GPU bandwidth, disk read) and the forward rate
the staged worker measured at warm-up; else an estimate, labelled so.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from console.messages import Forecast, ForecastPhase, WindowProjection
from console.procedure.answer_waits import overlap
from console.procedure.state import RunState, StateError
from console.views.units import duration

PHASES = ("stop", "free-vram", "extract", "start")
GB = 1e9


@dataclass(frozen=True)
class ForecastInputs:
    """What the forecast is made from; the engine fills it before the stop (and again for a resume)."""

    run_id: str
    service_host: str
    extract_host: str
    staged: bool  # the plan stages the weights (the window holds only the copy and the forward)
    prompt_tokens: tuple[int, ...]  # tokens to extract per prompt (prompt + completion), in order
    model_bytes: int | None = None  # the weights' size (preflight's probe)
    stop_grace_s: float = 10.0  # [service] stop_grace_s
    budget_s: float | None = None  # [window] max_downtime_s
    systemd: Mapping[str, Any] | None = None  # SystemdManager.history() (None for a command manager)
    speeds: Mapping[str, Any] | None = None  # the extract host's probe `speeds` (remote.probe)
    staged_event: Mapping[str, Any] | None = None  # the staged worker's `staged` event, once seen
    earlier: Sequence[Mapping[str, Any]] = ()  # earlier runs' state.json dicts (any order)
    stage_left_out: str | None = None  # why the plan does not stage, when it does not
    zero_downtime: str | None = None  # the zero-downtime route's proposal, when a host has room

    @property
    def tokens(self) -> int:
        return sum(self.prompt_tokens)


@dataclass(frozen=True)
class ExtractModel:
    """The extract phase as `fixed_s` (everything but the forward) plus tokens at `tokens_per_s`;
    either None when nothing tells it (the phase is then unknown, never 0 s)."""

    fixed_s: float | None
    tokens_per_s: float | None
    basis: str
    estimated: bool
    spread_s: float | None = None

    def seconds(self, tokens: int) -> float | None:
        if self.fixed_s is None or (tokens and not self.tokens_per_s):
            return None
        return self.fixed_s + (tokens / self.tokens_per_s if tokens else 0.0)


# --- what earlier runs measured ----------------------------------------------------------------

def _state(state: Mapping[str, Any] | RunState) -> RunState:
    return state if isinstance(state, RunState) else RunState.from_json(dict(state), "an earlier run's state")


def measured_phases(state: Mapping[str, Any] | RunState) -> dict[str, float | None]:
    """The phases as the run measured them (seconds); None for a phase it did not go through whole,
    or whose end the console saw late (it was away: killed and resumed).

    A phase is the hosts' work, never a wait for the operator's answer: every question the window
    waited on (`service.answer_waits`: the holders' end, a restart asked again, ...) is taken out of
    the phase it fell in, and start counts from the start command (issued once the restart was
    approved, or after a refused restart, when someone restarted it), not from the GPUs' release."""
    run = _state(state)
    svc, ext = run.service, run.extraction
    released = ext.gpu_released_at
    if released is not None and svc.start_issued_at is not None and svc.start_issued_at > released:
        issued = svc.start_issued_at
    else:
        issued = released
    marks = ((svc.stopped_at, svc.stop_returned_at), (svc.stop_returned_at, svc.vram_free_at),
             (svc.vram_free_at, released), (issued, svc.ready_at))
    phases: dict[str, float | None] = {}
    for name, (begin, end) in zip(PHASES, marks, strict=True):
        phases[name] = worked(svc.answer_waits, begin, end)
    if phases["free-vram"] is not None and not svc.answer_waits:  # a run from before the waits were kept
        phases["free-vram"] = max(0.0, phases["free-vram"] - (run.step("free-vram").decision_s or 0.0))
    if svc.ready_seen_late:
        phases["start"] = None
    if run.step("extract").found_on_resume:
        phases["extract"] = phases["start"] = None
    return phases


def worked(answer_waits: Sequence[Sequence[float]], begin: float | None, end: float | None) -> float | None:
    """The seconds from `begin` to `end` less the waits on the operator's answers among them; None
    without both ends (or with them out of order)."""
    if begin is None or end is None or end < begin:
        return None
    return max(0.0, end - begin - overlap(answer_waits, begin, end))


# The free-vram step's result when the engine had to end the processes holding VRAM (engine.py).
ENDED_HOLDERS = "free after ending"


def ended_holders(state: Mapping[str, Any] | RunState) -> bool:
    """Whether VRAM stayed held after the run's stop until its holders were ended (the drill's first
    stop, the story's): an episode that says little of how long VRAM usually takes to free."""
    detail = _state(state).step("free-vram").detail or ""
    return detail.startswith(ENDED_HOLDERS)


def _host_of(run: RunState, step: str) -> str | None:
    return next((s.get("host") for s in run.plan if s.get("name") == step), None)


def _same_hosts(inputs: ForecastInputs) -> list[RunState]:
    """Earlier window-route runs whose stop and extraction ran on this run's hosts, oldest first."""
    runs = []
    for raw in inputs.earlier:
        try:
            run = _state(raw)
        except StateError:
            continue  # a damaged run is listed by `runs`; it measures nothing here
        if run.run_id == inputs.run_id or (run.route or "window") != "window":
            continue
        if _host_of(run, "stop") == inputs.service_host and _host_of(run, "extract") == inputs.extract_host:
            runs.append(run)
    return sorted(runs, key=lambda r: r.created_at)


def _staged(run: RunState) -> bool:
    return bool(run.extraction.window.get("staged"))


def _runs_on(n: int, host: str) -> str:
    return f"the earlier run on {host}" if n == 1 else f"median of {n} earlier runs on {host}"


def _from_earlier(name: str, samples: list[float], host: str) -> ForecastPhase | None:
    """The phase as the earlier runs measured it (median, and their spread when several)."""
    if not samples:
        return None
    spread = max(samples) - min(samples) if len(samples) > 1 else None
    return ForecastPhase(name, statistics.median(samples), _runs_on(len(samples), host), spread)


# --- the forecast ------------------------------------------------------------------------------

def _speed(inputs: ForecastInputs, key: str) -> tuple[float | None, str]:
    """(bytes per second, what was measured) of the probe's `key` speed, or (None, why not)."""
    speed = (inputs.speeds or {}).get(key) or {}
    if speed.get("measured") and speed.get("bytes_per_s"):
        return float(speed["bytes_per_s"]), str(speed.get("what") or key)
    return None, str(speed.get("why") or f"the probe measured no {key} speed")


def extract_model(inputs: ForecastInputs) -> ExtractModel:
    """The extract phase: from earlier runs in the same mode (staged or cold) on these hosts, else
    from the probe's speeds and the stage warm-up's forward rate."""
    fixed, rates, totals = [], [], []
    for run in _same_hosts(inputs):
        measured = measured_phases(run)["extract"]
        window = run.extraction.window
        if measured is None or _staged(run) != inputs.staged:
            continue
        forward_s, tokens = window.get("forward_s"), window.get("tokens")
        if forward_s and tokens:
            fixed.append(max(measured - forward_s, 0.0))
            rates.append(tokens / forward_s)
            totals.append(fixed[-1] + inputs.tokens / rates[-1])
    if fixed:
        fixed_s, rate = statistics.median(fixed), statistics.median(rates)
        spread = max(totals) - min(totals) if len(totals) > 1 else None
        basis = (f"{_runs_on(len(fixed), inputs.extract_host)}: {fixed_s:.1f} s besides the forward, then "
                 f"{inputs.tokens} tokens at {rate:,.0f} tok/s")
        return ExtractModel(fixed_s, rate, basis, estimated=False, spread_s=spread)
    # The first window on these hosts: an estimate whatever it is made of (the forward rate is
    # scaled from a few layers; the copy's speed is the probe's, not the worker's).
    parts = []
    event = inputs.staged_event or {}
    copy_s: float | None
    if inputs.staged and event and event.get("pinned") is False and _speed(inputs, "h2d")[0] is None:
        # No CUDA device (the drill's CPU host): the staged weights already are where the forward runs.
        copy_s = 0.0
        parts.append(f"no copy: the staged weights stay in host memory, where the forward runs "
                     f"({_speed(inputs, 'h2d')[1]})")
    elif inputs.model_bytes is None:
        copy_s, parts = None, ["the copy is unknown: the weights' size is unknown"]
    else:
        key = "h2d" if inputs.staged else "disk_read"
        bps, what = _speed(inputs, key)
        if bps is None:
            copy_s = None
            parts.append(f"the copy is unknown ({what})")
        else:
            copy_s = inputs.model_bytes / bps
            source = "pinned host-to-GPU" if inputs.staged else "disk read"
            parts.append(f"{inputs.model_bytes / 2**30:.1f} GiB at {bps / GB:.2f} GB/s (the probe's {source}: {what})")
    rate = float(event["forward_tokens_per_s"]) if event.get("forward_tokens_per_s") else None
    if rate:
        parts.append(f"{inputs.tokens} tokens at {rate:,.0f} tok/s ({event.get('forward_rate_basis') or 'stage warm-up'})")
    else:
        parts.append("the forward is unknown: no rate measured yet (the staged worker's warm-up or an "
                     "earlier run gives one)")
    unknown = copy_s is None or (inputs.tokens and not rate)
    return ExtractModel(copy_s, rate, ("unknown: " if unknown else "") + "; ".join(parts), estimated=True)


def _phase_stop(inputs: ForecastInputs, samples: list[float]) -> ForecastPhase:
    if earlier := _from_earlier("stop", samples, inputs.service_host):
        return earlier
    stop_s = (inputs.systemd or {}).get("stop_s")
    if stop_s is not None:
        return ForecastPhase("stop", float(stop_s), f"the unit's last stop on {inputs.service_host} (systemd)")
    return ForecastPhase("stop", inputs.stop_grace_s, "estimate: the stop's grace ([service] stop_grace_s); "
                                                      "no stop measured on this host yet", estimated=True)


def _phase_free_vram(inputs: ForecastInputs, runs: list[RunState]) -> ForecastPhase:
    """Runs where VRAM freed by itself are the basis. A run that had to end VRAM holders (the drill's
    first stop, the story's) is an episode: alone, it says nothing of how long VRAM usually takes, and
    the next window (its holders gone) would be forecast its whole wait. Only when several earlier
    runs all had to end holders is that this host's habit, and the forecast."""
    measured = [(measured_phases(run)["free-vram"], ended_holders(run)) for run in runs]
    usual = [s for s, ended in measured if s is not None and not ended]
    episodes = [s for s, ended in measured if s is not None and ended]
    if usual:
        earlier = _from_earlier("free-vram", usual, inputs.service_host)
        left_out = f" ({len(episodes)} run{'s' if len(episodes) > 1 else ''} that ended VRAM holders left out)"
        return dataclasses.replace(earlier, basis=earlier.basis + (left_out if episodes else ""))
    if len(episodes) > 1:
        earlier = _from_earlier("free-vram", episodes, inputs.service_host)
        return dataclasses.replace(earlier, basis=earlier.basis + " (every one ended VRAM holders: this host "
                                                                  "keeps VRAM held after its stop)")
    grace = "estimate: the stop's grace ([service] stop_grace_s): "
    if episodes:
        return ForecastPhase("free-vram", inputs.stop_grace_s,
                             f"{grace}{_runs_on(1, inputs.service_host)} ended VRAM holders after "
                             f"{duration(episodes[0])}, an episode that says nothing of the usual release",
                             estimated=True)
    return ForecastPhase("free-vram", inputs.stop_grace_s,
                         f"{grace}no earlier run measured how long VRAM stays held after the stop", estimated=True)


def _phase_start(inputs: ForecastInputs, samples: list[float]) -> ForecastPhase:
    if earlier := _from_earlier("start", samples, inputs.service_host):
        return earlier
    history = inputs.systemd or {}
    ready_s = history.get("ready_s")
    if ready_s is not None:
        return ForecastPhase("start", float(ready_s), f"the server's last start on {inputs.service_host} "
                                                      f"(systemd: the unit's start to its ready line)")
    if history.get("start_s") and str(history.get("type") or "").startswith("notify"):
        # A notify unit is active only once the server says it is ready: its start is the whole start.
        return ForecastPhase("start", float(history["start_s"]), f"the server's last start on {inputs.service_host} "
                                                                 f"(systemd: the notify unit's start to active)")
    weights_s = history.get("weights_s")
    if weights_s is not None:
        return ForecastPhase("start", float(weights_s),
                             f"estimate: the server's last weight load on {inputs.service_host} (SGLang's log: "
                             f"Load weight end. elapsed={float(weights_s):.2f} s); the rest of its start-up comes "
                             f"on top", estimated=True)
    bps, what = _speed(inputs, "disk_read")
    if inputs.model_bytes is not None and bps is not None:
        return ForecastPhase("start", inputs.model_bytes / bps,
                             f"estimate: {inputs.model_bytes / 2**30:.1f} GiB of weights at {bps / GB:.2f} GB/s "
                             f"(the probe's disk read: {what}); the server's own start-up comes on top",
                             estimated=True)
    return ForecastPhase("start", None, "unknown: no earlier start, no start in the unit's history or the "
                                        "server's log, and no read speed", estimated=True)


def forecast(inputs: ForecastInputs) -> Forecast:
    """The downtime by phase, each with its basis; over budget when above `[window] max_downtime_s`."""
    runs = _same_hosts(inputs)
    measured = [measured_phases(run) for run in runs]

    def samples(name: str) -> list[float]:
        return [m[name] for m in measured if m[name] is not None]

    model = extract_model(inputs)
    extract = ForecastPhase("extract", model.seconds(inputs.tokens), model.basis, model.spread_s, model.estimated)
    phases = (_phase_stop(inputs, samples("stop")), _phase_free_vram(inputs, runs), extract,
              _phase_start(inputs, samples("start")))
    total = sum(p.seconds for p in phases if p.seconds is not None)  # the known phases' (a floor when some are not)
    over = inputs.budget_s is not None and total > inputs.budget_s
    return Forecast(inputs.run_id, total, phases, inputs.budget_s, over)


def phase(forecast: Forecast, name: str) -> ForecastPhase:
    return next(p for p in forecast.phases if p.name == name)


def unknown(forecast: Forecast) -> list[str]:
    """The phases nothing on the hosts could tell (their seconds None): the downtime is then a floor."""
    return [p.name for p in forecast.phases if p.seconds is None]


def figure(forecast: Forecast) -> str:
    """The downtime as one figure: '1 min 12 s', or 'unknown (at least 4 s)' when a phase is unknown."""
    if unknown(forecast):
        return f"unknown (at least {duration(forecast.downtime_s)})"
    return duration(forecast.downtime_s)


# The plan's steps whose time is a phase of the downtime (the restart's is the start to ready).
STEP_OF_PHASE = {"stop": "stop", "free-vram": "free-vram", "extract": "extract", "start": "restart"}


def planned_with(steps: Sequence[Any], forecast: Forecast) -> tuple[Any, ...]:
    """The plan's steps with the forecast in them, one figure each: a window step's estimate is its
    phase (None where the phase is unknown), and the stop says the downtime it begins."""
    seconds = {STEP_OF_PHASE[p.name]: p.seconds for p in forecast.phases if p.name in STEP_OF_PHASE}
    out = []
    for step in steps:
        if step.name in seconds:
            step = dataclasses.replace(step, estimate_s=seconds[step.name])
        if step.name == "stop" and step.acts:
            step = dataclasses.replace(step, why=f"{step.why}: forecast downtime {figure(forecast)}")
        out.append(step)
    return tuple(out)


def summary(forecast: Forecast) -> str:
    """One figure and its basis in words: '5 min 12 s = stop 11 s + free-vram 2 s + extract 3 min +
    start 1 min 59 s; stop, start: systemd's history of the unit; free-vram, extract: median of 2
    earlier runs on ct129'. An estimate says so ("estimate: ..."), an unknown phase "unknown"."""
    parts = " + ".join(f"{p.name} {duration(p.seconds) if p.seconds is not None else 'unknown'}"
                       for p in forecast.phases)
    return f"{figure(forecast)} = {parts}; {basis_words(forecast)}"


def basis_words(forecast: Forecast) -> str:
    """The phases grouped by what they rest on, each basis cut to its first clause."""
    groups: dict[str, list[str]] = {}
    for p in forecast.phases:
        basis = _first_clause(p.basis) or "no basis"
        if p.estimated and not basis.startswith(("estimate", "not forecast", "unknown")):
            basis = f"estimate: {basis}"
        groups.setdefault(basis, []).append(p.name)
    return "; ".join(f"{', '.join(names)}: {basis}" for basis, names in groups.items())


def _first_clause(basis: str) -> str:
    """'estimate: the stop's grace ([service] stop_grace_s): no earlier run ...' -> 'estimate: the
    stop's grace': no parenthesis, up to the first ';' (and after 'estimate: ', to the next ':')."""
    depth, kept = 0, []
    for ch in basis:
        depth += ch == "("
        if depth == 0:
            kept.append(ch)
        depth -= ch == ")" and depth > 0
    text = " ".join("".join(kept).split())
    text = re.sub(r" ([:;,])", r"\1", text).split("; ")[0].strip()  # "an H200 (issue 26): kv" -> "an H200: kv"
    head, sep, rest = text.partition("estimate: ")
    if sep and not head:
        return f"estimate: {rest.split(': ')[0].strip()}"
    return text


# --- the budget --------------------------------------------------------------------------------

def prompts_that_fit(planned: Forecast, inputs: ForecastInputs) -> int | None:
    """How many of the prompts (in order) fit the budget with the other phases as forecast; None
    without a budget or a forward rate to tell."""
    model = extract_model(inputs)
    if inputs.budget_s is None or not model.tokens_per_s or model.fixed_s is None:
        return None
    if any(p.seconds is None for p in planned.phases if p.name != "extract"):
        return None
    others = sum(p.seconds or 0.0 for p in planned.phases if p.name != "extract")
    allowance = (inputs.budget_s - others - model.fixed_s) * model.tokens_per_s
    fit, tokens = 0, 0
    for n in inputs.prompt_tokens:
        if tokens + n > allowance:
            break
        tokens += n
        fit += 1
    return fit


def refusal(planned: Forecast, inputs: ForecastInputs) -> str | None:
    """None within the budget; else why the stop is refused and what would fit: staging, the
    zero-downtime route, fewer prompts. A forecast with an unknown phase never passes a budget: it
    cannot be shown to fit (refused, saying which phases are unknown and what would tell them)."""
    if inputs.budget_s is None:
        return None
    if not planned.over_budget:
        return unchecked(planned, inputs)
    fits = []
    if not inputs.staged:
        bps, _ = _speed(inputs, "h2d")
        staged = forecast(dataclasses.replace(inputs, staged=True)) if bps else None
        if staged is not None:
            verdict = "fits" if not staged.over_budget else "still over"
            fits.append(f"staging the weights before the stop: {duration(staged.downtime_s)} ({verdict})"
                        + (f"; the plan left it out: {inputs.stage_left_out}" if inputs.stage_left_out else ""))
        else:
            fits.append("staging the weights before the stop" + (f" (left out: {inputs.stage_left_out})"
                                                                  if inputs.stage_left_out else ""))
    if inputs.zero_downtime:
        fits.append(f"the zero-downtime route, no downtime: {inputs.zero_downtime} (dflash-ops run --route zero-downtime)")
    else:
        fits.append("the zero-downtime route: no host has a free GPU, a copy of the weights and the kernels now")
    n = prompts_that_fit(planned, inputs)
    total = len(inputs.prompt_tokens)
    if n is None:
        fits.append("fewer prompts: how many cannot be told without a forward rate")
    elif n == 0:
        fits.append(f"fewer prompts: not even one of the {total} fits beside the other phases")
    else:
        fits.append(f"fewer prompts: the first {n} of {total} ({sum(inputs.prompt_tokens[:n])} tokens) would fit "
                    f"([prompts] file)")
    return (f"refused before the stop, the service untouched: the forecast downtime {summary(planned)} exceeds "
            f"the budget [window] max_downtime_s = {inputs.budget_s:g} s. What would fit: " + "; ".join(fits))


def unchecked(planned: Forecast, inputs: ForecastInputs) -> str | None:
    """Why a budget cannot be checked: the phases nothing could tell; None when every one is known."""
    names = unknown(planned)
    if inputs.budget_s is None or not names:
        return None
    why = "; ".join(f"{p.name}: {p.basis}" for p in planned.phases if p.seconds is None)
    return (f"refused before the stop, the service untouched: the budget [window] max_downtime_s = "
            f"{inputs.budget_s:g} s cannot be checked, the forecast's {', '.join(names)} "
            f"{'is' if len(names) == 1 else 'are'} unknown ({why}); known so far {summary(planned)}. What would "
            f"tell them: staging the weights (its warm-up measures the forward rate), the server's start in the "
            f"unit's journal or its log ([service] log), or one window without the budget (its measurements "
            f"are the next forecast's basis)")


# --- during the window -------------------------------------------------------------------------

@dataclass
class ExtractionProgress:
    """The extraction's tokens, fed from the worker's `tokens` progress events (t, done, total)."""

    done: int = 0
    total: int | None = None
    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, t: float, done: int, total: int | None) -> None:
        self.done, self.total = int(done), (int(total) if total is not None else self.total)
        self.samples.append((float(t), int(done)))

    @property
    def tokens_per_s(self) -> float | None:
        """The rate since the first prompt finished (its compile left out); None before a second."""
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 and d1 > d0 else None

    @property
    def left(self) -> int | None:
        return None if self.total is None else max(self.total - self.done, 0)


def after_extraction(forecast: Forecast) -> tuple[float, str]:
    """The phases after the extraction, as forecast: the stop route's start, or the pause route's
    resume and continue. (Seconds, unknown ones as 0 and said so; how it reads in a basis.)"""
    names = [p.name for p in forecast.phases]
    tail = forecast.phases[names.index("extract") + 1:] if "extract" in names else ()
    seconds = sum(p.seconds or 0.0 for p in tail)  # unknown: said in the basis, never taken as known
    if [p.name for p in tail] == ["start"]:
        return seconds, f"the start ({_seconds(tail[0].seconds)}: {tail[0].basis})"
    return seconds, " + ".join(f"{p.name} ({_seconds(p.seconds)}: {p.basis})" for p in tail) or "nothing"


def project(forecast: Forecast, inputs: ForecastInputs, down_since: float, now: float,
            progress: ExtractionProgress | None = None, waited_s: float = 0.0) -> WindowProjection:
    """When the service is expected back (served again: started, or resumed and continued): during the
    extraction, the tokens left at the rate measured so far (else the forecast's) then what follows
    the extraction as forecast; before it, the forecast, moved by `waited_s`, the time the window has
    waited on the operator's answers so far (never forecast: an answer is no lateness)."""
    start, then = after_extraction(forecast)
    budget_ends = down_since + inputs.budget_s if inputs.budget_s is not None else None
    rate = (progress.tokens_per_s if progress else None) or extract_model(inputs).tokens_per_s
    if progress is not None and progress.left is not None and rate:
        eta = progress.left / rate
        measured = "measured" if progress.tokens_per_s else "forecast"
        return WindowProjection(forecast.run_id, down_since, now + eta + start, eta, budget_ends,
                                f"{progress.done}/{progress.total} tokens, {progress.left} left at {rate:,.0f} tok/s "
                                f"({measured}), then {then}")
    expected = max(down_since + forecast.downtime_s + waited_s, now + start)
    answers = f", plus {duration(waited_s)} waiting on your answers" if waited_s >= 0.05 else ""
    return WindowProjection(forecast.run_id, down_since, expected, None, budget_ends,
                            f"the forecast: {summary(forecast)}{answers}")


def _seconds(seconds: float | None) -> str:
    return duration(seconds) if seconds is not None else "unknown"


def passes_budget(projection: WindowProjection) -> bool:
    """The projected end of the window lies beyond the budget: offer to stop the extraction now."""
    return projection.budget_ends_at is not None and projection.expected_ready_at > projection.budget_ends_at


# --- forecast against measured -----------------------------------------------------------------

def to_state(forecast: Forecast) -> dict[str, Any]:
    """`state.json`'s `forecast`: {downtime_s, phases: {name: {...}}, basis, budget_s, over_budget}."""
    return {"downtime_s": forecast.downtime_s, "budget_s": forecast.budget_s, "over_budget": forecast.over_budget,
            "basis": summary(forecast),
            "phases": {p.name: {"seconds": p.seconds, "basis": p.basis, "spread_s": p.spread_s,
                                "estimated": p.estimated} for p in forecast.phases}}


def from_state(run_id: str, data: Mapping[str, Any]) -> Forecast:
    # In the window's order (state.json is written with sorted keys): the stop route's, or the pause
    # route's (pause, release, free-vram, extract, resume, continue).
    order = ("pause", "release", "stop", "free-vram", "extract", "start", "resume", "continue")
    ordered = sorted(data["phases"].items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
    phases = tuple(ForecastPhase(name, None if p.get("seconds") is None else float(p["seconds"]), str(p["basis"]),
                                 p.get("spread_s"),
                                 bool(p.get("estimated"))) for name, p in ordered)
    return Forecast(run_id, float(data["downtime_s"]), phases, data.get("budget_s"), bool(data.get("over_budget")))


@dataclass(frozen=True)
class PhaseAgainst:
    """One row of the window's timeline: a phase as forecast and as measured."""

    phase: str  # a phase name, or "downtime" for the whole
    forecast_s: float | None
    measured_s: float | None
    basis: str = ""

    @property
    def error(self) -> float | None:
        """(forecast - measured) / measured: positive when the forecast was too long. None when it
        forecast nothing (absent, or 0.0 s as shown): '0.0 s ... -85%' is a figure that says nothing."""
        if self.forecast_s is None or round(self.forecast_s, 1) == 0 or not self.measured_s:
            return None
        return (self.forecast_s - self.measured_s) / self.measured_s


ANSWERS = "your answers"  # the row of the time the window waited on the operator (never forecast)
ANSWERS_SHOWN_S = 0.05  # less is `--yes` answering: no row of its own (it is still left out of the phases)


def against(state: Mapping[str, Any] | RunState) -> list[PhaseAgainst]:
    """Per phase forecast vs measured, then the whole downtime (the phases': the operator's answers
    left out, as the forecast leaves them out), then, when the window waited on any, the answers'
    time; [] for a run without a forecast."""
    run = _state(state)
    if run.route == "pause":  # pause -> continue, by the pause route's own phases
        return pause_against(run)
    if not run.forecast:
        return []
    planned = from_state(run.run_id, run.forecast)
    measured = measured_phases(run)
    rows = [PhaseAgainst(p.name, p.seconds, measured.get(p.name), p.basis) for p in planned.phases]
    svc = run.service
    whole = PhaseAgainst("downtime", planned.downtime_s, worked(svc.answer_waits, svc.stopped_at, svc.ready_at),
                         run.forecast.get("basis", ""))
    return [*rows, whole, *answers_row(svc.answer_waits, svc.stopped_at, svc.ready_at)]


def answers_row(answer_waits: Sequence[Sequence[float]], begin: float | None, end: float | None) -> list[PhaseAgainst]:
    """The time the window waited on the operator's answers, as a row of its own (none when it waited
    on none, or on `--yes` only): the service was down (or paused) that much longer than the downtime
    row says."""
    waited = overlap(answer_waits, begin, end) if begin is not None and end is not None else 0.0
    if waited < ANSWERS_SHOWN_S:
        return []
    return [PhaseAgainst(ANSWERS, None, waited, "the window waited on the operator's answers: never forecast")]


def error_of(state: Mapping[str, Any] | RunState) -> tuple[PhaseAgainst | None, float]:
    """The forecast's error, seen and not assumed: the whole downtime's row of a run's last window
    (forecast against measured, the operator's answers left out of both; None without a forecast),
    and the seconds that window waited on those answers."""
    rows = against(state)
    whole = next((r for r in rows if r.phase.startswith("downtime")), None)
    return whole, next((r.measured_s or 0.0 for r in rows if r.phase == ANSWERS), 0.0)


def forecast_errors(states: Iterable[Mapping[str, Any] | RunState]) -> list[tuple[str, PhaseAgainst]]:
    """(run id, its downtime row) for every run with a forecast and a measured downtime, oldest first."""
    rows = []
    for state in states:
        try:
            run = _state(state)
        except StateError:
            continue
        whole = next((r for r in against(run) if r.phase == "downtime"), None)
        if whole is not None and whole.measured_s is not None:
            rows.append((run.created_at, run.run_id, whole))
    return [(run_id, row) for _, run_id, row in sorted(rows, key=lambda r: r[0])]


def tokens_left(run: RunState, tokens: Sequence[int]) -> tuple[int, ...]:
    """The tokens of the prompts this window extracts, in order: every prompt's, or, after a window
    cut short at its budget, only the missing prompts' (the extractor keeps the verified ones)."""
    last = run.windows[-1] if run.windows else {}
    partial = (last.get("extraction") or {}).get("partial") if isinstance(last, dict) else None
    ids = [str(i) for i in run.facts.get("prompt_ids") or ()]
    if not partial or len(ids) != len(tokens):
        return tuple(int(t) for t in tokens)
    missing = {str(i) for i in partial.get("missing") or ()}
    return tuple(int(t) for i, t in zip(ids, tokens, strict=True) if i in missing)


PAUSE_PHASES = ("pause", "release", "free-vram", "extract", "resume", "continue")  # the pause route's


def pause_against(run: Any) -> list[PhaseAgainst]:
    """The pause route's forecast against what it measured, per phase (each step's own work time),
    then the route's downtime, pause -> continue, and the time it waited on the operator's answers
    (left out of the downtime, as of the forecast). [] for a run without a pause forecast."""
    made = run.facts.get("pause_forecast")
    if not made:
        return []
    planned = from_state(run.run_id, made)
    rows = []
    for name in PAUSE_PHASES:
        p = phase(planned, name)
        step = run.steps.get(p.name)
        measured = step.work_s if step is not None and step.status == "done" and not step.found_on_resume else None
        rows.append(PhaseAgainst(p.name, p.seconds, measured, p.basis))
    svc = run.service
    whole = worked(svc.answer_waits, svc.paused_at, svc.continued_at)  # the operator's answers left out
    return [*rows, PhaseAgainst("downtime (pause -> continue)", planned.downtime_s, whole, made.get("basis", "")),
            *answers_row(svc.answer_waits, svc.paused_at, svc.continued_at)]


def estimates(earlier_states: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Median duration of each step (and of the downtime, key "downtime") over earlier finished runs.

    The operator's answers never enter one: a step's is its work time; the downtime is the sum of
    the forecast's measured phases (forecast.measured_phases: the hosts' work from the stop to ready,
    a question's wait left out), from runs that measured every phase; the pause route's is its pause
    to its continue less the time the window waited on the operator's answers."""
    durations: dict[str, list[float]] = {}
    for state in earlier_states:
        for name, step in state.get("steps", {}).items():
            if step.get("status") != "done" or step.get("found_on_resume"):
                continue
            if step.get("work_s"):  # the work alone, the operator's think time left out
                durations.setdefault(name, []).append(step["work_s"])
            elif step.get("started_at") is not None and step.get("ended_at") is not None:
                durations.setdefault(name, []).append(max(0.0, step["ended_at"] - step["started_at"]
                                                          - (step.get("decision_s") or 0.0)))
        service = state.get("service", {})
        if service.get("stopped_at") is not None and service.get("ready_at") is not None:
            try:
                phases = measured_phases(state)
            except StateError:
                phases = {}
            if phases and all(v is not None for v in phases.values()):
                durations.setdefault("downtime", []).append(sum(phases.values()))
        if service.get("paused_at") is not None and service.get("continued_at") is not None:
            if service.get("answer_waits"):  # the window's own record of its waits on the operator
                work_s = worked(service["answer_waits"], service["paused_at"], service["continued_at"])
            else:  # a run from before it was kept: its steps' waits
                waited = sum((state.get("steps", {}).get(n) or {}).get("decision_s") or 0.0
                             for n in ("release", "free-vram", "extract", "resume", "continue"))
                work_s = max(0.0, service["continued_at"] - service["paused_at"] - waited)
            durations.setdefault("pause-downtime", []).append(work_s)
    return {name: statistics.median(values) for name, values in durations.items()}
