"""The steps that run while the server serves, side by side: stage (read the target into host RAM and
warm the kernels, then wait for the go) and cache (greedy completions from the live server,
verified and checked against the target)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import TYPE_CHECKING

from console.procedure import run_jobs
from console.procedure.facts import same_model, size_text
from console.procedure.outcomes import Found, LeftOut, Skip, StepFailed
from console.procedure.steps import between_hosts
from console.procedure.steps.extraction import LEASE_RENEW_S, extract_args, extraction_complete
from console.ssh.hosts import HostError

if TYPE_CHECKING:
    from console.procedure.window import Window


async def check_stage(window: Window) -> Skip | None:
    if not window.acts("stage"):
        return LeftOut(window.state.facts["plan_stage"]["why"])
    if window.state.service.stops or window.server_held_by_us:  # first: no sha256 of the states while it is down
        return Skip("the service was stopped (or paused) already: the extraction reads the weights itself if the "
                    "staged worker is gone")
    if await extraction_complete(window):
        return Found("the extraction already finished")
    record = window.state.jobs.get("extract")
    if record is not None and "staged" in record.events_seen:
        if await run_jobs.job_state(window, "extract") == "running":
            await keep_lease(window, record.host)
            return Found(f"staged worker pid {record.pid} alive on {record.host}, waiting for the go")
        window.journal("stage", f"the staged worker pid {record.pid} on {record.host} is gone: staging again",
                     host=record.host, level="warning")
        run_jobs.new_attempt(window, "extract")
    elif record is not None and await run_jobs.job_state(window, "extract") in ("dead", "exited"):
        run_jobs.new_attempt(window, "extract")
    return None


async def run_stage(window: Window) -> str:
    wdir = await window.dir_on(window.config.target.host)
    await window.hosts.run(window.config.target.host, ["rm", "-f", "--", f"{wdir}/stop", f"{wdir}/go"])
    await keep_lease(window, window.config.target.host)
    outcome = await run_jobs.job(window, window.config.target.host, "extract", "extract", extract_args(window, wdir, True),
                              step="stage", until="staged")
    staged = outcome["until"]
    window.state.extraction.staged_pid = outcome["handle"].pid
    window.run.save()
    window.crash_point("staged")
    return (f"{size_text(staged.get('bytes', 0))} in host RAM, kernels warmed "
            f"({staged.get('warmup_s', 0):.1f} s); waiting for the go")


async def staged_before_the_stop(window: Window) -> None:
    """Asked of the host before the stop's question: a staged worker that said `staged` and died
    since is staged again while the server still serves; if that fails too, the stage is left out of
    the plan and the stop is asked (and forecast, and held to its budget) for the cold path, the
    weights read from disk inside the window. Never a stop approved on a staged worker that is gone."""
    record = window.state.jobs.get("extract")
    if (not window.acts("stage") or record is None or "staged" not in record.events_seen
            or window.state.extraction.begun_at is not None or window.state.service.began()):
        return
    if await run_jobs.job_state(window, "extract") == "running":
        return
    window.journal("stop", f"the staged extractor (pid {record.pid}) on {record.host} is gone since it said "
                           f"`staged`: staging again before the stop is asked", host=record.host, level="warning")
    run_jobs.new_attempt(window, "extract")
    try:
        said = await run_stage(window)
    except StepFailed as exc:
        run_jobs.new_attempt(window, "extract")
        why = (f"left out: the staged extractor died after `staged` and staging again failed ({exc.msg}): the "
               f"weights are read from disk inside the window")
        window.state.facts["plan_stage"] = {"stage": False, "why": why}
        if window.plan is not None:
            window.plan = dataclasses.replace(window.plan, steps=tuple(
                dataclasses.replace(s, acts=False, why=why) if s.name == "stage" else s for s in window.plan.steps))
        for step in window.state.plan:
            if step.get("name") == "stage":
                step.update(acts=False, why=why)
        window.run.save()
        window.journal("stop", why, level="warning")
        return
    window.journal("stop", f"staged again: {said}", host=record.host)


async def keep_lease(window: Window, host: str) -> None:
    """The console's lease on its staged worker (`remote.extract`'s --lease-file): made now, then
    renewed every LEASE_RENEW_S while this engine runs (ended with it, `Engine.execute`). A worker
    whose console is gone (killed, or a full disk before it could end it) ends itself after
    STAGE_LEASE_S instead of holding the weights in RAM, waiting for a go, forever."""
    if window.lease is not None:
        return
    path = f"{await window.dir_on(host)}/lease"
    await window.hosts.run(host, ["touch", "--", path])
    window.lease = Lease(window, host, path)


class Lease:
    """The renewal: a timer (no task waits between renewals), each firing one `touch` on the host."""

    def __init__(self, window: Window, host: str, path: str):
        self.window, self.host, self.path = window, host, path
        self.touching: set[asyncio.Task] = set()
        self._timer = asyncio.get_running_loop().call_later(LEASE_RENEW_S, self._renew)

    def _renew(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(LEASE_RENEW_S, self._renew)
        task = asyncio.get_running_loop().create_task(self._touch(), name="stage-lease")
        self.touching.add(task)
        task.add_done_callback(self.touching.discard)

    async def _touch(self) -> None:
        with contextlib.suppress(HostError, TimeoutError):  # a dropped link: the next renewal, in time
            await self.window.hosts.run(self.host, ["touch", "--", self.path])

    def cancel(self) -> None:
        self._timer.cancel()
        for task in self.touching:
            task.cancel()


def _completions_path(window: Window, wdir: str) -> str:
    return f"{wdir}/completions.json"


async def check_cache(window: Window) -> Skip | None:
    """Satisfied when the completions on the service host verify, a copy is on the target host
    (when it is another) and the extractor's check against the target passed."""
    host, target = window.config.service.host, window.config.target.host
    wdir = await window.dir_on(host)
    verified = await _verify_completions(window, host, _completions_path(window, wdir), strict=False)
    if verified is None:
        if window.service_down_by_us:
            raise StepFailed("cache", f"no verified completions at {host}:{_completions_path(window, wdir)} and "
                                      f"the service is down: restart it and run again")
        return None
    if target != host and await _verify_completions(window,
            target, _completions_path(window, await window.dir_on(target))) is None:
        return None
    if not window.state.facts.get("checked_against_target"):
        return None
    return Found(f"already cached and verified: {verified}")


async def run_cache(window: Window) -> str:
    service_host = window.config.service.host
    wdir = await window.dir_on(service_host)
    completions = _completions_path(window, wdir)
    if await _verify_completions(window, service_host, completions, strict=False) is None:
        prompts = "\n".join(json.dumps(r) for r in window.prompt_records()) + "\n"
        await window.hosts.write_text(service_host, f"{wdir}/prompts.jsonl", prompts)
        args = ["--server", window.config.service.url, "--out", completions, "--prompts", f"{wdir}/prompts.jsonl",
                "--tokenizer", window.config.target.model_path]
        key = window.config.service.api_key()  # through the environment, never argv nor the journal
        await run_jobs.job(window, service_host, "completions", "cache", args, step="cache",
                        env={"DFLASH_SGLANG_API_KEY": key} if key else None)
    if window.config.target.host != service_host:
        target_window = await window.dir_on(window.config.target.host)
        await between_hosts.relay_file(window, service_host, completions, window.config.target.host,
                               f"{target_window}/completions.json", "cache")
    checked = await _check_against_target(window)
    window.state.facts["checked_against_target"] = True
    window.run.save()
    window.crash_point("cached")
    return f"{len(window.state.facts['prompt_ids'])} completions cached and verified; {checked}"


async def verify_cache(window: Window) -> None:
    wdir = await window.dir_on(window.config.service.host)
    if await _verify_completions(window, window.config.service.host, _completions_path(window, wdir)) is None:
        raise StepFailed("cache", f"{window.config.service.host}:{_completions_path(window, wdir)} was not written")


async def _check_against_target(window: Window) -> str:
    """The extractor's own check phase, run now while the server serves (no GPU): token ids inside
    the target's vocabulary, lengths within its context, finish reasons, the layers."""
    wdir = await window.dir_on(window.config.target.host)
    args = ["--check-only", "--model", window.config.target.model_path, "--completions",
            f"{wdir}/completions.json", "--layers", ",".join(map(str, window.facts.layers))]
    outcome = await run_jobs.job(window, window.config.target.host, "extract", "check", args, step="cache", fresh=True)
    result = outcome.get("result") or {}
    return (f"checked against the target: {result.get('prompts', '?')} prompts, {result.get('tokens', '?')} "
            f"tokens within vocab {result.get('vocab_size', '?')} and context {result.get('max_position_embeddings', '?')}")


async def _verify_completions(window: Window, host: str, path: str, strict: bool = True) -> str | None:
    """None when there is no cache; else raises unless it matches the prompts and the target.
    Not `strict`: a cache with incomplete generations is None too (the worker run again asks the
    server for those alone, keeping the complete ones)."""
    try:
        text = await window.hosts.read_text(host, path)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StepFailed("cache", f"{host}:{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list):
        raise StepFailed("cache", f"{host}:{path}: not a completions file (no `prompts` list)")
    ids = [p.get("id") for p in data["prompts"]]
    want = window.state.facts["prompt_ids"]
    if ids != want:
        raise StepFailed("cache", f"{host}:{path} holds prompts {ids}, expected {want}")
    # remote.completions marks an aborted, failed or empty generation incomplete (never complete).
    incomplete = [p for p in data["prompts"] if p.get("complete") is False or not p.get("completion_ids")]
    if incomplete and not strict and not window.service_down_by_us:
        return None
    if incomplete:
        why = "; ".join(f"{p.get('id')}: {p.get('incomplete_reason') or 'no completion tokens'}" for p in incomplete)
        raise StepFailed("cache", f"{host}:{path}: incomplete generations ({why}); the server must answer "
                                  f"them in full before it is stopped")
    model = data.get("model_path")
    if model and not same_model(model, window.config.target.model_path):
        raise StepFailed("cache", f"{host}:{path} was made by a server serving {model}, not the target "
                                  f"{window.config.target.model_path}")
    window.state.facts["completion_tokens"] = sum(len(p["completion_ids"]) for p in data["prompts"])
    window.state.facts["prompt_tokens"] = [len(p.get("prompt_ids") or ()) + len(p["completion_ids"])
                                         for p in data["prompts"]]
    return f"{len(ids)} prompts, {window.state.facts['completion_tokens']} completion tokens"
