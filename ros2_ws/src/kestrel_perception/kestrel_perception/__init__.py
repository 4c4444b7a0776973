"""Kestrel camera+LiDAR multi-task perception node."""
