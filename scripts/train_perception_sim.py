#!/usr/bin/env python3
"""Train the tiny perception model on frames rendered from the Kestrel MuJoCo world.

    source scripts/env.sh
    python scripts/train_perception_sim.py --frames 480 --steps 1500 \
        --out ros2_ws/src/kestrel_perception/weights/tiny_sim.pt \
        --bench-out docs/benchmarks/perception_training_cpu

(from random init; `--init FILE.pt` fine-tunes a state dict instead: the shipped weights'
command and starting point are in their .json).

Data: SimWorld episodes from random seeds (seed 0 = the demo layout is included), drawn with
the episode settings of the bringup's sim.yaml (which task objects are present, distractors,
poses), random arm poses within the joint limits and random lighting (headlight and sun
intensity); RGB + metric depth from CameraSensor; per-pixel class from MuJoCo segmentation
rendering (geom -> top-level body -> class, as kestrel_sim.core.scene); one box per object
instance (tight box of its visible pixels, >= --min-box-px pixels). The rendered set is cached
in /tmp as .npz. Evaluation uses held-out seeds (perception_sim_eval.py: mAP@0.5 per class,
mask mIoU, 3D position error of the LiDAR and predicted-depth paths). Writes the fp32 state
dict (.pt) and a .json with the config, data, metrics and command next to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    from tqdm import tqdm
except ImportError:  # no progress bar: plain iteration
    def tqdm(it, **_):  # type: ignore[no-redef]
        return it

ROOT = Path(__file__).resolve().parents[1]
for _p in ("models", "ros2_ws/src/kestrel_sim", "ros2_ws/src/kestrel_perception", "scripts"):
    if str(ROOT / _p) not in sys.path:
        sys.path.insert(0, str(ROOT / _p))
os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import mujoco  # noqa: E402
import torch  # noqa: E402
from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig  # noqa: E402
from kestrel_models.perception.train import Batch, evaluate, train  # noqa: E402
from kestrel_sim.core import CameraSensor, SimWorld  # noqa: E402
from kestrel_sim.core.scene import CLASS_NAMES  # noqa: E402
from kestrel_sim.core.world import SimWorldConfig  # noqa: E402

EVAL_SEED_BASE = 100_000  # held-out layouts: EVAL_SEED_BASE + i (training uses 0 .. frames)
SIM_YAML = ROOT / "ros2_ws/src/kestrel_bringup/config/sim.yaml"
# lighting randomisation: each intensity is the world file's times a factor in this range
LIGHT_SCALE = (0.6, 1.4)


def episode_config(sim_yaml: Path = SIM_YAML) -> SimWorldConfig:
    """SimWorldConfig with the episode settings the bringup runs the sim with (sim.yaml's
    sim.ros__parameters.episode), so training scenes are drawn like the evaluated ones."""
    import yaml
    ep = yaml.safe_load(sim_yaml.read_text())["sim"]["ros__parameters"].get("episode", {})
    return SimWorldConfig(min_objects=int(ep.get("min_objects", 3)),
                          max_distractors=int(ep.get("max_distractors", 0)))


def _top_level_bodies(model: mujoco.MjModel) -> np.ndarray:
    """(ngeom,) int: top-level body id of every geom (0 = world body)."""
    out = np.zeros(model.ngeom, dtype=np.int64)
    for g in range(model.ngeom):
        b = int(model.geom_bodyid[g])
        while b != 0 and model.body_parentid[b] != 0:
            b = int(model.body_parentid[b])
        out[g] = b
    return out


def arm_pose(rng: np.random.Generator, home: np.ndarray, lo: np.ndarray, hi: np.ndarray,
             mode: str) -> np.ndarray:
    """q [6] rad: "home", "near" (home + N(0, 0.5 rad)) or "uniform" in the joint limits."""
    if mode == "home":
        q = home.copy()
    elif mode == "near":
        q = home + rng.normal(0.0, 0.5, size=6)
    else:
        q = rng.uniform(lo, hi)
    return np.clip(q, lo, hi)


class SimRenderer:
    """RGB + depth (CameraSensor) and class / instance maps (MuJoCo segmentation render)."""

    def __init__(self, width: int, height: int, config: SimWorldConfig | None = None) -> None:
        self.world = SimWorld(config or episode_config())
        self.camera = CameraSensor(self.world, width, height)
        m = self.world.model
        self._seg = mujoco.Renderer(m, height, width)
        self._seg.enable_segmentation_rendering()
        self._data = mujoco.MjData(m)
        self.geom_class = self.world.info.geom_class.astype(np.uint8)  # (ngeom,)
        self.geom_body = _top_level_bodies(m)  # (ngeom,)
        self.home = self.world.joint_targets()
        v = m.vis.headlight
        self._light0 = (v.ambient.copy(), v.diffuse.copy(), m.light_diffuse.copy())

    def set_lighting(self, scales: np.ndarray | None) -> None:
        """scales [3] (headlight ambient, headlight diffuse, other lights' diffuse) times the
        world file's intensities; None = as in the world file."""
        amb, dif, lights = self._light0
        s = np.ones(3) if scales is None else np.asarray(scales, np.float64)
        v = self.world.model.vis.headlight
        v.ambient[:] = np.clip(amb * s[0], 0.0, 1.0)
        v.diffuse[:] = np.clip(dif * s[1], 0.0, 1.0)
        self.world.model.light_diffuse[:] = np.clip(lights * s[2], 0.0, 1.0)

    def render(self, seed: int, q: np.ndarray, light: np.ndarray | None = None
               ) -> tuple[np.ndarray, ...]:
        """-> rgb [H,W,3] uint8, depth [H,W] float32 m (inf = none), cls [H,W] uint8,
        inst [H,W] int16 top-level body id (0 = none / world). light: set_lighting scales."""
        self.world.reset(seed)
        self.world.set_joint_positions(q)
        self.set_lighting(light)
        frame = self.camera.render()
        self.world.snapshot_into(self._data)
        self._seg.update_scene(self._data, camera=self.world.info.camera_id)
        seg = self._seg.render()  # [H,W,2]: object id, object type
        gid = seg[..., 0]
        is_geom = (gid >= 0) & (seg[..., 1] == int(mujoco.mjtObj.mjOBJ_GEOM))
        g = np.where(is_geom, gid, 0)
        cls = np.where(is_geom, self.geom_class[g], 0).astype(np.uint8)
        inst = np.where(is_geom & (cls > 0), self.geom_body[g], 0).astype(np.int16)
        return frame.rgb, frame.depth, cls, inst

    def close(self) -> None:
        self._seg.close()
        self.camera.close()


def instance_boxes(cls: np.ndarray, inst: np.ndarray, min_px: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Tight xyxy box (px, x2/y2 exclusive) and class of every instance with >= min_px px."""
    boxes, labels = [], []
    for b in np.unique(inst):
        if b == 0:
            continue
        ys, xs = np.nonzero(inst == b)
        if ys.size < min_px:
            continue
        boxes.append([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
        labels.append(int(np.bincount(cls[ys, xs]).argmax()))
    return (np.asarray(boxes, np.float32).reshape(-1, 4), np.asarray(labels, np.int64))


def render_set(seeds: list[int], modes: list[str], width: int, height: int, rng_seed: int,
               min_px: int, cache_dir: Path | None, light: bool = True
               ) -> dict[str, np.ndarray]:
    """Render (or load from the .npz cache) one frame per (seed, arm mode); light: random
    lighting per frame (LIGHT_SCALE), else the world file's."""
    cfg = episode_config()
    key = hashlib.sha1(json.dumps([seeds, modes, width, height, rng_seed, min_px, light,
                                   cfg.min_objects, cfg.max_distractors,
                                   LIGHT_SCALE]).encode())
    # the world and the arm they were rendered from: a changed world is a new set
    from kestrel_sim.core.robot import default_urdf_path
    from kestrel_sim.core.scene import default_world_file
    key.update(default_world_file().read_bytes() + default_urdf_path().read_bytes())
    path = cache_dir / f"kestrel_sim_{key.hexdigest()[:12]}.npz" if cache_dir else None
    if path is not None and path.is_file():
        return dict(np.load(path))
    r = SimRenderer(width, height, cfg)
    lo, hi = r.world.joint_limits
    rng = np.random.default_rng(rng_seed)
    rgb, depth, cls, boxes, counts = [], [], [], [], []
    for seed, mode in tqdm(list(zip(seeds, modes, strict=True)), desc="render", unit="frame",
                           mininterval=5.0):
        q = arm_pose(rng, r.home, lo, hi, mode)
        scales = rng.uniform(*LIGHT_SCALE, size=3) if light else None
        im, d, c, ins = r.render(seed, q, scales)
        bx, lb = instance_boxes(c, ins, min_px)
        rgb.append(im)
        depth.append(d.astype(np.float16))
        cls.append(c)
        boxes.append(np.concatenate([bx, lb[:, None].astype(np.float32)], 1))
        counts.append(len(lb))
    r.close()
    data = {"rgb": np.stack(rgb), "depth": np.stack(depth), "cls": np.stack(cls),
            "boxes": np.concatenate(boxes), "counts": np.asarray(counts),
            "seeds": np.asarray(seeds)}
    if path is not None:
        np.savez(path, **data)
    return data


def to_batch(data: dict, idx: np.ndarray, rng: np.random.Generator | None) -> Batch:
    """Frames idx of a rendered set -> Batch; with rng: brightness/contrast jitter, h-flip."""
    starts = np.concatenate([[0], np.cumsum(data["counts"])])
    imgs = torch.from_numpy(data["rgb"][idx]).permute(0, 3, 1, 2).float()  # [B,3,H,W]
    seg = torch.from_numpy(data["cls"][idx].astype(np.int64))
    depth = torch.from_numpy(data["depth"][idx].astype(np.float32))
    boxes, labels = [], []
    w = imgs.shape[-1]
    for k, i in enumerate(idx):
        b = torch.from_numpy(data["boxes"][starts[i]:starts[i + 1]].copy())
        bx, lb = b[:, :4], b[:, 4].long()
        if rng is not None:
            c, br = rng.uniform(0.75, 1.25), rng.uniform(-25, 25)
            mean = imgs[k].mean()
            imgs[k] = (imgs[k] - mean) * c + mean + br + torch.from_numpy(
                rng.uniform(-8, 8, size=(3, 1, 1)).astype(np.float32))
            if rng.random() < 0.5:
                imgs[k], seg[k], depth[k] = imgs[k].flip(-1), seg[k].flip(-1), depth[k].flip(-1)
                bx = torch.stack([w - bx[:, 2], bx[:, 1], w - bx[:, 0], bx[:, 3]], 1)
        boxes.append(bx)
        labels.append(lb)
    return Batch(imgs.clamp(0, 255).round().to(torch.uint8), seg, depth, boxes, labels)


def batch_stream(data: dict, batch_size: int, seed: int):
    rng = np.random.default_rng(seed)
    n = data["rgb"].shape[0]
    while True:
        yield to_batch(data, rng.choice(n, batch_size, replace=False), rng)


def seg_weights(cls: np.ndarray, nc: int) -> torch.Tensor:
    """sqrt(median / frequency) class weights for the cross-entropy, clipped to [0.3, 3]."""
    freq = np.bincount(cls.ravel(), minlength=nc).astype(np.float64) + 1.0
    w = np.clip(np.sqrt(np.median(freq) / freq), 0.3, 3.0)
    return torch.tensor(w, dtype=torch.float32)


def bench_record(meta: dict, argv: list[str],
                 script: str = "scripts/train_perception_sim.py") -> dict:
    """kestrel_bench/1 record of a training run (its weights' metadata `meta`): one result per
    class (AP@0.5, mask IoU, position errors), the set's mAP / mIoU, training time. `script`
    and argv: the command that measured it (perception_sim_eval.py re-evaluates weights)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from kestrel_bench.record import Record

    node = meta.get("eval_node_heldout", {})
    rec = Record("perception_training", argv=["python", script, *argv],
                 config={k: meta.get(k) for k in ("model_config", "image_size_wh",
                                                  "train_frames", "steps_done", "batch_size",
                                                  "lr", "seed", "init", "episodes",
                                                  "lighting", "threads")})
    for name, pc in node.get("per_class", {}).items():
        m = {"ap50": pc["ap50"], "gt_objects": pc["gt"],
             "recall_at_default_threshold": pc["recall_at_default_threshold"],
             "mask_iou": node["mask_iou"].get(name)}
        for path, errs in node.get("position_error", {}).items():
            if name in errs and errs[name].get("n"):
                m[f"position_error_median_m_{path}"] = errs[name]["median_m"]
        rec.add(name, "variant", metrics=m)
    all_err = {p: e["all"] for p, e in node.get("position_error", {}).items()}
    rec.add("all_classes", "optimized", metrics={
        "map50": node.get("map50"), "mask_miou": node.get("mask_miou"),
        "heldout_frames": node.get("frames"),
        **{f"position_error_median_m_{p}": e.get("median_m") for p, e in all_err.items()},
        "train_wall_s": meta.get("train_wall_s"), "data_wall_s": meta.get("data_wall_s")})
    if meta.get("init", "random") != "random":
        rec.note(f"fine-tuned from {meta['init']}")
    rec.note("3D position, compared with the object's centre (the sim's ground truth): LiDAR "
             "path = the object's own points (segmentation class at their pixel) above the "
             "table plane, the centre half way between their top and the plane on the box "
             "centre's ray (kestrel_models perception/support.py); predicted-depth path = the "
             "box centre's ray at the median predicted depth inside the box")
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=400, help="training frames")
    ap.add_argument("--eval-frames", type=int, default=40, help="held-out frames")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--time-budget", type=float, default=660.0,
                    help="s of training; the cosine schedule ends by then (0 = steps only)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=50, help="linear LR warm-up steps")
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--min-box-px", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="torch init / sampling seed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default="/tmp", help="'' = no cache")
    ap.add_argument("--node-eval-frames", type=int, default=60,
                    help="held-out frames of the node-path evaluation (perception_sim_eval: "
                         "mAP, mIoU, 3D position error); 0 = skip")
    ap.add_argument("--bench-out", default="",
                    help="also write the kestrel_bench record STEM.json + STEM.md ('' = no)")
    ap.add_argument("--init", default="",
                    help="state dict (.pt) to start from (fine-tuning); '' = random init")
    ap.add_argument("--no-light", action="store_true",
                    help="training frames keep the world file's lighting")
    ap.add_argument("--out", default=str(ROOT / "ros2_ws/src/kestrel_perception/weights/"
                                                 "tiny_sim.pt"))
    args = ap.parse_args(argv)
    for name in ("frames", "eval_frames", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"parameter '{name}' = {getattr(args, name)}: must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cache = Path(args.cache_dir) if args.cache_dir else None
    modes_cycle = ["home", "near", "near", "uniform"]

    t0 = time.monotonic()
    # seed 0 (the demo layout) is frame 0 of each block of 20; the rest are random layouts
    tr_seeds = [0 if i % 20 == 0 else i for i in range(args.frames)]
    tr_modes = [modes_cycle[i % 4] for i in range(args.frames)]
    ev_seeds = [EVAL_SEED_BASE + i for i in range(args.eval_frames)]
    ev_modes = ["home" if i % 2 == 0 else "near" for i in range(args.eval_frames)]
    tr = render_set(tr_seeds, tr_modes, args.width, args.height, args.seed + 1,
                    args.min_box_px, cache, light=not args.no_light)
    ev = render_set(ev_seeds, ev_modes, args.width, args.height, args.seed + 2,
                    args.min_box_px, cache)
    t_data = time.monotonic() - t0
    print(f"data: {len(tr_seeds)} train / {len(ev_seeds)} eval frames in {t_data:.1f} s",
          flush=True)

    cfg = PerceptionConfig.tiny()
    model = MultiTaskPerceptionModel(cfg)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu", weights_only=True))
    sw = seg_weights(tr["cls"], cfg.num_classes)
    stream = tqdm(batch_stream(tr, args.batch_size, args.seed), total=args.steps,
                  desc="train", unit="step", mininterval=10.0)
    log = train(model, stream, args.steps, args.lr,
                seg_class_weights=sw, time_budget_s=args.time_budget or None,
                warmup_steps=args.warmup_steps,
                log=lambda s: print(s, flush=True))
    ev_batches = [to_batch(ev, np.arange(i, min(i + 8, len(ev_seeds))), None)
                  for i in range(0, len(ev_seeds), 8)]
    metrics = evaluate(model, ev_batches, CLASS_NAMES)
    demo = evaluate(model, [to_batch(tr, np.array([0]), None)], CLASS_NAMES)
    print(json.dumps({"heldout": metrics, "demo_seed0": demo}, indent=1), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    torch.save(state, out)
    meta = {
        "model_config": "PerceptionConfig.tiny()", "class_names": list(CLASS_NAMES),
        "image_size_wh": [args.width, args.height], "train_frames": args.frames,
        "train_seeds": "0 (demo layout, every 20th frame) and 1..frames-1",
        "eval_seeds": [ev_seeds[0], ev_seeds[-1]], "arm_pose_modes": modes_cycle,
        "steps_max": args.steps, "steps_done": log.steps,
        "time_budget_s": args.time_budget, "batch_size": args.batch_size, "lr": args.lr,
        "optimizer": f"AdamW wd 1e-4, {args.warmup_steps} warm-up steps, cosine", "seed": args.seed,
        "init": args.init or "random",
        "seg_class_weights": [round(float(x), 3) for x in sw],
        "augmentation": "brightness/contrast/colour jitter, horizontal flip",
        "lighting": None if args.no_light else {"scale_range": list(LIGHT_SCALE),
                                               "of": "headlight ambient, headlight diffuse, "
                                                     "light diffuse"},
        "episodes": {"min_objects": episode_config().min_objects,
                     "max_distractors": episode_config().max_distractors,
                     "from": str(SIM_YAML.relative_to(ROOT))},
        "data_wall_s": round(t_data, 1), "train_wall_s": round(log.wall_s, 1),
        "final_losses": log.history[-1] if log.history else {},
        "eval_heldout": metrics, "eval_demo_seed0": demo,
        "torch_version": torch.__version__, "mujoco_version": mujoco.__version__,
        "threads": args.threads, "file_bytes": out.stat().st_size,
        "command": "python scripts/train_perception_sim.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
    }
    if args.node_eval_frames > 0:
        import perception_sim_eval as pse
        ne = pse.render_eval_set(args.node_eval_frames, args.width, args.height, args.seed + 3,
                                 args.min_box_px, cache)
        meta["eval_node_heldout"] = pse.evaluate_weights(str(out), ne, threads=args.threads)
        print(json.dumps(meta["eval_node_heldout"], indent=1), flush=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) and {out.with_suffix('.json')}")
    if args.bench_out:
        from kestrel_bench.record import write
        write(bench_record(meta, argv if argv is not None else sys.argv[1:]), args.bench_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
