"""Issue 27: the follower (every console, once a second) parsed every state.json in the store on
the event loop. Each file is now parsed again only when it changed, and off the loop."""

from __future__ import annotations

import asyncio
import threading

from console.messages import LiveRun
from console.procedure import state as state_module
from console.procedure.follower import RunFollower
from console.procedure.store import RunStore
from console.session.bus import MessageBus

RUNS = 12


async def test_the_follower_parses_a_state_again_only_when_it_changed_and_never_on_the_loop(tmp_path,
                                                                                          monkeypatch) -> None:
    store = RunStore(tmp_path)
    runs = []
    for i in range(RUNS):  # finished runs, and the newest one paused: the one every console follows
        run = store.create(None, None)
        run.state.status = "paused" if i == RUNS - 1 else "done"
        run.save()
        runs.append(run)
    parsed: list[int] = []  # the thread of each parse
    real = state_module.RunState.from_json.__func__

    def counting(cls, data, where):
        parsed.append(threading.get_ident())
        return real(cls, data, where)

    monkeypatch.setattr(state_module.RunState, "from_json", classmethod(counting))
    bus = MessageBus()
    live: list[LiveRun] = []
    bus.subscribe(lambda message: live.append(message) if isinstance(message, LiveRun) else None)
    follower = RunFollower(store, bus, interval=0.01)
    looks = asyncio.Queue()
    look = follower.look

    def counted_look(*args):
        result = look(*args)
        looks.put_nowait(result)
        return result

    follower.look = counted_look
    task = asyncio.create_task(follower.run())
    try:
        for _ in range(5):
            await asyncio.wait_for(looks.get(), 30)
        assert live and live[-1].run_id == runs[-1].run_id and live[-1].status == "paused"
        assert len(parsed) == RUNS, "after the first look, an unchanged store is not parsed again"
        runs[3].state.message = "edited"  # one run's state rewritten (as a save does)
        runs[3].save()
        for _ in range(3):
            await asyncio.wait_for(looks.get(), 30)
        assert len(parsed) == RUNS + 1, "only the state that changed is parsed again"
        assert threading.get_ident() not in parsed, "the files are read off the event loop"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
