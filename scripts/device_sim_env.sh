#!/usr/bin/env bash
# Run on the GPU machine (no network), from the repo root, with .whl_sim and .gl copied along
# (scripts/fetch_device_sim.sh): the EGL loader packages unpacked into / (MuJoCo renders the sim
# camera through EGL there), MuJoCo and Pinocchio for the machine's Python 3.12 into $KSIM
# (default /tmp/ksim). scripts/device_ros_env.sh then puts $KSIM on its venv's path.
set -euo pipefail
KSIM="${KSIM:-/tmp/ksim}"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
mkdir -p "$KSIM"
tar xJf .whl_sim/pinocchio_py312.tar.xz -C "$KSIM"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$KSIM" .whl_sim/*.whl
MUJOCO_GL=egl PYOPENGL_PLATFORM=egl python3 - "$KSIM" <<'PY'
import site, sys
site.addsitedir(sys.argv[1])  # (its cmeel.pth adds Pinocchio's prefix)
import mujoco, pinocchio
m = mujoco.MjModel.from_xml_string("<mujoco><worldbody><light/><geom size='.1'/></worldbody></mujoco>")
r, d = mujoco.Renderer(m, 32, 32), mujoco.MjData(m)
mujoco.mj_forward(m, d)
r.update_scene(d)
r.render()
r.close()
print(f"device_sim_env: mujoco {mujoco.__version__} (EGL rendering works), pinocchio {pinocchio.__version__} in {sys.argv[1]}")
PY
