"""How a step ends other than done: failed, paused, refused, skipped (or left out, or found done on
the hosts), and the crash-point sweep's simulated death. Raised by the step modules
(`console/procedure/steps/`) and taken by the engine's loop (`console/procedure/engine.py`)."""

from __future__ import annotations


class StepFailed(Exception):
    """A step could not do its work; the message says what and where (one line)."""

    def __init__(self, step: str, msg: str):
        super().__init__(f"{step}: {msg}")
        self.step = step
        self.msg = msg


class Paused(Exception):
    """One step was asked for and it is done (or the window was cut short at its budget): the run
    waits, resumable, for the next."""

    def __init__(self, step: str, why: str | None = None):
        super().__init__(f"paused after {step}")
        self.step = step
        self.why = why


class Refused(Exception):
    """The operator said no: the run ends there and nothing more is changed."""

    def __init__(self, step: str, action: str):
        super().__init__(f"{step}: the operator refused to {action}")
        self.step = step


class ResumeRefused(LookupError):
    """A resume that would be wrong (another route than the run was made for); the message says why."""


class SimulatedCrash(BaseException):
    """Raised by a crash-point hook in the crash-point sweep: the console "dies" right there. Nothing
    after it runs in this engine, no compensation and no finish, as after a SIGKILL."""


class Skip(str):
    """Nothing to do for the step (say why): it is recorded `skipped`."""

    @property
    def why(self) -> str:
        return str(self)


class LeftOut(Skip):
    """The plan leaves the step out (e.g. no staging without the RAM for it)."""


class Found(Skip):
    """The step's work is already on the hosts (verified there): it is recorded `done`."""
