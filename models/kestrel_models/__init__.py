"""Kestrel models: PyTorch models, inference runtimes and export. Never imports rclpy."""

__version__ = "0.1.0"
