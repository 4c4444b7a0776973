#!/usr/bin/env python3
"""Held-out evaluation of sim-trained perception weights through PerceptionCore (the node's
path: preprocessing, model, decoding + NMS, LiDAR fusion).

    source scripts/env.sh
    python scripts/perception_sim_eval.py --frames 60 --update-json \
        --weights ros2_ws/src/kestrel_perception/weights/tiny_sim.pt

Frames: episodes of held-out seeds (EVAL_SEED_BASE + i, never used in training) drawn with the
bringup's episode settings, arm at home or near it, random lighting (as training), plus the
sim's LiDAR scan (sim.yaml's rings x azimuths) and the ground-truth object centres.
Metrics:
- mAP@0.5: per class, all-point interpolated average precision of the detections (score >=
  --score-threshold) against the tight boxes of each instance's visible pixels (>= min px);
  also recall at the node's default score threshold;
- mask mIoU: per-class IoU of the whole held-out set's pixels, mean over the classes;
- 3D position error (m): for every task object matched by a detection (IoU >= 0.5, best
  score), |detection position - object centre| with the LiDAR cloud (LiDAR path) and without
  it (predicted-depth path); median, p90, count.
The node's LiDAR position is the object's centre from its own points above the table (the
support rule, kestrel_models perception/support.py); its predicted-depth position is the box
centre ray at the median predicted depth inside the box, a point near the visible surface.
--bench-out writes the kestrel_bench record of the weights (their training config from the
weights' .json, these metrics, this command).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

import train_perception_sim as tps

POSITION_CLASSES = ("red_cube", "green_cube", "blue_cylinder")  # graspable task objects
DEFAULT_SCORE_THRESHOLD = 0.3  # the node's model.score_threshold default


def render_eval_set(n: int, width: int, height: int, rng_seed: int, min_px: int,
                    cache_dir: Path | None) -> dict[str, np.ndarray]:
    """n held-out frames: rgb, cls, boxes/counts (as tps.render_set), LiDAR points
    (concatenated, pcounts), K [3,3], T world-from-optical [n,4,4], gt [n,C,3] m (NaN: absent)."""
    import yaml
    from kestrel_sim.core.robot import default_urdf_path
    from kestrel_sim.core.scene import default_world_file
    from kestrel_sim.core.sensors import LidarSensor

    cfg = tps.episode_config()
    sim = yaml.safe_load(tps.SIM_YAML.read_text())["sim"]["ros__parameters"]
    lidar_args = (int(sim.get("lidar_n_vertical", 32)), int(sim.get("lidar_n_horizontal", 360)))
    max_range = float(sim.get("lidar_max_range", 5.0))
    key = hashlib.sha1(json.dumps(["eval", n, width, height, rng_seed, min_px, lidar_args,
                                   max_range, cfg.min_objects, cfg.max_distractors,
                                   tps.LIGHT_SCALE]).encode())
    key.update(default_world_file().read_bytes() + default_urdf_path().read_bytes())
    path = cache_dir / f"kestrel_sim_eval_{key.hexdigest()[:12]}.npz" if cache_dir else None
    if path is not None and path.is_file():
        return dict(np.load(path))
    r = tps.SimRenderer(width, height, cfg)
    lidar = LidarSensor(r.world, *lidar_args, max_range=max_range)
    lo, hi = r.world.joint_limits
    rng = np.random.default_rng(rng_seed)
    nc = len(tps.CLASS_NAMES)
    out: dict[str, list] = {k: [] for k in ("rgb", "cls", "boxes", "counts", "points",
                                            "pcounts", "T", "gt")}
    for i in tps.tqdm(range(n), desc="render eval", unit="frame", mininterval=5.0):
        q = tps.arm_pose(rng, r.home, lo, hi, "home" if i % 2 == 0 else "near")
        rgb, _, cls, inst = r.render(tps.EVAL_SEED_BASE + i, q, rng.uniform(*tps.LIGHT_SCALE,
                                                                            size=3))
        bx, lb = tps.instance_boxes(cls, inst, min_px)
        pts = lidar.scan().points
        gt = np.full((nc, 3), np.nan)
        for ob in r.world.ground_truth():
            gt[ob.class_index] = ob.position
        for k, v in (("rgb", rgb), ("cls", cls), ("counts", len(lb)), ("points", pts),
                     ("pcounts", len(pts)), ("T", r.camera.extrinsics()), ("gt", gt),
                     ("boxes", np.concatenate([bx, lb[:, None].astype(np.float32)], 1))):
            out[k].append(v)
    data = {k: np.concatenate(v) if k in ("boxes", "points") else np.stack(v)
            if k not in ("counts", "pcounts") else np.asarray(v) for k, v in out.items()}
    data["K"] = r.camera.intrinsics()
    r.close()
    if path is not None:
        np.savez(path, **data)
    return data


def average_precision(scores: list[float], tp: list[bool], n_gt: int) -> float | None:
    """All-point interpolated AP of detections (score, is true positive) against n_gt objects
    (None when there is no object of the class)."""
    if n_gt == 0:
        return None
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    hits = np.asarray(tp, np.float64)[order]
    ctp, cfp = np.cumsum(hits), np.cumsum(1.0 - hits)
    rec = np.concatenate([[0.0], ctp / n_gt])
    prec = np.concatenate([[1.0], ctp / np.maximum(ctp + cfp, 1e-12)])
    prec = np.maximum.accumulate(prec[::-1])[::-1]  # precision envelope
    return float(np.sum((rec[1:] - rec[:-1]) * prec[1:]))


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of box a [4] with boxes b [M,4] (xyxy)."""
    iw = np.clip(np.minimum(a[2], b[:, 2]) - np.maximum(a[0], b[:, 0]), 0, None)
    ih = np.clip(np.minimum(a[3], b[:, 3]) - np.maximum(a[1], b[:, 1]), 0, None)
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    return inter / np.maximum(union, 1e-9)


def _stats(errs: list[float]) -> dict:
    if not errs:
        return {"n": 0}
    e = np.asarray(errs)
    return {"n": int(e.size), "median_m": round(float(np.median(e)), 4),
            "p90_m": round(float(np.percentile(e, 90)), 4), "max_m": round(float(e.max()), 4)}


def evaluate_weights(weights: str, data: dict, score_threshold: float = 0.05,
                     iou_thr: float = 0.5, threads: int = 2) -> dict:
    """mAP@iou_thr per class, mask mIoU and 3D position errors of `weights` on `data`."""
    from kestrel_models.perception import PerceptionConfig
    from kestrel_perception.core import CameraModel, FrameSet, PerceptionCore
    from kestrel_perception.core.perception_core import PerceptionCoreConfig

    names = tps.CLASS_NAMES
    nc = len(names)
    core = PerceptionCore(PerceptionCoreConfig(
        model=dataclasses.replace(PerceptionConfig.tiny(), score_threshold=score_threshold),
        weights_path=weights, num_threads=threads))
    n, (h, w) = data["rgb"].shape[0], data["rgb"].shape[1:3]
    starts = np.concatenate([[0], np.cumsum(data["counts"])])
    pstarts = np.concatenate([[0], np.cumsum(data["pcounts"])])
    conf = np.zeros((nc, nc), np.int64)  # [gt, pred] pixels
    dets: dict[int, tuple[list, list]] = {c: ([], []) for c in range(1, nc)}
    n_gt = np.zeros(nc, np.int64)
    errs: dict[str, dict[str, list]] = {p: {c: [] for c in POSITION_CLASSES}
                                        for p in ("lidar", "predicted_depth")}
    sources: dict[str, int] = {}
    for i in tps.tqdm(range(n), desc="evaluate", unit="frame", mininterval=5.0):
        cam = CameraModel(data["K"], w, h, "camera", data["T"][i])
        gtb = data["boxes"][starts[i]:starts[i + 1]]
        pts = data["points"][pstarts[i]:pstarts[i + 1]].astype(np.float32)
        for path, cloud in (("lidar", pts), ("predicted_depth", None)):
            out = core.process(FrameSet(i, [data["rgb"][i]], [cam], cloud))
            if path == "lidar":
                conf += np.bincount(data["cls"][i].astype(np.int64).ravel() * nc +
                                    out.masks[0].astype(np.int64).ravel(),
                                    minlength=nc * nc).reshape(nc, nc)
            used = np.zeros(len(gtb), bool)
            for d in sorted(out.detections, key=lambda d: -d.score):
                same = np.nonzero((gtb[:, 4] == d.class_index) & ~used)[0]
                ious = _iou(np.asarray(d.box_xyxy, np.float64), gtb[same, :4]) if same.size \
                    else np.zeros(0)
                hit = bool(ious.size) and ious.max() >= iou_thr
                if hit:
                    used[same[int(ious.argmax())]] = True
                if path == "lidar":
                    dets[d.class_index][0].append(d.score)
                    dets[d.class_index][1].append(hit)
                if hit and d.class_name in POSITION_CLASSES and d.score >= \
                        DEFAULT_SCORE_THRESHOLD:
                    gt = data["gt"][i, d.class_index]
                    src = d.position_source.name.lower()
                    sources[f"{path}:{src}"] = sources.get(f"{path}:{src}", 0) + 1
                    if d.position is not None and np.all(np.isfinite(gt)):
                        errs[path][d.class_name].append(float(np.linalg.norm(d.position - gt)))
        n_gt += np.bincount(gtb[:, 4].astype(np.int64), minlength=nc)
    per_class = {}
    for c in range(1, nc):
        sc, tp = dets[c]
        ap = average_precision(sc, tp, int(n_gt[c]))
        rec = sum(t for s, t in zip(sc, tp, strict=True) if s >= DEFAULT_SCORE_THRESHOLD)
        per_class[names[c]] = {"ap50": None if ap is None else round(ap, 4), "gt": int(n_gt[c]),
                               "recall_at_default_threshold":
                                   round(rec / n_gt[c], 4) if n_gt[c] else None}
    inter = np.diag(conf).astype(np.float64)
    union = conf.sum(0) + conf.sum(1) - np.diag(conf)
    iou = {names[c]: round(float(inter[c] / union[c]), 4) for c in range(nc) if union[c]}
    aps = [v["ap50"] for v in per_class.values() if v["ap50"] is not None]
    pos = {p: {**{c: _stats(v) for c, v in e.items()},
               "all": _stats([x for v in e.values() for x in v])} for p, e in errs.items()}
    return {"frames": int(n), "seeds": [tps.EVAL_SEED_BASE, tps.EVAL_SEED_BASE + n - 1],
            "score_threshold": score_threshold, "iou_threshold": iou_thr,
            "map50": round(float(np.mean(aps)), 4), "per_class": per_class,
            "mask_miou": round(float(np.mean(list(iou.values()))), 4), "mask_iou": iou,
            "position_error": pos, "position_sources": sources}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=str(tps.ROOT / "ros2_ws/src/kestrel_perception/"
                                                        "weights/tiny_sim.pt"))
    ap.add_argument("--frames", type=int, default=60, help="held-out frames")
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--min-box-px", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="arm pose / lighting sampling seed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default="/tmp", help="'' = no cache")
    ap.add_argument("--update-json", action="store_true",
                    help="write the metrics into the weights' .json (key eval_node_heldout)")
    ap.add_argument("--bench-out", default="",
                    help="also write the kestrel_bench record STEM.json + STEM.md of the "
                         "weights and these metrics ('' = no)")
    args = ap.parse_args(argv)
    if args.frames < 1:
        raise SystemExit(f"parameter 'frames' = {args.frames}: must be >= 1")
    import torch
    torch.set_num_threads(args.threads)
    data = render_eval_set(args.frames, args.width, args.height, args.seed + 3,
                           args.min_box_px, Path(args.cache_dir) if args.cache_dir else None)
    m = evaluate_weights(args.weights, data, threads=args.threads)
    print(json.dumps(m, indent=1), flush=True)
    meta_path = Path(args.weights).with_suffix(".json")
    if args.update_json or args.bench_out:
        meta = json.loads(meta_path.read_text())
        meta["eval_node_heldout"] = m
    if args.update_json:
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    if args.bench_out:
        from kestrel_bench.record import write
        rec = tps.bench_record(meta, argv if argv is not None else sys.argv[1:],
                               script="scripts/perception_sim_eval.py")
        rec.note(f"the weights' training command: {meta.get('command', 'unknown')}")
        write(rec, args.bench_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
