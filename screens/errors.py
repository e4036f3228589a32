"""An exception in the console never ends it: the app and each of its screens hand what one of
their handlers lets out to the app's one error modal (`ConsoleApp.stay_up_after`), and go on.

Textual ends the message loop of whatever raised: a screen would then take no key (its bindings
are reached through its loop), and the app's own loop ending ends the console, and with it the run
its worker drives (the engine then records it as "cancelled by the operator", losing its
evaluation: issue 43)."""

from __future__ import annotations

from textual.message import Message
from textual.message_pump import MessagePump


class StaysUp(MessagePump):
    """Put before Textual's class (`class RunsScreen(StaysUp, Screen)`): every message of this node's
    loop (keys and actions, compose and mount, callbacks) is guarded."""

    async def _dispatch_message(self, message: Message) -> None:
        try:
            await super()._dispatch_message(message)
        except Exception as error:  # noqa: BLE001 - any at all: the loop must go on
            self.app.stay_up_after(error)

