"""The Textual console (`dflash-ops console`): it renders what the core publishes on the bus and
calls the core (`console.operator.Operator`); it opens no connection of its own.

    app.py        the shell: bus bridge, workers, error routing, keys, quit rules, `run_app`
    state.py      the newest of every message, folded (no Textual)
    dashboard.py  hosts, service, steps, jobs, events;  widgets/  one module per panel
    decider.py    the engine's questions as modals;     modals/   confirm, holders, error, quit, help
    results.py    a run's tables, charts and window;    runs.py   earlier runs, two side by side
    replay.py     `dflash-ops replay`: the same console over a past run's store, played back
"""
