"""A simulated server's step log read on the cost model's clock: each step's time as the simulator charges it (its
batch rebuilt from the Prefill / Decode / Retract lines), so a loaded machine slows a benchmark but does not move
its figures; and a watch that stops an arm after a number of decode steps on every server (bench_tuning)."""
from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.bench import bench_common as bc

DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS's default: the new-token ratio is at its floor after these
_DECODE = re.compile(r"Decode batch, #running-req: (\d+), #token: \d+, token usage: ([\d.]+),.*#queue-req: (\d+),")
_RETRACT = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
_CONSERVATIVENESS = re.compile(r"schedule_conservativeness=([\d.]+)")
_NO_CHUNKING = re.compile(r"chunked_prefill_size=(-\d+|0)\b")  # <= 0: no chunked prefill, so nothing is mixed


@dataclass(frozen=True)
class StepCost:
    """The simulator's cost model (engine.simulator.scheduler): a step over B requests takes step_ms + per_req_ms x B,
    a prefill step plus prefill_ms_per_1k per 1,000 uncached prompt tokens."""
    step_ms: float
    per_req_ms: float
    prefill_ms_per_1k: float
    tokens_per_step: int

    def seconds(self, batch: int, new_tokens: int = 0) -> float:
        return (self.step_ms + self.per_req_ms * batch) / 1000 + self.prefill_ms_per_1k * new_tokens / 1e6

    def sim_args(self) -> list[str]:
        return ["--sim-step-ms", str(self.step_ms), "--sim-step-ms-per-req", str(self.per_req_ms),
                "--sim-tokens-per-step", str(self.tokens_per_step),
                "--sim-prefill-ms-per-1k", str(self.prefill_ms_per_1k)]


def retractions(url: str) -> int | None:
    """sglang:num_retracted_requests (a counter: _total) from a server's /metrics; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "sglang:num_retracted_requests":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return None


class Watch:
    """Polled while an arm serves: follows each server's log and says when every server has run DECAY_STEPS +
    window_steps decode steps since its first admission (the same steps for every arm, whatever the machine's load
    did to the wall clock); it then reads each server's retraction counter, the reading at the stop."""

    def __init__(self, urls: list[str], logs: list[Path], window_steps: int):
        self.urls, self.logs, self.steps = urls, logs, DECAY_STEPS + window_steps
        self.started: float | None = None
        self.stopped_at: float | None = None
        self.retracted: list[int | None] = [None] * len(urls)
        self._offset = [0] * len(logs)
        self._admitted = [False] * len(logs)
        self._decodes = [0] * len(logs)
        self._next = 0.0

    def _follow(self, i: int) -> None:
        try:
            with open(self.logs[i], "rb") as f:
                f.seek(self._offset[i])
                chunk = f.read()
        except FileNotFoundError:
            return  # not launched yet
        end = chunk.rfind(b"\n") + 1
        self._offset[i] += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            p = bc.prefill_of(line)
            if p is not None and (p.new_seq, p.new_token) != (1, 1):
                self._admitted[i] = True
                self.started = self.started or time.time()
            elif self._admitted[i] and "Decode batch" in line:
                self._decodes[i] += 1

    def due(self) -> bool:
        now = time.time()
        if now < self._next:
            return False
        self._next = now + 0.25
        for i in range(len(self.logs)):
            self._follow(i)
        if min(self._decodes) < self.steps:
            return False
        self.stopped_at = time.time()  # the log's figures end here; the counters are read just after (+/- a line)
        self.retracted = [retractions(u) for u in self.urls]
        return True


def server_window(log: Path, stop: float, cost: StepCost) -> dict:
    """One server's figures up to `stop` (epoch s), on the cost model's clock (each step's time as the simulator
    charges it, whatever the loaded machine did to the wall clock): the steady window is from its DECAY_STEPS-th
    decode step on. The batch of a decode step is the last decode line's, plus the admissions, less the retractions
    since (its finished requests are in the next line's #running-req).

    With --enable-mixed-chunk a Prefill line with #running-req R > 0 is a mixed step: one forward pass over the R
    running requests, which decode in it, and the admitted ones (engine.simulator.kv_policy.next_step). The log
    cannot show the 0.5.23 case where the running rows sit such a step out because their tokens do not fit the pool
    after the prefill's; the admission's reservation (max_new_tokens >= 1 a request, beyond the R rows SGLang takes
    off the budget) leaves them room whenever tokens_per_step is 1 and prompts share few tokens, as here."""
    ready = False
    mixed = False
    conservativeness = 1.0
    first = start = prev_t = None
    decodes = tokens = retracted = window_decodes = window_prefills = window_admitted = window_mixed = 0
    model_s = window_model_s = window_wall_s = 0.0
    w_running = w_usage = w_queued = 0.0
    prev_running = admitted = 0
    prefill_s = 0.0
    for t, line in bc.sim_lines(log):
        if t > stop:
            break
        if not ready:
            m = _CONSERVATIVENESS.search(line)
            if "server_args=" in line and m:
                conservativeness = float(m.group(1))
                mixed = "enable_mixed_chunk=True" in line and not _NO_CHUNKING.search(line)
            ready = "fired up and ready" in line
            continue
        p = bc.prefill_of(line)
        if p is not None:
            if (p.new_seq, p.new_token) == (1, 1) and first is None:
                continue  # a /health probe's one token is no admission
            first = first if first is not None else t
            decoding = p.running_before if mixed else 0
            if decoding:  # its running rows decoded in it: the next decode step's batch starts from them
                prev_running, admitted = decoding, 0
            admitted += p.new_seq
            prefill_s += cost.seconds(decoding + p.new_seq, p.new_token)
            if start is not None:
                tokens += (decoding + p.new_seq) * cost.tokens_per_step
                window_prefills += 1
                window_admitted += p.new_seq
                window_mixed += 1 if decoding else 0
            continue
        m = _RETRACT.search(line)
        if m and first is not None:
            retracted += int(m.group(1))
            prev_running -= int(m.group(1))
            continue
        m = _DECODE.search(line)
        if not m or first is None:
            continue
        run, usage, queued = int(m.group(1)), float(m.group(2)), int(m.group(3))
        decodes += 1
        dt = cost.seconds(prev_running + admitted) + prefill_s
        model_s += dt
        if start is not None:
            tokens += (prev_running + admitted) * cost.tokens_per_step
            window_model_s += dt
            window_decodes += 1
            window_wall_s += t - prev_t
            w_running += run * dt
            w_usage += usage * dt
            w_queued += dt if queued > 0 else 0.0
        elif decodes >= DECAY_STEPS:
            start = t
        prev_t, prev_running, admitted, prefill_s = t, run, 0, 0.0
    if start is None or first is None or window_model_s <= 0:
        raise RuntimeError(f"{log}: fewer than {DECAY_STEPS} decode steps before the stop")
    return {"conservativeness": conservativeness, "mixed_chunk": mixed, "mixed_steps": window_mixed,
            "window_s": window_model_s, "tokens": tokens,
            "tokens_per_s": tokens / window_model_s, "tokens_per_wall_s": tokens / window_wall_s,
            "mean_running": w_running / window_model_s, "mean_usage": w_usage / window_model_s,
            "queued_share": w_queued / window_model_s, "lag": window_wall_s / window_model_s,
            "prefills_per_decode": window_prefills / window_decodes,
            "requests_per_prefill": window_admitted / window_prefills if window_prefills else 0.0,
            "serving_s": model_s, "serving_wall_s": stop - first, "retractions_log": retracted}


def figures(logs: list[Path], stop: float, retracted: list[int | None], cost: StepCost, time_scale: float) -> dict:
    """The servers' figures summed; retractions per server-minute on the unscaled clock (model seconds x time_scale)."""
    per = [server_window(p, stop, cost) for p in logs]
    minutes = sum(s["serving_s"] for s in per) / 60  # on the cost model's clock
    wall_minutes = sum(s["serving_wall_s"] for s in per) / 60
    counted = None if any(r is None for r in retracted) else sum(r for r in retracted if r is not None)
    return {"tokens_per_s": sum(s["tokens_per_s"] for s in per), "servers": per,
            "tokens_per_wall_s": sum(s["tokens_per_wall_s"] for s in per),
            "mean_running": sum(s["mean_running"] for s in per), "mean_usage": min(s["mean_usage"] for s in per),
            "queued_share_min": min(s["queued_share"] for s in per), "lag_max": max(s["lag"] for s in per),
            "prefills_per_decode": sum(s["prefills_per_decode"] for s in per) / len(per),
            "requests_per_prefill": sum(s["requests_per_prefill"] for s in per) / len(per),
            "conservativeness": [s["conservativeness"] for s in per], "retractions": counted,
            "mixed_chunk": [s["mixed_chunk"] for s in per], "mixed_steps": sum(s["mixed_steps"] for s in per),
            "retractions_log": sum(s["retractions_log"] for s in per), "server_minutes": minutes,
            "retractions_per_server_min": None if counted is None else counted / (minutes * time_scale),
            "retractions_per_wall_server_min": None if counted is None else counted / wall_minutes}
