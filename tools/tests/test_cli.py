"""`python -m kestrel_bench`: every registered subcommand parses `--help` (its module imports
without torch or rclpy at module level), and an unknown one is refused."""

from __future__ import annotations

import pytest
from kestrel_bench.__main__ import SUBCOMMANDS, main


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert f"kestrel_bench {name}" in capsys.readouterr().out


def test_benchmarks_are_registered_and_unknown_is_refused() -> None:
    assert {"control", "perception", "perception-node", "transport", "planner",
            "kernels"} <= set(SUBCOMMANDS)
    with pytest.raises(SystemExit) as exc:
        main(["no-such-benchmark"])
    assert exc.value.code == 2
