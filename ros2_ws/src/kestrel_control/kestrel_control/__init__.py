"""Kestrel real-time learned-policy control node."""
