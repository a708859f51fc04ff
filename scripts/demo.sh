#!/usr/bin/env bash
# The README's first command: set up a virtual environment (CPU torch, pinned) and run
# `ckpt-engine demo`: train, SIGKILL in the middle of a save, resume, compare the losses.
# Arguments go to the demo, e.g. `bash scripts/demo.sh --fast` or `bash scripts/demo.sh --ranks 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CKPT_ENGINE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# The engine and [demo] (matplotlib, for the plot): what the demo imports, with --ranks 2 too
# (tests/project/test_demo.py runs it with the [test] extra's packages hidden). The test tools
# are for .ci/run, which installs [test] into its own .venv-ci.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[demo]"
exec "$VENV/bin/ckpt-engine" demo "$@"
