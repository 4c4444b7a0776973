"""Per-kernel GPU time of one SmolVLM-256M-shaped decode step (scratch, not committed)."""
import sys, collections
sys.path[:0] = ["tools", "models"]
import torch
from kestrel_bench import planner_steps as ps
from kestrel_bench.repo import ensure_paths
ensure_paths("kestrel_models")
from kestrel_models.planner.engine import DecodeEngine

shape = sys.argv[1] if len(sys.argv) > 1 else "smolvlm-256m"
dev = torch.device("cuda")
dec, prompt, image, n_img = ps._request(shape, dev, torch.bfloat16)
for name in ("whole_rows", "whole_rows_pdl"):
    kw = dict(ps.OPTIONS[name])
    need = n_img + len(prompt) + 128 + 8
    max_len = 1 << (need - 1).bit_length()
    eng = DecodeEngine(dec, 1, max_len, -1, compile_step=True, **kw)
    eng.generate([prompt], 128, images=[image])
    pos = n_img + len(prompt) + 64
    t = ps._step_times(eng, pos, 200, 30)
    t.sort(); print(name, "p50 us", round(t[len(t)//2]*1e6, 1), "max_len", max_len, "n_img", n_img, "pos", pos)
    key = max(k for k in eng._graphs if k[0] == 1 and k[2] == 1 and not k[3])
    graph, _ = eng._graphs[key]
    from torch.profiler import profile, ProfilerActivity
    N = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(N):
            graph.replay()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in evs:
        a = agg[e.name[:90]]; a[0] += 1; a[1] += e.device_time
    tot = sum(v[1] for v in agg.values()) / N
    print(f"  kernels per step {sum(v[0] for v in agg.values())/N:.0f}, summed kernel time {tot:.1f} us")
    for k, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {us/N:8.1f} us  {c/N:5.0f}x  {us/c:6.2f} us each  {k}")
    del eng
