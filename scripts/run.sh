#!/usr/bin/env bash
# Run a command inside the Kestrel environment (venv + ROS prefix + built workspace).
#   scripts/run.sh python scripts/demo.py --duration 10
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$@"
