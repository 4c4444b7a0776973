"""A user's own perception model behind an output contract: the same toy model saved as
TorchScript, ExportedProgram and ONNX gives the same outputs through ExternalPerceptionModel;
contract mistakes fail at load with the parameter named; decoded detections go through the
same threshold / class-wise NMS / slots as the reference head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel_models.perception.external import (ExternalPerceptionModel, OutputContract,
                                                parse_outputs)
from kestrel_models.perception.postprocess import detections_from_decoded

torch.set_num_threads(1)
K = 4  # classes


class ToyDetector(nn.Module):
    """uint8 [B,3,H,W] -> (boxes [B,3,4], scores [B,3], labels [B,3], seg [B,K,H/4,W/4],
    depth [B,1,H/4,W/4]): two overlapping class-1 boxes (NMS keeps the better), one class-2 box;
    depth 2 m everywhere; seg favours class 3."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(4)
        self.seg = nn.Conv2d(3, K, 1)
        with torch.no_grad():
            self.seg.weight.zero_()
            self.seg.bias.copy_(torch.tensor([0.0, 0.1, 0.2, 1.0]))

    def forward(self, images: torch.Tensor):
        b = images.shape[0]
        x = self.pool(images.float() / 255.0)
        boxes = torch.tensor([[10.0, 10.0, 50.0, 50.0], [12.0, 12.0, 52.0, 52.0],
                              [60.0, 20.0, 90.0, 60.0]]).expand(b, 3, 4) + 0 * x.mean()
        scores = torch.tensor([0.9, 0.8, 0.7]).expand(b, 3) + 0 * x.mean()
        labels = torch.tensor([1, 1, 2]).expand(b, 3)
        depth = torch.full_like(x[:, :1], 2.0)
        return boxes, scores, labels, self.seg(x), depth


ROLES = ["boxes:output0", "scores:output1", "labels:output2", "seg:output3", "depth:output4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("user_models")
    m = ToyDetector().eval()
    x = torch.zeros((2, 3, 64, 96), dtype=torch.uint8)
    out = {"torchscript": str(d / "det.pt"), "exported_program": str(d / "det.pt2"),
           "onnx": str(d / "det.onnx")}
    torch.jit.save(torch.jit.trace(m, x), out["torchscript"])
    torch.export.save(torch.export.export(m, (x,)), out["exported_program"])
    torch.onnx.export(m, (x,), out["onnx"], input_names=["images"], dynamo=False,
                      output_names=[f"output{i}" for i in range(5)],
                      dynamic_axes={"images": {0: "cameras"}})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torchscript", "exported_program", "onnx"])
def test_every_format_gives_the_same_outputs(files, fmt) -> None:
    ext = ExternalPerceptionModel(files[fmt], "auto", OutputContract(parse_outputs(ROLES)))
    assert ext.format == fmt and ext.heads == {"detection", "segmentation", "depth"}
    ext.check(2, (64, 96), K)
    x = torch.randint(0, 255, (2, 3, 64, 96), dtype=torch.uint8)
    raw = ext(x)
    ref = ToyDetector().eval()(x)
    torch.testing.assert_close(raw["det_boxes"], ref[0])
    assert raw["det_labels"].dtype == torch.long and raw["det_labels"].tolist()[0] == [1, 1, 2]
    assert raw["seg"].shape == (2, K, 64, 96) and raw["depth"].shape == (2, 1, 64, 96)
    assert torch.all(raw["seg"].argmax(1) == 3) and torch.allclose(raw["depth"], torch.tensor(2.0))
    assert set(ext(x, frozenset({"depth"}))) == {"depth"}  # heads switched off at run time


@pytest.mark.slow
def test_contract_mistakes_fail_at_load_naming_the_parameter(files, tmp_path) -> None:
    with pytest.raises(ValueError, match="parameter 'model.outputs'.*come together"):
        parse_outputs(["boxes:output0", "seg:output3"])
    with pytest.raises(ValueError, match="parameter 'model.outputs'.*role in"):
        parse_outputs(["mask:output3"])
    ext = ExternalPerceptionModel(files["onnx"], "onnx", OutputContract(
        parse_outputs(["seg:logits"])))
    with pytest.raises(ValueError, match=r"parameter 'model.outputs'.*'logits' \(seg\) not "
                                         r"found; the model returns \['output0'"):
        ext.check(1, (64, 96), K)
    ext = ExternalPerceptionModel(files["torchscript"], "auto", OutputContract(
        parse_outputs(["seg:output3"])))
    with pytest.raises(ValueError, match=r"seg has shape \(1, 4, 16, 24\), expected \[1, 5 "):
        ext.check(1, (64, 96), 5)
    with pytest.raises(ValueError, match="parameter 'model.path'.*file not found"):
        ExternalPerceptionModel(str(tmp_path / "none.onnx"), "auto", OutputContract({"seg": "x"}))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(ValueError, match="parameter 'model.path'.*cannot load as onnx"):
        ExternalPerceptionModel(str(bad), "auto", OutputContract({"seg": "x"}))
    with pytest.raises(ValueError, match="parameter 'model.input_name' = 'img'"):
        ExternalPerceptionModel(files["onnx"], "onnx", OutputContract({"seg": "output3"},
                                                                      input_name="img"))


@pytest.mark.slow
@pytest.mark.parametrize("static,compile", [(True, False), (False, False), (True, True)])
def test_decoded_detections_get_threshold_nms_and_label_checks(static, compile) -> None:
    """(compile: the static path's compiled steps, as the node runs them on CUDA.)"""
    from kestrel_models.perception import compiled
    boxes = torch.tensor([[[10.0, 10, 50, 50], [12, 12, 52, 52], [60, 20, 90, 60],
                           [0, 0, 5, 5], [1, 1, 30, 30], [200, 200, 300, 300]]])
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.2, float("nan"), 0.95]])
    labels = torch.tensor([[1, 1, 2, 1, 1, 9]])  # label 9 is out of range (K = 4)
    d = detections_from_decoded(boxes, scores, labels, (64, 96), K, 0.3, 0.5, 8,
                                static=static, compile=compile)
    assert compiled.errors == []
    kept = [(round(float(s), 3), int(c)) for s, c, v in
            zip(d.scores[0], d.classes[0], d.valid[0], strict=True) if v]
    # overlapping class-1 pair -> the 0.9 one; 0.2 under the threshold; NaN score and
    # label 9 dropped (the box beyond the image is also empty after clipping)
    assert kept == [(0.9, 1), (0.7, 2)]
