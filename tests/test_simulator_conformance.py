"""Conformance: the simulator of each SGLang version answers as the table read from SGLang's source says.

The table is data (tests/data/sglang_conformance.toml): each row names a behaviour, the versions it holds
for, the SGLang file:line it was read from (shared/reference/sglang_contract.md is the table's reference),
a request, and the answer expected field by field. Every row runs against an in-process simulator of every
version it names; rows with the same launch flags share one server. A failure lists every row that failed.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.simulator.profiles import PROFILES
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)
TABLE = Path(__file__).parent / "data" / "sglang_conformance.toml"
ROWS: list[dict] = tomllib.loads(TABLE.read_text())["row"]
VERSIONS = sorted(PROFILES, key=lambda v: tuple(map(int, v.split("."))))
MISSING = object()
SCHEDULER_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                    "sglang:gen_throughput", "sglang:cache_hit_rate")


class Answer:
    """One response: status, JSON body (or text), stream chunks, and what the checks need."""

    def __init__(self, status: int, raw: str, chunks: list[dict] | None, prompt_len: int, tok, im_end: int):
        self.status, self.raw, self.chunks = status, raw, chunks
        self.prompt_len, self.tok, self.im_end = prompt_len, tok, im_end
        try:
            self.body = json.loads(raw) if raw and chunks is None else None
        except ValueError:
            self.body = None

    def final(self) -> dict:
        return self.chunks[-1] if self.chunks is not None else self.body


def lookup(data: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return MISSING
    return data


def resolve(value: Any, im_end: int) -> Any:
    if value == "$null":
        return None
    if value == "$im_end":
        return im_end
    if isinstance(value, dict):
        return {k: resolve(v, im_end) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, im_end) for v in value]
    return value


def metric_labels(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _check_stream_ids_delta(a: Answer) -> str | None:
    ids = [i for c in a.chunks for i in c["output_ids"]]
    n = a.chunks[-1]["meta_info"]["completion_tokens"]
    return None if len(ids) == n and len(a.chunks) > 1 else f"chunk ids add up to {len(ids)}, not {n}"


def _check_stream_ids_cumulative(a: Answer) -> str | None:
    last = a.chunks[-1]["output_ids"]
    ok = len(a.chunks) > 1 and all(last[: len(c["output_ids"])] == c["output_ids"] for c in a.chunks)
    ok = ok and len(last) == a.chunks[-1]["meta_info"]["completion_tokens"]
    return None if ok else "chunk ids are not prefixes of the last chunk's"


def _check_stream_finish_last(a: Answer) -> str | None:
    reasons = [c["meta_info"]["finish_reason"] for c in a.chunks]
    return None if reasons[-1] is not None and all(r is None for r in reasons[:-1]) else f"finish reasons {reasons}"


def _check_stream_text_cumulative(a: Answer) -> str | None:
    texts = [c["text"] for c in a.chunks]
    return None if all(texts[-1].startswith(t) for t in texts) else "texts are not prefixes of the last"


def _check_stream_text_delta(a: Answer) -> str | None:
    joined = "".join(c["text"] for c in a.chunks)
    ids = [i for c in a.chunks for i in c["output_ids"]]
    expected = a.tok.decode(ids, skip_special_tokens=True)
    return None if joined == expected else f"joined deltas {joined[:60]!r} != decode(ids) {expected[:60]!r}"


def _check_metrics_gauges(a: Answer) -> str | None:
    for name in SCHEDULER_GAUGES:
        labels = metric_labels(a.raw, name)
        if not labels or not {"model_name", "engine_type", "tp_rank", "pp_rank"} <= set(labels[0]):
            return f"{name}: labels {labels}"
    if not metric_labels(a.raw, "sglang:num_requests_total"):
        return "no sglang:num_requests_total"
    return None


def _check_metrics_priority_total(a: Answer) -> str | None:
    for name in SCHEDULER_GAUGES:
        if [lb.get("priority") for lb in metric_labels(a.raw, name)].count("") != 1:
            return f"{name}: not exactly one priority=\"\" series"
    return None


def _check_metrics_no_priority(a: Answer) -> str | None:
    labelled = [lb for name in SCHEDULER_GAUGES for lb in metric_labels(a.raw, name) if "priority" in lb]
    return f"priority labels present: {labelled[:2]}" if labelled else None


def _check_metrics_two_ranks(a: Answer) -> str | None:
    for name in SCHEDULER_GAUGES:
        ranks = sorted(lb["tp_rank"] for lb in metric_labels(a.raw, name))
        if ranks != ["0", "1"]:
            return f"{name}: tp ranks {ranks}"
    return None


CHECKS: dict[str, Callable[[Answer], str | None]] = {
    "completion_tokens_count_ids": lambda a: None if a.final()["meta_info"]["completion_tokens"] == len(
        a.final()["output_ids"]) else "completion_tokens != len(output_ids)",
    "prompt_tokens_count_prompt": lambda a: None if a.final()["meta_info"]["prompt_tokens"] == a.prompt_len
    else f"prompt_tokens {a.final()['meta_info']['prompt_tokens']} != {a.prompt_len}",
    "last_id_is_im_end": lambda a: None if a.final()["output_ids"][-1:] == [a.im_end] else "last id is not <|im_end|>",
    "text_is_ids_without_stop": lambda a: None if a.final()["text"] == a.tok.decode(
        a.final()["output_ids"][:-1], skip_special_tokens=False) else f"text {a.final()['text'][-40:]!r}",
    "text_is_all_ids": lambda a: None if a.final()["text"] == a.tok.decode(
        a.final()["output_ids"], skip_special_tokens=False) else f"text {a.final()['text'][-40:]!r}",
    "empty_body": lambda a: None if a.raw == "" else f"body {a.raw[:80]!r}",
    "stream_ids_delta": _check_stream_ids_delta,
    "stream_ids_cumulative": _check_stream_ids_cumulative,
    "stream_finish_last": _check_stream_finish_last,
    "stream_text_cumulative": _check_stream_text_cumulative,
    "stream_text_delta": _check_stream_text_delta,
    "metrics_scheduler_gauges": _check_metrics_gauges,
    "metrics_priority_total": _check_metrics_priority_total,
    "metrics_no_priority": _check_metrics_no_priority,
    "metrics_two_tp_ranks": _check_metrics_two_ranks,
}


def rows_for(version: str) -> list[dict]:
    return [r for r in ROWS if r["versions"] == "all" or version in r["versions"]]


def judge(row: dict, a: Answer) -> list[str]:
    """Every mismatch of one answer against its row, as text naming the field."""
    out = []
    if a.status != row["status"]:
        return [f"status {a.status} != {row['status']}: {a.raw[:200]}"]
    data = a.final()
    for path, want in row.get("equal", {}).items():
        got = lookup(data, path)
        if got != resolve(want, a.im_end):
            out.append(f"{path} = {got!r}, expected {resolve(want, a.im_end)!r}")
    for path, prefix in row.get("startswith", {}).items():
        got = lookup(data, path)
        if not isinstance(got, str) or not got.startswith(prefix):
            out.append(f"{path} = {got!r}, expected to start with {prefix!r}")
    out += [f"{path} missing" for path in row.get("present", []) if lookup(data, path) is MISSING]
    out += [f"{path} present" for path in row.get("absent", []) if lookup(data, path) is not MISSING]
    for name in row.get("checks", []):
        problem = CHECKS[name](a)
        if problem:
            out.append(f"{name}: {problem}")
    return out


async def ask(session: aiohttp.ClientSession, url: str, row: dict, tok, im_end: int) -> Answer:
    body = resolve(row.get("json", {}), im_end)
    prompt_len = 0
    if "input_len" in row:
        body = dict(body, input_ids=[9] * row["input_len"])
        prompt_len = row["input_len"]
    elif isinstance(body.get("text"), str):
        prompt_len = len(tok.encode(body["text"]))
    if row.get("stream"):
        body = dict(body, stream=True)
    kwargs = {"json": body} if row["method"] == "POST" else {}
    async with session.request(row["method"], url + row["path"], **kwargs) as resp:
        raw = (await resp.read()).decode()
    chunks = None
    if row.get("stream") and resp.status == 200:
        events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        if events[-1:] != ["[DONE]"]:
            return Answer(resp.status, "stream did not end with [DONE]", None, prompt_len, tok, im_end)
    return Answer(resp.status, raw, chunks, prompt_len, tok, im_end)


def test_every_row_cites_a_source_and_names_known_versions_and_checks():
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids))
    for row in ROWS:
        assert row["source"] and row["behaviour"], row["id"]
        assert row["versions"] == "all" or set(row["versions"]) <= set(PROFILES), row["id"]
        assert set(row.get("checks", [])) <= set(CHECKS), row["id"]
    for version in VERSIONS:
        assert rows_for(version), version


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_simulator_of_each_version_answers_as_the_table_says(start_sim, tiny_tokenizer, version):
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    groups: dict[str, list[dict]] = {}
    for row in rows_for(version):
        groups.setdefault(json.dumps(row.get("flags", {}), sort_keys=True), []).append(row)
    failures = []
    for flags, rows in groups.items():
        sim = await start_sim(sim_sglang_version=version, sim_output_mean=40, **json.loads(flags))
        async with aiohttp.ClientSession() as session:
            for row in rows:
                answer = await ask(session, sim.url, row, tiny_tokenizer, im_end)
                failures += [f"{row['id']} [{version}] ({row['source']}): {p}" for p in judge(row, answer)]
        await sim.server.stop()
    assert not failures, "\n".join(failures)
