#!/usr/bin/env bash
# Fetch, on a machine with a registry, the wheels the GPU suite's window stage needs on the device
# (which reaches no registry): the console and the drill's Python packages that its image lacks.
# They land in .whl/ (git-ignored), which `run` carries; bench/gpu_suite.sh installs them into
# /tmp/site before anything else. The device image already holds torch, transformers, rich, pytest,
# pytest-timeout, aiohttp, jinja2, requests, pyyaml (the device README); rich and its markdown and
# highlighting are carried at the versions textual was tested with. FastAPI, uvicorn and their
# dependencies serve the rehearsal server's HTTP front (remote/drill/standin) as SGLang serves its own.
#   bash bench/device-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# Versions as this project's own venv resolved them, so the device runs what CI tested.
pins() { .venv/bin/python -m pip freeze 2>/dev/null | grep -i -E "^($1)==" ; }
names='rich|markdown-it-py|mdurl|Pygments|uc-micro-py|textual|textual-plotext|plotext|asyncssh|cryptography|cffi|pycparser|platformdirs|pydantic|pydantic-core|pydantic_core|annotated-types|typing-inspection|typing_extensions|prompt_toolkit|prompt-toolkit|wcwidth|mdit-py-plugins|linkify-it-py|uc-micro-py|pytest-asyncio|apprise|textual-serve|aiohttp-jinja2|requests-oauthlib|oauthlib|fastapi|starlette|uvicorn|anyio|h11|click|idna|annotated-doc|opentelemetry-api'
pins "$names" | while read -r pin; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_34_x86_64 -d .whl "$pin"
done
ls .whl
