# Whether the host's sglang can honour a request's sampling_seed, read from its source files without
# importing it (importing sglang imports torch): SamplingParams must take `sampling_seed` (0.4.x has none:
# each request with it fails, HTTP 500) and ServerArgs must know --enable-deterministic-inference (without
# it SGLang ignores the seed; contract 7.3).
import importlib.util
import json
import os
import sys

FILES = {
    "sampling_seed": (os.path.join("srt", "sampling", "sampling_params.py"), "sampling_seed"),
    "deterministic_flag": (os.path.join("srt", "server_args.py"), "enable_deterministic_inference"),
}

out = {}  # type: dict  # the JSON report: values of every kind
try:
    spec = importlib.util.find_spec("sglang")
except (Exception, SystemExit) as exc:
    spec = None
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
if spec is None or not spec.submodule_search_locations:
    out.setdefault("error", "sglang is not installed for %s" % sys.executable)
else:
    root = list(spec.submodule_search_locations)[0]
    out["sglang"] = root
    for key, (rel, word) in FILES.items():
        path = os.path.join(root, rel)
        try:
            with open(path, encoding="utf-8") as f:
                out[key] = word in f.read()
        except OSError as exc:
            out[key] = None
            out[key + "_error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out), flush=True)
