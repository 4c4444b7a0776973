#!/usr/bin/env bash
# Fill .whl_sim/ and .gl/ (git-ignored) with what the whole stack needs on a GPU machine without
# network beyond scripts/fetch_device_wheels.sh (the ROS wheels): MuJoCo, glfw and PyOpenGL
# wheels for Python 3.12; Pinocchio for Python 3.12 (the control node's kinematics) as one
# trimmed tarball; and the EGL loader packages (libegl1 & co) for MuJoCo's GPU rendering.
# Why a tarball: Pinocchio's wheels (pin, coal, eigenpy and their cmeel-* libraries) are ~81 MB,
# over half of it C++ headers, static libraries and Boost libraries nothing links; without them
# it is ~19 MB, small enough to copy along with the ROS wheels in one go.
# Run here (PyPI and Debian reachable) after scripts/setup.sh. On the GPU machine:
#   bash scripts/device_sim_env.sh        # with .whl_sim and .gl copied along
#   source scripts/device_ros_env.sh      # with .whl copied along: puts $KSIM on its path
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
pip="$root/.venv/bin/pip"
[[ -x "$pip" ]] || { echo "run scripts/setup.sh first" >&2; exit 1; }
ver() { "$pip" freeze | grep -i "^$1==" | cut -d= -f3; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# pinocchio with its dependencies (those the GPU machine has, numpy & co, are left out below)
"$pip" download -q "${plat[@]}" -d "$tmp/pin" "pin==$(ver pin)" 2>&1 | { grep -v "is ignored" || true; }
mkdir -p "$tmp/site"
for w in "$tmp"/pin/{cmeel,coal,eigenpy,libcoal,libpinocchio,pin}*.whl; do
  python3 -m zipfile -e "$w" "$tmp/site"
done
lib="$tmp/site/cmeel.prefix/lib"
rm -rf "$tmp/site/cmeel.prefix/"{include,bin,share} "$tmp"/site/*.data
find "$tmp/site/cmeel.prefix" \( -name '*.a' -o -name cmake -o -name pkgconfig \) -prune -exec rm -rf {} +
# keep the libraries the Python extensions need (ldd, transitively); drop the rest
python3 - "$lib" <<'PY'
import glob, os, subprocess, sys
lib = os.path.abspath(sys.argv[1])
env = dict(os.environ, LD_LIBRARY_PATH=lib)
need, todo = set(), glob.glob(f"{lib}/python3.12/**/*.so", recursive=True)
while todo:
    out = subprocess.run(["ldd", todo.pop()], capture_output=True, text=True, env=env).stdout
    for line in out.splitlines():
        if "=>" in line and lib in line:
            name = line.split("=>")[0].strip()
            if name not in need:
                need.add(name)
                todo.append(os.path.join(lib, name))
for f in os.listdir(lib):
    if os.path.isfile(os.path.join(lib, f)) and f not in need:
        os.remove(os.path.join(lib, f))
PY
rm -rf .whl_sim && mkdir -p .whl_sim
tar cJf .whl_sim/pinocchio_py312.tar.xz -C "$tmp/site" .
"$pip" download -q --no-deps "${plat[@]}" -d .whl_sim "mujoco==$(ver mujoco)" "glfw==$(ver glfw)" \
  "pyopengl==$(ver pyopengl)" 2>&1 | { grep -v "is ignored" || true; }
# EGL loaders (the GPU machine's image has the NVIDIA driver's EGL, not libglvnd's loader)
rm -rf .gl && mkdir -p .gl "$tmp/apt/partial"
o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$tmp/apt")
apt-get "${o[@]}" update -qq >/dev/null
(cd .gl && apt-get "${o[@]}" download -qq libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 2>/dev/null)
echo "$(ls .whl_sim | wc -l) files, $(du -sh .whl_sim | cut -f1) in .whl_sim/; $(ls .gl | wc -l) packages in .gl/"
