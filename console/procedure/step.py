"""One step of the procedure, as data (`Step`), and the plan made from a route's steps.

A leaf: the step table (`steps/__init__.py`) is made of these, the window (`window.py`) carries its
route's steps, and the plan views read `done_earlier`; nothing here imports a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from console.messages import PlannedStep

StepCall = Callable[..., Awaitable[Any]]  # (window) -> the check's verdict, the run's detail, the verify's None


def by_route(**calls: StepCall) -> StepCall:
    """One step that does its work differently on each route (free-vram: the window route ends the
    stopped server's leftovers, the pause route only waits for the room)."""
    async def call(window: Any) -> Any:
        return await calls[window.route.replace("-", "_")](window)
    call.__name__ = "/".join(f"{route}:{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}" for route, fn in calls.items())
    return call


@dataclass(frozen=True)
class Step:
    """One step of the window, as data. The engine is a loop over `STEPS`; the plan, the stepper,
    `views/plan.py` and the console's state read the same table.

    `check`, `run` and `verify` are functions of the window (`window.py`): `check` asks the hosts whether the
    step's work is already there (a resumed run trusts the hosts, not its saved state) and returns
    why it is satisfied or None; `run` does the work and returns its detail; `verify` confirms the
    work on the host after it ran. `compensate` says what an early end after this step has begun
    must undo. `asks` is the confirmation it asks before it changes a host. `group`: the steps of
    one group run side by side (the first failure cancels the others).
    """

    name: str
    title: str
    host_role: str  # "hosts" | "target" | "service" | "extract" | "eval" | "console"
    routes: tuple[str, ...]
    check: StepCall | None
    run: StepCall
    verify: StepCall | None = None
    compensate: str | None = None  # "end our job" | "restart the service" | "resume and continue the server"
    asks: str | None = None
    left_out_when: str | None = None
    group: str | None = None
    while_down: bool = False  # runs while the service is down (window route)
    after_restart: bool = False  # runs once the service is back: a resume never re-runs the steps before it


def planned(steps: tuple[Step, ...], acts: dict[str, tuple[bool, str]], hosts: dict[str, str],
            argvs: dict[str, list[str]], earlier: dict[str, float]) -> tuple[PlannedStep, ...]:
    """The plan's steps: for each of a route's `steps`, whether it acts and why, its host, argv, estimate."""
    return tuple(PlannedStep(s.name, *acts.get(s.name, (True, s.title)), hosts.get(s.name),
                             tuple(argvs.get(s.name, ())), earlier.get(s.name)) for s in steps)


DONE_EARLIER = ("done", "skipped", "left-out")  # a resume does not do these steps again


def done_earlier(steps: tuple[PlannedStep, ...], ended: Mapping[str, str]) -> tuple[PlannedStep, ...]:
    """A resumed run's plan: the steps already ended earlier in it (step -> status) read "no" (done
    earlier in this run, not done again) and have no command (the engine's plan and this view agree)."""
    earlier = {name: status for name, status in ended.items() if status in DONE_EARLIER}
    return tuple(dataclasses.replace(step, acts=False, why=f"{earlier[step.name]} earlier in this run: not done again",
                                     argv=()) if step.name in earlier else step for step in steps)
