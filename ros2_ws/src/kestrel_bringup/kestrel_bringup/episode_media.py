"""An evaluation's pictures (no rclpy): the video of an episode from the sim camera with the
plan step written over it, and the bar chart of the outcomes.

write_video(frames, path, fps): frames are (rgb uint8 [H, W, 3], caption) pairs; the caption is
drawn in a band at the top of each frame (matplotlib, Agg); .mp4 through imageio-ffmpeg (the
ffmpeg binary ships in its wheel), .gif through imageio's pillow writer.
plot_summary(summary, path): success and every failure stage as bars (PNG).
write_outputs(summary, command, out, video): an evaluation's record, <out>.json, .png and .md.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np


def _captioned(frames: list[tuple[np.ndarray, str]]) -> list[np.ndarray]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, w = frames[0][0].shape[:2]
    fig = plt.figure(figsize=(w / 100.0, h / 100.0), dpi=100)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_axis_off()
    image = ax.imshow(frames[0][0])
    text = ax.text(0.01, 0.98, "", transform=ax.transAxes, va="top", ha="left", color="white",
                   fontsize=max(6, h // 28),
                   bbox={"facecolor": "black", "alpha": 0.6, "pad": 2, "edgecolor": "none"})
    out = []
    width_chars = max(20, int(w / (0.62 * text.get_fontsize())))  # wrap to the frame width
    try:
        for rgb, caption in frames:
            caption = "\n".join(textwrap.fill(line, width_chars)
                                for line in caption.split("\n"))
            if rgb.shape[:2] != (h, w):
                raise ValueError(f"frame of shape {rgb.shape}: the video is {h}x{w}")
            image.set_data(rgb)
            text.set_text(caption)
            fig.canvas.draw()
            out.append(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy())
    finally:
        plt.close(fig)
    return out


def write_video(frames: list[tuple[np.ndarray, str]], path: str | Path, fps: float = 5.0) -> Path:
    """Write the captioned frames as an MP4 (.mp4) or GIF (.gif). Returns the path."""
    import imageio.v2 as imageio

    if not frames:
        raise ValueError("no frames to write")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = _captioned(frames)
    if path.suffix == ".gif":
        imageio.mimsave(path, images, duration=1.0 / fps, loop=0)
    elif path.suffix == ".mp4":
        # even sizes for yuv420p; macro_block_size 1 keeps the frame size as it is
        images = [im[: im.shape[0] // 2 * 2, : im.shape[1] // 2 * 2] for im in images]
        imageio.mimsave(path, images, fps=fps, codec="libx264", macro_block_size=1,
                        ffmpeg_log_level="error")
    else:
        raise ValueError(f"video '{path}': use a .mp4 or .gif file name")
    return path


def plot_summary(summary: dict, path: str | Path) -> Path:
    """Bar chart of the episodes' outcomes (success and each failure stage), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["success", *summary["failures_by_stage"]]
    counts = [summary["successes"], *summary["failures_by_stage"].values()]
    lo, hi = summary["success_ci95"]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    ax.bar(labels, counts, color=["tab:green"] + ["tab:red"] * (len(labels) - 1))
    ax.set_ylabel("episodes")
    ax.set_title(f"{summary['episodes']} episodes: success {summary['success_rate']:.0%} "
                 f"(95 % CI {lo:.0%}-{hi:.0%})")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(summary: dict, command: str, out: Path, video: Path | None) -> None:
    """<out>.json (the summary), <out>.png (plot_summary) and <out>.md (the report, the plot
    and, when it lies beside them, the video of the first episode)."""
    from kestrel_bringup.evaluation import markdown

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    plot_summary(summary, out.with_suffix(".png"))
    media = ["", f"![outcomes]({out.with_suffix('.png').name})"]
    if video and video.exists() and video.resolve().parent == out.resolve().parent:
        media.append(f"\nThe first episode, from the sim camera: [{video.name}]({video.name})")
    out.with_suffix(".md").write_text(markdown(summary, command) + "\n".join(media) + "\n")
