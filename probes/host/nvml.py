# GPUs through NVML (pynvml from nvidia-ml-py), as the engine's telemetry reads them.
import json
import sys


def text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def fail(stage, exc):
    print(json.dumps({"ok": False, "stage": stage, "error": "%s: %s" % (type(exc).__name__, exc)}))
    sys.exit(0)


try:
    import pynvml
except Exception as exc:
    fail("import", exc)
try:
    pynvml.nvmlInit()
except Exception as exc:
    fail("nvmlInit", exc)
out = {"ok": True, "module": getattr(pynvml, "__file__", None), "gpus": []}  # type: dict  # the JSON report
try:
    out["driver_version"] = text(pynvml.nvmlSystemGetDriverVersion())
    cuda = pynvml.nvmlSystemGetCudaDriverVersion()
    out["cuda_version"] = "%d.%d" % (cuda // 1000, (cuda % 1000) // 10)
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out["gpus"].append({"index": i, "name": text(pynvml.nvmlDeviceGetName(handle)),
                            "memory_total_mib": mem.total // (1 << 20), "memory_used_mib": mem.used // (1 << 20)})
except Exception as exc:
    fail("query", exc)
finally:
    try:
        pynvml.nvmlShutdown()
    except Exception as exc:
        out["shutdown_error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
