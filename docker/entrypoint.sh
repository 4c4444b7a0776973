#!/usr/bin/env bash
set -e
source /opt/ros/kilted/setup.bash
source /opt/kestrel/venv/bin/activate
source /opt/kestrel/src/ros2_ws/install/setup.bash
exec "$@"
