# A prompt file's rows: its format (jsonl, a JSON array, parquet; gzip'd or not), read row by row, each row
# normalized to chat messages or a RowError naming what is wrong with it. Inlined into probes/host/prompts.py
# (its include line): standard library only, no `from __future__` import.
import codecs
import gzip
import json
import os

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "bot": "assistant",
                "model": "assistant", "chatgpt": "assistant", "system": "system"}
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
EXCERPT = 160


class RowError(Exception):
    def __init__(self, kind, reason):
        Exception.__init__(self, reason)
        self.kind = kind
        self.reason = reason


def json_type(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def content_text(content, where):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                what = part.get("type") if isinstance(part, dict) else json_type(part)
                raise RowError("non_string_content", "non-string content in %s: part %d is %r, not text" % (where, j, what))
        return "\n".join(texts)
    raise RowError("non_string_content", "non-string content in %s (a JSON %s)" % (where, json_type(content)))


def normalize(obj):
    """(messages, shape) or RowError; the same rules as engine/text/ingest.py."""
    if not isinstance(obj, dict):
        raise RowError("not_object", "not an object (a JSON %s)" % json_type(obj))
    turns, field = None, None
    for key in ("messages", "conversations", "conversation"):
        if obj.get(key) is not None:
            turns, field = obj[key], key
            break
    if turns is None and isinstance(obj.get("prompt"), list):
        turns, field = obj["prompt"], "prompt"
    if turns is not None:
        if not isinstance(turns, list):
            raise RowError("bad_conversation", "'%s' is not a list (a JSON %s)" % (field, json_type(turns)))
        messages, keys_seen = [], set()
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise RowError("bad_conversation", "%s[%d] is not an object (a JSON %s)" % (field, i, json_type(turn)))
            role = turn.get("role", turn.get("from"))
            if not isinstance(role, str):
                raise RowError("unknown_role", "%s[%d] has no role (expected 'role' or 'from')" % (field, i))
            norm = ROLE_ALIASES.get(role.strip().lower())
            if norm is None:
                raise RowError("unknown_role", "unknown role %r in %s[%d] (known: user/human, assistant/gpt/bot/model, system)"
                               % (role, field, i))
            keys_seen.add("from/value" if "from" in turn and "role" not in turn else "role/content")
            content = turn["content"] if "content" in turn else turn.get("value")
            messages.append({"role": norm, "content": content_text(content, "%s[%d]" % (field, i))})
        shape = ("sharegpt" if keys_seen == {"from/value"} else "openai" if keys_seen == {"role/content"} else "mixed")
        shape = "%s (%s)" % (shape, field)
    elif "prompt" in obj or "instruction" in obj:
        if "prompt" in obj:
            text, shape = content_text(obj["prompt"], "'prompt'"), "prompt"
        else:
            text = content_text(obj["instruction"], "'instruction'")
            extra = obj.get("input")
            extra = "" if extra is None else content_text(extra, "'input'")
            text, shape = (text + "\n\n" + extra if extra.strip() else text), "instruction"
        if not text.strip():
            raise RowError("empty_conversation", "empty conversation (the prompt text is empty)")
        messages = []
        system = obj.get("system")
        if system is not None:
            system = content_text(system, "'system'")
            if system.strip():
                messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": text})
    else:
        keys = ", ".join(sorted(map(str, obj))[:12]) or "none"
        raise RowError("no_conversation",
                       "no conversation: expected 'messages', 'conversations', 'prompt' or 'instruction' (keys: %s)" % keys)
    if not messages:
        raise RowError("empty_conversation", "empty conversation")
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no_user_turn", "no user turn (roles: " + ", ".join(m["role"] for m in messages) + ")")
    return messages, shape


def open_binary(path):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def detect_format(path, fmt):
    if fmt != "auto":
        return fmt
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    guess = FORMAT_BY_SUFFIX.get(os.path.splitext(name)[1])
    with open_binary(path) as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    text = head.decode("utf-8", "replace").lstrip("\ufeff").lstrip()
    char = text[:1]
    if guess in ("json", None) and char == "{":
        return "jsonl"
    if guess is None:
        if char == "[":
            return "json"
        raise RowError("unknown_format", "unknown format (expected .jsonl, .json or .parquet, or set prompt_format)")
    return guess


def jsonl_rows(path):
    """(origin, obj or RowError, raw line) for every non-blank line."""
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            origin = {"line": lineno}
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield origin, RowError("invalid_utf8", "invalid UTF-8 at byte %d: %s" % (exc.start, exc.reason)), raw
                continue
            try:
                yield origin, json.loads(text.lstrip("\ufeff") if lineno == 1 else text), raw
            except ValueError as exc:
                yield origin, RowError("malformed_json", "malformed JSON: %s" % exc), raw


def json_array_rows(path, max_object_bytes=64 << 20):
    """(origin, obj or RowError, raw text) for every element of a JSON array, read in 1 MiB chunks; one element may
    span up to max_object_bytes before it is called malformed."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, row, consumed, eof = "", 0, 0, 0, False
    with open_binary(path) as f:
        def fill():
            nonlocal buf, eof, consumed
            chunk = f.read(1 << 20)
            consumed += len(chunk)
            if not chunk:
                eof = True
            buf += utf8.decode(chunk, final=not chunk)
            return bool(chunk)

        try:
            fill()
            stripped = buf.lstrip("\ufeff \t\r\n")
            if not stripped.startswith("["):
                yield {"row": 0}, RowError("not_array", "not a JSON array (starts with %r)" % stripped[:20]), b""
                return
            pos = len(buf) - len(stripped) + 1
            while True:
                while True:
                    while pos < len(buf) and buf[pos] in " \t\r\n,":
                        pos += 1
                    if pos < len(buf) or eof:
                        break
                    fill()
                if pos >= len(buf) or buf[pos] == "]":
                    return
                started = consumed  # the bytes read while this element is incomplete are its own
                while True:
                    try:
                        obj, end = decoder.raw_decode(buf, pos)
                        break
                    except ValueError as exc:
                        if eof or consumed - started > max_object_bytes:
                            yield {"row": row}, RowError("malformed_json", "malformed JSON: %s (reading of this file "
                                                         "stopped here)" % exc), buf[pos:pos + EXCERPT].encode()
                            return
                        fill()
                yield {"row": row}, obj, buf[pos:end].encode("utf-8", "replace")
                row += 1
                pos = end
                if pos > (1 << 20):  # drop what was parsed, not on every row (that would copy the buffer each time)
                    buf, pos = buf[pos:], 0
        except UnicodeDecodeError as exc:
            yield {"row": row}, RowError("invalid_utf8", "invalid UTF-8 near byte %d of the file: %s (reading of this "
                                         "file stopped here)" % (consumed - len(exc.object) + exc.start, exc.reason)), b""


def parquet_rows(path):
    import pyarrow.parquet as pq  # the host's pyarrow; an ImportError is reported by the caller

    pf = pq.ParquetFile(path)
    row = 0
    for batch in pf.iter_batches(batch_size=4096):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:
            rows = []
            for i in range(batch.num_rows):
                try:
                    rows.append(batch.slice(i, 1).to_pylist()[0])
                except UnicodeDecodeError as exc:
                    rows.append(RowError("invalid_utf8", "invalid UTF-8 in a string column at byte %d: %s"
                                         % (exc.start, exc.reason)))
        for obj in rows:
            yield {"row": row}, obj, b""
            row += 1


def total_rows(path, fmt, read, bytes_read, complete):
    """(rows, exact) of the whole file: the rows read when the file was read to its end; Parquet's from its
    metadata; else estimated from the bytes per row read (a gzip file's size is its compressed size)."""
    if complete:
        return read, True
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows, True
    if not read or not bytes_read:
        return None, False  # nothing read to estimate from
    return max(read, int(os.path.getsize(path) / (bytes_read / float(read)))), False


def excerpt(raw):
    return raw[:EXCERPT].decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)[:EXCERPT]
