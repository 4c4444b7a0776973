"""Detection decoding (FCOS) and class-wise NMS, in torch (no torchvision)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import nms_triton as _nms_triton
from .compiled import compiled
from .model import DET_STRIDES

# the static (graphed) NMS on CUDA with triton importable runs nms_triton's two kernels (same
# result as the torch matrix rounds, fewer kernels); False forces the torch path
USE_TRITON_NMS: bool = True


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


_LEVEL_POINTS: dict[tuple, torch.Tensor] = {}


def _cached_level_points(h: int, w: int, stride: int, device: torch.device) -> torch.Tensor:
    """`level_points`, computed once per (shape, stride, device): read-only afterwards."""
    key = (h, w, stride, str(device))
    pts = _LEVEL_POINTS.get(key)
    if pts is None:
        pts = level_points(h, w, stride, device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a tensor made inside a graph capture holds no values yet
            _LEVEL_POINTS[key] = pts
    return pts


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


@dataclass
class BatchedDetections:
    """Detections of B images in static-shape tensors (M = max_det slots per image).

    Slots are sorted by descending score; slot m of image b is a detection iff valid[b, m]
    (the valid slots come first). Produced without any host sync.
    """

    boxes: torch.Tensor  # [B, M, 4] float32, xyxy px, clipped to the image
    scores: torch.Tensor  # [B, M] float32 in [0, 1] (0 in invalid slots)
    classes: torch.Tensor  # [B, M] int64 (logit channel + class_offset; 0 in invalid slots)
    valid: torch.Tensor  # [B, M] bool
    nms_converged: torch.Tensor  # [] bool: False -> `nms_rounds` did not reach the fixed point

    def to_list(self) -> list[ImageDetections]:
        """Per-image `ImageDetections` (host sync: for tests and the slow path only)."""
        return [ImageDetections(self.boxes[b][v], self.scores[b][v], self.classes[b][v])
                for b, v in enumerate(self.valid)]


# a threshold of the batched (static) path: a float, or a 0-d fp32 tensor on the device that
# captured graphs and compiled steps read at run time (the perception node's threshold buffer)
Thr = float | torch.Tensor


def batched_nms_dense(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
                      valid: torch.Tensor, iou_thr: Thr, rounds: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-wise greedy NMS of B images at once, without a host sync.

    boxes [B,N,4] xyxy, scores [B,N], classes [B,N], valid [B,N] bool; the N candidates of
    each image must already be sorted by descending score. Runs `rounds` fixed-point rounds
    of `nms` (matrix form) plus one check round; returns keep [B,N] bool and converged []
    bool (False: a suppression chain was longer than `rounds`, keep is then not final and
    the caller must iterate further, see `finish_nms`).
    """
    b = _offset_by_class(boxes, classes, valid)  # [B,N,4], classes never overlap
    if USE_TRITON_NMS and _nms_triton.available(b):  # the same result in 2 Triton kernels
        return _nms_triton.nms_dense(b, valid, iou_thr, rounds)
    iou = _box_iou_batched(b, b)  # [B,N,N]
    suppress = (iou > iou_thr).triu_(diagonal=1) & valid[:, :, None]  # [B,i,j]
    keep = valid.clone()
    for _ in range(max(1, rounds)):
        keep = valid & ~(suppress & keep[:, :, None]).any(dim=1)
    nxt = valid & ~(suppress & keep[:, :, None]).any(dim=1)
    converged = (nxt == keep).all()  # [] bool, stays on the device
    return nxt, converged


def finish_nms(boxes: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor,
               keep: torch.Tensor, iou_thr: Thr) -> torch.Tensor:
    """Iterate `batched_nms_dense` to the exact fixed point (host-synced; rare slow path)."""
    b = _offset_by_class(boxes, classes, valid)
    suppress = (_box_iou_batched(b, b) > iou_thr).triu_(diagonal=1) & valid[:, :, None]
    for _ in range(boxes.shape[1] + 1):
        nxt = valid & ~(suppress & keep[:, :, None]).any(dim=1)
        if torch.equal(nxt, keep):
            break
        keep = nxt
    return keep


def _offset_by_class(boxes: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor
                     ) -> torch.Tensor:
    """The offset trick of `batched_nms` per image: shift by class * (max valid coord + 1)."""
    top = torch.where(valid[..., None], boxes, torch.zeros_like(boxes)).amax(dim=(1, 2))  # [B]
    return boxes + (classes.to(boxes.dtype) * (top[:, None] + 1.0))[..., None]


def _box_iou_batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of xyxy boxes a [B,N,4] and b [B,M,4] -> [B,N,M] (same formula as `box_iou`)."""
    ax1, ay1, ax2, ay2 = (c[:, :, None] for c in a.unbind(dim=2))  # each [B,N,1]
    bx1, by1, bx2, by2 = (c[:, None, :] for c in b.unbind(dim=2))  # each [B,1,M]
    area_a = (ax2 - ax1).clamp(min=0) * (ay2 - ay1).clamp(min=0)
    area_b = (bx2 - bx1).clamp(min=0) * (by2 - by1).clamp(min=0)
    iw = (torch.minimum(ax2, bx2) - torch.maximum(ax1, bx1)).clamp_(min=0)  # [B,N,M]
    ih = (torch.minimum(ay2, by2) - torch.maximum(ay1, by1)).clamp_(min=0)
    inter = iw.mul_(ih)
    return inter / (area_a + area_b - inter).clamp_(min=1e-9)


def decode_detections_batched(raw: dict, image_size: tuple[int, int], score_thr: Thr,
                              iou_thr: Thr, max_det: int, *, pre_nms_top_k: int = 1000,
                              class_offset: int = 0, strides: tuple[int, ...] = DET_STRIDES,
                              nms_rounds: int = 8, points: list[torch.Tensor] | None = None,
                              static: bool = True, exact: bool = False,
                              compile: bool = False) -> BatchedDetections:
    """`decode_detections` for all B images at once, static shapes, no host sync.

    Same candidates, scores, boxes and class-wise NMS as `decode_detections` (ties in the
    scores aside): the top `pre_nms_top_k` (location, class) pairs over all levels (one
    top-k, see `_candidates`), those <= `score_thr` or with an empty box masked out,
    greedy class-wise NMS (`nms_rounds` rounds + a convergence flag, see
    `batched_nms_dense`), the best `max_det` kept into static slots.
    points: optional per-level [HW, 2] px locations (default: cached per level shape).
    compile=True: the element-wise parts run torch.compile'd (`compiled.py`: fused kernels
    instead of ~100 small ones on CUDA; same math).
    static=False (CPU, where a host read is no device sync): the NMS matrix is trimmed to the
    candidates above the threshold and NMS runs per image to its fixed point with a
    convergence check per round (same result and cost as the per-image path).
    exact=True: NMS iterated to its fixed point with host-synced convergence checks
    (`finish_nms`; the slow path after a False `nms_converged`).
    """
    cls_l, ltrb_l, ctr_l = raw["det_cls"], raw["det_ltrb"], raw["det_ctr"]
    if points is None:
        points = [_cached_level_points(c.shape[2], c.shape[3], s, c.device)
                  for c, s in zip(cls_l, strides, strict=True)]
    cand = compiled(_candidates, compile and static and not exact)
    scores, boxes, classes = cand(cls_l, ltrb_l, ctr_l, points, image_size, score_thr,
                                  pre_nms_top_k)
    return _nms_select(scores, boxes, classes, iou_thr, max_det, pre_nms_top_k, class_offset,
                       nms_rounds, static, exact, compile)


def _candidates(cls_l: list[torch.Tensor], ltrb_l: list[torch.Tensor],
                ctr_l: list[torch.Tensor], points: list[torch.Tensor],
                image_size: tuple[int, int], score_thr: Thr, top_k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `top_k` (location, class) pairs over ALL levels at once: scores [B,k] (-1 where
    <= score_thr or the box is empty; not sorted), boxes [B,k,4] px clipped, classes [B,k].

    One top-k over the levels' concatenated scores selects the same pairs as a top-k per level
    followed by a top-k over their union: a pair among the best k overall is among the best k
    of its own level (ties aside). The reference `decode_detections` drops empty boxes and
    NaN scores before the union's top-k, this after the one top-k, so the two differ only when
    such a pair is among the best k: an FCOS box (exp distances > 0) of a location inside the
    image is never empty, and a NaN score means a broken model.
    One top-k instead of one per level (5 levels: 5 top-k + 5 sorts fewer).
    """
    h_img, w_img = image_size
    nc = cls_l[0].shape[1]
    s_l, d_l = [], []
    for cls, ltrb, ctr, pts in zip(cls_l, ltrb_l, ctr_l, points, strict=True):
        bsz = cls.shape[0]
        inside = (pts[:, 0] < w_img) & (pts[:, 1] < h_img)  # [HW]
        score = torch.sqrt(torch.sigmoid(cls.float()) * torch.sigmoid(ctr.float()))
        score = score.flatten(2).transpose(1, 2) * inside[None, :, None]  # [B,HW,C]
        s_l.append(score.reshape(bsz, -1))  # [B, HW*C], index = loc * C + class
        d_l.append(ltrb.float().flatten(2).transpose(1, 2))  # [B,HW,4] px
    score, dist = torch.cat(s_l, 1), torch.cat(d_l, 1)  # [B, L*C], [B,L,4] (L: all levels)
    pts = torch.cat(points, 0)  # [L,2] px
    k = min(top_k, score.shape[1])
    top_s, top_i = score.topk(k, dim=1, sorted=False)  # [B,k]; `_nms_select` sorts
    loc, c = top_i // nc, top_i % nc
    p = pts[loc]  # [B,k,2]
    d = torch.gather(dist, 1, loc[..., None].expand(-1, -1, 4))  # [B,k,4]
    boxes = torch.cat([p - d[..., :2], p + d[..., 2:]], dim=2)
    boxes = torch.stack([boxes[..., 0].clamp(0, w_img), boxes[..., 1].clamp(0, h_img),
                         boxes[..., 2].clamp(0, w_img), boxes[..., 3].clamp(0, h_img)], dim=2)
    ok = (top_s > score_thr) & (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])
    return torch.where(ok, top_s, torch.full_like(top_s, -1.0)), boxes, c


def detections_from_decoded(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
                            image_size: tuple[int, int], num_classes: int, score_thr: Thr,
                            iou_thr: Thr, max_det: int, *, pre_nms_top_k: int = 1000,
                            class_offset: int = 0, nms_rounds: int = 8, static: bool = True,
                            exact: bool = False, compile: bool = False) -> BatchedDetections:
    """A user model's decoded detections (boxes [B,N,4] xyxy px, scores [B,N], labels [B,N])
    through the same threshold, class-wise NMS and static slots as our own head's.

    Candidates with a score <= score_thr, a non-finite value, an empty box (after clipping to
    the image) or a label outside [0, num_classes) are dropped (never silently kept)."""
    h_img, w_img = image_size
    boxes = boxes.float().clone()
    boxes[..., 0::2] = boxes[..., 0::2].clamp(0, w_img)
    boxes[..., 1::2] = boxes[..., 1::2].clamp(0, h_img)
    scores = scores.float()
    labels = labels.long()
    ok = (scores > score_thr) & torch.isfinite(scores) & torch.isfinite(boxes).all(-1) & \
        (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1]) & \
        (labels >= 0) & (labels < num_classes)
    scores = torch.where(ok, scores, torch.full_like(scores, -1.0))
    boxes = torch.where(ok[..., None], boxes, torch.zeros_like(boxes))
    labels = torch.where(ok, labels, torch.zeros_like(labels))
    return _nms_select(scores, boxes, labels, iou_thr, max_det, pre_nms_top_k, class_offset,
                       nms_rounds, static, exact, compile)


def _nms_select(scores: torch.Tensor, boxes: torch.Tensor, classes: torch.Tensor, iou_thr: Thr,
                max_det: int, pre_nms_top_k: int, class_offset: int, nms_rounds: int,
                static: bool, exact: bool, compile: bool = False) -> BatchedDetections:
    """Candidates (score -1 = invalid) -> the best `pre_nms_top_k`, class-wise NMS, slots."""
    device = scores.device
    k2 = min(pre_nms_top_k, scores.shape[1])
    best = compiled(_best_candidates, compile and static and not exact)
    scores, boxes, classes, valid = best(scores, boxes, classes, k2)
    if not static:  # valid candidates come first (sorted by score, invalid = -1)
        n = max(1, int(valid.sum(dim=1).max()))
        scores, boxes, classes, valid = scores[:, :n], boxes[:, :n], classes[:, :n], valid[:, :n]
    if static:
        keep, converged = batched_nms_dense(boxes, scores, classes, valid, iou_thr, nms_rounds)
        if exact:
            keep = finish_nms(boxes, classes, valid, keep, iou_thr)
            converged = torch.ones((), dtype=torch.bool, device=device)
    else:  # per image, rounds until its own fixed point (host-checked, as `nms` does)
        keep = torch.zeros_like(valid)
        for b in range(valid.shape[0]):
            nb = int(valid[b].sum())  # valid candidates come first
            if nb == 0:
                continue
            keep[b, :nb] = finish_nms(boxes[b:b + 1, :nb], classes[b:b + 1, :nb],
                                      valid[b:b + 1, :nb], valid[b:b + 1, :nb], iou_thr)[0]
        converged = torch.ones((), dtype=torch.bool, device=device)
    select = compiled(_select_slots, compile and static and not exact)
    return BatchedDetections(*select(boxes, scores, classes, keep, max_det, class_offset),
                             converged)


def _best_candidates(scores: torch.Tensor, boxes: torch.Tensor, classes: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best k candidates, by descending score (scores [B,k], boxes [B,k,4], classes [B,k],
    valid [B,k] = score >= 0; invalid candidates carry score -1)."""
    scores, idx = scores.topk(k, dim=1)  # [B,k], descending
    boxes = torch.gather(boxes, 1, idx[..., None].expand(-1, -1, 4))
    classes = torch.gather(classes, 1, idx)
    return scores, boxes, classes, scores >= 0.0


def _select_slots(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
                  keep: torch.Tensor, max_det: int, class_offset: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """First `max_det` kept candidates (in score order) of each image -> static slots
    (boxes [B,M,4], scores [B,M], classes [B,M], valid [B,M])."""
    n = keep.shape[1]
    ar = torch.arange(n, device=keep.device)
    key = torch.where(keep, ar, ar + n)  # kept first, in score order
    m = min(max_det, n)
    sel = key.topk(m, dim=1, largest=False).indices  # [B,m] (sorted ascending key)
    valid = torch.gather(keep, 1, sel)
    out_b = torch.gather(boxes, 1, sel[..., None].expand(-1, -1, 4))
    out_s = torch.gather(scores, 1, sel).clamp(min=0.0) * valid
    out_c = (torch.gather(classes, 1, sel) + class_offset) * valid
    if m < max_det:  # pad to the static slot count
        pad = max_det - m
        out_b = torch.nn.functional.pad(out_b, (0, 0, 0, pad))
        out_s = torch.nn.functional.pad(out_s, (0, pad))
        out_c = torch.nn.functional.pad(out_c, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
    return out_b, out_s, out_c, valid
