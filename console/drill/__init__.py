"""The drill: rehearsal hosts on this machine and the assets they serve, for a first run and the end-to-end test.

- `console.drill.assets`: the tiny target, two drafters and the prompt set, built once and cached;
- `console.drill.hosts`: `up(dir) -> config path`, `down(dir)`, `status(dir)` of the rehearsal hosts,
  which run in a background process of their own;
- `console.drill.config`: the config the drill writes; `console.drill.layout`: where everything lives;
- `console.drill.procs`: the processes a drill started, found by the mark in their environment.
"""
