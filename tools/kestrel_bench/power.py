"""GPU power and energy over a timed window, through NVML (nvidia-ml-py, `import pynvml`).

    meter = PowerMeter()            # never raises: without NVML, meter.skipped says why
    with meter:
        run_the_timed_loop()        # n items (inferences, tokens, control steps)
    record_result["power"] = meter.result(items=n, item="inference")

result() -> {"avg_w", "energy_j", "energy_j_per_item", "item", "window_s", "samples",
"method"} or {"skipped": reason}. Energy comes from the driver's total-energy counter (mJ, Volta
and newer) where the device has one ("method": "energy_counter"), else from the mean of power
samples taken by a thread every `interval_s` times the window ("method": "sampled"). The
driver refreshes its power reading every few tens of ms, so a window under ~1 s gives a
coarse figure (flagged with "coarse": true): time long loops when power matters.
"""

from __future__ import annotations

import threading
import time

MIN_WINDOW_S = 1.0  # below this the figure is flagged coarse


class PowerMeter:
    """Average board power (W) and energy (J) of one NVIDIA GPU over a `with` window."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.skipped: str | None = None
        self._nvml = None
        self._handle = None
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = self._t1 = 0.0
        self._e0 = self._e1 = None
        try:
            import pynvml
        except ImportError:
            self.skipped = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            pynvml.nvmlDeviceGetPowerUsage(self._handle)
        except Exception as exc:  # noqa: BLE001 (NVMLError_* or a missing libnvidia-ml)
            self.skipped = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return
        self._nvml = pynvml

    def _energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 (not supported on this device)
            return None

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self._samples.append(self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3)
            except Exception:  # noqa: BLE001 (a failed read is a missing sample)
                pass
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self.skipped:
            return
        self._samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._sample, name="kestrel-power", daemon=True)
        self._e0 = self._energy_mj()
        self._t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        if self.skipped or self._thread is None:
            return
        self._t1 = time.perf_counter()
        self._e1 = self._energy_mj()
        self._stop.set()
        self._thread.join(1.0)
        self._thread = None

    def __enter__(self) -> PowerMeter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def result(self, items: int | None = None, item: str = "item") -> dict:
        """The window's average power and energy (per item when `items` is given)."""
        if self.skipped:
            return {"skipped": self.skipped}
        window = self._t1 - self._t0
        if window <= 0:
            return {"skipped": "no timed window (start/stop not called)"}
        if self._e0 is not None and self._e1 is not None and self._e1 > self._e0:
            energy, method = (self._e1 - self._e0) / 1e3, "energy_counter"
        elif self._samples:
            energy, method = sum(self._samples) / len(self._samples) * window, "sampled"
        else:
            return {"skipped": "no power samples in the window"}
        out = {"avg_w": energy / window, "energy_j": energy, "window_s": window,
               "samples": len(self._samples), "method": method, "item": item}
        if items:
            out["energy_j_per_item"] = energy / items
            out["items"] = int(items)
        if window < MIN_WINDOW_S:
            out["coarse"] = True
        return out


def skipped_without_cuda(cuda: bool) -> dict | None:
    """{"skipped": ...} for a path that does not run on the GPU, else None."""
    return None if cuda else {"skipped": "path runs on the CPU (NVML measures GPUs only)"}
