"""Which config a recovery command uses: the one given, else `./dflash-ops.toml`, else the one the
run was made with (its absolute path, recorded in the run store).

During an outage the operator may be in any directory: `run --resume`, `run --discard` and
`status` (when a run left the service down) must not fail on a missing `./dflash-ops.toml` when the
run that matters says which config it was made with. They say which config they use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from console.config import DEFAULT_CONFIG_NAME, Config, load_config
from console.procedure.store import Run


def config_for(given: str | None, run: Run | None, say: Callable[[str], None]) -> Config:
    """The config to use: `given` when it names a file that exists or when no run recorded one (a
    missing file is then the usual one-line error), else the run's recorded config, said on `say`."""
    path = Path(given or DEFAULT_CONFIG_NAME)
    recorded = run.state.config if run is not None else None
    if path.exists() or not recorded or (given not in (None, DEFAULT_CONFIG_NAME)):
        return load_config(path)
    say(f"using the config of run {run.run_id}: {recorded} (recorded by the run; ./{DEFAULT_CONFIG_NAME} is not here)")
    return load_config(recorded)
