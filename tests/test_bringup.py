"""The stack table, parameter files and launch files agree with each other (no ROS needed)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import yaml

from kestrel_bringup.stack import NODE_NAMES, STACK, entry, ros_args
from kestrel_common.base_node import BASE_SPECS
from kestrel_common.params import check_known_names, validate_params

BRINGUP = Path(__file__).resolve().parents[1] / "ros2_ws" / "src" / "kestrel_bringup"


def test_every_node_has_a_params_file_keyed_by_its_name():
    for e in STACK:
        data = yaml.safe_load((BRINGUP / "config" / e.params_file).read_text())
        assert list(data) == [e.name], f"{e.params_file} must hold exactly the '{e.name}' key"
        params = data[e.name]["ros__parameters"]
        assert params.get("autostart") is True, f"{e.params_file}: autostart must be true"


def test_params_files_name_only_declared_parameters_with_valid_values():
    """A misspelt key in a params file would be ignored by ROS (the node keeps the default);
    the nodes now fail configure on it, and this catches it before any node runs."""
    for e in STACK:
        specs = list(BASE_SPECS) + list(importlib.import_module(e.module).SPECS)
        given = yaml.safe_load((BRINGUP / "config" / e.params_file).read_text())
        given = given[e.name]["ros__parameters"]
        check_known_names([s.name for s in specs], given)
        validate_params(specs, given)


def test_every_consumed_topic_has_a_producer():
    produced = {dst for e in STACK for src, dst in e.remappings if "/output/" in src}
    for e in STACK:
        for src, dst in e.remappings:
            if "/input/" in src:
                assert dst in produced, f"{e.name} reads {dst}, which no node publishes"


def test_ros_args_carry_name_params_sim_time_and_remaps():
    args = ros_args(entry("control"))
    assert args[:3] == ["--ros-args", "-r", "__node:=control"]
    assert "use_sim_time:=true" in args
    assert "~/output/joint_command:=/control/joint_command" in args
    assert "use_sim_time:=false" in ros_args(entry("sim"))


def test_launch_files_parse_and_use_the_table():
    launch_dir = BRINGUP / "launch"
    names = {p.name for p in launch_dir.glob("*.launch.py")}
    assert names == {"stack.launch.py"} | {f"{n}.launch.py" for n in NODE_NAMES}
    for path in launch_dir.glob("*.launch.py"):
        tree = ast.parse(path.read_text())
        funcs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert "generate_launch_description" in funcs, path.name


def test_installed_console_scripts_match_the_table():
    for e in STACK:
        setup_py = (BRINGUP.parent / e.package / "setup.py").read_text()
        assert f"'{e.executable} = {e.module}:main'" in setup_py, e.package


def test_stack_processes_get_the_large_data_dds_profile():
    """Every node of the stack runs with the Fast DDS large-data profile unless the user names
    one; the profile is a valid Fast DDS XML whose SHM segment holds a 640x640 rgb8 image."""
    import xml.etree.ElementTree as ET

    from kestrel_bringup.stack import dds_environment
    env = dds_environment({"RMW_IMPLEMENTATION": "rmw_fastrtps_cpp"})
    path = Path(env["FASTDDS_DEFAULT_PROFILES_FILE"])
    assert path.is_file()
    ns = {"d": "http://www.eprosima.com"}
    seg = ET.parse(path).getroot().find(".//d:transport_descriptor/d:segment_size", ns)
    assert seg is not None and int(seg.text) > 640 * 640 * 3 * 6  # six cameras in flight
    assert dds_environment({"FASTDDS_DEFAULT_PROFILES_FILE": "/mine.xml"}) == {}
    assert dds_environment({"RMW_IMPLEMENTATION": "rmw_cyclonedds_cpp"}) == {}
    from kestrel_bringup.run_stack import StackRunner
    assert StackRunner(env={"PATH": "/usr/bin"}).env["FASTDDS_DEFAULT_PROFILES_FILE"] == str(path)
