"""The downtime forecast (console.procedure.forecast): by phase with its basis, the budget, the live
projection, forecast against measured; and the systemd unit's own history it starts from."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console.procedure import forecast as fc
from console.procedure.state import ExtractionState, RunState, ServiceState, StepState
from console.procedure.step import planned
from console.procedure.steps import route_steps
from console.service.control import SystemdManager
from console.views.units import duration
from remote import extract, probe
from remote.events import EventWriter
from tests.fixtures_models import write_completions
from tests.test_service_systemd import RecordedSystemctl, Result

DATA = Path(__file__).parent / "data"

# --- the systemd unit's history (recorded systemctl / journalctl output: tests/data/systemd) -------


async def test_history_of_a_unit_stopped_and_started():
    runner = RecordedSystemctl("history", journal="journal_ready_monotonic.txt")
    history = await SystemdManager(runner, "sglang-qwen", sudo=True).history()
    assert history == {"type": "simple", "stop_s": pytest.approx(11.22), "start_s": pytest.approx(0.012),
                       "ready_s": pytest.approx(260122.412118 - 260047.005), "weights_s": None}
    show, journal = runner.calls
    assert show[:5] == ["sudo", "-n", "systemctl", "show", "sglang-qwen"]
    assert show[5] == "-p" and set(show[6].split(",")) == {
        "Type", "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic", "ActiveExitTimestampMonotonic",
        "InactiveEnterTimestampMonotonic"}
    assert journal[:4] == ["sudo", "-n", "journalctl", "-u"] and "-b" in journal and "short-monotonic" in journal
    assert journal[journal.index("-g") + 1] == "fired up and ready to roll"


async def test_history_leaves_out_what_systemd_did_not_record():
    never = await SystemdManager(RecordedSystemctl("history_never_stopped"), "u").history()
    assert never["stop_s"] is None and never["start_s"] == pytest.approx(0.012)
    stopping = await SystemdManager(RecordedSystemctl("history_stopping"), "u").history()
    assert stopping["stop_s"] is None  # under way: the last stop's end is older than its begin
    # The journal's last ready line belongs to a start before the unit's last one: not this start's.
    earlier = await SystemdManager(RecordedSystemctl("history", journal="journal_ready_earlier_start.txt"),
                                   "u").history()
    assert earlier["ready_s"] is None and earlier["stop_s"] == pytest.approx(11.22)


class JournalUnreadable(RecordedSystemctl):
    """A host whose journalctl cannot search (built without pattern matching)."""

    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None) -> Result:
        if "journalctl" in argv:
            self.calls.append(argv)
            return Result(1, stderr="Compiled without pattern matching support")
        return await super().run(argv, check, timeout)


async def test_history_without_a_readable_journal_still_has_the_stop():
    history = await SystemdManager(JournalUnreadable("history"), "u").history()
    assert history["ready_s"] is None and history["stop_s"] == pytest.approx(11.22)


class JournalWithoutReadyLine(RecordedSystemctl):
    """A journal that no longer holds the last start's ready line (rotated, or a server that never
    says it), but still its weight load, in SGLang's words, after the unit's last start."""

    weights_line = ("[260083.120000] ct129 python3[2741803]: [2026-11-28 21:14:43 TP0] Load weight end. "
                    "elapsed=36.12 s, type=Qwen3_5MoeForCausalLM, dtype=torch.bfloat16, avail mem=40.12 GB, "
                    "mem usage=31.01 GB.")

    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None) -> Result:
        if "journalctl" in argv:
            self.calls.append(argv)
            pattern = argv[argv.index("-g") + 1]
            return Result(0, self.weights_line + "\n") if pattern == "Load weight end" else Result(1)
        return await super().run(argv, check, timeout)


async def test_without_its_ready_line_the_start_is_told_by_sglangs_weight_load():
    history = await SystemdManager(JournalWithoutReadyLine("history"), "u").history()
    assert history["ready_s"] is None and history["weights_s"] == pytest.approx(36.12)
    made = fc.forecast(fc.ForecastInputs(run_id="r", service_host="ct129", extract_host="ct129", staged=False,
                                         prompt_tokens=(100,), systemd=history))
    start = fc.phase(made, "start")
    assert start.seconds == pytest.approx(36.12) and start.estimated
    assert "Load weight end. elapsed=36.12 s" in start.basis and "comes on top" in start.basis


class LocalRunner:
    """Runs the manager's commands on this machine, for real (a command manager's `log`: `tail -F`)."""

    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None) -> Result:
        import asyncio

        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        return Result(proc.returncode, out.decode(), err.decode())


async def test_a_command_managed_servers_last_weight_load_is_read_from_its_log(tmp_path):
    """The drill's kind of service: `log = tail -n +1 -F FILE`, a command that never ends by itself. It
    is read for a moment, and the last start's `Load weight end` (the standin writes SGLang's line)
    tells the start; no log command, or no such line: nothing (the start is then unknown)."""
    from console.service.control import CommandManager

    log = tmp_path / "server.log"
    log.write_text("[2026-12-01 09:00:00] Load weight begin. avail mem=79.10 GB\n"
                   "[2026-12-01 09:00:09] Load weight end. elapsed=9.20 s, type=Qwen3_5ForCausalLM\n"
                   "[2026-12-01 09:00:15] The server is fired up and ready to roll!\n")
    manager = CommandManager(LocalRunner(), "true", "true", "true", log=["tail", "-n", "+1", "-F", str(log)],
                             timeout=30)
    assert await manager.history() == {"weights_s": pytest.approx(9.2)}
    log.write_text("[2026-12-01 09:00:00] Load weight begin.\n")
    assert await manager.history() is None
    assert await CommandManager(LocalRunner(), "true", "true", "true").history() is None


def test_a_phase_nothing_tells_is_unknown_and_no_budget_passes_it():
    """Issue 27: the drill's first question said `extract 0 s + start 0 s`. With no earlier run, no
    systemd history, no log and no speeds, the extraction and the start are unknown, never 0 s; the
    downtime is a floor, said so; and a budget, however large, refuses the stop, naming them."""
    ask = fc.ForecastInputs(run_id="r", service_host="ct129", extract_host="ct129", staged=False,
                            prompt_tokens=(300, 400), stop_grace_s=2, budget_s=10_000)
    made = fc.forecast(ask)
    assert fc.unknown(made) == ["extract", "start"]
    assert [p.seconds for p in made.phases] == [2, 2, None, None] and made.downtime_s == 4 and not made.over_budget
    said = fc.summary(made)
    assert said.startswith("unknown (at least 4 s) = stop 2 s + free-vram 2 s + extract unknown + start unknown")
    assert "0 s" not in said
    refused = fc.refusal(made, ask)
    assert refused.startswith("refused before the stop, the service untouched: the budget [window] "
                              "max_downtime_s = 10000 s cannot be checked, the forecast's extract, start are unknown")
    assert fc.prompts_that_fit(made, ask) is None
    assert fc.refusal(made, dataclasses.replace(ask, budget_s=None)) is None  # no budget: nothing to check
    kept = fc.from_state("r", json.loads(json.dumps(fc.to_state(made))))
    assert kept == made and fc.unknown(kept) == ["extract", "start"]
    projection = fc.project(made, ask, down_since=1000.0, now=1001.0)
    assert "unknown" in projection.basis


@settings(max_examples=200)
@given(st.lists(st.integers(0, 2**40), min_size=4, max_size=4), st.sampled_from(["simple", "notify", "forking"]))
def test_unit_durations_are_never_negative_nor_from_an_unfinished_transition(stamps, kind):
    inactive_exit, active_enter, active_exit, inactive_enter = stamps
    props = {"Type": kind, "InactiveExitTimestampMonotonic": str(inactive_exit),
             "ActiveEnterTimestampMonotonic": str(active_enter), "ActiveExitTimestampMonotonic": str(active_exit),
             "InactiveEnterTimestampMonotonic": str(inactive_enter)}
    got = SystemdManager.durations(props)
    if active_exit and inactive_enter >= active_exit:
        assert got["stop_s"] == (inactive_enter - active_exit) / 1e6
    else:
        assert got["stop_s"] is None
    if inactive_exit and active_enter >= inactive_exit:
        assert got["start_s"] == (active_enter - inactive_exit) / 1e6
    else:
        assert got["start_s"] is None


# --- the budget's config: [window] max_downtime_s ------------------------------------------------

def _example_with(window: dict | None) -> str:
    from console.config import config_to_dict, dump_toml, example_config_text, parse_config

    data = config_to_dict(parse_config(example_config_text()))
    data.pop("window", None)
    if window is not None:
        data["window"] = window
    return dump_toml(data)


def test_the_window_budget_is_read_and_round_trips():
    from console.config import config_to_dict, example_config_text, parse_config

    assert parse_config(example_config_text()).window.max_downtime_s == 1800  # the example sets one
    assert parse_config(_example_with(None)).window.max_downtime_s is None  # no budget unless one is set
    config = parse_config(_example_with({"max_downtime_s": 600}))
    assert config.window.max_downtime_s == 600
    assert config_to_dict(config)["window"] == {"max_downtime_s": 600}


@pytest.mark.parametrize(("window", "message"), [
    ({"max_downtime_s": -5}, "`window.max_downtime_s`: expected a positive number of seconds, found -5"),
    ({"max_downtime_s": "10m"}, "`window.max_downtime_s`: expected a positive number of seconds, found \"10m\""),
    ({"max_downtime": 600}, "unknown key `window.max_downtime` in dflash-ops.toml; did you mean `max_downtime_s`?"),
])
def test_a_bad_window_budget_is_a_clear_error(window, message):
    from console.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(_example_with(window), "dflash-ops.toml")
    assert message in str(info.value)



# --- fixtures from the real producers ------------------------------------------------------------

class GoWhenStaged(io.StringIO):
    """The staged worker's event stream; gives the go (the console's job) once `staged` is seen."""

    def __init__(self, go: Path):
        super().__init__()
        self.go = go

    def write(self, text: str) -> int:
        if '"type":"staged"' in text:
            self.go.touch()
        return super().write(text)


@pytest.fixture(scope="module")
def staged_run(tiny_target, tmp_path_factory) -> dict:
    """A real staged extraction of 4 prompts on the tiny target: its `staged` event, its `gpu_released`
    window figures (what the engine keeps in state.extraction.window) and its `tokens` events."""
    root = tmp_path_factory.mktemp("staged")
    completions = write_completions(tiny_target, root / "c.json", n_prompts=4)
    stream = GoWhenStaged(root / "go")
    extract.main(EventWriter(stream=stream), ["--model", str(tiny_target), "--completions", str(completions),
                                              "--out", str(root / "out"), "--layers", "1", "--kernels", "torch",
                                              "--staged", "--go-file", str(root / "go")])
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    released = next(e for e in events if e["type"] == "gpu_released")
    prompts = json.loads(completions.read_text())["prompts"]
    return {"staged": next(e for e in events if e["type"] == "staged"),
            "window": {k: v for k, v in released.items() if k not in ("type", "seq")},
            "tokens": [e for e in events if e["type"] == "progress" and e["key"] == "tokens"],
            "prompt_tokens": tuple(len(p["prompt_ids"]) + len(p["completion_ids"]) for p in prompts)}


@pytest.fixture(scope="module")
def cpu_speeds(tiny_target) -> dict:
    """This machine's probe speeds: a disk read measured, no CUDA."""
    return probe.probe(str(tiny_target))["speeds"]


@pytest.fixture(scope="module")
def gpu_speeds(cpu_speeds) -> dict:
    """A GPU host's: the H2D bandwidth recorded on an H200 (tests/data/probe), this disk read."""
    return {**cpu_speeds, "h2d": json.loads((DATA / "probe" / "h2d_h200.json").read_text())}


async def _history(state: str = "history", journal: str = "journal_ready_monotonic.txt") -> dict:
    return await SystemdManager(RecordedSystemctl(state, journal=journal), "sglang-qwen").history()


@pytest.fixture
async def systemd_history() -> dict:
    return await _history()


def window_state(run_id: str, created_at: float, phases: dict[str, float], window: dict,
                 service_host: str = "ct129", extract_host: str = "ct129", route: str = "window",
                 free_vram: str = "free after 0.6 s (GPU0 12 MiB, GPU1 12 MiB)") -> dict:
    """An earlier run's state.json as the engine writes it (the run state's own dataclasses and
    serialiser, its plan from steps.planned), with the phases' stamps laid end to end."""
    t = created_at + 30.0
    stamps = [t]
    for name in fc.PHASES:
        t += phases[name]
        stamps.append(t)
    hosts = {"stop": service_host, "free-vram": service_host, "extract": extract_host, "restart": service_host}
    plan = [dataclasses.asdict(step) for step in planned(route_steps(route), {}, hosts, {}, {})]
    steps = {"free-vram": StepState(status="done", started_at=stamps[1], ended_at=stamps[2], detail=free_vram)}
    state = RunState(run_id, created_at, status="done", route=route, plan=plan, steps=steps,
                     service=ServiceState(stopped_at=stamps[0], stop_returned_at=stamps[1], vram_free_at=stamps[2],
                                          restart_begun_at=stamps[3], start_issued_at=stamps[3], ready_at=stamps[4]),
                     extraction=ExtractionState(gpu_released_at=stamps[3], window=dict(window), complete=True))
    return state.to_json()


def inputs(staged_run: dict, **changes) -> fc.ForecastInputs:
    base = fc.ForecastInputs(run_id="20261201-120000-next", service_host="ct129", extract_host="ct129", staged=True,
                             prompt_tokens=staged_run["prompt_tokens"], model_bytes=staged_run["staged"]["bytes"],
                             stop_grace_s=10, staged_event=staged_run["staged"])
    return dataclasses.replace(base, **changes)


# --- the forecast --------------------------------------------------------------------------------

def test_a_first_run_is_forecast_phase_by_phase_each_saying_its_basis(staged_run, cpu_speeds, systemd_history):
    """No earlier run: the stop and the start from the unit's own systemd history, VRAM free from the
    stop's grace (an estimate), the extraction from the stage warm-up's measured forward rate; on a
    CPU host the probe says there is no H2D copy to time, and the forecast says so."""
    made = fc.forecast(inputs(staged_run, speeds=cpu_speeds, systemd=systemd_history, budget_s=600))
    stop, free, ext, start = made.phases
    assert [p.name for p in made.phases] == ["stop", "free-vram", "extract", "start"]
    assert stop.seconds == pytest.approx(11.22) and "last stop on ct129 (systemd)" in stop.basis and not stop.estimated
    assert free.seconds == 10 and free.estimated and "stop_grace_s" in free.basis
    rate = staged_run["staged"]["forward_tokens_per_s"]
    assert ext.seconds == pytest.approx(sum(staged_run["prompt_tokens"]) / rate)
    assert ext.estimated and "stage warm-up" in ext.basis and "no CUDA device" in ext.basis
    assert start.seconds == pytest.approx(75.407118) and "last start on ct129 (systemd" in start.basis
    assert made.downtime_s == pytest.approx(sum(p.seconds for p in made.phases))
    assert made.budget_s == 600 and not made.over_budget and fc.refusal(made, inputs(staged_run)) is None


def test_a_staged_copy_is_forecast_from_the_probes_h2d_and_a_cold_one_from_its_disk_read(staged_run, gpu_speeds):
    model_bytes = 54 << 30
    staged = fc.phase(fc.forecast(inputs(staged_run, speeds=gpu_speeds, model_bytes=model_bytes)), "extract")
    h2d = gpu_speeds["h2d"]["bytes_per_s"]
    forward = sum(staged_run["prompt_tokens"]) / staged_run["staged"]["forward_tokens_per_s"]
    assert staged.seconds == pytest.approx(model_bytes / h2d + forward)
    assert "54.0 GiB at 54.08 GB/s (the probe's pinned host-to-GPU" in staged.basis
    made = fc.forecast(inputs(staged_run, speeds=gpu_speeds, model_bytes=model_bytes, staged=False, staged_event=None))
    cold, start = fc.phase(made, "extract"), fc.phase(made, "start")
    disk = gpu_speeds["disk_read"]["bytes_per_s"]
    # Cold with no forward rate yet: the copy is told (the disk read), the forward is not, so the phase
    # is unknown, never the copy alone passed off as the extraction (issue 27: "extract 0 s").
    assert cold.seconds is None and "the probe's disk read" in cold.basis and "78.93" not in cold.basis
    assert "the forward is unknown: no rate measured yet" in cold.basis and cold.estimated
    assert fc.unknown(made) == ["extract"] and fc.figure(made).startswith("unknown (at least ")
    assert "extract unknown" in fc.summary(made)
    # No systemd history (a command-managed service) and no earlier start: the weights at the read speed,
    # labelled as an estimate.
    assert start.estimated and start.basis.startswith("estimate:") and start.seconds == pytest.approx(model_bytes / disk)


def _earlier(staged_run: dict, durations: list[dict[str, float]], **kwargs) -> list[dict]:
    return [window_state(f"20261201-0{i}0000-aaaa", 1_795_000_000.0 + 3600 * i, d, staged_run["window"], **kwargs)
            for i, d in enumerate(durations)]


def test_earlier_runs_on_the_same_hosts_refine_it_median_and_spread(staged_run, cpu_speeds, systemd_history):
    window = staged_run["window"]
    runs = [{"stop": 9.0, "free-vram": 1.0, "extract": window["forward_s"] + 4.0, "start": 60.0},
            {"stop": 12.0, "free-vram": 3.0, "extract": window["forward_s"] + 6.0, "start": 70.0},
            {"stop": 10.0, "free-vram": 2.0, "extract": window["forward_s"] + 5.0, "start": 90.0}]
    earlier = _earlier(staged_run, runs)
    # Runs that do not count: on another host, the zero-downtime route, a damaged state.
    earlier += _earlier(staged_run, [dict(runs[0], stop=500.0)], service_host="ct300", extract_host="ct300")
    earlier += _earlier(staged_run, [dict(runs[0], stop=500.0)], route="zero-downtime")
    earlier += [{"format": "dflash-ops.run/2"}]
    made = fc.forecast(inputs(staged_run, speeds=cpu_speeds, systemd=systemd_history, earlier=earlier))
    stop, free, ext, start = made.phases
    assert (stop.seconds, stop.spread_s, stop.basis) == (10.0, 3.0, "median of 3 earlier runs on ct129")
    assert (free.seconds, free.spread_s) == (2.0, 2.0) and not free.estimated
    assert (start.seconds, start.spread_s) == (70.0, 30.0)
    # The extraction: what it took besides the forward, plus this run's tokens at the measured rate.
    rate = window["tokens"] / window["forward_s"]
    assert ext.seconds == pytest.approx(5.0 + sum(staged_run["prompt_tokens"]) / rate)
    assert ext.spread_s == pytest.approx(2.0) and not ext.estimated and "besides the forward" in ext.basis
    # Twice the tokens: the forward part doubles, the rest does not.
    double = fc.forecast(inputs(staged_run, earlier=earlier, prompt_tokens=staged_run["prompt_tokens"] * 2))
    assert fc.phase(double, "extract").seconds == pytest.approx(5.0 + 2 * sum(staged_run["prompt_tokens"]) / rate)
    # A cold run does not learn its extraction from staged ones.
    cold = fc.forecast(inputs(staged_run, earlier=earlier, staged=False, staged_event=None, speeds=cpu_speeds))
    assert fc.phase(cold, "extract").estimated and fc.phase(cold, "stop").seconds == 10.0


phase_seconds = st.floats(0.01, 5000, allow_nan=False)
a_run = st.fixed_dictionaries({name: phase_seconds for name in fc.PHASES})


@settings(max_examples=150, deadline=None)
@given(runs=st.lists(a_run, min_size=0, max_size=6), budget=st.none() | st.floats(1, 20000))
def test_a_forecast_lies_within_what_earlier_runs_measured(staged_run, cpu_speeds, runs, budget):
    """Every phase forecast from earlier runs lies between their shortest and longest; the downtime is
    the phases' sum; over budget exactly when that sum exceeds the budget."""
    # A run's extraction holds its forward (the worker's own forward_s), and whatever else it took.
    runs = [dict(r, extract=staged_run["window"]["forward_s"] + r["extract"]) for r in runs]
    made = fc.forecast(inputs(staged_run, speeds=cpu_speeds, earlier=_earlier(staged_run, runs), budget_s=budget,
                              prompt_tokens=(staged_run["window"]["tokens"],)))
    assert made.downtime_s == pytest.approx(sum(p.seconds for p in made.phases))
    assert made.over_budget == (budget is not None and made.downtime_s > budget)
    for p in made.phases:
        if runs:
            low, high = min(r[p.name] for r in runs), max(r[p.name] for r in runs)
            # Up to rounding: stamps are epoch seconds (a microsecond's worth), and the extraction is
            # rebuilt from its parts (the rest + tokens / rate).
            slack = 1e-5 + 1e-6 * high
            assert low - slack <= p.seconds <= high + slack, p
            assert not p.estimated and "earlier run" in p.basis
        assert p.seconds >= 0


# --- the budget ----------------------------------------------------------------------------------

def test_over_the_budget_the_stop_is_refused_naming_the_budget_the_forecast_and_what_fits(staged_run, cpu_speeds,
                                                                                            gpu_speeds):
    window = staged_run["window"]
    runs = [{"stop": 10.0, "free-vram": 2.0, "extract": window["forward_s"] + 5.0, "start": 60.0}]
    rate = window["tokens"] / window["forward_s"]
    many = staged_run["prompt_tokens"] * 50
    # Room for the other phases (72 s) and the extraction's fixed 5 s, then 43 % of the forward (not
    # a whole number of repeats of the prompts: no prompt ends exactly at the edge).
    room = sum(many) / rate * 0.43
    budget = 72 + 5 + room
    ask = inputs(staged_run, speeds=cpu_speeds, earlier=_earlier(staged_run, runs), budget_s=budget, prompt_tokens=many,
                 zero_downtime="ct200 GPU3 (81 GiB free, a copy of the weights, the same kernels)")
    made = fc.forecast(ask)
    assert made.over_budget
    text = fc.refusal(made, ask)
    assert text.startswith("refused before the stop, the service untouched: the forecast downtime "
                           f"{duration(made.downtime_s)} = stop 10 s + free-vram 2 s + extract ")
    assert f"exceeds the budget [window] max_downtime_s = {budget:g} s" in text
    assert "the zero-downtime route, no downtime: ct200 GPU3" in text and "--route zero-downtime" in text
    n = fc.prompts_that_fit(made, ask)
    assert 0 < n < len(many) and f"fewer prompts: the first {n} of {len(many)}" in text
    assert sum(many[:n]) <= room * rate * (1 + 1e-9) and sum(many[:n + 1]) > room * rate * (1 - 1e-9)
    assert "staging" not in text  # it stages already
    # Cold, where the probe measured an H2D bandwidth: staging is offered with its own forecast.
    cold = dataclasses.replace(ask, staged=False, speeds=gpu_speeds, model_bytes=54 << 30, budget_s=30,
                               stage_left_out="the target host has 31.2 GiB RAM available, staging needs 56.0 GiB")
    text = fc.refusal(fc.forecast(cold), cold)
    assert "staging the weights before the stop: " in text and "(still over); the plan left it out: the target " \
        "host has 31.2" in text
    nowhere = dataclasses.replace(ask, zero_downtime=None)
    assert "the zero-downtime route: no host has a free GPU" in fc.refusal(made, nowhere)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(1, 4000), min_size=1, max_size=40), budget=st.floats(50, 400))
def test_the_prompts_said_to_fit_do_fit_and_one_more_does_not(staged_run, cpu_speeds, tokens, budget):
    window = staged_run["window"]
    runs = [{"stop": 10.0, "free-vram": 2.0, "extract": window["forward_s"] + 5.0, "start": 30.0}]
    ask = inputs(staged_run, speeds=cpu_speeds, earlier=_earlier(staged_run, runs), budget_s=budget,
                 prompt_tokens=tuple(tokens))
    made = fc.forecast(ask)
    n = fc.prompts_that_fit(made, ask)
    assert 0 <= n <= len(tokens)
    assert not fc.forecast(dataclasses.replace(ask, prompt_tokens=tuple(tokens[:n]))).over_budget
    if n < len(tokens):
        assert fc.forecast(dataclasses.replace(ask, prompt_tokens=tuple(tokens[:n + 1]))).over_budget


# --- during the window ---------------------------------------------------------------------------

def test_the_projection_follows_the_extractions_real_progress(staged_run, cpu_speeds, systemd_history):
    """Fed the real worker's `tokens` events, the projection puts the service back after the tokens
    left at the rate measured so far, then the start as forecast; past the budget it says so."""
    ask = inputs(staged_run, speeds=cpu_speeds, systemd=systemd_history, budget_s=120)
    made = fc.forecast(ask)
    events = staged_run["tokens"]
    progress = fc.ExtractionProgress()
    before = fc.project(made, ask, down_since=1000.0, now=1001.0)
    assert before.extract_eta_s is None and before.expected_ready_at == 1000.0 + made.downtime_s
    assert before.budget_ends_at == 1120.0 and "the forecast" in before.basis
    progress.add(events[0]["t"], events[0]["done"], events[0]["total"])
    assert progress.tokens_per_s is None  # one sample: the forecast's rate is used until a second
    one = fc.project(made, ask, down_since=1000.0, now=1010.0, progress=progress)
    assert one.extract_eta_s == pytest.approx(progress.left / staged_run["staged"]["forward_tokens_per_s"])
    for event in events[1:]:
        progress.add(event["t"], event["done"], event["total"])
    assert progress.done == progress.total == sum(staged_run["prompt_tokens"]) and progress.left == 0
    done = fc.project(made, ask, down_since=1000.0, now=1020.0, progress=progress)
    assert done.extract_eta_s == 0 and done.expected_ready_at == pytest.approx(1020.0 + fc.phase(made, "start").seconds)
    assert "(measured)" in done.basis and not fc.passes_budget(done)
    late = fc.project(made, ask, down_since=1000.0, now=1100.0, progress=progress)
    assert fc.passes_budget(late)  # 1100 + the 75 s start is past 1120


@settings(max_examples=200)
@given(samples=st.lists(st.tuples(st.floats(0.1, 100), st.integers(1, 5000)), min_size=2, max_size=20),
       now=st.floats(0, 1000), start=st.floats(0, 300))
def test_a_projection_is_never_in_the_past_and_more_done_is_never_later(staged_run, samples, now, start):
    ask = inputs(staged_run, earlier=_earlier(staged_run, [{"stop": 1.0, "free-vram": 1.0,
                                                           "extract": staged_run["window"]["forward_s"] + 1,
                                                           "start": start + 0.01}]))
    made = fc.forecast(ask)
    t, done, progress = 0.0, 0, fc.ExtractionProgress()
    total = sum(n for _, n in samples)
    last = None
    for dt, n in samples:
        t, done = t + dt, done + n
        progress.add(t, done, total)
        projection = fc.project(made, ask, down_since=-50.0, now=now, progress=progress)
        assert projection.expected_ready_at >= now
        if progress.tokens_per_s is not None and last is not None and last[1] == progress.tokens_per_s:
            assert projection.expected_ready_at <= last[0]
        last = (projection.expected_ready_at, progress.tokens_per_s)


# --- forecast against measured -------------------------------------------------------------------

@settings(max_examples=100)
@given(st.lists(st.tuples(phase_seconds, st.booleans()), min_size=4, max_size=4), st.none() | phase_seconds)
def test_the_forecast_kept_in_state_reads_back_the_same(phases, budget):
    made = fc.Forecast("r", sum(s for s, _ in phases),
                       tuple(fc.ForecastPhase(n, s, f"basis {n}", None if e else s / 2, e)
                             for n, (s, e) in zip(fc.PHASES, phases, strict=True)), budget,
                       budget is not None and sum(s for s, _ in phases) > budget)
    kept = json.loads(json.dumps(fc.to_state(made)))
    assert fc.from_state("r", kept) == made
    assert set(kept) >= {"downtime_s", "phases", "basis"} and set(kept["phases"]) == set(fc.PHASES)


def test_forecast_against_measured_per_phase_and_across_runs(staged_run, cpu_speeds, systemd_history):
    window = staged_run["window"]
    first = {"stop": 11.0, "free-vram": 4.0, "extract": window["forward_s"] + 6.0, "start": 80.0}
    second = {"stop": 10.0, "free-vram": 2.0, "extract": window["forward_s"] + 5.0, "start": 70.0}
    older = _earlier(staged_run, [first])
    ask = inputs(staged_run, speeds=cpu_speeds, systemd=systemd_history, earlier=older,
                 prompt_tokens=(window["tokens"],))
    made = fc.forecast(ask)
    run = RunState.from_json(window_state("20261201-100000-bbbb", 1_795_100_000.0, second, window), "second")
    run.forecast = fc.to_state(made)
    rows = fc.against(run.to_json())
    assert [r.phase for r in rows] == [*fc.PHASES, "downtime"]
    by = {r.phase: r for r in rows}
    assert by["stop"].forecast_s == 11.0 and by["stop"].measured_s == pytest.approx(10.0)
    assert by["stop"].error == pytest.approx(0.1) and by["start"].error == pytest.approx(10 / 70)
    assert by["downtime"].measured_s == pytest.approx(sum(second.values()))
    assert by["downtime"].forecast_s == pytest.approx(sum(first.values()))
    errors = fc.forecast_errors([run.to_json(), *older, {"format": "not a run"}])
    assert [(run_id, row.phase) for run_id, row in errors] == [("20261201-100000-bbbb", "downtime")]
    assert fc.against(older[0]) == []  # a run from before the forecast: nothing to compare


def test_vram_freed_by_ending_its_holders_is_not_the_usual_wait(staged_run):
    """The drill's first stop (and the story's) left VRAM held until its holders were ended: an
    episode, not how long VRAM usually takes; runs where it freed by itself are the basis, unless
    every earlier run had to end holders."""
    window = staged_run["window"]
    ended = "free after ending 1 holder(s) (GPU0 12 MiB, GPU1 12 MiB)"  # the engine's own words
    phases = {"stop": 1.0, "free-vram": 9.0, "extract": window["forward_s"] + 1, "start": 10.0}
    stuck = window_state("20261201-010000-aaaa", 1_795_000_000.0, phases, window, free_vram=ended)
    clean = window_state("20261201-020000-aaaa", 1_795_003_600.0, dict(phases, **{"free-vram": 2.0}), window)
    assert fc.ended_holders(stuck) and not fc.ended_holders(clean)
    free = fc.phase(fc.forecast(inputs(staged_run, earlier=[stuck, clean])), "free-vram")
    assert free.seconds == pytest.approx(2.0) and "1 run that ended VRAM holders left out" in free.basis
    # One episode alone: the next window (its holders gone) is not forecast its whole wait, but the
    # stop's grace, as with no history; the episode is named (issue 43: the drill's second window was
    # forecast +49 % from its first window's 5 s episode).
    only = fc.phase(fc.forecast(inputs(staged_run, earlier=[stuck])), "free-vram")
    assert only.estimated and only.seconds == pytest.approx(10.0)  # inputs()' stop_grace_s
    assert only.basis.startswith("estimate: the stop's grace") and "ended VRAM holders after 9 s" in only.basis
    # Every one of several runs had to end holders: that is the host's habit, and the forecast.
    again = window_state("20261201-030000-aaaa", 1_795_007_200.0, dict(phases, **{"free-vram": 11.0}), window,
                         free_vram=ended)
    habit = fc.phase(fc.forecast(inputs(staged_run, earlier=[stuck, again])), "free-vram")
    assert not habit.estimated and habit.seconds == pytest.approx(10.0)  # the median of 9 and 11
    assert "every one ended VRAM holders" in habit.basis


def test_the_operators_hesitation_never_enters_a_measured_phase():
    """Issue 28: a refused restart (the start issued a minute after the GPUs' release, when someone
    pressed r) and a 20 s answer to the holders' question are the operator's time, not the hosts':
    the next forecast must not learn them."""
    phases = {"stop": 1.0, "free-vram": 25.0, "extract": 5.0, "start": 80.0}
    raw = window_state("20261201-030000-aaaa", 1_795_000_000.0, phases, {})
    state = RunState.from_json(raw, "test")
    state.service.start_issued_at += 70.0  # refused at gpu_released, started 70 s later: ready 10 s after
    state.step("free-vram").decision_s = 20.0
    measured = fc.measured_phases(state.to_json())
    assert measured["start"] == pytest.approx(10.0) and measured["free-vram"] == pytest.approx(5.0)
    assert measured["stop"] == pytest.approx(1.0) and measured["extract"] == pytest.approx(5.0)


def test_the_forecasts_summary_is_one_figure_with_its_basis_in_words():
    made = fc.Forecast("r", 95.0, (fc.ForecastPhase("stop", 1.0, "median of 2 earlier runs on ct129"),
                                   fc.ForecastPhase("free-vram", 10.0, "estimate: the stop's grace ([service] "
                                                    "stop_grace_s); no earlier run measured it", estimated=True),
                                   fc.ForecastPhase("extract", 4.0, "median of 2 earlier runs on ct129"),
                                   fc.ForecastPhase("start", 80.0, "median of 2 earlier runs on ct129")))
    said = fc.summary(made)
    assert said == ("1 min 35 s = stop 1 s + free-vram 10 s + extract 4 s + start 1 min 20 s; "
                    "stop, extract, start: median of 2 earlier runs on ct129; "
                    "free-vram: estimate: the stop's grace")
    assert "estimated)" not in said


def test_a_basis_cut_to_its_first_clause_leaves_no_space_before_its_colon() -> None:
    """The tmux walk: the pause question said "measured on an H200 : kv_cache 0.06 s" once the
    parenthesis was taken out."""
    from console.procedure.forecast import _first_clause

    said = _first_clause("measured on an H200 (issue 26, torch_memory_saver 0.0.10): kv_cache 0.06 s, cuda_graph 0.06 s")
    assert said == "measured on an H200: kv_cache 0.06 s, cuda_graph 0.06 s"
    assert _first_clause("estimate: the stop's grace ([service] stop_grace_s): no earlier run") == \
        "estimate: the stop's grace"
