#!/usr/bin/env bash
# The device check (tests/gpu/check.py says what it does): `tests/gpu/check.sh` on a GPU host,
# `tests/gpu/check.sh --cpu` on CPU (CI). Runs with the repository's .venv when there is one.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="$repo/.venv/bin/python"
[[ -x "$python" ]] || python="$(command -v python3)"
exec "$python" "$repo/tests/gpu/check.py" "$@"
