"""The Workers tab's log tail leaves out regen's own successful polls, and only those."""
from __future__ import annotations

from console.view.log_polls import without_polls

TAIL = [
    '[2026-12-06 08:50:45] INFO:     127.0.0.1:60992 - "GET /metrics HTTP/1.1" 200',  # the simulator
    'INFO:     127.0.0.1:41230 - "GET /health HTTP/1.1" 200 OK',  # real uvicorn
    '[2026-12-06 08:50:46] INFO:     127.0.0.1:60918 - "GET /sim/gpu HTTP/1.1" 200',
    'INFO:     127.0.0.1:41230 - "GET /get_server_info HTTP/1.1" 200 OK',
    '[2026-12-06 08:50:45] Prefill batch, #new-seq: 1, #new-token: 22, #cached-token: 8, token usage: 0.00',
    'INFO:     127.0.0.1:41230 - "POST /generate HTTP/1.1" 200 OK',  # work, not a poll
    'INFO:     127.0.0.1:41230 - "GET /metrics HTTP/1.1" 500 Internal Server Error',  # a failed poll is news
    'INFO:     127.0.0.1:41230 - "GET /health HTTP/1.1" 503 Service Unavailable',
    'ERROR: the scheduler hit an exception: "GET /metrics HTTP/1.1" 2000 tokens',  # not an access line's status
]


def test_only_successful_polls_are_left_out():
    tail = without_polls(TAIL)
    assert tail.polls_hidden == 4
    assert tail.lines == TAIL[4:]
