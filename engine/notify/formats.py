"""The webhook body for each `notify.format`: generic (JSON), slack, discord (cut to 2000 characters), ntfy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from email.header import Header
from typing import Any

from engine.notify.message import Notification

SLACK_MAX = 3500  # Slack truncates a message's text around 4000 characters
DISCORD_MAX = 2000  # Discord refuses content over 2000 characters (HTTP 400)
NTFY_MAX_BYTES = 4096  # ntfy turns a longer body into an attachment
EVIDENCE_MAX = 1500
GENERIC_FIELDS = ("run_dir", "host", "kind", "severity", "title", "text", "evidence", "key", "ts")
NTFY_PRIORITY = {"info": "low", "warning": "default", "error": "high", "critical": "urgent"}
NTFY_TAGS = {"info": "white_check_mark", "warning": "warning", "error": "x", "critical": "rotating_light"}


@dataclass(frozen=True)
class WebhookRequest:
    json: dict[str, Any] | None = None  # sent as JSON (aiohttp's json=)
    data: bytes | None = None  # sent as is (text/plain)
    headers: dict[str, str] = field(default_factory=dict)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def _markdown(n: Notification, bold: str, limit: int) -> str:
    parts = [f"{bold}{n.title}{bold}"]
    if n.text and n.text not in n.title:
        parts.append(n.text)
    if n.evidence:
        parts.append(f"```\n{_cut(n.evidence, EVIDENCE_MAX)}\n```")
    footer = f"_run `{n.run_dir}` on {n.host}, {_when(n.ts)}_"
    return _cut("\n".join(parts), limit - len(footer) - 1) + "\n" + footer


def plain_text(n: Notification) -> str:
    parts = [n.text or n.title]
    if n.evidence:
        parts.append(_cut(n.evidence, EVIDENCE_MAX))
    parts.append(f"run {n.run_dir} on {n.host}, {_when(n.ts)}")
    return "\n".join(parts)


def _header_value(text: str) -> str:
    """HTTP header values are latin-1 on the wire: anything else goes as an RFC 2047 encoded-word
    (ntfy decodes it for Title and Tags)."""
    try:
        text.encode("ascii")
        return text
    except UnicodeEncodeError:
        return Header(text, "utf-8").encode()


def webhook_request(n: Notification, fmt: str, extra_headers: dict[str, str] | None = None) -> WebhookRequest:
    headers: dict[str, str] = {}
    if fmt == "generic":
        d = n.to_dict()
        req = WebhookRequest(json={k: d[k] for k in GENERIC_FIELDS})
    elif fmt == "slack":
        req = WebhookRequest(json={"text": _markdown(n, "*", SLACK_MAX)})
    elif fmt == "discord":
        req = WebhookRequest(json={"content": _markdown(n, "**", DISCORD_MAX)})
    elif fmt == "ntfy":
        body = plain_text(n).encode()
        if len(body) > NTFY_MAX_BYTES:
            body = body[: NTFY_MAX_BYTES - 3].decode(errors="ignore").encode() + "…".encode()
        headers = {"Title": _header_value(n.title), "Priority": NTFY_PRIORITY.get(n.severity, "default"),
                   "Tags": NTFY_TAGS.get(n.severity, "warning"), "Content-Type": "text/plain; charset=utf-8"}
        req = WebhookRequest(data=body)
    else:
        raise ValueError(f"unknown notify.format {fmt!r}")  # refused at config load; a bug if reached
    headers.update({k: _header_value(v) for k, v in (extra_headers or {}).items()})
    return WebhookRequest(json=req.json, data=req.data, headers=headers)
