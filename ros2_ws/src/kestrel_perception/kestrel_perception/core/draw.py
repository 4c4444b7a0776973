"""Debug rendering in numpy: the segmentation mask blended over the camera images, detection
boxes drawn on top, cameras side by side."""

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


def overlay_mask(image: np.ndarray, mask: np.ndarray, stride: int = 0,
                 alpha: float = 0.45) -> None:
    """Blend the class colours of `mask` [Hs,Ws] uint8 (class index; 0 = background, left
    as is) into image [H,W,3] uint8 in place. A mask subsampled by the node's output_stride s
    (Hs = ceil(H/s)) is expanded back by repetition: mask pixel (i, j) covers image pixels
    [s*i, s*i + s) x [s*j, s*j + s). stride 0: inferred from the shapes (exact unless the
    image has fewer rows than about s * s)."""
    h, w = image.shape[:2]
    s = stride if stride > 0 else max(1, -(-h // mask.shape[0]))
    full = mask.repeat(s, 0).repeat(s, 1)[:h, :w] if s > 1 else mask[:h, :w]
    fg = full != 0
    if not fg.any():
        return
    colour = PALETTE[full[fg] % len(PALETTE)].astype(np.float32)
    image[fg] = ((1.0 - alpha) * image[fg] + alpha * colour).astype(np.uint8)


def render_debug(images: list[np.ndarray], detections: list[Detection],
                 thickness: int = 2, masks: list[np.ndarray] | None = None,
                 mask_stride: int = 0) -> np.ndarray:
    """Copies of the camera images [H,W,3] uint8 (same size) with their segmentation masks
    blended in (`masks`: per camera [Hs,Ws] uint8, optional) and their boxes, tiled
    horizontally -> [H, W * cameras, 3] uint8."""
    canvas = np.concatenate([np.asarray(img, dtype=np.uint8) for img in images], axis=1)
    w = images[0].shape[1]
    for cam, mask in enumerate(masks or []):
        overlay_mask(canvas[:, cam * w:(cam + 1) * w], mask, mask_stride)
    for det in detections:
        box = np.asarray(det.box_xyxy, dtype=np.float64).copy()
        box[[0, 2]] += det.camera_index * w
        draw_box(canvas, box, PALETTE[det.class_index % len(PALETTE)], thickness)
    return canvas
