"""`python -m kestrel_bringup.doctor [options]`: the deployment checklist of the stack, the same
as `python -m kestrel_bench doctor` (kestrel_bench/doctor.py lists the checks and options)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from kestrel_bench.__main__ import main as bench_main

    return bench_main(["doctor", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
