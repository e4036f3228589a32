"""The TUI's Decider: each confirmation the engine asks becomes a modal, and the engine waits for
the answer. Implements `console.procedure.decider.Decider`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from textual.message import Message
from textual.screen import Screen

from console.messages import Confirmation, HoldersFound
from screens.modals.confirm import ConfirmModal, RestartOrLeaveModal
from screens.modals.holders import HoldersModal
from screens.quitting import QUIT_DIALOGS

if TYPE_CHECKING:
    from screens.window import ConsoleWindow


class DecisionAsked(Message):
    """A confirmation is on screen."""

    def __init__(self, confirmation: Confirmation) -> None:
        super().__init__()
        self.confirmation = confirmation


class DecisionAnswered(Message):
    """The operator answered a confirmation."""

    def __init__(self, confirmation: Confirmation, approved: bool) -> None:
        super().__init__()
        self.confirmation = confirmation
        self.approved = approved


class ModalDecider:
    """Asks with the confirm modal, with the holders modal for `free-vram`, and with restart-or-leave for
    the restart offered after a no while down (`Confirmation.leaves`); read-only refuses."""

    name = "tui"

    def __init__(self, app: ConsoleWindow) -> None:
        self.app = app
        self.asking: Confirmation | None = None  # the question on screen now (the banner says so)
        self._one_at_a_time = asyncio.Lock()  # two questions at once (a restart's and a compensation's): in turn

    async def decide(self, confirmation: Confirmation) -> bool:
        if self.app.read_only or self.app.quitting:
            # read-only: nothing that acts is offered, so a question that comes anyway is refused;
            # quitting: nobody is left to answer (the operator chose to leave, and was asked first)
            return False
        async with self._one_at_a_time:
            if self.app.quitting:  # the operator left while this one waited its turn
                return False
            return await self._ask(confirmation)

    async def _ask(self, confirmation: Confirmation) -> bool:
        if confirmation.step == "free-vram":
            found = self.app.operator.bus.last.get(HoldersFound) or self.app.state.holders
            modal = HoldersModal(confirmation, found if isinstance(found, HoldersFound) else None)
        elif confirmation.step == "restart" and confirmation.leaves:
            modal = RestartOrLeaveModal(confirmation)
        else:
            modal = ConfirmModal(confirmation)
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def answered(result: bool | str | None) -> None:
            if result == "leave":  # left down for later: the console goes once the run has recorded its end
                self.app.leave_down_and_quit(after_run=True)
            if not answer.done():
                answer.set_result(result != "leave" and bool(result))

        self.app.post_message(DecisionAsked(confirmation))
        self.asking = confirmation  # (question.json, for the other consoles, is the engine's: its _ask)
        try:
            self.app.make_way_for(modal)  # (never over a quit dialog, to find it again later)
            await self.app.push_screen(modal, callback=answered)
            approved = await answer
        except asyncio.CancelledError:  # the run was cancelled under the question: take it away
            with contextlib.suppress(Exception):  # (the app may be closing: no screen left to pop)
                self._take_away(modal)
            raise
        finally:
            self.asking = None
        self.app.post_message(DecisionAnswered(confirmation, approved))
        return approved

    def _take_away(self, modal: Screen) -> None:
        """The question nobody waits on any more leaves the screen, also from under a quit dialog (which
        goes with it, as "stay": it was asked over that question), never left behind to be answered."""
        if not modal.is_attached or modal not in self.app.screen_stack:
            return
        while self.app.screen is not modal and self.app.screen.id in QUIT_DIALOGS:
            self.app.screen.dismiss(None)
        if self.app.screen is modal:
            modal.dismiss(False)
