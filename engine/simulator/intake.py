"""A request's way in: SGLang's validation before scheduling, the simulated 5xx faults, and its output plan and text."""
from __future__ import annotations

import dataclasses
from collections import Counter as CountDict
from typing import TYPE_CHECKING

from engine.simulator.generator import OutputPlan, attempt_draw, request_key
from engine.simulator.protocol import ApiError, GenerateItem, bad_request, check_context
from engine.simulator.request import SimRequest
from engine.simulator.stops import answer_text, apply_stops, rules_from_sampling

if TYPE_CHECKING:
    from engine.simulator.server import SimServer


class Intake:
    """What one server does with a request before and after the scheduler: checks, faults, plan, text."""

    def __init__(self, server: SimServer):
        self.server = server
        self.attempts: CountDict[bytes] = CountDict()
        self.special_pieces: dict[int, str] = {}  # special token id -> its text (stop trimming without decoding)

    def check_request(self, items: list[GenerateItem]) -> None:
        """Validation SGLang does before scheduling: the tokenizer's context checks, duplicate in-flight rids
        (refused from 0.5.10), then the scheduler's prompt limit (0.5.5 managers/utils.py:93-121,
        scheduler.py:1356-1364), which SGLang turns into an HTTP 400 as well."""
        for item in items:
            max_new = item.sampling["max_new_tokens"]
            if self.server.cfg.allow_auto_truncate:
                item.prompt_ids = item.prompt_ids[: min(self.server.context_len - 1, self.server.max_req_input_len)]
                if max_new is not None:
                    item.sampling["max_new_tokens"] = min(max_new, self.server.context_len - len(item.prompt_ids) - 1)
                continue
            check_context(len(item.prompt_ids), max_new, self.server.context_len)
        rids = [i.rid for i in items]
        if self.server.profile.refuses_duplicate_rid:
            dup = sorted({r for r in rids if r in self.server.in_flight_rids} | {r for r in rids if rids.count(r) > 1})
            if dup:
                raise ApiError(400, {"error": {"message": f"Duplicate request ID(s) detected: {', '.join(dup)}"}})
        for item in items:
            if len(item.prompt_ids) >= self.server.max_req_input_len:
                raise bad_request(f"Input length ({len(item.prompt_ids)} tokens) exceeds the maximum allowed length "
                                  f"({self.server.max_req_input_len} tokens). Use a shorter input or enable "
                                  "--allow-auto-truncate.")

    def check_5xx(self, items: list[GenerateItem]) -> None:
        if self.server.cfg.sim_5xx_rate <= 0 or not items:
            return
        key = self.key_for(items[0])
        attempt = self.attempts[key]
        self.attempts[key] += 1
        if attempt_draw(key, attempt, b"5xx") < self.server.cfg.sim_5xx_rate:
            raise ApiError(503, {"object": "error", "message": "The server is temporarily unable to handle the "
                                 f"request (simulated failure, --sim-5xx-rate={self.server.cfg.sim_5xx_rate}, "
                                 f"attempt {attempt + 1}).", "type": "503", "param": None, "code": 503})

    def key_for(self, item: GenerateItem) -> bytes:
        seed = item.sampling.get("sampling_seed")
        if self.server.cfg.enable_deterministic_inference and seed is not None:
            # the seed is honoured only in deterministic mode (0.5.5 sampling/sampling_batch_info.py:90-98;
            # 0.5.23 :157-170): the same prompt and seed give the same output, whatever the rid
            return request_key(self.server.cfg.sim_seed, f"sampling_seed:{seed}", item.prompt_ids)
        return request_key(self.server.cfg.sim_seed, item.rid if item.rid_given else None, item.prompt_ids)

    def max_new_for(self, item: GenerateItem) -> int:
        """max_new_tokens silently capped to what the request may still hold (0.5.5 scheduler.py:1171-1179)."""
        cap = max(0, self.server.max_req_len - len(item.prompt_ids) - 1)
        return cap if item.sampling["max_new_tokens"] is None else min(item.sampling["max_new_tokens"], cap)

    def plan_for(self, item: GenerateItem) -> OutputPlan:
        sp = item.sampling
        max_new = self.max_new_for(item)
        key = self.key_for(item)
        if self.server.cfg.sim_instant and not sp["ignore_eos"] and not sp["min_new_tokens"] and not self.server.cfg.sim_abort_rate \
                and not self.server.cfg.sim_loop_share and not self.server.cfg.sim_repetitive_share:
            plan = self.server.loaded_generator.plan_instant(key, item.prompt_ids, max_new, sp["skip_special_tokens"])
        else:
            plan = self.server.loaded_generator.plan(key, item.prompt_ids, max_new, min_new_tokens=sp["min_new_tokens"],
                                       ignore_eos=sp["ignore_eos"])
        rules = rules_from_sampling(sp)
        if sp["ignore_eos"]:  # ignore_eos skips the token checks (eos and stop_token_ids), not the strings
            rules = dataclasses.replace(rules, token_ids=frozenset())
        if not rules.custom:
            return plan
        generator = self.server.loaded_generator
        return apply_stops(plan, rules, generator.decode, generator.reasoning_count)

    def text_of(self, req: SimRequest) -> str:
        """The response's `text`: the matched stop cut unless no_stop_trim (contract 7.2)."""
        output_ids = req.final_ids()
        unchanged = req.plan.text is not None and output_ids is req.plan.output_ids
        return answer_text(output_ids, req.finish_reason, skip_special_tokens=req.skip_special_tokens,
                           no_stop_trim=req.no_stop_trim, decode=self.server.loaded_generator.decode,
                           prebuilt=req.plan.text if unchanged else None, special_piece=self.special_pieces.get)
