# torch's CUDA build and runtime, and the CUDA toolkit's nvcc (needed by some SGLang kernels' JIT).
import json
import os
import re
import shutil
import subprocess
import sys

args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
out = {}  # type: dict  # the JSON report: values of every kind
nvcc = shutil.which("nvcc")
searched = ["PATH=" + os.environ.get("PATH", "")]
if nvcc is None:
    candidates = [os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")] if os.environ.get("CUDA_HOME") else []
    for cand in candidates + list(args.get("nvcc_candidates", ["/usr/local/cuda/bin/nvcc"])):
        searched.append(cand)
        if os.access(cand, os.X_OK):
            nvcc = cand
            break
out["nvcc"] = {"path": nvcc, "searched": searched}
if nvcc is not None:
    try:
        proc = subprocess.run([nvcc, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvcc"]["error"] = "%s: %s" % (type(exc).__name__, exc)
    else:
        stdout = proc.stdout.decode("utf-8", "replace")
        out["nvcc"].update(exit_status=proc.returncode, stdout=stdout, stderr=proc.stderr.decode("utf-8", "replace"))
        match = re.search(r"release (\d+\.\d+)", stdout)
        out["nvcc"]["version"] = match.group(1) if match else None
try:
    import torch
except Exception as exc:
    out["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
else:
    out["torch_version"] = str(torch.__version__)
    out["torch_file"] = getattr(torch, "__file__", None)
    out["torch_cuda"] = getattr(torch.version, "cuda", None)
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = int(torch.cuda.device_count())
        if out["cuda_available"]:
            out["devices"] = [str(torch.cuda.get_device_name(i)) for i in range(out["device_count"])]
        else:
            try:
                torch.cuda.init()  # raises with the reason is_available() keeps to itself
            except Exception as exc:
                out["cuda_error"] = "%s: %s" % (type(exc).__name__, exc)
    except Exception as exc:
        out["cuda_error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
