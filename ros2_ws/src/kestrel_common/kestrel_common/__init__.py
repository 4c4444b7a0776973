"""Shared pieces of the Kestrel node shells: parameter specs, counters, message conversions, lifecycle node base."""
