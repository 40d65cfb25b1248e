"""SGLang's own client (`python -m sglang.bench_serving --backend sglang`) against the simulator of each profile.

Not part of `make test` or `make bench`: it needs SGLang's client installed, which this script does in a venv of
its own (default /tmp/sglvenv) without torch: sglang==0.5.5.post3 with --no-deps, plus only what
`sglang.bench_serving` imports (and `sglang/__init__.py`: IPython), pinned to what that SGLang pins
(transformers 4.57.1). Nothing else is downloaded: the `random` dataset samples its token ids from a ShareGPT-format
file, and this script writes a local one (otherwise bench_serving downloads ShareGPT).

For each simulated version (0.5.5, 0.5.10, 0.5.23) one simulator is started on the tiny model and bench_serving runs
twice against it, streaming (its default) and with --disable-stream. A case passes when every request completed
and the server generated exactly the tokens bench_serving asked for (it sends ignore_eos).

    .venv/bin/python -m tests.bench.sglang_client_check [--num-prompts N] [--venv DIR] [--keep DIR]

Prints bench_serving's result block per case and a summary; exit status 0 when every case passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SGLANG = "sglang==0.5.5.post3"
# what bench_serving (and sglang/__init__.py) import, at the versions sglang 0.5.5.post3 works with
CLIENT_DEPS = ["numpy", "aiohttp", "requests", "tqdm", "transformers==4.57.1", "pybase64", "pillow", "ipython", "pydantic",
               "datasets==4.0.0"]
VERSIONS = ("0.5.5", "0.5.10", "0.5.23")
SIM_KNOBS = ["--sim-step-ms", "5", "--sim-step-ms-per-req", "0.05"]
READY_LINE = "The server is fired up and ready to roll!"
RESULT_LINES = ("Successful requests", "Benchmark duration", "Total generated tokens:", "Request throughput",
                "Output token throughput", "Mean TTFT", "Mean TPOT")


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang.bench_serving"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing SGLang's client into {venv} (no torch) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--no-deps", SGLANG], check=True)
    subprocess.run(pip + CLIENT_DEPS, check=True)
    check = subprocess.run(probe, capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"{python} cannot import sglang.bench_serving after the install:\n{check.stderr}")
    return python


def tokenizer_dir(work: Path) -> Path:
    """The tiny model, its tokenizer config in the form transformers 4.57 reads: build_tiny_model writes it with
    transformers 5 (`tokenizer_class: TokenizersBackend`, `extra_special_tokens` as a list), which 4.57 refuses."""
    from engine.text.tiny_model import build_tiny_model

    built = build_tiny_model(work / "tiny-built")
    model = work / "tiny"
    shutil.copytree(built, model, dirs_exist_ok=True)
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    config.pop("backend", None)
    path.write_text(json.dumps(config, indent=2))
    return model


def write_sharegpt(path: Path, n: int = 300) -> None:
    rng = random.Random(0)
    words = "the of and to in is that for it as with was on be by this are or at from which an have not".split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    rows = [{"id": str(i), "conversations": [{"from": "human", "value": text(20, 160)},
                                             {"from": "gpt", "value": text(20, 200)}]} for i in range(n)]
    path.write_text(json.dumps(rows))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_simulator(model: Path, version: str, log_path: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv = [sys.executable, "-m", "engine.simulator", "--model-path", str(model), "--port", str(port),
            "--enable-metrics", "--sim-sglang-version", version, *SIM_KNOBS]
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO),
                            env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while READY_LINE not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"simulator {version} not ready (exit {proc.returncode}); log {log_path}:\n"
                             + log_path.read_text(errors="replace")[-2000:])
        time.sleep(0.2)  # polling a log file for the ready line, with a deadline
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def bench(python: Path, port: int, model: Path, dataset: Path, out: Path, stream: bool, n: int) -> dict:
    argv = [str(python), "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random",
            "--dataset-path", str(dataset), "--random-input-len", "256", "--random-output-len", "128",
            "--num-prompts", str(n), "--request-rate", "inf", "--seed", "1", "--disable-tqdm",
            "--output-file", str(out)] + ([] if stream else ["--disable-stream"])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    asked = re.search(r"#Output tokens: (\d+)", text)
    result = json.loads(out.read_text().splitlines()[-1]) if r.returncode == 0 and out.exists() else {}
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_LINES)]
    errors = [ln for ln in text.splitlines() if "error" in ln.lower() and "Fail to set RLIMIT" not in ln]
    return {"exit": r.returncode, "asked_tokens": int(asked.group(1)) if asked else None, "result": result,
            "lines": lines, "errors": errors[-5:], "tail": text[-3000:] if r.returncode else ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--venv", type=Path, default=Path("/tmp/sglvenv"))
    ap.add_argument("--keep", type=Path, default=None, help="work dir kept (simulator logs, results)")
    args = ap.parse_args(argv)
    python = ensure_venv(args.venv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="regen-sglang-client-"))
    work.mkdir(parents=True, exist_ok=True)
    model = tokenizer_dir(work)
    dataset = work / "sharegpt_local.json"
    write_sharegpt(dataset)
    summary, failed = [], 0
    for version in VERSIONS:
        proc, port = start_simulator(model, version, work / f"sim-{version}.log")
        try:
            for stream in (True, False):
                case = f"{version} {'stream' if stream else 'no-stream'}"
                res = bench(python, port, model, dataset, work / f"result-{version}-{int(stream)}.jsonl", stream,
                            args.num_prompts)
                r = res["result"]
                ok = (res["exit"] == 0 and r.get("completed") == args.num_prompts
                      and r.get("total_output_tokens") == res["asked_tokens"])
                failed += not ok
                print(f"== {case}: {'PASS' if ok else 'FAIL'} (exit {res['exit']})")
                for line in res["lines"] + res["errors"]:
                    print("   " + line)
                if res["tail"]:
                    print(res["tail"])
                summary.append(f"{case:18} {'PASS' if ok else 'FAIL'}  completed {r.get('completed')}/"
                               f"{args.num_prompts}  output tokens {r.get('total_output_tokens')} (asked "
                               f"{res['asked_tokens']})  {r.get('output_throughput', 0):.0f} out tok/s  "
                               f"{r.get('request_throughput', 0):.1f} req/s  server_info version "
                               f"{(r.get('server_info') or {}).get('version')}")
        finally:
            stop(proc)
    print("\n".join(["", "summary:"] + summary))
    print(f"work dir: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
