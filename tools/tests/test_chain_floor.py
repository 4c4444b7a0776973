"""kestrel_bench.chain_floor: GPU only; elsewhere it says so and exits 2."""

from __future__ import annotations

import pytest
import torch

from kestrel_bench import chain_floor

GPU = pytest.mark.skipif(not torch.cuda.is_available() or chain_floor.triton is None,
                         reason="needs a CUDA GPU and triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer only")
def test_without_a_gpu_it_says_what_is_missing(capsys) -> None:  # noqa: ANN001
    assert chain_floor.main(["--kernels", "4"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@GPU
def test_a_short_chain_is_timed() -> None:
    times = chain_floor.time_chain(4, 3, False, 5)
    assert len(times) == 5 and 0 < times[0] <= times[-1]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("barrier", chain_floor.BARRIERS)
def test_every_persistent_barrier_completes_its_phases(barrier: str) -> None:
    """A barrier that let a program run ahead or wait forever would hang or time out here;
    the grid is twice the SM count, so programs share SMs."""
    grid = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    times = chain_floor.time_barrier(6, grid, barrier, 5)
    assert len(times) == 5 and 0 < times[0] <= times[-1]
    stream, nbytes = chain_floor.time_stream(6, grid, True, 5, barrier)
    assert len(stream) == 5 and nbytes == 6 * grid * chain_floor.ROWS * chain_floor.D * 2


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("barrier", chain_floor.BARRIERS)
def test_the_persistent_gemv_chain_computes_what_the_kernel_chain_does(barrier: str) -> None:
    """The last phase's row from one persistent kernel equals the PDL kernels' row: a barrier
    that let a phase read its input early would give another row."""
    want = chain_floor.stream_result(5, 64, False)
    got = chain_floor.stream_result(5, 64, True, barrier)
    assert want.abs().max() > 0.1  # the row neither vanished nor stayed at its start
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
