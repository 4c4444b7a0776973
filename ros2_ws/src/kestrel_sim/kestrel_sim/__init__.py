"""Kestrel embedded MuJoCo simulator: clock, camera, LiDAR, joint states, ground truth."""
