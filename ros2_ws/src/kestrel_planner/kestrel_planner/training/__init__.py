"""Training data and training of the planner VLM on generated (image, scene objects,
instruction) -> plan pairs (no rclpy). scripts/train_planner.py is the command line."""
