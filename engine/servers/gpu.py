"""GPU readings through NVML (nvidia-ml-py). Any NVML failure is a visible N/A with its text."""
from __future__ import annotations

from engine.api.events import GpuEvent


class GpuSampler:
    def __init__(self) -> None:
        self.init_error: str | None = None
        self._nvml = None
        self._handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except Exception as exc:  # NVMLError, ImportError, OSError (no libnvidia-ml): reported, not fatal
            self.init_error = f"NVML unavailable: {type(exc).__name__}: {exc}"

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def sample(self) -> list[GpuEvent]:
        if self._nvml is None:
            return [GpuEvent(index=0, error=self.init_error)]
        nv = self._nvml
        events = []
        for index, handle in enumerate(self._handles):
            ev = GpuEvent(index=index)
            errors: list[str] = []

            def read(label, fn):
                try:
                    return fn()
                except Exception as exc:  # per-field NVML failure -> that field is N/A, text kept
                    errors.append(f"{label}: {exc}")
                    return None

            name = read("name", lambda: nv.nvmlDeviceGetName(handle))
            ev.name = name.decode() if isinstance(name, bytes) else name
            mem = read("memory", lambda: nv.nvmlDeviceGetMemoryInfo(handle))
            if mem is not None:
                ev.mem_used_mb = mem.used / 2**20
                ev.mem_total_mb = mem.total / 2**20
            util = read("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(handle))
            ev.util_pct = float(util.gpu) if util is not None else None
            temp = read("temperature", lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
            ev.temp_c = float(temp) if temp is not None else None
            power = read("power", lambda: nv.nvmlDeviceGetPowerUsage(handle))
            ev.power_w = power / 1000.0 if power is not None else None
            ev.error = "; ".join(errors) or None
            events.append(ev)
        return events

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:  # shutdown failure changes nothing for the run; say so
                print(f"NVML shutdown failed: {exc}")
