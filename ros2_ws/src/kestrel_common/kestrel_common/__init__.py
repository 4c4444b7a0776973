"""Shared pieces of the Kestrel node shells: parameter specs, counters, message
conversions, the lifecycle node base."""
