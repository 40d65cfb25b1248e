"""regen demo [--gpus N] [--prompts N] [--shard-size N] [--run-dir DIR] [--quick] [--headless --until-done]: the whole
flow on this machine (a tiny model, synthetic prompts with a few bad rows, one SGLang simulator per simulated GPU),
started over the `local` transport like `regen start`, paced to leave time to explore (--quick: short)."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time
from pathlib import Path

from console.commands.status_text import progress_line
from console.host.deploy import EXIT_ERROR, EXIT_OK, DeployError, start_run
from console.host.hints import regen_command
from console.host.run_client import RunClientError
from console.host.transport import TransportError
from console.host.connect import open_transport
from engine.config.load import SIMULATOR_LAUNCH, RunConfig, Sampling, Workers, Alerts, Dispatch
from engine.api.events import AlertEvent, DispatchEvent
from engine.api.wire import FINAL_RUN_STATES, RunState, Severity

CACHE = Path.home() / ".cache" / "regen"
DEMO_CONTEXT = 4096
DEMO_SHARD_SIZE = 50
DEMO_KV_TOKENS = 8192
# --quick: fast enough that 500 prompts finish in a minute or two on 2 cores, slow enough to watch batching
DEMO_SIM_ARGS = (
    "--max-total-tokens", str(DEMO_KV_TOKENS), "--context-length", str(DEMO_CONTEXT),
    "--sim-step-ms", "12", "--sim-step-ms-per-req", "0.2", "--sim-tokens-per-step", "2",
    "--sim-output-mean", "160", "--sim-output-sigma", "0.7", "--sim-empty-share", "0.02",
    "--sim-load-s", "1",
)

# the default demo: 20x slower decode steps and half the KV pool, so the default run lasts a few minutes (time to
# try the keys); measured with `regen demo --headless --until-done`
WATCHABLE_PACE = ("--sim-step-ms", "240", "--max-total-tokens", str(DEMO_KV_TOKENS // 2))

TOPICS = ("prime numbers", "a python list", "the attention layer", "gpu memory", "a test case", "the cache",
          "an array index error", "the square root of two", "batch size", "a string function")


def add_arguments(parser) -> None:
    parser.add_argument("--gpus", type=int, default=4, help="simulated GPUs, one SGLang simulator each")
    parser.add_argument("--prompts", type=int, default=200, help="synthetic conversations")
    parser.add_argument("--run-dir", default=None, help="default: ~/.cache/regen/demo/run-<time>")
    parser.add_argument("--headless", action="store_true", help="no TUI: print progress lines")
    parser.add_argument("--until-done", action="store_true", help="with --headless: wait until the run is done")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=DEMO_SHARD_SIZE,
                        help=f"prompt rows per shard (default {DEMO_SHARD_SIZE}); e.g. --prompts 1000 --shard-size 1 "
                             "for a run of ~1,000 shards")
    parser.add_argument("--template", choices=("qwen3", "qwen3.5"), default="qwen3",
                        help="chat template family of the tiny model: qwen3 (the model opens <think>) or qwen3.5 "
                             "(Qwen3.5/3.6 style: the generation prompt ends with <think>)")
    parser.add_argument("--sim-arg", action="append", default=[], help="extra simulator argument (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="the short run (about half a minute; tests, scripts) instead of a few minutes to watch")


def free_port_block(n: int) -> int:
    """A base port with n consecutive free loopback ports."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 45000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports found on 127.0.0.1")


def write_prompts(prompt_dir: Path, n: int, seed: int) -> list[str]:
    """Two sources; ~30% multi-turn; bad rows: malformed JSON, no messages, unknown role, too long."""
    rng = random.Random(seed)
    prompt_dir.mkdir(parents=True, exist_ok=True)
    files = [prompt_dir / "chat_a.jsonl", prompt_dir / "chat_b.jsonl"]
    if all(f.exists() for f in files):
        return [str(f) for f in files]
    lines: list[list[str]] = [[], []]
    for i in range(n):
        topic = rng.choice(TOPICS)
        if rng.random() < 0.3:
            messages = []
            for k in range(rng.randint(2, 3)):
                messages.append({"role": "user", "content": f"question {k + 1} about {topic}: why does it work?"})
                messages.append({"role": "assistant", "content": f"an old answer about {topic}."})
            messages = messages[:-1]
        else:
            messages = [{"role": "user", "content": f"explain {topic} with a simple example ({i})"}]
            if rng.random() < 0.2:
                messages.insert(0, {"role": "system", "content": "you are a careful assistant"})
        lines[i % 2].append(json.dumps({"id": f"demo-{i:06d}", "messages": messages}))
    bad = [
        '{"id": "bad-json", "messages": [{"role": "user", "content": "unterminated"',
        json.dumps({"id": "bad-no-messages", "text": "no conversation here"}),
        json.dumps({"id": "bad-role", "messages": [{"role": "wizard", "content": "abracadabra"}]}),
        json.dumps({"id": "too-long", "messages": [{"role": "user", "content": " ".join(["token"] * (DEMO_CONTEXT + 500))}]}),
    ]
    for j, row in enumerate(bad):
        lines[j % 2].insert(rng.randrange(len(lines[j % 2]) + 1), row)
    for f, rows in zip(files, lines):
        f.write_text("\n".join(rows) + "\n")
    return [str(f) for f in files]


def demo_config(run_dir: Path, model: Path, prompts: list[str], gpus: int, extra: list[str],
                shard_size: int = DEMO_SHARD_SIZE) -> RunConfig:
    return RunConfig(
        run_dir=str(run_dir), model=str(model), prompts=tuple(prompts), host_python=sys.executable,
        turns="all", shard_size=shard_size, context_length=DEMO_CONTEXT,
        sampling=Sampling(max_new_tokens=1024),
        workers=Workers(gpus=tuple(range(gpus)), base_port=free_port_block(gpus), launch=SIMULATOR_LAUNCH,
                        extra_args=DEMO_SIM_ARGS + tuple(extra), ready_timeout_s=120.0),
        dispatch=Dispatch(request_timeout_s=120.0, retry_backoff_s=0.5),
        alerts=Alerts(disk_free_min_gb=0.5),
    )


def run(args) -> int:
    from engine.text.tiny_model import build_tiny_model

    if args.shard_size < 1:
        print(f"regen demo: --shard-size must be at least 1, not {args.shard_size}", file=sys.stderr)
        return EXIT_ERROR
    run_dir = Path(args.run_dir or CACHE / "demo" / time.strftime("run-%Y%m%d-%H%M%S")).expanduser().resolve()
    template = args.template
    model_dir = CACHE / ("tiny-model" if template == "qwen3" else f"tiny-model-{template}")
    print(f"building the tiny model ({template} chat template) in {model_dir}", file=sys.stderr)
    model = build_tiny_model(model_dir, template=template)
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(run_dir / "prompts", args.prompts, args.seed)
    pace = [] if args.quick else list(WATCHABLE_PACE)  # --sim-arg after it wins
    cfg = demo_config(run_dir, model, prompts, args.gpus, pace + list(args.sim_arg), args.shard_size)
    tui = None  # console.tui.app.run_tui, unless headless
    if not args.headless:
        try:
            from console.tui.app import run_tui
        except ModuleNotFoundError as exc:
            print(f"the TUI is not available ({exc}); running headless", file=sys.stderr)
        else:
            tui = run_tui
    return asyncio.run(_demo(args, cfg, tui))


async def _demo(args, cfg: RunConfig, run_tui) -> int:
    transport = await open_transport("local")
    try:
        started = await start_run(transport, cfg, progress=lambda m: print(m, file=sys.stderr))
    except (DeployError, TransportError) as exc:
        print(f"regen demo: {exc}", file=sys.stderr)
        await transport.close()
        return EXIT_ERROR
    print(f"demo run started: supervisor pid {started.pid}, run dir {started.run_dir}", file=sys.stderr)
    if run_tui is not None:
        await transport.close()
        result = run_tui("local", started.run_dir, host_python=started.host_python)
        if asyncio.iscoroutine(result):
            result = await result
        await offer_to_stop(started)
        return int(result or 0)
    if args.headless and not args.until_done:
        print(f"watch it with:\n  {regen_command('status', 'local', '--run-dir', started.run_dir)}")
        await transport.close()
        return EXIT_OK
    try:
        return await follow_until_done(started.client(transport), started.run_dir)
    finally:
        await transport.close()


async def offer_to_stop(started) -> None:
    """The console was quit while the demo's run goes on: ask (a terminal) whether to stop it, and say what stays."""
    transport = await open_transport("local")
    try:
        client = started.client(transport)
        try:
            status = await client.status()
        except RunClientError:
            print(f"the demo run has ended; its run dir stays at {started.run_dir}", file=sys.stderr)
            return
        print(f"the demo run is still going (supervisor pid {started.pid}, state {status.state}).",
              file=sys.stderr)
        answer = "y"
        if sys.stdin.isatty():
            answer = (await asyncio.to_thread(input, "stop it now? [Y/n] ")).strip().lower() or "y"
        if answer.startswith("y"):
            await client.stop()
            print(f"stopped the demo run; its run dir stays at {started.run_dir}", file=sys.stderr)
        else:
            print(f"left running; stop it with:\n  {regen_command('stop', 'local', '--run-dir', started.run_dir)}",
                  file=sys.stderr)
    finally:
        await transport.close()


async def follow_until_done(client, run_dir: str) -> int:
    started = time.monotonic()
    last: DispatchEvent | None = None
    last_print = 0.0
    async for event in client.follow(since=time.time() - 5):
        if isinstance(event, DispatchEvent):
            last = event
            if time.monotonic() - last_print >= 2.0 or event.state in FINAL_RUN_STATES:
                last_print = time.monotonic()
                print(f"[{time.monotonic() - started:6.1f}s] {progress_line(event)}", flush=True)
        elif isinstance(event, AlertEvent) and event.severity != Severity.INFO:
            print(f"ALERT {event.severity}: {event.text}", flush=True)
    wall = time.monotonic() - started
    state = last.state if last else "unknown"
    print(f"supervisor exited, run {state} after {wall:.1f} s; shards in {run_dir}/shards, "
          f"rejects in {run_dir}/rejects.jsonl, logs in {run_dir}/supervisor.log", flush=True)
    return EXIT_OK if state == RunState.DONE else EXIT_ERROR
