"""Detection decoding (FCOS) and class-wise NMS, in torch (no torchvision)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import DET_STRIDES


@dataclass
class ImageDetections:
    """Detections of one image, sorted by descending score."""

    boxes: torch.Tensor  # [K, 4] float32, xyxy px, clipped to the image
    scores: torch.Tensor  # [K] float32 in [0, 1]
    classes: torch.Tensor  # [K] int64 class indices (logit channel + class_offset)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of xyxy boxes a [N,4] and b [M,4] -> [N, M]."""
    ax1, ay1, ax2, ay2 = (c[:, None] for c in a.unbind(dim=1))  # each [N,1]
    bx1, by1, bx2, by2 = (c[None, :] for c in b.unbind(dim=1))  # each [1,M]
    area_a = (ax2 - ax1).clamp(min=0) * (ay2 - ay1).clamp(min=0)  # [N,1]
    area_b = (bx2 - bx1).clamp(min=0) * (by2 - by1).clamp(min=0)  # [1,M]
    iw = (torch.minimum(ax2, bx2) - torch.maximum(ax1, bx1)).clamp_(min=0)  # [N,M]
    ih = (torch.minimum(ay2, by2) - torch.maximum(ay1, by1)).clamp_(min=0)
    inter = iw.mul_(ih)
    return inter / (area_a + area_b - inter).clamp_(min=1e-9)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_thr: float) -> torch.Tensor:
    """Exact greedy NMS. boxes [N,4] xyxy, scores [N] -> kept indices [K], by descending score.

    Matrix form: with boxes sorted by score, box j survives iff no *surviving* box i < j has
    IoU(i, j) > iou_thr. That triangular system is solved by fixed-point iteration from
    "all kept": after t rounds the first t entries are final, and it usually converges in a
    few rounds (the length of the longest suppression chain), each one [N,N] bool op.
    """
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    order = torch.argsort(scores, descending=True)
    b = boxes[order]
    n = b.shape[0]
    # suppress[i, j]: i ranks before j and overlaps it
    suppress = (box_iou(b, b) > iou_thr).triu_(diagonal=1)
    keep = torch.ones(n, dtype=torch.bool, device=b.device)
    for _ in range(n):
        new_keep = ~(suppress & keep[:, None]).any(dim=0)
        if torch.equal(new_keep, keep):
            break
        keep = new_keep
    return order[keep]


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
                iou_thr: float) -> torch.Tensor:
    """Class-wise NMS with the offset trick: boxes of different classes are shifted apart by
    more than the largest coordinate, so they never overlap. Returns kept indices [K]."""
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    offset = classes.to(boxes.dtype) * (boxes.max() + 1.0)
    return nms(boxes + offset[:, None], scores, iou_thr)


def level_points(h: int, w: int, stride: int, device: torch.device) -> torch.Tensor:
    """Locations of a feature map in input px: [h*w, 2] (x, y), FCOS convention s//2 + i*s."""
    ys = torch.arange(h, device=device, dtype=torch.float32) * stride + stride // 2
    xs = torch.arange(w, device=device, dtype=torch.float32) * stride + stride // 2
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=1)


def decode_detections(raw: dict, image_size: tuple[int, int], score_thr: float,
                      iou_thr: float, max_det: int, *, pre_nms_top_k: int = 1000,
                      class_offset: int = 0, strides: tuple[int, ...] = DET_STRIDES
                      ) -> list[ImageDetections]:
    """Decode the raw FCOS outputs of `MultiTaskPerceptionModel` into per-image detections.

    raw: {"det_cls", "det_ltrb", "det_ctr"} lists over levels (see the model's docstring).
    image_size: (H, W) px of the un-padded input; boxes are clipped to it and locations in
    the padding are ignored. score = sqrt(sigmoid(cls) * sigmoid(ctr)) (FCOS). Per level the
    top `pre_nms_top_k` (location, class) pairs above `score_thr` are kept (and again over all
    levels), then class-wise NMS at `iou_thr` and the best `max_det`.
    class index = logit channel + class_offset.
    """
    h_img, w_img = image_size
    cls_l, ltrb_l, ctr_l = raw["det_cls"], raw["det_ltrb"], raw["det_ctr"]
    batch = cls_l[0].shape[0]
    device = cls_l[0].device
    cands: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in
                                                                         range(batch)]
    for cls, ltrb, ctr, stride in zip(cls_l, ltrb_l, ctr_l, strides, strict=True):
        _, nc, h, w = cls.shape
        pts = level_points(h, w, stride, device)  # [HW, 2] px
        inside = (pts[:, 0] < w_img) & (pts[:, 1] < h_img)  # [HW]
        # [B, HW, C] scores; [B, HW, 4] distances
        score = torch.sqrt(torch.sigmoid(cls.float()) * torch.sigmoid(ctr.float()))
        score = score.flatten(2).transpose(1, 2)
        score = score * inside[None, :, None]
        dist = ltrb.float().flatten(2).transpose(1, 2)
        for b in range(batch):
            flat = score[b].reshape(-1)  # [HW * C], index = loc * C + class
            k = min(pre_nms_top_k, flat.numel())
            top_s, top_i = flat.topk(k)
            ok = top_s > score_thr
            top_s, top_i = top_s[ok], top_i[ok]
            loc, c = top_i // nc, top_i % nc
            p, d = pts[loc], dist[b, loc]
            boxes = torch.stack([p[:, 0] - d[:, 0], p[:, 1] - d[:, 1],
                                 p[:, 0] + d[:, 2], p[:, 1] + d[:, 3]], dim=1)
            boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w_img)
            boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h_img)
            cands[b].append((boxes, top_s, c))
    results = []
    for b in range(batch):
        boxes = torch.cat([x[0] for x in cands[b]])
        scores = torch.cat([x[1] for x in cands[b]])
        classes = torch.cat([x[2] for x in cands[b]])
        valid = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        boxes, scores, classes = boxes[valid], scores[valid], classes[valid]
        if scores.numel() > pre_nms_top_k:  # bound the [K, K] NMS matrix over all levels
            top = scores.topk(pre_nms_top_k).indices
            boxes, scores, classes = boxes[top], scores[top], classes[top]
        keep = batched_nms(boxes, scores, classes, iou_thr)[:max_det]
        results.append(ImageDetections(boxes[keep], scores[keep], classes[keep] + class_offset))
    return results
