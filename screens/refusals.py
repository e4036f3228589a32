"""What a key that would act says when this console may not act (issue 43): a read-only console
(`console --read-only`, the palette's "Read-only", each browser's view of `dflash-ops serve`, a
replay) or a console that follows a run another console drives. The key's binding is not offered
there (`ConsoleApp.check_action`), so the key reaches the app's `on_key`, which says this briefly and
does nothing else."""

from __future__ import annotations

from typing import Any

from textual.binding import Binding

# What each acting key would have done, in the words of the refusal.
DOING = {"run_procedure": "runs nothing", "next_step": "runs no step", "zero_downtime": "runs nothing",
         "plan": "plans nothing", "cancel_run": "cancels nothing",
         "restart_service": "restarts nothing"}


def acting_action(app: Any, key: str) -> str | None:
    """The acting action (`app.ACTING`) a key of the app's own bindings is bound to, or None."""
    for cls in type(app).__mro__:
        for binding in vars(cls).get("BINDINGS", ()):
            if isinstance(binding, Binding) and key in binding.key.split(","):
                action = binding.action.partition("(")[0]
                if action in app.ACTING:
                    return action
    return None


def what_it_is(app: Any) -> str:
    """Why this console is read-only, in a few words."""
    from console.sharing import SharedSession

    operator = app.operator
    if type(operator).__name__ == "ReplayOperator":
        return "a replay of a past run"
    if isinstance(getattr(operator, "session", None), SharedSession):
        return "a browser view of `dflash-ops serve`"
    if getattr(operator, "read_only", False):
        return "opened with --read-only"
    return "made read-only from the palette"


def who_drives(app: Any) -> str | None:
    """'run X is driven by OWNER' while another live console drives a run, else None."""
    elsewhere = app.live_elsewhere()
    if elsewhere is None:
        return None
    return f"run {elsewhere.run_id} is driven by {elsewhere.owner or 'another console'}"


def refusal(app: Any, action: str) -> str | None:
    """What `action`'s key says in this console when it may not act; None when it may (or when it is
    only not offered now for another reason: a run going, a question open)."""
    doing = DOING.get(action, "does nothing")
    drives = who_drives(app)
    if app.read_only:
        return f"read-only: this console {doing} ({what_it_is(app)})" + (f"; {drives}" if drives else "")
    if drives is not None and action in ("run_procedure", "next_step", "zero_downtime", "cancel_run"):
        return f"{drives}: this console follows it and {doing}; its own console acts"
    return None
