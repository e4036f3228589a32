"""The screens see the console through `screens.window.ConsoleWindow`, not the whole app: the app
provides every member of that window, and the screens use no member of the app outside it (else a
screen would break on a console whose window lacks it, and the window would stop saying what they use)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from screens.app import ConsoleApp
from screens.window import ConsoleWindow
from tests.tui.standin import StandinOperator

ROOT = Path(__file__).resolve().parents[2]
WRITTEN_AGAINST_IT = ("screens/dashboard.py", "screens/decider.py", "screens/plan.py", "screens/results.py",
                      "screens/runs.py")


def members() -> set[str]:
    return {name for name in (*vars(ConsoleWindow), *ConsoleWindow.__annotations__)
            if not name.startswith("_")}


def test_the_console_app_provides_every_member_of_the_screens_window():
    app = ConsoleApp(StandinOperator())
    missing = []
    for name in sorted(members()):
        try:
            inspect.getattr_static(app, name)  # an instance attribute, a method or a property, none run
        except AttributeError:
            missing.append(name)
    assert not missing, f"ConsoleApp lacks {missing} of screens/window.py's ConsoleWindow"


def test_the_screens_use_no_member_of_the_app_outside_their_window():
    used = {}
    for path in WRITTEN_AGAINST_IT:
        text = (ROOT / path).read_text()
        assert "ConsoleWindow" in text and "screens.app" not in text, path
        for name in re.findall(r"\bapp\.([A-Za-z_]\w*)", text):
            used.setdefault(name, path)
    outside = {name: path for name, path in used.items() if name not in members()}
    assert not outside, f"used of the app but not in screens/window.py's ConsoleWindow: {outside}"
