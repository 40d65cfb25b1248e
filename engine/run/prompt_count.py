"""The counting pass over the prompt files (per-shard totals: the ledger's planned figures; bad input rows), cached in
the run dir (engine.store.count_cache) so a restart reads a file instead of parsing, and the streams of good
conversations from a shard's saved position on (the feed reads them)."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from engine.config.load import RunConfig
from engine.run.counts import ShardCounts
from engine.store import count_cache
from engine.store.rejects import RejectLog
from engine.store.names import shard_id_for
from engine.text.ingest import Conversation, StreamStart, iter_prompts, resolve_prompt_files
from engine.text.row_errors import Reject
from engine.text.render import Renderer

log = logging.getLogger("regen.feed")


class PromptCount:
    def __init__(self, cfg: RunConfig, renderer: Renderer, rejects: RejectLog):
        self.cfg = cfg
        self.renderer = renderer
        self.rejects = rejects
        self.planned: dict[str, ShardCounts] = {}  # the counting pass's result: the ledger's shards once it opens
        self.input_rejects = 0
        self._files: list[Path] | None = None  # the resolved prompt files (set by the count)
        self._starts: dict[str, tuple[StreamStart, str]] = {}  # shard -> its first conversation (pos, id)
        self._skip: dict[int, set[int]] = {}  # file number -> positions the full stream rejects
        self._seekable = False
        self._count_from_cache = False
        self._count_s = 0.0
        self._cache_to_save: tuple[list[dict[str, Any]], count_cache.CountResult] | None = None

    # -- startup ----------------------------------------------------------------------------
    def count_stream(self) -> list[Reject]:
        """The counting pass (safe in a thread: touches no sqlite): per-shard totals and bad input
        rows, from the run dir's count cache when the prompt files and config are unchanged."""
        started = time.monotonic()
        self._files = files = resolve_prompt_files(self.cfg.prompts)
        facts = None
        try:
            facts = count_cache.file_facts(files)
        except OSError as exc:
            log.warning("count cache: cannot fingerprint the prompt files (%s): not used", exc)
        if facts is not None and self._use_cache(facts, started):
            return []
        bad: list[Reject] = []
        file_no_of = {str(p): i for i, p in enumerate(files)}
        skip: dict[int, set[int]] = {}
        seekable = True
        for entry in iter_prompts(self.cfg.prompts, self.cfg.prompt_format, files=files):
            if isinstance(entry, Reject):
                bad.append(entry)
                fno = file_no_of.get(entry.file)
                pos = entry.line if entry.line is not None else entry.row
                if fno is None or pos is None:
                    seekable = False  # a reject without a position: partial streams could shift indices
                else:
                    skip.setdefault(fno, set()).add(pos)
                continue
            sid = shard_id_for(entry.index, self.cfg.shard_size)
            counts = self.planned.get(sid)
            if counts is None:
                counts = self.planned[sid] = ShardCounts(first_index=entry.index)
                pos = entry.offset if entry.line is not None else entry.row
                if pos is None:
                    seekable = False
                else:
                    self._starts[sid] = (StreamStart(file_no_of[entry.file], pos, entry.line, entry.index),
                                         entry.conversation_id)
            counts.conversations += 1
            counts.total += len(self.renderer.user_turns(entry, self.cfg.turns))
            counts.end_index = entry.index + 1
        self.input_rejects = len(bad)
        self._skip = skip
        self._seekable = seekable
        self._count_s = time.monotonic() - started
        if facts is not None:
            result = count_cache.CountResult(
                [count_cache.ShardStart(sid, c.conversations, c.total, c.first_index, c.end_index,
                                        self._starts[sid][0] if sid in self._starts else None,
                                        self._starts[sid][1] if sid in self._starts else "")
                 for sid, c in self.planned.items()], skip, len(bad), self._count_s, seekable)
            self._cache_to_save = (facts, result)  # saved by finish_count, once the rejects are logged
        return bad

    def _use_cache(self, facts: list[dict[str, Any]], started: float) -> bool:
        run_dir = Path(self.cfg.run_dir)
        try:
            cached = count_cache.load(run_dir, self.cfg, facts)
            if cached.input_rejects > self.rejects.count:
                raise count_cache.CacheUnusable(
                    f"{self.rejects.path} holds {self.rejects.count} rejects, fewer than the {cached.input_rejects}"
                    " bad input rows of the cached count", stale=True)
        except count_cache.CacheUnusable as exc:
            if exc.stale:
                log.info("count cache: not used: %s; counting the prompt files", exc)
            else:
                log.warning("count cache: IGNORED: %s; counting the prompt files again", exc)
            return False
        for sh in cached.shards:
            self.planned[sh.shard_id] = ShardCounts(total=sh.total, conversations=sh.conversations,
                                                   first_index=sh.first_index, end_index=sh.end_index)
            if sh.start is not None:
                self._starts[sh.shard_id] = (sh.start, sh.first_id)
        self._skip = cached.skip
        self._seekable = cached.seekable
        self.input_rejects = cached.input_rejects
        self._count_from_cache = True
        self._count_s = time.monotonic() - started
        log.info("count cache: %d shards, %d bad input rows from %s (prompt files unchanged; the full count "
                 "took %.1f s)", len(cached.shards), cached.input_rejects, run_dir / count_cache.CACHE_FILE,
                 cached.count_s)
        return True

    def finish_count(self, bad: list[Reject]) -> None:
        """The counting pass's own writes (on the loop thread): its bad input rows logged, the count cache saved."""
        self.rejects.add_many(bad)  # one fsync for the lot
        if self._cache_to_save is not None:
            facts, result = self._cache_to_save
            self._cache_to_save = None
            try:
                path = count_cache.save(Path(self.cfg.run_dir), self.cfg, facts, result)
                log.info("count cache: saved %s (%d shards)", path, len(result.shards))
            except OSError as exc:
                log.warning("count cache: cannot save it in %s (%s): the next start counts again", self.cfg.run_dir, exc)

    def counted(self) -> str:
        """How the count was made, for the log."""
        return f"counted in {self._count_s:.1f} s" + (" (count cache)" if self._count_from_cache else "")

    def stream_from(self, first_index: int) -> Iterator[Conversation]:
        """Good conversations from index `first_index` on (earlier ones may come too: callers skip
        them), starting at the saved position of the shard holding it when there is one."""
        def full() -> Iterator[Conversation]:
            return _good(iter_prompts(self.cfg.prompts, self.cfg.prompt_format, files=self._files))

        sid = shard_id_for(first_index, self.cfg.shard_size)
        entry = self._starts.get(sid) if self._seekable else None
        if entry is None or entry[0].index == 0:
            return full()
        start, first_id = entry
        stream = iter_prompts(self.cfg.prompts, self.cfg.prompt_format, files=self._files, start=start,
                              skip=self._skip)
        return self._checked(stream, sid, start, first_id, full)

    @staticmethod
    def _checked(stream: Iterable[Conversation | Reject], sid: str, start: StreamStart, first_id: str,
                 full: Callable[[], Iterator[Conversation]]) -> Iterator[Conversation]:
        first = True
        for entry in stream:
            if not isinstance(entry, Conversation):
                continue
            if first:
                first = False
                if entry.conversation_id != first_id or entry.index != start.index:
                    log.error("count cache: shard %s should start with conversation %r (index %d) at file %d"
                              " position %d, found %r (index %d): reading the prompt files from the start instead",
                              sid, first_id, start.index, start.file_no, start.position, entry.conversation_id,
                              entry.index)
                    yield from full()
                    return
            yield entry


def _good(entries: Iterable[Conversation | Reject]) -> Iterator[Conversation]:
    for entry in entries:
        if isinstance(entry, Conversation):
            yield entry
