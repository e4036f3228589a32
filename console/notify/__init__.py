"""Notifications: who shares the window is told when the stop is approved, when the downtime runs
past its forecast, when the server is back, how the run ended and whether it left the server down
(`[notify]` in the config; sent through apprise, off the event loop, journalled)."""

from console.notify.events import Notification, Watcher
from console.notify.notifier import Notifier

__all__ = ["Notification", "Notifier", "Watcher"]
