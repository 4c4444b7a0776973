"""The dense class-wise NMS as two Triton kernels (perception/nms_triton.py) == the torch matrix
rounds of `postprocess.batched_nms_dense`.

CPU: the dispatch (triton absent or CPU tensors -> the torch path, `nms_dense` refuses). GPU
(marked gpu): EXACT equality of keep and converged with the torch path at the node's sizes
(6 images x 1000 candidates, 80 classes) and at odd sizes, with invalid slots, heavy overlap,
boxes touching the threshold, a suppression chain longer than the rounds (converged False),
and inside a torch.cuda.CUDAGraph replayed with new inputs; then the whole static decode with
the kernels vs without."""

from __future__ import annotations

import pytest
import torch
from kestrel_models.perception import nms_triton
from kestrel_models.perception import postprocess as pp

torch.set_num_threads(1)
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and nms_triton.HAVE_TRITON),
                         reason="needs a CUDA GPU and triton (CI has neither)")


def candidates(b: int, n: int, classes: int, seed: int, device: str = "cpu",
               invalid: float = 0.2, spread: float = 200.0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(b, n, 2, generator=g) * spread
    wh = 5 + torch.rand(b, n, 2, generator=g) * 60
    boxes = torch.cat([xy, xy + wh], 2)
    scores = torch.rand(b, n, generator=g).sort(dim=1, descending=True).values
    cls = torch.randint(0, classes, (b, n), generator=g)
    valid = torch.rand(b, n, generator=g) > invalid
    return boxes.to(device), scores.to(device), cls.to(device), valid.to(device)


def both(boxes, scores, cls, valid, iou, rounds):
    pp.USE_TRITON_NMS = False
    try:
        ref = pp.batched_nms_dense(boxes, scores, cls, valid, iou, rounds)
    finally:
        pp.USE_TRITON_NMS = True
    got = pp.batched_nms_dense(boxes, scores, cls, valid, iou, rounds)
    return ref, got


def test_cpu_tensors_take_the_torch_path() -> None:
    boxes, scores, cls, valid = candidates(2, 50, 3, 0)
    assert not nms_triton.available(boxes)
    with pytest.raises(RuntimeError, match="torch path"):
        nms_triton.nms_dense(boxes, valid, 0.5, 4)
    (k1, c1), (k2, c2) = both(boxes, scores, cls, valid, 0.5, 4)
    assert torch.equal(k1, k2) and bool(c1) == bool(c2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,n,classes,iou,rounds,spread", [
    (6, 1000, 80, 0.6, 8, 400.0),   # the node's sizes
    (6, 1000, 2, 0.3, 8, 60.0),     # heavy overlap, few classes: long chains
    (3, 37, 1, 0.5, 1, 30.0),       # odd size, one round: not converged
    (1, 129, 5, 0.45, 3, 100.0),
    (2, 1, 1, 0.5, 8, 10.0),
])
def test_kernels_equal_the_torch_rounds(b, n, classes, iou, rounds, spread) -> None:
    for seed in range(3):
        boxes, scores, cls, valid = candidates(b, n, classes, seed, "cuda", spread=spread)
        (k_ref, c_ref), (k, c) = both(boxes, scores, cls, valid, iou, rounds)
        assert torch.equal(k, k_ref), (seed, (k != k_ref).sum().item())
        assert bool(c) == bool(c_ref)
        if rounds == 1 and n == 37:
            assert not bool(c_ref)  # the case is what it claims to be


@gpu
@pytest.mark.gpu
def test_threshold_ties_and_the_hand_made_chain() -> None:
    # pairs whose IoU is exactly representable around the threshold: 50 % overlap
    boxes = torch.tensor([[[0.0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10], [15, 0, 25, 10],
                           [100, 100, 110, 110], [0, 0, 10, 10]]], device="cuda")
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]], device="cuda")
    cls = torch.zeros(1, 6, dtype=torch.long, device="cuda")
    valid = torch.ones(1, 6, dtype=torch.bool, device="cuda")
    for iou in (1 / 3, 0.3, 0.5, 1.0, 0.0):
        for rounds in (1, 4):
            (k_ref, c_ref), (k, c) = both(boxes, scores, cls, valid, iou, rounds)
            assert torch.equal(k, k_ref) and bool(c) == bool(c_ref), (iou, rounds)


@gpu
@pytest.mark.gpu
def test_kernels_in_a_cuda_graph_replay_new_inputs() -> None:
    boxes, scores, cls, valid = candidates(6, 1000, 80, 1, "cuda")
    static = [t.clone() for t in (boxes, scores, cls, valid)]
    pp.batched_nms_dense(*static, 0.6, 8)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep, conv = pp.batched_nms_dense(*static, 0.6, 8)
    for seed in (5, 6):
        new = candidates(6, 1000, 80, seed, "cuda")
        for s, t in zip(static, new, strict=True):
            s.copy_(t)
        graph.replay()
        (k_ref, c_ref), _ = both(*new, 0.6, 8)
        assert torch.equal(keep, k_ref) and bool(conv) == bool(c_ref)


@gpu
@pytest.mark.gpu
def test_a_captured_graph_follows_a_threshold_tensor() -> None:
    """The perception node keeps the NMS IoU threshold in a device tensor: a graph captured
    once gives, after the tensor is refilled, the result of the new threshold (a float would
    have been frozen into the capture)."""
    boxes, scores, cls, valid = candidates(6, 1000, 2, 7, "cuda")  # 2 classes: overlaps
    thr = torch.full((), 0.6, device="cuda")
    pp.batched_nms_dense(boxes, scores, cls, valid, thr, 8)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep, conv = pp.batched_nms_dense(boxes, scores, cls, valid, thr, 8)
    kept = []
    for iou in (0.6, 0.2, 0.9):
        thr.fill_(iou)
        graph.replay()
        (k_ref, c_ref), _ = both(boxes, scores, cls, valid, iou, 8)
        assert torch.equal(keep, k_ref) and bool(conv) == bool(c_ref), iou
        kept.append(int(keep.sum()))
    assert kept[1] < kept[0] < kept[2], kept  # the threshold really changed the result


@gpu
@pytest.mark.gpu
def test_static_decode_with_and_without_the_kernels() -> None:
    g = torch.Generator().manual_seed(3)
    raw = {"det_cls": [], "det_ltrb": [], "det_ctr": []}
    for s in (8, 16, 32):
        h = w = 640 // s
        raw["det_cls"].append(torch.randn(6, 80, h, w, generator=g).cuda())
        raw["det_ltrb"].append((torch.rand(6, 4, h, w, generator=g) * 4 * s).cuda())
        raw["det_ctr"].append(torch.randn(6, 1, h, w, generator=g).cuda())
    pp.USE_TRITON_NMS = False
    try:
        ref = pp.decode_detections_batched(raw, (640, 640), 0.3, 0.6, 20)
    finally:
        pp.USE_TRITON_NMS = True
    got = pp.decode_detections_batched(raw, (640, 640), 0.3, 0.6, 20)
    for a, b in ((ref.boxes, got.boxes), (ref.scores, got.scores), (ref.classes, got.classes),
                 (ref.valid, got.valid)):
        assert torch.equal(a, b)
    assert int(ref.valid.sum()) > 20  # detections were made
