"""Data between hosts through the console: content-addressed, sha256-verified copies with progress."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from console.messages import JobProgress

if TYPE_CHECKING:
    from console.procedure.window import Window


async def relay_file(window: Window, src: str, src_path: str, dst: str, dst_path: str, step: str) -> None:
    await window.connected(src, step)
    await window.connected(dst, step)
    await window.hosts.relay_file(src, src_path, dst, dst_path, relay_progress(window, step))


async def relay_tree(window: Window, src: str, src_path: str, dst: str, step: str) -> str:
    """Copy directory `src_path` from host `src` to host `dst` through the console, content-addressed
    (an unchanged tree is not sent twice) and sha256-verified; returns its path on `dst`."""
    await window.connected(src, step)
    await window.connected(dst, step)
    path, sent = await window.hosts.relay_tree(src, src_path, dst, relay_progress(window, step))
    window.journal(step, f"{src}:{src_path} -> {dst}:{path} ({'sent ' + str(sent) + ' bytes' if sent else 'already there'})")
    return path


async def relay_heads(window: Window, source: str, model_path: str, dst: str) -> str:
    """The target's embed_tokens/lm_head on the eval host (exported once where the weights are)."""
    heads = f"{await window.dir_on(source)}/target-heads"
    await window.hosts.export_heads(source, model_path, heads)
    return await relay_tree(window, source, heads, dst, "evaluate")


def relay_progress(window: Window, step: str) -> Callable[[int, int], None]:
    def progress(done: int, total: int) -> None:
        window.bus.publish(relay_message(window.run.run_id, step, done, total))
    return progress


def relay_message(run_id: str, step: str, done: int, total: int) -> JobProgress:
    """Progress of a copy between hosts through the console, shown like a job's."""
    return JobProgress(job_id=f"{run_id}-relay-{step}", worker="relay", host="console", done=done, total=total,
                       unit="bytes", phase=step, message="copying between hosts", key="relay")
