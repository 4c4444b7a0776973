"""Accuracy drift of an optimized perception variant against the fp32 reference outputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .postprocess import ImageDetections, box_iou, decode_detections


@dataclass
class AccuracyReport:
    """Differences of one variant's outputs from the reference (fp32 eager) outputs."""

    seg_max_abs: float | None = None  # max |logit difference| over [B, classes, H, W]
    depth_max_abs: float | None = None  # m, max |depth difference|
    bev_max_abs: float | None = None  # max |BEV occupancy logit difference|
    det_agreement: float | None = None  # F1 of matched boxes (same class, IoU > 0.5)
    det_ref_count: int = 0  # reference detections over the batch
    det_count: int = 0  # variant detections over the batch

    def as_dict(self) -> dict:
        return asdict(self)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def match_detections(ref: ImageDetections, out: ImageDetections, iou: float = 0.5) -> int:
    """Greedy one-to-one matches (by reference score order) of same-class boxes, IoU > iou."""
    if ref.boxes.shape[0] == 0 or out.boxes.shape[0] == 0:
        return 0
    ious = box_iou(ref.boxes.float().cpu(), out.boxes.float().cpu())  # [R, O]
    same = ref.classes.cpu()[:, None] == out.classes.cpu()[None, :]
    ious = torch.where(same, ious, torch.zeros_like(ious))
    used = torch.zeros(ious.shape[1], dtype=torch.bool)
    matched = 0
    for r in range(ious.shape[0]):
        cand = torch.where(used, torch.zeros_like(ious[r]), ious[r])
        j = int(cand.argmax())
        if float(cand[j]) > iou:
            used[j] = True
            matched += 1
    return matched


def compare_outputs(ref: dict, out: dict, image_hw: tuple[int, int], score_thr: float = 0.05,
                    nms_iou: float = 0.5, max_det: int = 100, class_offset: int = 0
                    ) -> AccuracyReport:
    """Compare two output dicts of the model (same inputs). Detection agreement =
    2 * matched / (n_ref + n_out) (1.0 when both are empty)."""
    rep = AccuracyReport()
    if "seg" in ref and "seg" in out:
        rep.seg_max_abs = _max_abs(ref["seg"], out["seg"])
    if "depth" in ref and "depth" in out:
        rep.depth_max_abs = _max_abs(ref["depth"], out["depth"])
    if "bev_occ" in ref and "bev_occ" in out:
        rep.bev_max_abs = _max_abs(ref["bev_occ"], out["bev_occ"])
    if "det_cls" in ref and "det_cls" in out:
        def dec(raw: dict) -> list[ImageDetections]:
            raw = {k: [t.float().cpu() for t in raw[k]] for k in ("det_cls", "det_ltrb",
                                                                   "det_ctr")}
            return decode_detections(raw, image_hw, score_thr, nms_iou, max_det,
                                     class_offset=class_offset)
        dr, do = dec(ref), dec(out)
        matched = sum(match_detections(a, b) for a, b in zip(dr, do, strict=True))
        rep.det_ref_count = sum(int(d.boxes.shape[0]) for d in dr)
        rep.det_count = sum(int(d.boxes.shape[0]) for d in do)
        total = rep.det_ref_count + rep.det_count
        rep.det_agreement = 1.0 if total == 0 else 2.0 * matched / total
    return rep
