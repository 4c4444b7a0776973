# Source me: puts the Kestrel venv and the built workspace on this shell's paths.
#   source scripts/env.sh
# Encodes the required fixes for ROS 2 from pip: AMENT_PREFIX_PATH must name the venv (the venv
# is the ROS prefix), and every Python must be the venv's own interpreter.
_kestrel_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kestrel_venv="${KESTREL_VENV:-$_kestrel_root/.venv}"
if [[ ! -x "$_kestrel_venv/bin/python" ]]; then
  echo "Kestrel venv not found at $_kestrel_venv: run scripts/setup.sh first" >&2
  return 1 2>/dev/null || exit 1
fi
set +u
# shellcheck disable=SC1091
source "$_kestrel_venv/bin/activate"
export AMENT_PREFIX_PATH="$_kestrel_venv${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
if [[ -f "$_kestrel_root/ros2_ws/install/setup.bash" ]]; then
  # shellcheck disable=SC1091
  source "$_kestrel_root/ros2_ws/install/setup.bash"
fi
# Never multicast on the host's network; tests and the demo also set their own ROS_DOMAIN_ID.
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
export RMW_IMPLEMENTATION="${RMW_IMPLEMENTATION:-rmw_fastrtps_cpp}"
# Camera-sized samples: Fast DDS's default 512 KB SHM segment loses best-effort 1.2 MB images
# (kestrel_bringup/config/fastdds_large_data.xml); the stack's runner and launch files set the
# same profile for every node.
export FASTDDS_DEFAULT_PROFILES_FILE="${FASTDDS_DEFAULT_PROFILES_FILE:-$_kestrel_root/ros2_ws/src/kestrel_bringup/config/fastdds_large_data.xml}"
# Offscreen rendering on machines without a GPU (set MUJOCO_GL=egl on a GPU machine).
export MUJOCO_GL="${MUJOCO_GL:-osmesa}"
export PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-$MUJOCO_GL}"
export KESTREL_ROOT="$_kestrel_root"
unset _kestrel_root _kestrel_venv
