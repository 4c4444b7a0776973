#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the Python 3.12 wheels that scripts/device_ros_env.sh installs on
# the GPU machine (which has no network): every ros-* package of this repo's .venv at the same
# version, plus what rosidl's cmake build imports (lark-parser, empy, catkin-pkg + dependencies)
# and the planner's grammar engine (llguidance: abi3 wheel).
# Run here (PyPI reachable), after scripts/setup.sh. ~47 MB; pass `carry: [".whl"]` to the device.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
pip="$root/.venv/bin/pip"
[[ -x "$pip" ]] || { echo "run scripts/setup.sh first" >&2; exit 1; }
mapfile -t ros < <("$pip" freeze | grep '^ros-')
pins=()
for p in catkin-pkg docutils pyparsing python-dateutil packaging six lark-parser llguidance; do
  v="$("$pip" freeze | grep -i "^${p}==" || true)"
  pins+=("${v:-$p}")
done
mkdir -p .whl
"$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${ros[@]}" "${pins[@]}"
ls .whl/empy-4.2.1-*.whl >/dev/null 2>&1 || "$pip" wheel -q --no-deps empy==4.2.1 -w .whl
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
