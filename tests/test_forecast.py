"""The downtime forecast (console.procedure.forecast): by phase with its basis, the budget, the live
projection, forecast against measured; and the systemd unit's own history it starts from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console.service.control import SystemdManager
from tests.test_service_systemd import RecordedSystemctl, Result

# --- the systemd unit's history (recorded systemctl / journalctl output: tests/data/systemd) -------


async def test_history_of_a_unit_stopped_and_started():
    runner = RecordedSystemctl("history", journal="journal_ready_monotonic.txt")
    history = await SystemdManager(runner, "sglang-qwen", sudo=True).history()
    assert history == {"type": "simple", "stop_s": pytest.approx(11.22), "start_s": pytest.approx(0.012),
                       "ready_s": pytest.approx(260122.412118 - 260047.005)}
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
