"""Small pieces of the engine with real inputs: metrics text, launch command, error lines, control socket."""
from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from engine.servers.capacity import parse_server_info
from engine.config.load import RunConfig, Workers
from engine.api.control_socket import request
from engine.api.ops import ControlError
from engine.supervisor.control import ControlServer
from engine.servers.metrics_client import parse_metrics
from engine.api.ops import Pause
from engine.servers.launch import WorkerSpec, launch_argv, redact, worker_specs
from engine.servers.server_log import error_lines

METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 1520.5
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.42
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 8.128902e+06
"""


def test_metrics_are_parsed_from_prometheus_text():
    m = parse_metrics(METRICS)
    assert (m.running_reqs, m.queued_reqs, m.gen_throughput, m.token_usage) == (12.0, 3.0, 1520.5, 0.42)
    assert parse_metrics("").running_reqs is None


def test_server_info_prefers_resolved_internal_state():
    info = {"max_running_requests": None, "max_total_num_tokens": 90000, "context_length": None,
            "internal_states": [{"max_running_requests": 48, "context_length": 4096}]}
    cap = parse_server_info(info)
    assert (cap.max_running_requests, cap.max_total_num_tokens, cap.context_length) == (48, 90000, 4096)


def test_launch_argv_keeps_paths_with_spaces_and_redacts_the_key():
    cfg = RunConfig(run_dir="/r", model="/models/my model", prompts=("p",),
                    workers=Workers(gpus=(0, 1, 2, 3), tp_size=2, api_key="s3cret", extra_args=("--log-level", "debug")))
    specs = worker_specs(cfg)
    assert [s.name for s in specs] == ["gpu0-1", "gpu2-3"]
    assert specs[1].port == 30001
    argv = launch_argv(cfg, specs[0], "/usr/bin/python3")
    assert argv[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "/models/my model"
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert argv[-2:] == ["--api-key", "s3cret"] and "--log-level" in argv
    assert "s3cret" not in redact(" ".join(argv), "s3cret")


def test_error_lines_quote_sglang_fatal_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("old launch: CUDA error: before this launch\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("[2026-01-01 00:00:00] Load weight begin.\n")
        f.write("[2026-01-01 00:00:01] Scheduler hit an exception: Traceback (most recent call last):\n")
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        f.write("[2026-01-01 00:00:02] Received sigquit from a child process. It usually means the child failed.\n")
    lines = error_lines(log, offset)
    assert len(lines) == 3 and "Scheduler hit an exception" in lines[0] and "sigquit" in lines[2]
    assert not any("before this launch" in line for line in lines)


def test_error_lines_know_the_0_5_23_fatal_lines(tmp_path):
    """0.5.23 writes its watchdog line in lowercase and says `died during initialization` where older ones said
    `is dead` (sglang_contract.md 7.4)."""
    log = tmp_path / "server.log"
    log.write_text("[2026-01-01 00:00:00] Load weight begin.\n"
                   "[2026-01-01 00:05:00] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)\n"
                   "Rank 0 scheduler died during initialization (exit code: -9)\n")
    lines = error_lines(log, 0)
    assert len(lines) == 2 and "watchdog timeout" in lines[0] and "died during initialization" in lines[1]


def test_error_lines_quote_a_python_traceback_s_cause(tmp_path):
    """A server that dies before SGLang's handlers run (an import, a bad flag) ends its log with a traceback: its
    last, unindented line is the cause the crash error quotes; an indented source line is not."""
    log = tmp_path / "server.log"
    log.write_text("Traceback (most recent call last):\n"
                   '  File "<frozen runpy>", line 189, in _run_module_as_main\n'
                   "    raise ValueError: not a real line\n"
                   "ModuleNotFoundError: No module named 'sglang'\n")
    assert error_lines(log, 0) == ["ModuleNotFoundError: No module named 'sglang'"]
    log.write_text("sglang.srt.server_args.SomeConfigError: --tp-size 3 does not divide 8 heads\n"
                   "INFO: a request log with ValueError: inside is not the cause\n")
    assert error_lines(log, 0) == ["sglang.srt.server_args.SomeConfigError: --tp-size 3 does not divide 8 heads"]


def test_each_server_gets_its_own_empty_prometheus_multiproc_dir(tmp_path):
    from engine.servers.launch import own_prometheus_dir

    first, second = own_prometheus_dir(tmp_path / "gpu0"), own_prometheus_dir(tmp_path / "gpu1")
    assert first != second and first.is_dir() and second.is_dir()
    (first / "gauge_livesum_1.db").write_bytes(b"x")
    assert list(own_prometheus_dir(tmp_path / "gpu0").iterdir()) == []  # emptied at each launch


def test_control_socket_replies_and_is_private(tmp_path):
    sock = tmp_path / "control.sock"

    async def handler(op):
        if isinstance(op, Pause):
            raise ControlError(f"unknown shard(s): {', '.join(op.shards)}")
        return {"echo": op.op}

    async def main():
        server = ControlServer(sock, handler)
        await server.start()
        try:
            mode = stat.S_IMODE(os.stat(sock).st_mode)
            ok = await asyncio.to_thread(request, sock, {"op": "status"})
            err = await asyncio.to_thread(request, sock, {"op": "pause", "shards": ["s9"]})
            unknown = await asyncio.to_thread(request, sock, {"op": "explode"})
            return mode, ok, err, unknown
        finally:
            await server.close()

    mode, ok, err, unknown = asyncio.run(main())
    assert mode == 0o600
    assert ok == {"ok": True, "result": {"echo": "status"}}
    assert err == {"ok": False, "error": "unknown shard(s): s9"}
    assert unknown["ok"] is False and "unknown op 'explode'" in unknown["error"]
    assert not Path(sock).exists()


def test_the_tokenizer_thread_pool_is_off_on_one_cpu_unless_the_operator_set_it(monkeypatch):
    import gc

    from engine.supervisor import main, supervisor

    for cpus, preset, expected in (({0}, None, "false"), ({0, 1}, None, None), ({3}, "true", "true")):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, cpus=cpus: cpus)
        if preset is None:
            monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        else:
            monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
        main._single_cpu_tokenizer()
        assert os.environ.get("TOKENIZERS_PARALLELISM") == expected, (cpus, preset)
    assert supervisor.GC_THRESHOLDS[0] > gc.get_threshold()[0]  # young collections made rarer after the freeze
