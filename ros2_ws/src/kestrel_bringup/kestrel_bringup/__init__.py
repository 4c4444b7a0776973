"""Kestrel launch files, parameter files and the launch-free stack runner."""
