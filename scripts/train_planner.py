#!/usr/bin/env python3
"""Train the planner VLM on generated (image, scene objects, instruction) -> plan pairs.

    bash scripts/run.sh python scripts/train_planner.py \
        --out ros2_ws/src/kestrel_planner/weights/planner_small.pt

Data, model and metrics: kestrel_planner.training (data.py: the generator; train.py: the
loop and the held-out evaluation, greedy decoding with and without the plan grammar). Runs on
the CPU. Writes the state dict (.pt) and, next to it, a .json with the command, the config,
the training time, the loss curve (every 50 steps) and the held-out metrics.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in ("models", "ros2_ws/src/kestrel_planner"):
    if str(ROOT / _p) not in sys.path:
        sys.path.insert(0, str(ROOT / _p))

import torch  # noqa: E402
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # noqa: E402
                           TimeElapsedColumn, TimeRemainingColumn)

from kestrel_planner.training.train import TrainConfig, evaluate, train  # noqa: E402


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="state dict path (.pt)")
    ap.add_argument("--preset", default=d.preset, help="VLM preset (kestrel_models.planner)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    ap.add_argument("--device", default=d.device, help="torch device: cpu | cuda")
    ap.add_argument("--workers", type=int, default=d.workers,
                    help="batch-generating processes (0: in the training process)")
    ap.add_argument("--init", default="", help="start from this state dict of --preset "
                    "(fine-tuning on the current data) instead of a random init")
    ap.add_argument("--eval-samples", type=int, default=d.eval_samples,
                    help="held-out samples per evaluation (0 = no evaluation)")
    ap.add_argument("--evaluate-only", action="store_true",
                    help="load --out (trained elsewhere, e.g. on the GPU machine) and its .json, "
                         "run the held-out evaluation here, write the metrics into the .json")
    args = ap.parse_args(argv)
    if args.evaluate_only:
        return _evaluate_only(args.out, args.eval_samples, argv)
    cfg = TrainConfig(preset=args.preset, steps=args.steps, batch=args.batch, lr=args.lr,
                      seed=args.seed, threads=args.threads, eval_samples=args.eval_samples,
                      device=args.device, workers=args.workers, init=args.init,
                      warmup=min(d.warmup, max(1, args.steps // 10)))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
    metrics: dict = {}
    # where fine-tuned weights started: the record of that training (read before --out may
    # overwrite it)
    init_json = Path(args.init).with_suffix(".json") if args.init else None
    init_record = ({k: v for k, v in json.loads(init_json.read_text()).items()
                    if k in ("command", "commit", "date", "machine", "train_seconds", "init")}
                   if init_json is not None and init_json.exists() else None)
    with Progress(*columns) as progress:
        task = progress.add_task("train", total=cfg.steps, info="")

        def on_step(step: int, loss: float) -> None:
            progress.update(task, completed=step + 1, info=f"loss {loss:.4f}")
            if (step + 1) % 100 == 0:  # also a line in logs (no terminal: no live bar)
                progress.console.print(f"step {step + 1}/{cfg.steps} loss {loss:.4f}")

        model, hist = train(cfg, on_step)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.out)  # before the (slower) evaluation
        for grammar in (True, False) if cfg.eval_samples else ():
            name = "grammar_on" if grammar else "grammar_off"
            ev = progress.add_task(f"eval {name}", total=cfg.eval_samples, info="")
            metrics[name] = evaluate(model, cfg.eval_samples, grammar,
                                     on_batch=lambda n, ev=ev: progress.update(ev, completed=n))
    record = {
        "command": "python scripts/train_planner.py " + " ".join(
            a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:])),
        "commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"class": "gpu" if cfg.device.startswith("cuda") else "cpu",
                    "device": (torch.cuda.get_device_name() if cfg.device.startswith("cuda")
                               else platform.processor() or platform.machine()),
                    "threads": cfg.threads, "workers": cfg.workers, "torch": torch.__version__},
        "config": {**vars(cfg), "params": model.num_params()},
        "train_seconds": round(hist.seconds, 1),
        "loss": {"first": round(hist.loss[0], 4), "last": round(hist.loss[-1], 4),
                 "every_50": [round(x, 4) for x in hist.loss[::50]]},
        "heldout": metrics,
    }
    if args.init:
        record["init"] = {"path": args.init, "record": init_record}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    _print_metrics(metrics)
    print(f"trained in {hist.seconds:.0f} s; wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


def _print_metrics(metrics: dict) -> None:
    for name, m in metrics.items():
        print(f"{name}: grammatical {m['grammatical']:.3f}  exact {m['exact']:.3f}  refusals "
              f"{m['refusals']:.3f}  false refusals {m['false_refusals']:.3f}  accepted "
              f"{m['accepted']:.3f}")


def _evaluate_only(out: Path, n: int, argv: list[str] | None) -> int:
    from kestrel_models.planner import VisionLanguageModel, get_config

    record = json.loads(out.with_suffix(".json").read_text())
    model = VisionLanguageModel(get_config(record["config"]["preset"]))
    model.load_state_dict(torch.load(out, map_location="cpu", weights_only=True))
    metrics = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as progress:
        for grammar in (True, False):
            name = "grammar_on" if grammar else "grammar_off"
            ev = progress.add_task(f"eval {name}", total=n)
            metrics[name] = evaluate(model.eval(), n, grammar,
                                     on_batch=lambda k, ev=ev: progress.update(ev, completed=k))
    record["heldout"] = metrics
    record["config"]["eval_samples"] = n
    record["evaluation"] = {
        "command": "python scripts/train_planner.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"class": "cpu", "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__}}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    _print_metrics(metrics)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
