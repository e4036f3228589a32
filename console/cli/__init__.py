"""The `dflash-ops` command line: `main` parses and dispatches; one module per command."""

from console.cli.main import main

__all__ = ["main"]
