"""The extraction as it stands on its host, read by every step that waits on it: the worker's
arguments, the console's lease on a staged worker, and whether its states are complete. Its own
module so that the steps around the extraction (stage, stop, restart, resume) read it without
importing the extract step, which begins their work at `gpu_released`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from console.procedure.window import Window


STAGE_LEASE_S = 600.0  # a staged worker whose console has not renewed its lease for this long ends itself
LEASE_RENEW_S = 30.0  # the console renews it this often while it runs


def extract_args(window: Window, window_dir: str, staged: bool) -> list[str]:
    target = window.config.target
    args = ["--model", target.model_path, "--completions", f"{window_dir}/completions.json",
            "--out", f"{window_dir}/states", "--layers", ",".join(map(str, window.facts.layers)),
            "--kernels", target.kernels]
    args += ["--stop-file", f"{window_dir}/stop"]  # the operator's stop at the budget
    if staged:  # the console's lease on it (steps/serving.py: keep_lease): it ends itself once the console is gone
        args += ["--staged", "--go-file", f"{window_dir}/go", "--lease-file", f"{window_dir}/lease",
                 "--lease-s", f"{STAGE_LEASE_S:g}"]
    return args


async def extraction_complete(window: Window) -> bool:
    """The states' manifest on the extraction host is complete and its files match their sha256."""
    if window.state.extraction.complete:
        return True
    record = window.state.jobs.get("extract")
    if record is None:
        return False
    if window.state.extraction.begun_at is None and "staged" in record.events_seen:
        return False  # a staged extractor writes nothing before its go, and the go is recorded before it is sent
    host_name, _ = window.extract_host()
    wdir = await window.dir_on(host_name)
    if await window.hosts.manifest_complete(host_name, f"{wdir}/states"):
        window.state.extraction.complete = True
        window.run.save()
        return True
    return False
