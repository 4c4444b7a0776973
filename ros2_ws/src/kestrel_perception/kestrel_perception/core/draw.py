"""Debug rendering in numpy: detection boxes drawn on the camera images, cameras side by side."""

from __future__ import annotations

import numpy as np

from .types import Detection

# one RGB colour per class index (cycled)
PALETTE = np.array([
    (128, 128, 128), (255, 160, 0), (230, 25, 25), (25, 200, 25), (40, 80, 255),
    (200, 0, 200), (0, 220, 220), (255, 255, 0), (255, 255, 255),
], dtype=np.uint8)


def draw_box(image: np.ndarray, box_xyxy: np.ndarray, color: np.ndarray,
             thickness: int = 2) -> None:
    """Draw the outline of an xyxy px box in place on image [H,W,3] uint8 (clipped)."""
    h, w = image.shape[:2]
    x1, y1, x2, y2 = (int(round(float(v))) for v in box_xyxy)
    x1, x2 = max(0, min(x1, w - 1)), max(0, min(x2, w - 1))
    y1, y2 = max(0, min(y1, h - 1)), max(0, min(y2, h - 1))
    if x2 < x1 or y2 < y1:
        return
    t = max(1, thickness)
    image[y1:min(y1 + t, y2 + 1), x1:x2 + 1] = color
    image[max(y2 - t + 1, y1):y2 + 1, x1:x2 + 1] = color
    image[y1:y2 + 1, x1:min(x1 + t, x2 + 1)] = color
    image[y1:y2 + 1, max(x2 - t + 1, x1):x2 + 1] = color


def render_debug(images: list[np.ndarray], detections: list[Detection],
                 thickness: int = 2) -> np.ndarray:
    """Copies of the camera images [H,W,3] uint8 (same size) with their boxes, tiled
    horizontally -> [H, W * cameras, 3] uint8."""
    canvas = np.concatenate([np.asarray(img, dtype=np.uint8) for img in images], axis=1)
    w = images[0].shape[1]
    for det in detections:
        box = np.asarray(det.box_xyxy, dtype=np.float64).copy()
        box[[0, 2]] += det.camera_index * w
        draw_box(canvas, box, PALETTE[det.class_index % len(PALETTE)], thickness)
    return canvas
