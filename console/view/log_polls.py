"""Which server.log lines are regen's own successful polls (GET /metrics, /health, ...): most of a tail, none news."""
from __future__ import annotations

import re
from dataclasses import dataclass

# uvicorn's access line as SGLang logs it: `... 127.0.0.1:60992 - "GET /metrics HTTP/1.1" 200` (real uvicorn adds
# `OK`). Only a 200 is a poll's routine; any other status stays in the log, where the operator sees it.
_POLL = re.compile(r'"GET /(?:metrics|health|health_generate|sim/gpu|get_server_info|server_info|get_model_info'
                   r'|model_info|v1/models)(?:\?[^" ]*)? HTTP/[\d.]+" 200\b')


@dataclass(frozen=True)
class TailLines:
    lines: list[str]  # what to show
    polls_hidden: int


def without_polls(lines: list[str]) -> TailLines:
    kept = [line for line in lines if not _POLL.search(line)]
    return TailLines(kept, len(lines) - len(kept))
