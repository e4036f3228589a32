"""The session core: live connections and the message bus that every view shares."""

from console.session.bus import MessageBus, Subscription
from console.session.session import SIMULATED_GPU_FILE, Session, service_name

__all__ = ["SIMULATED_GPU_FILE", "MessageBus", "Session", "Subscription", "service_name"]
