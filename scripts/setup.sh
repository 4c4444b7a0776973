#!/usr/bin/env bash
# Kestrel setup: one idempotent script that takes a fresh Debian 12 machine (root, Python 3.11,
# no ROS distro) to a built workspace. A second run only checks and returns in a few seconds.
#
#   scripts/setup.sh            # venv + Python deps + ROS wheel fixes + colcon build
#   KESTREL_VENV=/path ...      # use another venv location (default: .venv in the repo)
#
# Steps (each skipped when already done):
#   1. system packages (Debian): OSMesa for offscreen MuJoCo rendering, cmake, a C++ compiler
#   2. venv with pinned versions (requirements/base.txt + requirements/constraints.txt)
#   3. the three fixes of the ROS 2 pip wheels (see docs/ROS2_ON_PIP.md)
#   4. pip install -e models/ tools/ (kestrel_models, kestrel_bench)
#   5. colcon build of ros2_ws (skipped when no source changed since the last build)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KESTREL_VENV:-$ROOT/.venv}"
PY="${KESTREL_PYTHON:-python3}"
STAMP_DIR="$VENV/.kestrel"
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] ERROR:\033[0m %s\n' "$*" >&2; exit 1; }

t0=$(date +%s)

# ---- 1. system packages -------------------------------------------------------------------
need_apt=()
for pkg in libosmesa6 libgl1-mesa-dri cmake g++ make; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  if [[ $(id -u) -ne 0 ]] && ! command -v sudo >/dev/null; then
    die "missing Debian packages: ${need_apt[*]}. Install them as root: apt-get install -y ${need_apt[*]}"
  fi
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  say "installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null \
    || die "apt-get install ${need_apt[*]} failed"
else
  say "Debian packages present (libosmesa6 libgl1-mesa-dri cmake g++ make)"
fi

"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null \
  || die "Python 3.11 is required (the ROS 2 kilted wheels are cp311); found: $("$PY" --version 2>&1)"

# ---- 2. venv + pinned Python packages -----------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
mkdir -p "$STAMP_DIR"
req_hash=$(cat "$ROOT/requirements/base.txt" "$ROOT/requirements/constraints.txt" "$ROOT/models/pyproject.toml" | sha256sum | cut -c1-16)
if [[ "$(cat "$STAMP_DIR/req" 2>/dev/null)" != "$req_hash" ]]; then
  say "installing pinned Python packages (torch 2.13.0 CPU, ROS 2 kilted wheels, colcon, mujoco) ..."
  # --no-compile, then compileall on every core: the same .pyc files that pip writes on one
  "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check \
    -r "$ROOT/requirements/base.txt" -c "$ROOT/requirements/constraints.txt" \
    2>&1 | { grep -v "is ignored: it is neither" || true; }; [[ ${PIPESTATUS[0]} -eq 0 ]] || die "pip install failed (see above)"
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # as pip's own compile step, a file that does not compile (templates, other Pythons' tests)
  # is skipped; processes that import it compile it themselves
  "$VENV/bin/python" -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -e "$ROOT/models" -e "$ROOT/tools" || die "pip install -e models tools failed"
  echo "$req_hash" > "$STAMP_DIR/req"
  rm -f "$STAMP_DIR/fixed"
else
  say "Python packages up to date"
fi

# ---- 3. the fixes for ROS 2 from pip ------------------------------------------------------
# Fix 1 (AMENT_PREFIX_PATH=$VIRTUAL_ENV) and fix 3 (run the venv's own interpreter) live in
# scripts/env.sh. Fix 2: the wheels' exported cmake files hard-code the manylinux build image's
# Python and numpy include dirs; point them at this venv's.
if [[ ! -f "$STAMP_DIR/fixed" ]]; then
  py_inc=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  np_inc=$("$VENV/bin/python" -c "import numpy; print(numpy.get_include())")
  say "rewriting /opt/python paths in the ROS cmake files -> $py_inc, $np_inc"
  { grep -rl --include='*.cmake' '/opt/python' "$VENV/share" 2>/dev/null || true; } | while read -r f; do
    sed -i -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#$np_inc#g" \
           -e "s#/opt/python/cp311-cp311/include/python3.11#$py_inc#g" "$f"
  done
  left=$(grep -rl --include='*.cmake' '/opt/python' "$VENV/share" 2>/dev/null || true)
  [[ -z "$left" ]] || die "cmake files still reference /opt/python: $left"
  touch "$STAMP_DIR/fixed"
fi

# ---- 4/5. colcon build --------------------------------------------------------------------
src_hash=$(cd "$ROOT/ros2_ws" && find src -type f \( -name '*.msg' -o -name '*.srv' -o -name '*.action' \
  -o -name 'CMakeLists.txt' -o -name 'package.xml' -o -name 'setup.py' -o -name 'setup.cfg' \
  -o -path '*/launch/*' -o -path '*/config/*' -o -path '*/resource/*' -o -path '*/weights/*' \) -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [[ "$(cat "$ROOT/ros2_ws/.kestrel_build" 2>/dev/null)" != "$src_hash" || ! -f "$ROOT/ros2_ws/install/setup.bash" ]]; then
  say "colcon build (ros2_ws) ..."
  (
    set +u
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
    export AMENT_PREFIX_PATH="$VENV" PYTHONWARNINGS=ignore
    cd "$ROOT/ros2_ws"
    colcon --log-base log build --symlink-install --event-handlers console_cohesion- summary+ \
      --cmake-args -DBUILD_TESTING=OFF -DPython3_EXECUTABLE="$VENV/bin/python" 2>&1 | tail -n 25
    exit "${PIPESTATUS[0]}"
  ) || die "colcon build failed (log: ros2_ws/log/latest_build)"
  echo "$src_hash" > "$ROOT/ros2_ws/.kestrel_build"
else
  say "ros2_ws build up to date"
fi

say "done in $(( $(date +%s) - t0 )) s. Use: source scripts/env.sh"
