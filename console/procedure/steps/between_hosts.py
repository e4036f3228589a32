"""Data between hosts through the console: content-addressed, sha256-verified copies with progress."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from console.messages import JobProgress

if TYPE_CHECKING:
    from console.procedure.engine import Engine


async def relay_file(engine: Engine, src: str, src_path: str, dst: str, dst_path: str, step: str) -> None:
    await engine._connected(src, step)
    await engine._connected(dst, step)
    await engine.hosts.relay_file(src, src_path, dst, dst_path, relay_progress(engine, step))


async def relay_tree(engine: Engine, src: str, src_path: str, dst: str, step: str) -> str:
    """Copy directory `src_path` from host `src` to host `dst` through the console, content-addressed
    (an unchanged tree is not sent twice) and sha256-verified; returns its path on `dst`."""
    await engine._connected(src, step)
    await engine._connected(dst, step)
    path, sent = await engine.hosts.relay_tree(src, src_path, dst, relay_progress(engine, step))
    engine.journal(step, f"{src}:{src_path} -> {dst}:{path} ({'sent ' + str(sent) + ' bytes' if sent else 'already there'})")
    return path


async def relay_heads(engine: Engine, source: str, model_path: str, dst: str) -> str:
    """The target's embed_tokens/lm_head on the eval host (exported once where the weights are)."""
    heads = f"{await engine._window_dir(source)}/target-heads"
    await engine.hosts.export_heads(source, model_path, heads)
    return await relay_tree(engine, source, heads, dst, "evaluate")


def relay_progress(engine: Engine, step: str) -> Callable[[int, int], None]:
    def progress(done: int, total: int) -> None:
        engine.bus.publish(relay_message(engine.run.run_id, step, done, total))
    return progress


def relay_message(run_id: str, step: str, done: int, total: int) -> JobProgress:
    """Progress of a copy between hosts through the console, shown like a job's."""
    return JobProgress(job_id=f"{run_id}-relay-{step}", worker="relay", host="console", done=done, total=total,
                       unit="bytes", phase=step, message="copying between hosts", key="relay")
