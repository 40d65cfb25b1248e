# Where a missing prompt file might be: files with its name (or a close one) near the configured path and in the
# usual data roots, best match first.
#
# One finder for every place that reports a missing prompt file: the prompts.paths probe (this file is inlined
# into probes/host/prompts.py, which runs in the host's interpreter where regen is not installed), `regen plan`
# and the supervisor (engine/text/ingest.py imports it: PromptFileError carries the candidates). So: standard library
# only, no side effect at import, and no `from __future__` import (a SyntaxError once inlined mid-script).
#
# Where it looks, nearest first, each root searched breadth-first to DEPTH levels below it:
#   1. the configured path's directory and its ancestors, up to MAX_ANCESTORS levels above it (never "/");
#   2. DATA_ROOTS: ~/data, /data, /datasets, /mnt, /workspace, $HOME.
# Nothing run-specific (such as the run dir), so the probe, `regen plan` and the supervisor, which only know the
# path, list the same candidates.
# Hidden directories and SKIP_DIRS are not entered; symlinked directories are not followed (no loops).
# The search stops at BUDGET_S seconds or MAX_DIRS directories, and says so (`cut`); the budget is checked
# between directories, so one directory that takes long to list (a hung network mount) can overrun it.
#
# What matches a plain path's file name (e.g. chat.jsonl), best first:
#   exact  the same name;
#   stem   the same name before the prompt suffix (chat.jsonl.gz, chat.json, chat.parquet; case ignored);
#   close  a prompt file whose name before the suffix is difflib-close (ratio >= CLOSE_CUTOFF) or the same plus
#          a separated tail, e.g. chat_v2.jsonl, chat-old.jsonl.
# then fewer path hops from the configured path's directory (then fewer of them upwards), then closeness.
# A glob that matches nothing (e.g. work/prompt/*.jsonl) gets the directories where its last component matches,
# as the pattern to use instead (work/data/prompts/*.jsonl, 3 files), nearest and closest-named first. A match that cannot be read (permission, dangling symlink, a directory
# named like the file) is listed apart with its error. The configured path itself is never a candidate.
import collections
import difflib
import fnmatch
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field

DATA_ROOTS = ("~/data", "/data", "/datasets", "/mnt", "/workspace", "~")
MAX_ANCESTORS = 4
DEPTH = 4
BUDGET_S = 2.0
MAX_DIRS = 20000
LIMIT = 5
CLOSE_CUTOFF = 0.75
SKIP_DIRS = frozenset(("proc", "sys", "dev", "node_modules", "__pycache__", "site-packages"))
PROMPT_SUFFIXES = (".jsonl.gz", ".json.gz", ".ndjson.gz", ".jsonl", ".json", ".ndjson", ".parquet", ".pq")
MATCH_RANK = {"exact": 0, "stem": 1, "close": 2, "glob": 3}
MATCH_WORDS = {"exact": "same name", "stem": "same name, other extension", "close": "similar name",
               "glob": "matches"}
GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass
class Candidate:
    path: str  # for a glob: the pattern to use instead (dir/<last component>)
    match: str  # exact | stem | close | glob
    hops: int  # directories between the configured path's directory and this one
    up: int  # of those, how many above it (0: inside the configured directory)
    closeness: float  # difflib ratio of the names (for a glob: of the directory names)
    size: int | None = None
    files: int | None = None  # glob: how many files the pattern matches there
    error: str | None = None  # why it cannot be read (listed apart)


@dataclass
class Search:
    configured: str  # the path or glob as given
    name: str  # the file name (or last glob component) searched for
    roots: list[str]  # where it looked, in order
    depth: int
    budget_s: float
    candidates: list[Candidate] = field(default_factory=list)  # readable, best first, at most LIMIT
    unreadable: list[Candidate] = field(default_factory=list)  # name matches that cannot be read
    total: int = 0  # readable matches found (candidates lists the best LIMIT)
    dirs_scanned: int = 0
    elapsed_s: float = 0.0
    cut: str | None = None  # why the search stopped early, if it did
    unlisted: list[str] = field(default_factory=list)  # directories that could not be listed (first few)
    unlisted_count: int = 0

    def to_dict(self):
        return asdict(self)


def error_text(exc):
    return "%s: %s" % (type(exc).__name__, exc)


def split_target(configured):
    """(anchor directory, name or name pattern, is_glob) of a configured path or glob, absolute."""
    path = os.path.abspath(os.path.expanduser(configured))
    if not GLOB_CHARS.search(path):
        return os.path.dirname(path), os.path.basename(path), False
    parts = path.split(os.sep)
    first_glob = next(i for i, p in enumerate(parts) if GLOB_CHARS.search(p))
    anchor = os.sep.join(parts[:first_glob]) or os.sep
    name = parts[-1] if parts[-1] != "**" else "*"
    return anchor, name.replace("**", "*"), True


def prompt_stem(name):
    lower = name.lower()
    for suffix in PROMPT_SUFFIXES:
        if lower.endswith(suffix):
            return lower[: -len(suffix)]
    return None


def search_roots(anchor, data_roots=DATA_ROOTS):
    """Existing directories to search, nearest first: the anchor's ancestors, then the data roots."""
    roots = []
    d = anchor
    for _ in range(MAX_ANCESTORS + 1):
        if d == os.sep:
            break
        roots.append(d)
        d = os.path.dirname(d)
    extra = [os.path.expanduser(r) for r in data_roots]
    seen, out = set(), []
    for r in roots + extra:
        if r in ("", os.sep) or not os.path.isdir(r):
            continue
        real = os.path.realpath(r)
        if real not in seen and real != os.sep:
            seen.add(real)
            out.append(real)
    return out


def distance(anchor, directory):
    """(hops, up): directories walked from `anchor` to `directory`, and how many of them upwards."""
    common = os.path.commonpath([anchor, directory])
    depth = lambda p: 0 if p == os.sep else p.rstrip(os.sep).count(os.sep)  # noqa: E731
    up = depth(anchor) - depth(common)
    return up + depth(directory) - depth(common), up


class Matcher:
    """Classifies one directory entry's name against the searched name."""

    def __init__(self, name, is_glob):
        self.name, self.is_glob = name, is_glob
        self.stem = prompt_stem(name)
        self.seq = difflib.SequenceMatcher()
        # names are compared without the prompt suffix: a shared ".jsonl" would make "a.jsonl" close to "chat.jsonl"
        self.seq.set_seq2(self.stem if self.stem is not None else name.lower())

    def ratio(self, stem):
        self.seq.set_seq1(stem)
        if self.seq.real_quick_ratio() < CLOSE_CUTOFF or self.seq.quick_ratio() < CLOSE_CUTOFF:
            return 0.0
        return self.seq.ratio()

    def kind(self, entry_name):
        """(match kind, closeness) or None."""
        if self.is_glob:
            return ("glob", 1.0) if fnmatch.fnmatchcase(entry_name, self.name) else None
        if entry_name == self.name:
            return "exact", 1.0
        stem = prompt_stem(entry_name)
        if stem is None:
            return None
        if stem == self.stem:
            return "stem", difflib.SequenceMatcher(None, self.name.lower(), entry_name.lower()).ratio()
        r = self.ratio(stem)
        if r < CLOSE_CUTOFF and not self.extends(stem):
            return None
        return "close", r or difflib.SequenceMatcher(None, self.seq.b, stem).ratio()

    def extends(self, stem):
        """One name is the other plus a tail (chat -> chat_v2, sharegpt_train_v2 -> sharegpt_train)."""
        short, long = sorted((self.seq.b, stem), key=len)
        return len(short) >= 3 and long.startswith(short) and not long[len(short)].isalnum()


def open_check(path):
    """Open and close `path` for reading: the real test of readability (os.access is wrong under sudo/ACLs)."""
    with open(path, "rb"):
        pass


def readable_size(path):
    """(size, None) when `path` can be read as a prompt file, else (None, why not)."""
    try:
        st = os.stat(path)
    except OSError as exc:  # e.g. a dangling symlink
        return None, error_text(exc)
    if stat.S_ISDIR(st.st_mode):
        return None, "IsADirectoryError: [Errno 21] Is a directory: %r" % path
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open
        return None, "not a regular file (mode %s)" % stat.filemode(st.st_mode)
    try:
        open_check(path)
    except OSError as exc:
        return None, error_text(exc)
    return st.st_size, None


class Walk:
    """Breadth-first listing of the roots within the budget; yields (directory, entries)."""

    def __init__(self, search, clock, max_dirs):
        self.search, self.clock, self.max_dirs = search, clock, max_dirs
        self.scanned = set()

    def over_budget(self, started):
        s = self.search
        if self.clock() - started > s.budget_s:
            s.cut = "time budget %g s reached after %d directories" % (s.budget_s, s.dirs_scanned)
        elif s.dirs_scanned >= self.max_dirs:
            s.cut = "directory cap %d reached" % self.max_dirs
        return s.cut is not None

    def listing(self, directory):
        try:
            with os.scandir(directory) as it:
                return list(it)
        except OSError as exc:
            self.search.unlisted_count += 1
            if len(self.search.unlisted) < 5:
                self.search.unlisted.append(error_text(exc))
            return None

    def run(self, started):
        for root in self.search.roots:
            queue = collections.deque([(root, 0)])
            while queue:
                if self.over_budget(started):
                    return
                directory, level = queue.popleft()
                if directory in self.scanned:
                    continue  # a nearer root covered it, deeper
                self.scanned.add(directory)
                self.search.dirs_scanned += 1
                entries = self.listing(directory)
                if entries is None:
                    continue
                yield directory, entries
                if level < self.search.depth:
                    queue.extend((e.path, level + 1) for e in entries if self.enter(e))

    @staticmethod
    def enter(entry):
        if entry.name.startswith(".") or entry.name in SKIP_DIRS:
            return False
        try:
            return entry.is_dir(follow_symlinks=False)
        except OSError:  # vanished while listing: nothing to enter
            return False


def find_candidates(configured, *, budget_s=BUDGET_S, depth=DEPTH, limit=LIMIT, max_dirs=MAX_DIRS,
                    data_roots=DATA_ROOTS, clock=time.monotonic):
    """Search for the file `configured` names (or files its glob would match); a Search, best candidates first."""
    started = clock()
    anchor, name, is_glob = split_target(configured)
    search = Search(configured=configured, name=name, roots=search_roots(anchor, data_roots), depth=depth,
                    budget_s=budget_s)
    given = os.path.abspath(os.path.expanduser(configured))
    own = {given, os.path.realpath(given)}  # the configured path is never its own candidate
    matcher = Matcher(name, is_glob)
    found, bad = [], []
    for directory, entries in Walk(search, clock, max_dirs).run(started):
        if is_glob:
            n = sum(1 for e in entries if matcher.kind(e.name) and is_file(e))
            if n:
                found.append(Candidate(os.path.join(directory, name), "glob", *distance(anchor, directory),
                                       dir_closeness(anchor, directory), files=n))
            continue
        for e in entries:
            kind = matcher.kind(e.name)
            if kind is None or e.path in own or os.path.realpath(e.path) in own:
                continue
            c = Candidate(e.path, kind[0], *distance(anchor, directory), round(kind[1], 3))
            c.size, c.error = readable_size(e.path)
            (found if c.error is None else bad).append(c)
    # equal hops: inside the configured directory before beside it
    order = lambda c: (MATCH_RANK[c.match], c.hops, c.up, -c.closeness, c.path)  # noqa: E731
    search.total = len(found)
    search.candidates = sorted(found, key=order)[:limit]
    search.unreadable = sorted(bad, key=order)[:limit]
    search.elapsed_s = round(clock() - started, 3)
    return search


def is_file(entry):
    try:
        return entry.is_file()
    except OSError:  # vanished or unreadable: not a file the glob would give the run
        return False


def dir_closeness(anchor, directory):
    a, b = os.path.basename(anchor).lower(), os.path.basename(directory).lower()
    return round(difflib.SequenceMatcher(None, a, b).ratio(), 3) if a and b else 0.0


# ----------------------------------------------------------------------------------------- words


def size_words(n):
    if n is None:
        return "?"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return "%.1f %s" % (n / scale, unit)
    return "%d B" % n


def candidate_words(c):
    """e.g. `/x/work/data/prompts/chat.jsonl (1.2 KB; same name, 2 dirs away)`."""
    away = "here" if c.hops == 0 else "%d dir%s away" % (c.hops, "" if c.hops == 1 else "s")
    if c.match == "glob":
        return "%s (%d file%s; %s)" % (c.path, c.files, "" if c.files == 1 else "s", away)
    return "%s (%s; %s, %s)" % (c.path, size_words(c.size), MATCH_WORDS[c.match], away)


def where_words(s):
    what = ("files matching %s" % s.name) if GLOB_CHARS.search(s.name) else ("%s and similar names" % s.name)
    return "looked for %s under %s (%d levels deep; %d directories in %.1f s)" % (
        what, ", ".join(s.roots) or "(no existing directory)", s.depth, s.dirs_scanned, s.elapsed_s)


def describe(search):
    """The lines an operator reads: where it looked, the candidates best first, the unreadable ones apart."""
    s = search if isinstance(search, Search) else search_from_dict(search)
    lines = [where_words(s)]
    if s.candidates:
        more = " (best %d of %d)" % (len(s.candidates), s.total) if s.total > len(s.candidates) else ""
        lines.append("candidates, best first%s:" % more)
        lines += ["  " + candidate_words(c) for c in s.candidates]
    else:
        lines.append("no candidate found")
    if s.unreadable:
        lines.append("found but unreadable:")
        lines += ["  %s: %s" % (c.path, c.error) for c in s.unreadable]
    if s.cut:
        lines.append("search stopped early: %s" % s.cut)
    if s.unlisted_count:
        lines.append("%d director%s could not be listed, e.g. %s" % (
            s.unlisted_count, "y" if s.unlisted_count == 1 else "ies", s.unlisted[0]))
    return lines


def search_from_dict(d):
    d = dict(d)
    d["candidates"] = [Candidate(**c) for c in d.get("candidates", [])]
    d["unreadable"] = [Candidate(**c) for c in d.get("unreadable", [])]
    return Search(**d)
