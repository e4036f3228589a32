"""`python -m console.cli ARGS`: `dflash-ops ARGS` where the console script is not on PATH (each
browser's console that `dflash-ops serve` starts runs so, with this interpreter)."""

import sys

from console.cli.main import main

sys.exit(main())
