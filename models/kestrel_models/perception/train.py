"""Training of `MultiTaskPerceptionModel`: FCOS targets, losses, train loop, evaluation.

No ROS, no data source: callers feed `Batch`es (e.g. scripts/train_perception_sim.py renders
them from the MuJoCo world). Conventions follow the model (see model.py / postprocess.py):
detection locations are the FCOS points s//2 + i*s of P3-P5, `det_ltrb` is in px, class
index = logit channel + config.det_class_offset.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .model import DET_STRIDES, MultiTaskPerceptionModel
from .postprocess import box_iou, decode_detections, level_points

# FCOS object-size ranges (max of l, t, r, b in px) of P3, P4, P5
DEFAULT_SIZE_RANGES: tuple[tuple[float, float], ...] = ((0.0, 64.0), (64.0, 128.0),
                                                        (128.0, math.inf))
IGNORE_INDEX = 255  # segmentation pixels with this label do not count


@dataclass
class Batch:
    """One training / evaluation batch (B images of the same size H x W)."""

    images: torch.Tensor  # [B, 3, H, W] uint8 RGB
    seg: torch.Tensor  # [B, H, W] int64 class index (IGNORE_INDEX = unlabelled)
    depth: torch.Tensor  # [B, H, W] float32 m; <= 0 or non-finite = no valid depth
    boxes: list[torch.Tensor]  # per image [N, 4] float32 xyxy px
    labels: list[torch.Tensor]  # per image [N] int64 class index (background excluded)


@dataclass
class LossWeights:
    cls: float = 1.0
    box: float = 1.0
    ctr: float = 1.0
    seg: float = 1.0
    depth: float = 1.0


@dataclass
class FCOSTargets:
    """Per image, over the locations of all levels concatenated (P3 first): L locations."""

    cls: torch.Tensor  # [B, L] int64 logit channel, -1 = background
    ltrb: torch.Tensor  # [B, L, 4] float32 px (valid where cls >= 0)
    ctr: torch.Tensor  # [B, L] float32 centerness target in [0, 1] (valid where cls >= 0)


def centerness(ltrb: torch.Tensor) -> torch.Tensor:
    """[..., 4] distances -> [...] sqrt(min(l,r)/max(l,r) * min(t,b)/max(t,b))."""
    lr, tb = ltrb[..., 0::2], ltrb[..., 1::2]
    c = (lr.min(-1).values / lr.max(-1).values.clamp(min=1e-6)) * \
        (tb.min(-1).values / tb.max(-1).values.clamp(min=1e-6))
    return c.clamp(min=0).sqrt()


def assign_targets(points: list[torch.Tensor], boxes: torch.Tensor, labels: torch.Tensor,
                   strides: tuple[int, ...] = DET_STRIDES,
                   size_ranges: tuple[tuple[float, float], ...] = DEFAULT_SIZE_RANGES,
                   center_radius: float = 1.5, class_offset: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FCOS assignment for one image.

    points: per level [L_l, 2] (x, y) px; boxes [N, 4] xyxy px; labels [N] class indices.
    A location is positive for a box when it lies inside the box (and, with center_radius > 0,
    within center_radius * stride of the box centre) and max(l, t, r, b) is inside the
    level's size range; among several boxes it takes the smallest (area). Returns
    (cls [L] logit channel or -1, ltrb [L, 4] px, ctr [L]) with L = sum L_l.
    """
    pts = torch.cat(points)  # [L, 2]
    n_loc = pts.shape[0]
    if boxes.numel() == 0:
        return (torch.full((n_loc,), -1, dtype=torch.long), torch.zeros(n_loc, 4),
                torch.zeros(n_loc))
    lo = torch.cat([torch.full((p.shape[0],), r[0]) for p, r in zip(points, size_ranges,
                                                                    strict=True)])
    hi = torch.cat([torch.full((p.shape[0],), r[1]) for p, r in zip(points, size_ranges,
                                                                    strict=True)])
    st = torch.cat([torch.full((p.shape[0],), float(s)) for p, s in zip(points, strides,
                                                                        strict=True)])
    x, y = pts[:, 0:1], pts[:, 1:2]  # [L, 1]
    b = boxes[None].float()  # [1, N, 4]
    ltrb = torch.stack([x - b[..., 0], y - b[..., 1], b[..., 2] - x, b[..., 3] - y], -1)
    inside = ltrb.min(-1).values > 0  # [L, N]
    if center_radius > 0:
        cx, cy = (b[..., 0] + b[..., 2]) / 2, (b[..., 1] + b[..., 3]) / 2  # [1, N]
        rad = st[:, None] * center_radius
        inside &= ((x - cx).abs() < rad) & ((y - cy).abs() < rad)
    m = ltrb.max(-1).values
    in_range = (m >= lo[:, None]) & (m <= hi[:, None])
    area = ((b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])).expand(n_loc, -1).clone()
    area[~(inside & in_range)] = math.inf
    min_area, idx = area.min(dim=1)  # [L]
    pos = torch.isfinite(min_area)
    cls = torch.where(pos, labels[idx] - class_offset, torch.full_like(idx, -1))
    t_ltrb = ltrb[torch.arange(n_loc), idx]  # [L, 4]
    t_ltrb = torch.where(pos[:, None], t_ltrb, torch.zeros_like(t_ltrb))
    ctr = torch.where(pos, centerness(t_ltrb), torch.zeros(n_loc))
    return cls, t_ltrb, ctr


def build_targets(raw: dict, batch: Batch, class_offset: int = 1,
                  center_radius: float = 1.5) -> FCOSTargets:
    """FCOS targets for a batch, on the feature sizes of the model output `raw`."""
    points = [level_points(c.shape[-2], c.shape[-1], s, torch.device("cpu"))
              for c, s in zip(raw["det_cls"], DET_STRIDES, strict=True)]
    out = [assign_targets(points, bx.cpu(), lb.cpu(), center_radius=center_radius,
                          class_offset=class_offset)
           for bx, lb in zip(batch.boxes, batch.labels, strict=True)]
    dev = raw["det_cls"][0].device
    return FCOSTargets(torch.stack([o[0] for o in out]).to(dev),
                       torch.stack([o[1] for o in out]).to(dev),
                       torch.stack([o[2] for o in out]).to(dev))


def sigmoid_focal_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float = 0.25,
                       gamma: float = 2.0) -> torch.Tensor:
    """Summed focal loss (Lin et al. 2017); logits, targets (0/1 float) of the same shape."""
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    a_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (a_t * ce * (1 - p_t) ** gamma).sum()


def giou_loss_ltrb(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-location 1 - GIoU of boxes given as distances from the same point: [N, 4] -> [N]."""
    pl, pt, pr, pb = pred.unbind(-1)
    tl, tt, tr, tb = target.unbind(-1)
    p_area = (pl + pr) * (pt + pb)
    t_area = (tl + tr) * (tt + tb)
    inter = (torch.minimum(pl, tl) + torch.minimum(pr, tr)) * \
        (torch.minimum(pt, tt) + torch.minimum(pb, tb))
    union = p_area + t_area - inter
    iou = inter / union.clamp(min=1e-6)
    enclose = (torch.maximum(pl, tl) + torch.maximum(pr, tr)) * \
        (torch.maximum(pt, tt) + torch.maximum(pb, tb))
    return 1 - (iou - (enclose - union) / enclose.clamp(min=1e-6))


def _flat(levels: list[torch.Tensor]) -> torch.Tensor:
    """list over levels of [B, C, H_l, W_l] -> [B, L, C]."""
    return torch.cat([x.flatten(2) for x in levels], dim=2).transpose(1, 2)


def compute_losses(raw: dict, batch: Batch, class_offset: int = 1,
                   seg_class_weights: torch.Tensor | None = None,
                   center_radius: float = 1.5) -> dict[str, torch.Tensor]:
    """Per-task losses (scalars) for the heads present in `raw`.

    cls: focal loss / #positives; box: centerness-weighted GIoU; ctr: BCE over positives;
    seg: (weighted) cross-entropy; depth: L1 (m) over pixels with a valid depth target.
    """
    losses: dict[str, torch.Tensor] = {}
    if "det_cls" in raw:
        t = build_targets(raw, batch, class_offset, center_radius)
        cls, ltrb, ctr = _flat(raw["det_cls"]), _flat(raw["det_ltrb"]), _flat(raw["det_ctr"])
        pos = t.cls >= 0  # [B, L]
        n_pos = max(float(pos.sum()), 1.0)
        onehot = torch.zeros_like(cls)
        onehot[pos, t.cls[pos]] = 1.0
        losses["cls"] = sigmoid_focal_loss(cls.float(), onehot) / n_pos
        if pos.any():
            w = t.ctr[pos]
            g = giou_loss_ltrb(ltrb[pos].float(), t.ltrb[pos])
            losses["box"] = (g * w).sum() / w.sum().clamp(min=1e-6)
            losses["ctr"] = F.binary_cross_entropy_with_logits(ctr[pos][:, 0].float(), w)
        else:
            losses["box"] = ltrb.sum() * 0.0
            losses["ctr"] = ctr.sum() * 0.0
    if "seg" in raw:
        wts = seg_class_weights.to(raw["seg"].device) if seg_class_weights is not None else None
        losses["seg"] = F.cross_entropy(raw["seg"].float(), batch.seg.to(raw["seg"].device),
                                        weight=wts, ignore_index=IGNORE_INDEX)
    if "depth" in raw:
        d = raw["depth"][:, 0].float()
        gt = batch.depth.to(d.device)
        valid = torch.isfinite(gt) & (gt > 0)
        losses["depth"] = ((d - gt).abs()[valid].mean() if valid.any() else d.sum() * 0.0)
    return losses


@dataclass
class TrainLog:
    steps: int = 0
    wall_s: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)  # every log_every steps


def train(model: MultiTaskPerceptionModel, batches: Iterator[Batch] | Iterable[Batch],
          steps: int, lr: float = 2e-3, *, weight_decay: float = 1e-4, warmup_steps: int = 50,
          grad_clip: float = 10.0, weights: LossWeights | None = None,
          seg_class_weights: torch.Tensor | None = None, log_every: int = 50,
          time_budget_s: float | None = None,
          log: Callable[[str], None] | None = print) -> TrainLog:
    """AdamW + linear warm-up + cosine decay to 0 over `steps` steps on `batches` (cycled
    when it is a finite iterable). With `time_budget_s` (s) the schedule's progress is
    max(step / steps, elapsed / time_budget_s) and training stops when it reaches 1, so a
    slow machine still gets a complete schedule. Leaves the model in eval mode."""
    if steps < 1:
        raise ValueError(f"parameter 'steps' = {steps}: must be >= 1")
    if not lr > 0:
        raise ValueError(f"parameter 'lr' = {lr}: must be > 0")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"parameter 'time_budget_s' = {time_budget_s}: must be > 0")
    weights = weights or LossWeights()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr)

    def lr_factor(step: int, progress: float) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        w = warmup_steps / steps
        frac = (progress - w) / max(1e-9, 1 - w)
        return 0.5 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0)))

    off = model.config.det_class_offset
    it = iter(batches)
    out = TrainLog()
    acc: dict[str, float] = {}
    t0 = time.monotonic()
    model.train()
    for step in range(steps):
        elapsed = time.monotonic() - t0
        progress = step / steps
        if time_budget_s is not None:
            progress = max(progress, elapsed / time_budget_s)
            if progress >= 1.0:
                break
        cur_lr = lr * lr_factor(step, progress)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        try:
            batch = next(it)
        except StopIteration:
            it = iter(batches)
            batch = next(it)
        raw = model(batch.images)
        losses = compute_losses(raw, batch, off, seg_class_weights)
        total = sum(getattr(weights, k) * v for k, v in losses.items())
        opt.zero_grad(set_to_none=True)
        total.backward()
        if grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        out.steps = step + 1
        for k, v in losses.items():
            acc[k] = acc.get(k, 0.0) + float(v.detach())
        acc["total"] = acc.get("total", 0.0) + float(total.detach())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            row = {k: v / ((step % log_every) + 1) for k, v in acc.items()}
            row.update(step=step + 1, lr=cur_lr, wall_s=time.monotonic() - t0)
            out.history.append(row)
            acc = {}
            if log is not None:
                log(" ".join(f"{k}={v:.4g}" for k, v in row.items()))
    if acc and out.steps % log_every:  # stopped by the time budget inside a log window
        row = {k: v / (out.steps % log_every) for k, v in acc.items()}
        row.update(step=out.steps, lr=cur_lr, wall_s=time.monotonic() - t0)
        out.history.append(row)
    out.wall_s = time.monotonic() - t0
    model.eval()
    return out


def _match(pred_boxes: torch.Tensor, gt_boxes: torch.Tensor, iou_thr: float) -> int:
    """Greedy one-to-one matching (preds sorted by score): number of true positives."""
    if pred_boxes.numel() == 0 or gt_boxes.numel() == 0:
        return 0
    iou = box_iou(pred_boxes.float(), gt_boxes.float())  # [P, G]
    used = torch.zeros(gt_boxes.shape[0], dtype=torch.bool)
    tp = 0
    for p in range(iou.shape[0]):
        cand = iou[p].clone()
        cand[used] = -1
        g = int(cand.argmax())
        if cand[g] >= iou_thr:
            used[g] = True
            tp += 1
    return tp


@torch.inference_mode()
def evaluate(model: MultiTaskPerceptionModel, batches: Iterable[Batch],
             class_names: tuple[str, ...], score_thr: float | None = None,
             iou_thr: float = 0.5) -> dict:
    """Mask mIoU and detection recall/precision at IoU >= iou_thr, per class.

    Returns {"miou": mean IoU over classes present (in GT or prediction),
             "iou": {class: IoU or None}, "det": {class: {"recall", "precision", "tp",
             "gt", "pred"}}, "images": n}. score_thr defaults to the model's config.
    """
    cfg = model.config
    thr = cfg.score_threshold if score_thr is None else score_thr
    nc = cfg.num_classes
    conf = torch.zeros(nc, nc, dtype=torch.long)  # [gt, pred]
    tp, n_gt, n_pred = (torch.zeros(nc, dtype=torch.long) for _ in range(3))
    n_img = 0
    model.eval()
    for batch in batches:
        raw = model(batch.images)
        h, w = batch.images.shape[-2:]
        if "seg" in raw:
            pred = raw["seg"].argmax(1).cpu()
            gt = batch.seg
            ok = gt != IGNORE_INDEX
            conf += torch.bincount(gt[ok] * nc + pred[ok], minlength=nc * nc).view(nc, nc)
        if "det_cls" in raw:
            dets = decode_detections(raw, (h, w), thr, cfg.nms_iou, cfg.max_detections,
                                     pre_nms_top_k=cfg.pre_nms_top_k,
                                     class_offset=cfg.det_class_offset)
            for d, gb, gl in zip(dets, batch.boxes, batch.labels, strict=True):
                for c in range(nc):
                    pm, gm = d.classes.cpu() == c, gl == c
                    tp[c] += _match(d.boxes.cpu()[pm], gb[gm], iou_thr)
                    n_gt[c] += int(gm.sum())
                    n_pred[c] += int(pm.sum())
        n_img += batch.images.shape[0]
    inter = conf.diag().float()
    union = conf.sum(0).float() + conf.sum(1).float() - inter
    iou = {name: (float(inter[c] / union[c]) if union[c] > 0 else None)
           for c, name in enumerate(class_names)}
    present = [v for v in iou.values() if v is not None]
    det = {}
    for c in range(cfg.det_class_offset, nc):
        det[class_names[c]] = {
            "recall": float(tp[c]) / max(int(n_gt[c]), 1) if n_gt[c] else None,
            "precision": float(tp[c]) / max(int(n_pred[c]), 1) if n_pred[c] else None,
            "tp": int(tp[c]), "gt": int(n_gt[c]), "pred": int(n_pred[c])}
    return {"miou": sum(present) / max(len(present), 1), "iou": iou, "det": det,
            "images": n_img}
