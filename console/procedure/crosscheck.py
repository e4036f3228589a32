"""The online cross-check: the offline tau beside what the restarted server really accepts.

After the restart (or on the zero-downtime route, where the server never stopped) the cached prompts
are replayed through `/generate`, greedy, as the same token ids and for as many new tokens as the
cache holds, and SGLang's per-request speculative fields are read from `meta_info`
(`spec_verify_ct`, `completion_tokens`, `spec_accept_length`, `spec_correct_drafts_histogram` where
sent). Bounded by `[crosscheck] prompts` and `[crosscheck] budget_s`; it never asks the server for
more than that. A server without speculative decoding gives one line and no check.

    result = await crosscheck(client, config, run_dir, facts)   # an SglangClient (or a Session)
    result.to_json()  # report.json's `online`

Definitions (stated in every result):
- online tau, pooled: the sum of completion_tokens over the sum of spec_verify_ct over the replayed
  prompts (SGLang's spec_accept_length of the whole set: every emitted token counted, the prefill's
  first token and each verify step's bonus token included); the per-request mean of
  spec_accept_length beside it; 95 % CI: percentile bootstrap over prompts of the pooled figure
  (fixed seed, 2000 draws);
- offline tau: the evaluation's vanilla tau (results.json, macro over prompts, its bootstrap CI):
  r + 1 per walk round (the bonus token counted), rounds only while a whole block of known truth
  remains, the prefill token not counted, same block size as the checkpoint;
- compared like with like, on the same prompts (the replayed ones that have an offline figure): the
  per-request mean beside the offline macro (mean over prompts of each prompt's tau), the pooled
  figure beside the offline micro (every round of those prompts pooled); each difference online -
  offline with a 95 % paired percentile bootstrap over those prompts (fixed seed). They agree when
  every interval holds 0; below MIN_COMPARED prompts they are "not compared" (an interval over fewer
  says nothing). When they do not agree, a triage list of what the run knows that could explain it
  (block size and draft window, layers and their provenance, the cache's template and sampling, each
  host's kernel path, g != x divergence, online tokens that left the cached completion).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from console.config import Config
from console.service.sglang_api import ServerUnreachable, SglangClient
from remote.artifacts import atomic_path, write_json_atomic

CROSSCHECK_FILE = "crosscheck.json"
COMPLETIONS_FILE = "completions.json"
FORMAT = "dflash-ops.crosscheck/1"
BOOTSTRAP_DRAWS = 2000
MISMATCH_THRESHOLD = 0.02  # g != x above this is flagged (as the report's tables do)
NOT_SPECULATIVE = "not served speculatively: no online check"
DEFINITION = ("online tau = sum of completion_tokens / sum of spec_verify_ct over the replayed prompts (pooled; "
              "SGLang's spec_accept_length: every emitted token counted, the prefill's first token and each "
              "verify step's bonus token included); per_request_mean = mean of spec_accept_length; 95% CI: "
              "percentile bootstrap over prompts of the pooled figure (seed 0, 2000 draws)")
OFFLINE_DEFINITION = ("offline tau = the evaluation's vanilla tau (macro over prompts, bootstrap CI): r+1 per walk "
                      "round, bonus token counted, prefill token not, rounds only while a whole block of known truth "
                      "remains; same block size as the checkpoint")
MIN_COMPARED = 4  # prompts with both figures, at the least, for a verdict
AGREEMENT = (f"compared on the same prompts (at least {MIN_COMPARED}): per-request mean beside the offline macro, "
             f"pooled beside the offline micro; agree when the 95% paired bootstrap interval of each difference "
             f"(online - offline) holds 0")
NO_CHECK = "no online check"


class CrossCheckError(Exception):
    """The cross-check cannot run; the message names what is missing or malformed, and where."""


@dataclass
class PromptCheck:
    """One replayed prompt: what the server reported, and the offline figure for the same prompt."""

    id: str
    completion_tokens: int
    verify_ct: int
    online: float  # completion_tokens / verify_ct (SGLang's spec_accept_length)
    offline: float | None  # this prompt's vanilla tau in the evaluation
    same_tokens: bool  # the online output is the cached completion, token for token
    histogram: list[int] | None = None  # spec_correct_drafts_histogram: index r = steps that accepted r drafts
    offline_rounds: int | None = None  # the rounds its offline tau is the mean of (the micro's weight)


@dataclass
class CrossCheck:
    """The cross-check's outcome; `to_json()` is report.json's `online`."""

    status: str  # "checked", "not-speculative", "unknown-drafter", "out-of-time" (nothing replayed), "no-check"
    message: str
    drafter: str | None = None
    tau: float | None = None
    ci: list[float] | None = None
    per_request_mean: float | None = None
    offline_tau: float | None = None
    offline_ci: list[float] | None = None
    agrees: bool | None = None  # None: not compared (`compared` says why)
    compared: dict[str, Any] = field(default_factory=dict)  # like with like on the same prompts (`compare`)
    prompts: list[PromptCheck] = field(default_factory=list)
    triage: list[dict[str, Any]] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)  # the speculative settings /server_info reported
    left_out: int = 0  # cached prompts not replayed (the prompt count or the time budget)
    budget: dict[str, Any] = field(default_factory=dict)
    definition: str = DEFINITION
    offline_definition: str = OFFLINE_DEFINITION
    agreement: str = AGREEMENT

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> CrossCheck:
        """A saved cross-check (crosscheck.json); CrossCheckError naming `where` when it is not one."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise CrossCheckError(f"{where}: not a cross-check ({FORMAT})")
        names = {f for f in cls.__dataclass_fields__ if f != "prompts"}
        try:
            return cls(**{k: v for k, v in data.items() if k in names},
                       prompts=[PromptCheck(**p) for p in data.get("prompts") or []])
        except TypeError as exc:
            raise CrossCheckError(f"{where}: a damaged cross-check ({exc})") from None

    def headline(self) -> dict[str, float]:
        """{drafter: online tau}, for the run's state (`headline_online`)."""
        return {self.drafter: self.tau} if self.drafter and self.tau is not None else {}

    def line(self) -> str:
        """One line for the step's journal and the terminal."""
        return summary_sentence(self.to_json())


# -- the figures ---------------------------------------------------------------------------------

def pooled_ci(tokens: list[int], steps: list[int], seed: int = 0, draws: int = BOOTSTRAP_DRAWS) -> list[float] | None:
    """95% percentile bootstrap over prompts of sum(tokens) / sum(steps) (prompts resampled whole)."""
    if not tokens:
        return None
    rng = random.Random(seed)
    n = len(tokens)
    ratios = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(tokens[i] for i in picks) / sum(steps[i] for i in picks))
    ratios.sort()
    return [ratios[int(0.025 * (draws - 1))], ratios[int(round(0.975 * (draws - 1)))]]


def compare(checks: list[PromptCheck], seed: int = 0, draws: int = BOOTSTRAP_DRAWS) -> dict[str, Any]:
    """Online beside offline on the same prompts, like with like: {"prompts": n, "min_prompts",
    "macro": {online, offline, difference, ci95}, "micro": {...} (when every prompt's offline rounds
    are known), "agrees": True/False, or None with "why" below MIN_COMPARED prompts}. The difference
    is online - offline; its 95% interval a percentile bootstrap over prompts resampled whole, each
    prompt's online and offline figures kept together (paired)."""
    pairs = [c for c in checks if c.offline is not None]
    out: dict[str, Any] = {"prompts": len(pairs), "min_prompts": MIN_COMPARED, "agrees": None}
    if len(pairs) < MIN_COMPARED:
        out["why"] = (f"not compared: {len(pairs)} prompt{'s' if len(pairs) != 1 else ''} with both figures, "
                      f"fewer than {MIN_COMPARED} ([crosscheck] prompts)")
        return out

    def macro(ps: list[PromptCheck]) -> tuple[float, float]:
        return sum(c.online for c in ps) / len(ps), sum(float(c.offline or 0) for c in ps) / len(ps)

    def micro(ps: list[PromptCheck]) -> tuple[float, float]:
        online = sum(c.completion_tokens for c in ps) / sum(c.verify_ct for c in ps)
        rounds = sum(c.offline_rounds or 0 for c in ps)
        return online, sum(float(c.offline or 0) * (c.offline_rounds or 0) for c in ps) / rounds

    figures = {"macro": macro}
    if all(c.offline_rounds for c in pairs):
        figures["micro"] = micro
    rng = random.Random(seed)
    n = len(pairs)
    samples: dict[str, list[float]] = {name: [] for name in figures}
    for _ in range(draws):
        picks = [pairs[rng.randrange(n)] for _ in range(n)]
        for name, of in figures.items():
            online, offline = of(picks)
            samples[name].append(online - offline)
    agrees = True
    for name, of in figures.items():
        online, offline = of(pairs)
        diffs = sorted(samples[name])
        ci = [diffs[round(0.025 * (draws - 1))], diffs[round(0.975 * (draws - 1))]]  # as many left out each side
        holds = ci[0] <= 0.0 <= ci[1]
        agrees = agrees and holds
        out[name] = {"online": online, "offline": offline, "difference": online - offline, "ci95": ci,
                     "agrees": holds}
    out["agrees"] = agrees
    return out


# -- what the server says ------------------------------------------------------------------------

def speculative_settings(info: Mapping[str, Any]) -> dict[str, Any]:
    """The speculative settings of /server_info under SGLang's names (empty when it does not speculate)."""
    if not info.get("speculative_algorithm"):
        return {}
    return {k: v for k, v in info.items() if k.startswith("speculative_") and v is not None} | (
        {"preferred_sampling_params": info["preferred_sampling_params"]} if info.get("preferred_sampling_params") else {})


def _count(meta: Mapping[str, Any], key: str, where: str, least: int) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise CrossCheckError(f"{where}: meta_info.{key}: expected an integer >= {least}, found {value!r}")
    return value


def read_answer(answer: Mapping[str, Any], prompt_id: str) -> tuple[int, int, list[int] | None]:
    """(completion_tokens, spec_verify_ct, histogram or None) of one /generate answer, checked."""
    where = f"POST /generate for prompt {prompt_id}"
    meta = answer.get("meta_info")
    if not isinstance(meta, Mapping):
        raise CrossCheckError(f"{where}: no meta_info object in the answer")
    if "spec_verify_ct" not in meta:
        raise CrossCheckError(f"{where}: meta_info has no spec_verify_ct although /server_info says the server "
                              f"decodes speculatively (keys: {sorted(meta)[:10]})")
    tokens = _count(meta, "completion_tokens", where, 1)
    steps = _count(meta, "spec_verify_ct", where, 1)
    histogram = meta.get("spec_correct_drafts_histogram")
    if histogram is not None and (not isinstance(histogram, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in histogram) or sum(histogram) != steps):
        raise CrossCheckError(f"{where}: meta_info.spec_correct_drafts_histogram {histogram!r} is not a list of "
                              f"counts summing to spec_verify_ct {steps}")
    return tokens, steps, histogram


# -- what the run holds --------------------------------------------------------------------------

def read_completions(run_dir: Path) -> dict[str, Any]:
    """The run's cached completions (RUN/completions.json), checked for what the replay needs."""
    path = run_dir / COMPLETIONS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CrossCheckError(f"{path}: no cached completions in the run directory (the cache step's "
                              f"completions.json is fetched there first)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CrossCheckError(f"{path}: not JSON ({exc})") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise CrossCheckError(f"{path}: `prompts`: expected a non-empty list of cached completions")
    for i, record in enumerate(prompts):
        ok = isinstance(record, dict) and isinstance(record.get("id"), str) and all(
            isinstance(record.get(k), list) and record[k] and all(isinstance(t, int) for t in record[k])
            for k in ("prompt_ids", "completion_ids"))
        if not ok:
            raise CrossCheckError(f"{path}: prompts[{i}]: expected `id`, `prompt_ids` and `completion_ids` "
                                  f"(non-empty lists of token ids)")
    return data


def read_offline(run_dir: Path) -> dict[str, Any] | None:
    """The evaluation's results (RUN/results, complete), as the report reads them; None when absent."""
    from console.procedure.results import ResultsError, read_run

    results_dir = run_dir / "results"
    if not (results_dir / "results.json").is_file():
        return None
    try:
        return read_run(results_dir)[0]
    except ResultsError as exc:
        raise CrossCheckError(str(exc)) from None


def served_drafter(config: Config, settings: Mapping[str, Any]) -> str | None:
    """The run's drafter the server drafts with: `[service] drafter`, else the one whose path is the
    server's `speculative_draft_model_path` (the whole path, then its last component)."""
    if config.service.drafter:
        return config.service.drafter
    served = str(settings.get("speculative_draft_model_path") or "").rstrip("/")
    if not served:
        return None
    for match in (lambda d: d.path.rstrip("/") == served,
                  lambda d: Path(d.path.rstrip("/")).name == Path(served).name):
        found = [d.name for d in config.drafters if match(d)]
        if len(found) == 1:
            return found[0]
    return None


def triage(settings: Mapping[str, Any], drafter: str, offline: Mapping[str, Any] | None,
           completions: Mapping[str, Any], checks: list[PromptCheck], probes: Mapping[str, Any] | None,
           config: Config) -> list[dict[str, Any]]:
    """What the run knows that could make offline and online differ; the suspect ones first."""
    items: list[dict[str, Any]] = []

    def add(what: str, found: str, suspect: bool) -> None:
        items.append({"what": what, "found": found, "suspect": suspect})

    metrics = (offline or {}).get("drafters", {}).get(drafter) or {}
    facts = metrics.get("facts") or {}
    provenance = metrics.get("provenance") or {}
    block, served_block = facts.get("block_size") or metrics.get("block_size"), settings.get("speculative_num_draft_tokens")
    window = settings.get("speculative_draft_window_size")
    add("block size and draft window",
        f"server drafts {served_block} tokens a step (dflash block {settings.get('speculative_dflash_block_size')}), "
        f"the checkpoint's block is {block}; draft window "
        f"{'the whole context' if window is None else f'{window} tokens (offline: the whole context)'}",
        (served_block is not None and block is not None and served_block != block) or window is not None)
    layers = provenance.get("target_layer_ids") or facts.get("layers")
    source = provenance.get("layers_source") or facts.get("layers_source")
    configured = next((d for d in config.drafters if d.name == drafter), None)
    path = settings.get("speculative_draft_model_path")
    add("layer ids and provenance",
        f"offline read layers {layers} ({'the config override; config.json says ' + str(provenance.get('config_target_layer_ids')) if source == 'override' else 'config.json'}); "
        f"the server loads {path} (the run's drafter: {configured.path if configured else '?'})",
        source == "override" or (configured is not None and path is not None
                                 and Path(str(path)).name != Path(configured.path).name))
    sampling = completions.get("sampling") or {}
    preferred = settings.get("preferred_sampling_params")
    add("template and sampling of the cache",
        f"cache from {completions.get('prompt_file') or 'the shipped prompts'} (chat template applied to "
        f"`messages` prompts, thinking mode as the template's default), temperature "
        f"{sampling.get('temperature')}; replayed greedy as the same token ids; server's preferred sampling "
        f"params {preferred or 'none'}",
        sampling.get("temperature") not in (0, 0.0, None) or bool(preferred))
    hosts = {name: (p.get("kernels") or {}).get("fast") for name, p in (probes or {}).items()}
    extraction = (offline or {}).get("kernels")
    paths = ", ".join(f"{h}: {'fast' if f else 'torch' if f is not None else '?'}" for h, f in hosts.items()) or "no probes"
    add("kernel path of each host", f"{paths}; the extraction bound {json.dumps(extraction)[:120] if extraction else '?'}",
        len({f for f in hosts.values() if f is not None}) > 1)
    mismatch = (offline or {}).get("g_x_mismatch")
    diverged = [c.id for c in checks if not c.same_tokens]
    add("g != x divergence",
        f"extraction g != cached x on {'?' if mismatch is None else f'{mismatch:.1%}'} of completion positions; "
        f"online output left the cached completion on {len(diverged)} of {len(checks)} prompts"
        + (f" ({', '.join(diverged[:5])})" if diverged else ""),
        (mismatch is not None and mismatch > MISMATCH_THRESHOLD) or bool(diverged))
    return sorted(items, key=lambda item: not item["suspect"])


# -- the check -----------------------------------------------------------------------------------

async def _client_of(source: Any) -> SglangClient:
    if isinstance(source, SglangClient):
        return source
    return await source.service.client()  # a console Session: the forward to the service host


async def crosscheck(source: SglangClient | Any, config: Config, run_dir: str | Path,
                     facts: Mapping[str, Any] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> CrossCheck:
    """Replay the run's cached prompts through the service and put its acceptance beside the offline tau.

    `source`: the SGLang client, or the console Session (its service client is used). `facts`: the
    run state's facts (`probes` per host when there; else RUN/probes.json is read). Needs
    RUN/completions.json; reads RUN/results (the evaluation) when it is there. `clock` measures the
    time budget (seconds, monotonic). Raises CrossCheckError
    (a malformed cache, answer or results) or the client's ServerUnreachable / ServerAnswerError.
    """
    run_dir = Path(run_dir)
    client = await _client_of(source)
    settings = speculative_settings(await client.server_info())
    if not settings:
        return CrossCheck(status="not-speculative", message=NOT_SPECULATIVE)
    completions = read_completions(run_dir)
    offline = read_offline(run_dir)
    drafter = served_drafter(config, settings)
    limit, budget_s = config.crosscheck.prompts, config.crosscheck.budget_s
    records = completions["prompts"][:limit]
    deadline = clock() + budget_s
    checks: list[PromptCheck] = []
    per_prompt = ((offline or {}).get("drafters", {}).get(drafter) or {}).get("per_prompt") or {}
    for record in records:
        left = deadline - clock()
        if left <= 0:
            break
        try:
            answer = await client.within(left).generate(record["prompt_ids"], len(record["completion_ids"]),
                                                        timeout=left)
        except ServerUnreachable as exc:
            if clock() >= deadline:
                break  # the budget ran out during this request: it is left out, not an error
            raise ServerUnreachable(f"cross-check, prompt {record['id']}: {exc}") from None
        tokens, steps, histogram = read_answer(answer, record["id"])
        vanilla = (per_prompt.get(record["id"]) or {}).get("tau", {}).get("vanilla") or {}
        rounds = vanilla.get("rounds")
        checks.append(PromptCheck(id=record["id"], completion_tokens=tokens, verify_ct=steps, online=tokens / steps,
                                  offline=vanilla.get("macro"), same_tokens=answer["output_ids"] == record["completion_ids"],
                                  histogram=histogram,
                                  offline_rounds=rounds if isinstance(rounds, int) and rounds > 0 else None))
    result = CrossCheck(status="checked", message="", drafter=drafter, server=dict(settings), prompts=checks,
                        left_out=len(completions["prompts"]) - len(checks),
                        budget={"prompts": limit, "budget_s": budget_s})
    if not checks:
        result.status = "out-of-time"
        result.message = f"no prompt replayed within the time budget of {budget_s:g} s ([crosscheck] budget_s)"
        return result
    tokens = [c.completion_tokens for c in checks]
    steps = [c.verify_ct for c in checks]
    result.tau = sum(tokens) / sum(steps)
    result.ci = pooled_ci(tokens, steps)
    result.per_request_mean = sum(c.online for c in checks) / len(checks)
    if drafter is None:
        result.status = "unknown-drafter"
        result.message = (f"the server drafts with {settings.get('speculative_draft_model_path')}, none of the run's "
                          f"drafters ({', '.join(d.name for d in config.drafters) or 'none'}): set [service] drafter "
                          f"= NAME to compare it")
        return result
    vanilla = ((offline or {}).get("drafters", {}).get(drafter) or {}).get("tau", {}).get("vanilla") or {}
    result.offline_tau, result.offline_ci = vanilla.get("macro"), vanilla.get("ci95")  # the whole set's, shown
    result.compared = compare(checks)
    result.agrees = result.compared["agrees"]
    if result.agrees is False:
        probes = (facts or {}).get("probes") or _saved_probes(run_dir)
        result.triage = triage(settings, drafter, offline, completions, checks, probes, config)
    result.message = result.line()
    return result


def _saved_probes(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "probes.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("hosts")
    except (OSError, ValueError, AttributeError):
        return None


async def fetch_completions(session: Any, config: Config, run_dir: str | Path, run_id: str,
                            timeout: float | None = None) -> Path:
    """RUN/completions.json, fetched from the service host's window directory of this run
    (`<workdir>/windows/<run_id>/completions.json`, where the cache step wrote it) unless already there."""
    from console.procedure import remote_files

    local = Path(run_dir) / COMPLETIONS_FILE
    if local.is_file():
        return local
    runner = await session.runner(config.service.host, timeout)
    remote = f"{await runner.workdir()}/windows/{run_id}/{COMPLETIONS_FILE}"
    try:
        text = await remote_files.read_text(runner.host, remote)
    except FileNotFoundError:
        raise CrossCheckError(f"{config.service.host}:{remote}: this run cached no completions there") from None
    with atomic_path(local) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return local


async def crosscheck_run(session: Any, config: Config, run_dir: str | Path, run_id: str,
                         facts: Mapping[str, Any] | None = None, timeout: float | None = None) -> CrossCheck:
    """The engine's and the command's step: RUN/completions.json fetched when missing, the check over
    the session's service client, RUN/crosscheck.json written. The caller records `result.headline()`
    in its state and writes the report again (it reads crosscheck.json)."""
    await fetch_completions(session, config, run_dir, run_id, timeout)
    result = await crosscheck(await session.service.client(timeout), config, run_dir, facts)
    save(run_dir, result)
    return result


# -- showing it (report.md, the console's Online tab, the command) --------------------------------

PROMPT_HEADERS = ["prompt", "online tau", "verify steps", "tokens", "offline tau", "same tokens as the cache"]


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def interval(ci: list[float] | None) -> str:
    return "[-]" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def prompt_rows(online: Mapping[str, Any]) -> list[list[str]]:
    """Per replayed prompt, the cells under PROMPT_HEADERS, from a result's JSON (report.json's `online`)."""
    return [[p["id"], _figure(p["online"]), str(p["verify_ct"]), str(p["completion_tokens"]), _figure(p.get("offline")),
             "yes" if p.get("same_tokens") else "NO"] for p in online.get("prompts") or []]


def _difference(name: str, said: Mapping[str, Any]) -> str:
    ci = said.get("ci95") or [0.0, 0.0]
    return (f"{name} {said['online']:.2f} vs {said['offline']:.2f}, difference {said['difference']:+.2f} "
            f"[{ci[0]:+.2f}, {ci[1]:+.2f}]")


def summary_sentence(online: Mapping[str, Any]) -> str:
    """The result in one sentence (its message when nothing was measured): the served drafter's
    online tau, then the verdict of the like-with-like comparison on the same prompts."""
    if online.get("tau") is None:
        return online.get("message") or NO_CHECK
    verdict = {True: "agree", False: "DISAGREE", None: "not compared"}[online.get("agrees")]
    served = online.get("drafter") or (online.get("server") or {}).get("speculative_draft_model_path") or "?"
    text = (f"served drafter {served}: online tau {online['tau']:.2f} {interval(online.get('ci'))} "
            f"(per-request mean {_figure(online.get('per_request_mean'))}, {len(online.get('prompts') or [])} prompts, "
            f"{online.get('left_out', 0)} left out); offline vanilla tau {_figure(online.get('offline_tau'))} "
            f"{interval(online.get('offline_ci'))}")
    compared = online.get("compared") or {}
    if compared.get("macro"):
        said = [_difference("per-request mean vs macro", compared["macro"])]
        if compared.get("micro"):
            said.append(_difference("pooled vs micro", compared["micro"]))
        text += f"; on the same {compared['prompts']} prompts: " + "; ".join(said)
    elif compared.get("why"):
        text += f"; {compared['why']}"
    text += f": {verdict}"
    return f"{text} ({online['message']})" if online.get("status") == "unknown-drafter" else text


def triage_lines(online: Mapping[str, Any]) -> list[str]:
    return [f"{'SUSPECT ' if t['suspect'] else ''}{t['what']}: {t['found']}" for t in online.get("triage") or []]


# -- keeping it ----------------------------------------------------------------------------------

def save(run_dir: str | Path, result: CrossCheck) -> Path:
    """RUN/crosscheck.json, atomically; the report reads it from there."""
    path = Path(run_dir) / CROSSCHECK_FILE
    write_json_atomic(path, result.to_json())
    return path


def load(run_dir: str | Path) -> CrossCheck | None:
    """RUN/crosscheck.json, or None when the run has none."""
    path = Path(run_dir) / CROSSCHECK_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CrossCheckError(f"{path}: not JSON ({exc})") from None
    return CrossCheck.from_json(data, str(path))

