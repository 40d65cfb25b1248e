# Prompt files on the host: where they are (mode "paths"), what their rows look like ("format"),
# and how long their prompts are through the model's chat template ("tokens").
# Standard library only (pyarrow, transformers when a mode needs them): it runs in the host's interpreter.
import collections
import errno
import glob
import heapq
import json
import os
import stat
import sys
import time

# the candidate finder (find_candidates, describe), shared with engine/text/ingest.py:
# @include candidates

ARGS = json.loads(sys.argv[1])
MAX_MALFORMED_LISTED = 50


def err(exc):
    return "%s: %s" % (type(exc).__name__, exc)


# ----------------------------------------------------------------------------------------- paths

def resolve(patterns):
    files, missing = [], []
    for given in patterns:
        pattern = os.path.expanduser(given)
        if GLOB_CHARS.search(pattern):
            matches = sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
            if not matches:
                missing.append({"pattern": given, "expanded": pattern, "why": "glob matched no files",
                                "error": glob_miss_text(pattern), "near": near_path(pattern)})
            files += [{"pattern": given, "path": m} for m in matches]
            continue
        try:
            st = os.stat(pattern)
        except OSError as exc:
            missing.append({"pattern": given, "expanded": pattern, "why": "cannot stat", "error": str(exc),
                            "near": near_path(pattern)})
            continue
        if stat.S_ISDIR(st.st_mode):
            e = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), pattern)
            missing.append({"pattern": given, "expanded": pattern, "error": str(e), "near": pattern, "is_dir": True,
                            "why": "is a directory (use a glob such as %s/*.jsonl)" % pattern.rstrip("/")})
            continue
        if not stat.S_ISREG(st.st_mode):
            missing.append({"pattern": given, "expanded": pattern, "why": "not a regular file", "error": "",
                            "near": near_path(pattern)})
            continue
        try:
            with open(pattern, "rb"):
                pass
        except OSError as exc:
            missing.append({"pattern": given, "expanded": pattern, "why": "cannot open", "error": str(exc),
                            "near": near_path(pattern)})
            continue
        files.append({"pattern": given, "path": pattern})
    seen, unique = set(), []
    for f in files:
        real = os.path.realpath(f["path"])
        if real not in seen:
            seen.add(real)
            unique.append(f)
    for f in unique:
        try:
            f["size"] = os.path.getsize(f["path"])
        except OSError as exc:
            f["size"] = None
            f["error"] = str(exc)
    return sorted(unique, key=lambda f: f["path"]), missing


def glob_miss_text(pattern):
    literal = []
    for part in pattern.split(os.sep):
        if GLOB_CHARS.search(part):
            break
        literal.append(part)
    base = os.sep.join(literal) or "."
    try:
        entries = os.listdir(base)
    except OSError as exc:
        return str(exc)
    e = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), pattern)
    return "%s (looked in %s/, which has %d entries)" % (e, base.rstrip("/"), len(entries))


def near_path(pattern):
    literal = []
    for part in pattern.split(os.sep):
        if GLOB_CHARS.search(part):
            break
        literal.append(part)
    return os.sep.join(literal) or "."


# ----------------------------------------------------------------------------------------- rows
# @include prompt_rows


def prompt_messages(messages, turns):
    """The longest prompt a conversation gives: its history up to its last user turn (its first with turns
    "first"), the prompt regen renders for that turn with the dataset's own earlier answers."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    cut = users[0] if turns == "first" else users[-1]
    return messages[: cut + 1]


def prompt_chars(messages, turns):
    """The characters of prompt_messages(messages, turns), in one pass (it runs on every row)."""
    total = upto = 0
    for m in messages:
        total += len(m["content"])
        if m["role"] == "user":
            upto = total
            if turns == "first":
                break
    return upto


class Picker:
    """Which good rows are tokenized (tokenizing every row of a 10^6-row set takes too long for a probe): rows
    spread evenly over every row read (every stride-th row; the stride doubles each time the pick fills up, so the
    pick covers the whole stream, tail included), each file's first and last `ends` rows, and the `longest` rows by
    the characters of their prompt (where an over-long prompt is)."""

    def __init__(self, spread, ends, longest):
        self.spread_n, self.ends_n, self.longest_n = max(1, spread), max(0, ends), max(0, longest)
        self.stride, self.seq = 1, 0
        self.spread, self.ends, self.heap = [], [], []
        self.tail, self.head_left = None, 0

    def begin_file(self):
        self.tail, self.head_left = collections.deque(maxlen=self.ends_n), self.ends_n

    def end_file(self):
        self.ends.extend(self.tail or ())
        self.tail = None

    def add(self, where, messages, turns):
        entry = (self.seq, where, messages, prompt_chars(messages, turns))
        self.seq += 1
        if self.head_left > 0:
            self.ends.append(entry)
            self.head_left -= 1
        elif self.ends_n:
            self.tail.append(entry)
        if entry[0] % self.stride == 0:
            self.spread.append(entry)
            if len(self.spread) >= 2 * self.spread_n:
                self.spread, self.stride = self.spread[::2], self.stride * 2
        if self.longest_n:
            if len(self.heap) < self.longest_n:
                heapq.heappush(self.heap, (entry[3], -entry[0], entry))
            elif entry[3] > self.heap[0][0]:  # ties keep the earlier row
                heapq.heapreplace(self.heap, (entry[3], -entry[0], entry))

    def spread_pick(self):
        n = min(self.spread_n, len(self.spread))
        return [self.spread[(i * len(self.spread)) // n] for i in range(n)]

    def picked(self):
        """(sample entries, longest entries): the sample (spread and ends) gives the distribution; the longest
        rows, tokenized too, the max and the prompts over the context."""
        sample = {e[0]: e for e in self.spread_pick() + self.ends}
        longest = [e for _, _, e in sorted(self.heap, key=lambda item: item[:2], reverse=True)]
        return sorted(sample.values(), key=lambda e: e[0]), longest

    def how(self, read):
        spread = len(self.spread_pick())
        gap = "every row" if spread >= self.seq else "about every %dth" % max(2, round(self.seq / float(spread or 1)))
        return ("%d rows spread evenly over all %d good rows of the %d read (%s), the first and last %d of each "
                "file, and the %d longest prompts by characters" % (spread, self.seq, read, gap, self.ends_n,
                                                                     len(self.heap)))


def read_file(path, fmt, deadline, picker=None, turns="all"):
    """Every row of one file (until `deadline`, a time.monotonic() value): counts, shapes, sources, malformed rows
    (their first MAX_MALFORMED_LISTED listed); the good rows go to `picker` when tokens are wanted."""
    out = {"path": path, "read": 0, "good": 0, "malformed": [], "malformed_count": 0, "by_source": {},
           "shapes": {}, "with_assistant": 0, "user_turns": 0, "bytes_read": 0, "complete": False}
    if picker is not None:
        picker.begin_file()
    try:
        out["format"] = fmt = detect_format(path, fmt)
        reader = {"jsonl": jsonl_rows, "json": json_array_rows, "parquet": parquet_rows}[fmt]
        stopped_early = False
        for origin, obj, raw in reader(path):
            if out["read"] % 1024 == 0 and time.monotonic() > deadline:
                stopped_early = True
                break
            out["read"] += 1
            out["bytes_read"] += len(raw)
            where = "%s:%s" % (path, origin["line"]) if "line" in origin else "%s:row%d" % (path, origin["row"])
            try:
                if isinstance(obj, RowError):
                    raise obj
                messages, shape = normalize(obj)
            except RowError as exc:
                out["malformed_count"] += 1
                kinds = out.setdefault("malformed_by_kind", {})
                kinds[exc.kind] = kinds.get(exc.kind, 0) + 1
                if len(out["malformed"]) < MAX_MALFORMED_LISTED:
                    out["malformed"].append({"where": where, "kind": exc.kind, "reason": exc.reason,
                                             "excerpt": excerpt(raw if raw else json.dumps(obj, default=str)[:EXCERPT]
                                                                if not isinstance(obj, RowError) else b"")})
                continue
            out["good"] += 1
            out["shapes"][shape] = out["shapes"].get(shape, 0) + 1
            src = obj.get("source") if isinstance(obj.get("source"), str) and obj.get("source") else os.path.basename(path)
            out["by_source"][src] = out["by_source"].get(src, 0) + 1
            if any(m["role"] == "assistant" for m in messages):
                out["with_assistant"] += 1
            out["user_turns"] += sum(1 for m in messages if m["role"] == "user")
            if picker is not None:
                picker.add(where, messages, turns)
        # a JSON array whose reading stopped at a row it cannot read was not read to its end
        cut = set(out.get("malformed_by_kind", {})) & {"malformed_json", "invalid_utf8", "not_array"}
        out["complete"] = not stopped_early and not (fmt == "json" and cut)
        if stopped_early:
            out["stopped"] = "time budget"
        elif not out["complete"]:
            out["stopped"] = "unreadable JSON array element"
        rows, exact = total_rows(path, fmt, out["read"], out["bytes_read"], out["complete"])
        out["rows"], out["rows_exact"] = rows, exact
    except RowError as exc:
        out["error"] = exc.reason
    except ImportError as exc:
        out["error"] = "cannot read Parquet without pyarrow: %s" % err(exc)
        out["import_error"] = err(exc)
    except (OSError, ValueError, EOFError) as exc:  # unreadable file, gzip or Parquet corruption (ArrowInvalid is a ValueError)
        out["error"] = err(exc)
    finally:
        if picker is not None:
            picker.end_file()
    return out


# ----------------------------------------------------------------------------------------- tokens

def percentile(sorted_values, q):
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, int(round(q / 100.0 * (len(sorted_values) - 1)))))
    return sorted_values[k]


TOP_LISTED = 20  # the longest tokenized prompts listed, with where they are


def token_lengths(picker, read, tokenizer_path, enable_thinking, turns):
    """The picked rows' prompts through the chat template: the sample's distribution, and every tokenized
    prompt's length (the longest by characters included) for the max and the prompts over the context."""
    try:
        from transformers import AutoTokenizer
    except Exception as exc:
        return {"error": "cannot import transformers: %s" % err(exc), "stage": "import"}
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as exc:
        return {"error": "cannot load the tokenizer from %s: %s" % (tokenizer_path, err(exc)), "stage": "load"}
    sample, longest = picker.picked()
    counted = {}  # seq -> tokens (a row both in the sample and among the longest is tokenized once)
    failures, failure_count = [], 0
    top = []
    for seq, where, messages, chars in sample + longest:
        if seq in counted:
            continue
        try:
            text = tok.apply_chat_template(prompt_messages(messages, turns), tokenize=False, add_generation_prompt=True,
                                           enable_thinking=enable_thinking)
            counted[seq] = n = len(tok.encode(text, add_special_tokens=False))
            top.append({"where": where, "tokens": n, "chars": chars})
        except Exception as exc:
            counted[seq] = None
            failure_count += 1
            if len(failures) < MAX_MALFORMED_LISTED:
                failures.append({"where": where, "reason": "chat template failed: %s" % err(exc)})
    lengths = sorted(counted[e[0]] for e in sample if counted.get(e[0]) is not None)
    checked = sorted(n for n in counted.values() if n is not None)
    top.sort(key=lambda t: -t["tokens"])
    return {"count": len(lengths), "p50": percentile(lengths, 50), "p90": percentile(lengths, 90),
            "p99": percentile(lengths, 99), "max": checked[-1] if checked else None,
            "mean": (sum(lengths) / len(lengths)) if lengths else None, "lengths": lengths,
            "checked": len(checked), "checked_lengths": checked, "read": read, "how": picker.how(read),
            "longest_lengths": [counted[e[0]] for e in longest if counted.get(e[0]) is not None],
            "longest_asked": picker.longest_n, "top": top[:TOP_LISTED],
            "template_failures": failures, "template_failure_count": failure_count,
            "tokenizer_class": type(tok).__name__}


def main():
    mode = ARGS["mode"]
    files, missing = resolve(ARGS["patterns"])
    if mode == "paths":
        for m in missing:
            if not m.get("is_dir"):  # a directory given as the path is not missing: its files are in it
                m["candidates"] = find_candidates(m["pattern"]).to_dict()
        print(json.dumps({"files": files, "missing": missing}))
        return
    started = time.monotonic()
    deadline = started + float(ARGS.get("budget_s", 120.0))
    picker = Picker(int(ARGS.get("sample", 1000)), int(ARGS.get("ends", 5)), int(ARGS.get("longest", 64))) \
        if mode == "tokens" else None
    results = []
    for f in files:
        res = read_file(f["path"], ARGS.get("format", "auto"), deadline, picker, ARGS.get("turns", "all"))
        res["size"] = f.get("size")
        results.append(res)
    out = {"files": results, "missing": missing, "read_s": round(time.monotonic() - started, 3),
           "budget_s": float(ARGS.get("budget_s", 120.0))}
    if mode == "tokens":
        read = sum(r.get("read", 0) for r in results)
        out["tokens"] = token_lengths(picker, read, ARGS["tokenizer"], bool(ARGS.get("enable_thinking", True)),
                                      ARGS.get("turns", "all"))
        out["tokens_s"] = round(time.monotonic() - started - out["read_s"], 3)
    print(json.dumps(out))


main()
