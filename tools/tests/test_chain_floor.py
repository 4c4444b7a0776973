"""kestrel_bench.chain_floor: GPU only; elsewhere it says so and exits 2."""

from __future__ import annotations

import pytest
import torch

from kestrel_bench import chain_floor


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer only")
def test_without_a_gpu_it_says_what_is_missing(capsys) -> None:  # noqa: ANN001
    assert chain_floor.main(["--kernels", "4"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or chain_floor.triton is None,
                    reason="needs a CUDA GPU and triton")
def test_a_short_chain_is_timed() -> None:
    times = chain_floor.time_chain(4, 3, False, 5)
    assert len(times) == 5 and 0 < times[0] <= times[-1]
