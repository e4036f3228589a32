"""Which config a recovery command uses: the one given, else `./dflash-ops.toml`, else the one the
run was made with (its absolute path, recorded in the run store).

During an outage the operator may be in any directory: `run --resume`, `run --discard` and
`status` (when a run left the service down) must not fail on a missing `./dflash-ops.toml` when the
run that matters says which config it was made with. They say which config they use.

A config that is missing while a drill is up (`dflash-ops drill up`) is said with the drill's config
named, to pass with `--config`: after the drill, in a fresh directory, the example `config init`
writes is not what the operator is after. It is named, never used unasked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from console.config import DEFAULT_CONFIG_NAME, Config, ConfigError, load_config
from console.procedure.store import Run


def config_for(given: str | None, run: Run | None, say: Callable[[str], None]) -> Config:
    """The config to use: `given` when it names a file that exists or when no run recorded one (a
    missing file is then the usual one-line error), else the run's recorded config, said on `say`."""
    path = Path(given or DEFAULT_CONFIG_NAME)
    recorded = run.state.config if run is not None else None
    if path.exists() or not recorded or (given not in (None, DEFAULT_CONFIG_NAME)):
        return load_pointing_to_drill(path)
    say(f"using the config of run {run.run_id}: {recorded} (recorded by the run; ./{DEFAULT_CONFIG_NAME} is not here)")
    return load_config(recorded)


def load_pointing_to_drill(path: str | Path) -> Config:
    """`load_config(path)`; a missing file, while a drill is up, is said naming the drill's config."""
    try:
        return load_config(path)
    except ConfigError as exc:
        if Path(path).exists():
            raise
        from console.drill.hosts import running_config  # only when the file is missing: it imports asyncssh

        drill = running_config()
        if drill is None or Path(path).resolve() == drill.resolve():
            raise
        raise ConfigError(f"{path}: no such file; a drill is up, its config is {drill} (`--config {drill}`), "
                          f"or write an example with `dflash-ops config init {path}`", file=exc.file) from None
