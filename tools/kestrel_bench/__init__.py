"""Kestrel's benchmark harness: one CLI (`python -m kestrel_bench <subcommand>`), one result
record (kestrel_bench.record), one markdown renderer, and the methodology around them: the
bottleneck identifier (profile), the regression gate (gate), the deployment checklist (doctor)
and the report with plots (report)."""
