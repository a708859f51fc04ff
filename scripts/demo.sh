#!/usr/bin/env bash
# Set up a virtual environment (CPU torch, pinned) and run the example: train, SIGKILL, resume, compare.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CKPT_ENGINE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
exec "$VENV/bin/python" examples/train_resume.py "$@"
