# Source me on the GPU machine (the `device` tool), from the repo root, with carry [".whl"]:
#   source scripts/device_ros_env.sh && "$KPY" -m kestrel_bench <subcommand> ...
# Builds (once per machine start, ~1 min) a Python 3.12 venv with rclpy from the carried ROS 2
# kilted wheels, builds the project's kestrel_interfaces for that Python with plain cmake (the
# colcon build of scripts/setup.sh is for the dev machine's Python 3.11), registers the
# ament_python packages in an ament index, and exports the paths. $KPY is the interpreter to use:
# it sees the machine's own CUDA torch through a .pth file (the torch venv's site-packages).
# The .whl folder (ignored by git) holds `pip download --python-version 3.12` wheels of every
# ros-* package of .venv plus lark-parser, empy and catkin-pkg with its
# pure-Python dependencies (docutils, pyparsing, python-dateutil, packaging, six) (see docs/DEPENDENCIES.md, "GPU machine").
# Why not colcon there: it is not among the carried wheels and one ament_cmake package needs
# only cmake; the ament_python packages need no build (source folders on PYTHONPATH).
_kroot="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KV="${KV:-/tmp/kv}"
KWS="${KWS:-/tmp/kv_ws}"
_klog="${KWS}_build.log"
_kfail() { echo "device_ros_env: $*" >&2; return 1; }
if [[ ! -d "$_kroot/.whl" ]]; then
  _kfail "no .whl folder in $_kroot: copy the .whl folder (scripts/fetch_device_wheels.sh) next to the repository"
elif ! ls "$_kroot/.whl" | cmp -s - "$KV/.kestrel_whl"; then
  echo "device_ros_env: (re)creating $KV from .whl ..." >&2
  rm -rf "$KV" "$KWS"
  python3 -m venv "$KV" && "$KV/bin/pip" install -q --no-index --no-deps "$_kroot"/.whl/*.whl \
    && python3 -c "import sysconfig;print(sysconfig.get_paths()['purelib'])" \
       > "$("$KV/bin/python" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")/zz_torch.pth" \
    && ls "$_kroot/.whl" > "$KV/.kestrel_whl" \
    || _kfail "venv setup failed"
fi
export AMENT_PREFIX_PATH="$KV"
# MuJoCo and Pinocchio from scripts/device_sim_env.sh (the sim and control nodes), when there
_ksim="${KSIM:-/tmp/ksim}"
if [[ -d "$_ksim" ]]; then
  echo "import site; site.addsitedir('$_ksim')" \
    > "$("$KV/bin/python" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")/zz_ksim.pth"
fi
# Fix 2 of ROS2_ON_PIP: the wheels' cmake files name the manylinux build image's Python paths.
_kpyinc="$("$KV/bin/python" -c "import sysconfig;print(sysconfig.get_paths()['include'])")"
_knpinc="$("$KV/bin/python" -c "import numpy;print(numpy.get_include())")"
{ grep -rl --include='*.cmake' '/opt/python' "$KV/share" 2>/dev/null || true; } | while read -r f; do
  sed -i -e "s#/opt/python/cp3[0-9]*-cp3[0-9]*/lib/python3\.[0-9]*/site-packages/numpy/_core/include#$_knpinc#g" \
         -e "s#/opt/python/cp3[0-9]*-cp3[0-9]*/include/python3\.[0-9]*#$_kpyinc#g" "$f"
done
if [[ ! -f "$KWS/.built" ]]; then
  echo "device_ros_env: building kestrel_interfaces for $("$KV/bin/python" -V) (log $_klog) ..." >&2
  [[ -f "$_kpyinc/Python.h" ]] || echo "device_ros_env: warning: no Python.h in $_kpyinc" >&2
  rm -rf "${KWS}_build" "$KWS"
  if cmake -S "$_kroot/ros2_ws/src/kestrel_interfaces" -B "${KWS}_build" \
       -DCMAKE_INSTALL_PREFIX="$KWS" -DBUILD_TESTING=OFF -DCMAKE_PREFIX_PATH="$KV" \
       -DPython3_EXECUTABLE="$KV/bin/python" > "$_klog" 2>&1 \
     && cmake --build "${KWS}_build" -j "$(nproc)" >> "$_klog" 2>&1 \
     && cmake --install "${KWS}_build" >> "$_klog" 2>&1; then
    # ament index entries + share folders for the ament_python packages (launch/config/weights).
    for _kp in "$_kroot"/ros2_ws/src/*/; do
      _kn="$(basename "$_kp")"
      [[ -f "$_kp/setup.py" ]] || continue
      mkdir -p "$KWS/share/ament_index/resource_index/packages" "$KWS/share"
      touch "$KWS/share/ament_index/resource_index/packages/$_kn"
      ln -sfn "$_kp" "$KWS/share/$_kn"
    done
    touch "$KWS/.built"
  else
    tail -30 "$_klog" >&2
    _kfail "kestrel_interfaces build failed (log $_klog)"
  fi
fi
_kpyver="$("$KV/bin/python" -c "import sys;print(f'python{sys.version_info[0]}.{sys.version_info[1]}')")"
export AMENT_PREFIX_PATH="$KWS:$KV"
export LD_LIBRARY_PATH="$KWS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
_kpp="$KWS/lib/$_kpyver/site-packages:$_kroot/models:$_kroot/tools:$_kroot/tests"
for _kp in "$_kroot"/ros2_ws/src/*/; do [[ -f "$_kp/setup.py" ]] && _kpp="$_kpp:${_kp%/}"; done
export PYTHONPATH="$_kpp${PYTHONPATH:+:$PYTHONPATH}"
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST RMW_IMPLEMENTATION=rmw_fastrtps_cpp
export MUJOCO_GL="${MUJOCO_GL:-egl}" PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-egl}"
export KPY="$KV/bin/python" KESTREL_ROOT="$_kroot"
# As scripts/env.sh: the stack's Fast DDS profile for camera-sized samples (without it a
# 1.8 MB PerceptionResult went over UDP fragments on the H200: 13 / 34 ms publish -> callback,
# best effort lost 62 of 100; docs/benchmarks/transport_h200.md)
export FASTDDS_DEFAULT_PROFILES_FILE="${FASTDDS_DEFAULT_PROFILES_FILE:-$_kroot/ros2_ws/src/kestrel_bringup/config/fastdds_large_data.xml}"
unset _kroot _klog _kpyinc _knpinc _kp _kn _kpp _kpyver _ksim
unset -f _kfail
