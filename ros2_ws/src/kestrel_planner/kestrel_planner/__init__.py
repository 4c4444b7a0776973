"""Kestrel vision-language task planner node (PlanTask action)."""
