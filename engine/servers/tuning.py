"""A run's --schedule-conservativeness per server: where it starts (the operator's flag or number, the pilot's choice,
else SGLang's default), what each launch's /metrics say (engine.servers.tuning_rule), and the change at a server's
restart with the alert that says why, recorded in the run dir (engine.servers.tuning_record)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Sequence
from pathlib import Path

from engine.api.events import AlertEvent
from engine.api.tuning import (
    SGLANG_DEFAULT, AnswerTail, LaunchTuning, TuningChoice, TuningEvidence, TuningSource, TuningVerdict,
)
from engine.api.wire import Severity
from engine.config.load import RunConfig
from engine.config.schema import (
    CONSERVATIVENESS_FLAG, MIXED_CHUNK_FLAG, operator_conservativeness, operator_mixed_chunk,
)
from engine.servers.metrics_client import ServerMetrics
from engine.servers.tuning_record import RECORD_FILE, ServerRecord, TuningRecord, config_key, read_record, write_record
from engine.servers.tuning_rule import CLIP_DEFAULT, CLIP_ENV, Bounds, EvidenceWindow, choose_clip, decide

log = logging.getLogger("regen.workers")


@dataclass(frozen=True)
class Start:
    """Where every server of the run starts, before its own restarts."""
    value: float | None  # None: the operator's flag with a value that is not a number (SGLang says so at launch)
    source: TuningSource
    reason: str
    clip: int | None = None
    mixed_chunk: bool = False  # --enable-mixed-chunk added by regen
    mixed_reason: str = ""


# why the pilot adds --enable-mixed-chunk where admission holds requests back
MIXED_WHY = ("admission holds requests back, so each finished answer's replacement is prefilled in a step of its own "
             "in which no running request decodes: mixed, the prefill runs in the decode step's forward pass "
             "(SGLang's is_mixed_chunk, chunked prefill on)")


@dataclass(frozen=True)
class Change:
    """A server's value changed at its restart: the alert that says so."""
    severity: Severity
    text: str
    evidence: str


def evidence_lines(evidence: list[TuningEvidence]) -> list[str]:
    now = time.time()
    return [e.text(now) for e in evidence]


class RunTuning:
    """The run's start value and its servers' tuners. `pilot`: for `regen plan --pilot` (a run-wide value, nothing
    written); else the record in `run_dir` is read at start and written at each change."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None, *, pilot: bool = False):
        self.cfg = cfg
        w = cfg.workers
        self.bounds = Bounds(float(w.conservativeness_min), float(w.conservativeness_max))
        self.path = run_dir / RECORD_FILE if run_dir is not None else None
        self.pilot = pilot
        self.key = config_key(cfg)
        self.notes: list[str] = []  # what the start alert also says (an unreadable or foreign record)
        record, problem = read_record(self.path) if self.path is not None else (None, None)
        if problem:
            self.notes.append(problem)
        if record is not None and record.config_key != self.key:
            self.notes.append(f"{self.path} was measured on another config (model, launch, prompts or max_new_tokens "
                              "changed since): not used")
            record = None
        self.record = record or TuningRecord(config_key=self.key)
        self.operator_clip = CLIP_ENV in w.env
        self.start = self._with_mixed(self._start())

    def _start(self) -> Start:
        w = self.cfg.workers
        flag = operator_conservativeness(w)
        if flag is not None:
            try:
                value: float | None = float(flag)
            except ValueError:
                value = None
            return Start(value, TuningSource.OPERATOR_FLAG,
                         f"{CONSERVATIVENESS_FLAG} {flag} in [workers] launch / extra_args: the operator's, not tuned")
        if w.schedule_conservativeness != "auto":
            return Start(float(w.schedule_conservativeness), TuningSource.CONFIG,
                         f"[workers] schedule_conservativeness = {w.schedule_conservativeness:g}: fixed, not tuned")
        pilot = self.record.pilot
        if pilot is not None:
            return Start(pilot.value, TuningSource.PILOT, f"the pilot's choice: {pilot.reason}",
                         None if self.operator_clip else pilot.clip)
        return Start(SGLANG_DEFAULT, TuningSource.SGLANG_DEFAULT,
                     f"auto: SGLang's default {SGLANG_DEFAULT:g} until a pilot or the servers' /metrics say otherwise")

    def _with_mixed(self, start: Start) -> Start:
        """Whether regen adds --enable-mixed-chunk: the operator's line or [workers] mixed_chunk, else the pilot's."""
        w = self.cfg.workers
        not_ours = operator_mixed_chunk(w)
        if not_ours is not None:
            return replace(start, mixed_chunk=False, mixed_reason=not_ours)
        if w.mixed_chunk != "auto":
            return replace(start, mixed_chunk=w.mixed_chunk,
                           mixed_reason=f"[workers] mixed_chunk = {str(w.mixed_chunk).lower()}: fixed, not tuned")
        pilot = self.record.pilot
        if start.source == TuningSource.PILOT and pilot is not None and pilot.mixed_chunk:
            return replace(start, mixed_chunk=True, mixed_reason=pilot.mixed_reason)
        return start

    @property
    def mixed_tuned(self) -> bool:
        """The pilot may choose --enable-mixed-chunk: [workers] mixed_chunk = "auto" and nothing in the launch line."""
        return self.cfg.workers.mixed_chunk == "auto" and operator_mixed_chunk(self.cfg.workers) is None

    @property
    def clip_in_force(self) -> int:
        """The SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION the servers start with: the operator's, the pilot's, SGLang's."""
        if self.operator_clip:
            try:
                return int(self.cfg.workers.env[CLIP_ENV])
            except ValueError:
                return CLIP_DEFAULT  # SGLang refuses it at launch and says so
        return self.start.clip or CLIP_DEFAULT

    def for_server(self, name: str) -> ServerTuner:
        s = self.start
        floor = None
        value, source, clip, reason = s.value, s.source, s.clip, s.reason
        kept = self.record.server(name) if s.source.tuned and not self.pilot else None
        if kept is not None:  # where this server's last restart left it in an earlier start of the run
            value, source, reason, floor = kept.value, kept.source, kept.reason, kept.floor
            clip = None if self.operator_clip else kept.clip
        return ServerTuner(self, name, value, source, reason, clip, floor, s.mixed_chunk)

    def start_alert(self) -> AlertEvent:
        """What the servers start with, and what the run may change (info)."""
        s = self.start
        value = "the operator's value" if s.value is None else f"{s.value:g}"
        text = f"servers start with {CONSERVATIVENESS_FLAG} {value} ({s.source})"
        if s.source == TuningSource.SGLANG_DEFAULT:
            text += (f": no pilot choice in the run dir (`regen plan --pilot N` measures one); a server's restart "
                     f"lowers it toward {self.bounds.low:g} when its /metrics show token usage < 0.9 while requests "
                     f"queue, and raises it toward {self.bounds.high:g} when it retracts more than once a minute")
        elif s.source.tuned:
            text += f"; a server's restart changes it within {self.bounds.text()} as its /metrics say"
        evidence = [s.reason]
        if s.source == TuningSource.PILOT and self.record.pilot is not None:
            evidence += evidence_lines(self.record.pilot.evidence)
            if s.clip is not None:
                evidence.append(f"{CLIP_ENV}={s.clip}: {self.record.pilot.clip_reason}")
        if s.mixed_chunk:
            evidence.append(f"{MIXED_CHUNK_FLAG}: {s.mixed_reason}")
        return AlertEvent(severity=Severity.INFO, text=text, evidence="\n".join(evidence + self.notes),
                          key="tuning:start")

    def host_record(self, host_cfg: RunConfig, names: list[str]) -> TuningRecord | None:
        """What a host agent's (or a Slurm job's) servers `names` start from, written beside its host.toml: the run's
        pilot choice and where each one's last restart left it, keyed for the host's config (the agent's own
        RunTuning(host_cfg, work_dir) reads it). None when the run has nothing to give: a value the operator fixed
        (the host's config says it), or nothing measured yet."""
        servers = [s for s in self.record.servers if s.name in names]
        if self.pilot or not self.start.source.tuned or (self.record.pilot is None and not servers):
            return None
        return TuningRecord(config_key=config_key(host_cfg), pilot=self.record.pilot, servers=servers)

    def remote_change(self, name: str, launched: LaunchTuning, where: str) -> Change | None:
        """A server another host's agent launched, as its identity record says (`where`: which record): a value its
        restart chose that the run does not hold yet is recorded as the run's (the next join or job starts it there),
        and is the Change to alert, once; None for anything else."""
        if self.pilot or launched.source != TuningSource.RESTART or launched.value is None:
            return None
        kept = self.record.server(name)
        if kept is not None and (kept.value, kept.floor, kept.clip) == (launched.value, launched.floor, launched.clip):
            return None
        old = kept.value if kept is not None else self.start.value
        unsaved = self.save(ServerTuner(self, name, launched.value, launched.source, launched.reason, launched.clip,
                                        launched.floor, launched.mixed_chunk))
        raised = old is not None and launched.value > old
        was = "" if old is None else f" (was {old:g})"
        lines = [f"from {where}", f"bounds {self.bounds.text()} ([workers] conservativeness_min / _max)"]
        return Change(Severity.WARNING if raised else Severity.INFO,
                      f"worker {name} restarts with {CONSERVATIVENESS_FLAG} {launched.value:g}{was}: {launched.reason}",
                      "\n".join(lines + ([unsaved] if unsaved else [])))

    def save(self, tuner: ServerTuner) -> str | None:
        """The server's value into the run dir's record; None, or why it could not be written."""
        if self.pilot or self.path is None or tuner.value is None:
            return None
        self.record.servers = [s for s in self.record.servers if s.name != tuner.name] + [ServerRecord(
            tuner.name, tuner.value, tuner.source, tuner.reason, time.time(), tuner.floor, tuner.clip)]
        try:
            write_record(self.path, self.record)
        except OSError as exc:
            log.warning("worker %s: cannot record its %s in %s: %s", tuner.name, CONSERVATIVENESS_FLAG, self.path, exc)
            return f"not recorded in {self.path} ({exc}): the run's next start launches it at {self.start.value}"
        return None


class ServerTuner:
    """One server's value: the flag and environment of its next launch, and its /metrics since its last launch."""

    def __init__(self, run: RunTuning, name: str, value: float | None, source: TuningSource, reason: str,
                 clip: int | None, floor: float | None, mixed_chunk: bool = False):
        self.run, self.name = run, name
        self.value, self.source, self.reason, self.clip, self.floor = value, source, reason, clip, floor
        self.mixed_chunk = mixed_chunk  # --enable-mixed-chunk on its launch line (the run's, never changed at a restart)
        self.window = EvidenceWindow(name, f"{name} /metrics since its launch")
        # why its restarts keep its value (None: they change it as its /metrics say)
        self.held: str | None = None

    def flag_value(self) -> float | None:
        """The value regen adds to the launch line; None where the operator's own flag stays."""
        return None if self.source == TuningSource.OPERATOR_FLAG else self.value

    def env(self) -> dict[str, str]:
        return {CLIP_ENV: str(self.clip)} if self.clip is not None else {}

    def launch(self) -> LaunchTuning:
        """What its launch runs with, as its identity record and its event carry it."""
        return LaunchTuning(self.value, self.source, self.reason, self.clip, self.floor, self.mixed_chunk)

    def observe(self, m: ServerMetrics, now: float, batch_cap: int | None = None) -> None:
        self.window.add(m, now, batch_cap)

    def launched(self) -> None:
        """A new launch: its /metrics are a new window (SGLang's counters start again from 0)."""
        self.window = EvidenceWindow(self.name, f"{self.name} /metrics since its launch")

    def at_restart(self) -> Change | None:
        """Judge the launch that ended; the change for the next one (None: unchanged)."""
        evidence = self.window.evidence()
        self.launched()  # judged once
        if evidence is None or not self.source.tuned or self.value is None:
            return None
        if self.held is not None:
            log.info("worker %s: %s kept at %g: %s", self.name, CONSERVATIVENESS_FLAG, self.value, self.held)
            return None
        b = self.run.bounds
        pilot = self.run.record.pilot
        d = decide(self.value, [evidence], b, self.floor, pilot.answer_tail if pilot is not None else None)
        if d.verdict == TuningVerdict.KEEP:
            log.info("worker %s: %s kept at %g: %s", self.name, CONSERVATIVENESS_FLAG, self.value, d.reason)
            return None
        if d.verdict == TuningVerdict.RAISE:
            self.floor = max(self.floor or 0.0, self.value)
        old, self.value, self.source, self.reason = self.value, d.value, TuningSource.RESTART, d.reason
        unsaved = self.run.save(self)
        lines = evidence_lines([evidence]) + [f"bounds {b.text()} ([workers] conservativeness_min / _max)"]
        lines += [unsaved] if unsaved else []
        severity = Severity.WARNING if d.verdict == TuningVerdict.RAISE else Severity.INFO
        return Change(severity, f"worker {self.name} restarts with {CONSERVATIVENESS_FLAG} {d.value:g} (was {old:g}): "
                                f"{d.why}", "\n".join(lines))


def pilot_choice(run: RunTuning, evidence: list[TuningEvidence], max_new_tokens: int,
                 tail: AnswerTail | None = None, clip_tails: Sequence[AnswerTail] = ()) -> TuningChoice:
    """The run's value from the pilot's servers' /metrics (they ran at `run.start`) and its answers' tail past the clip;
    the operator's own value is kept and the plan says what the guide would have chosen."""
    s = run.start
    measured_at = s.value if s.value is not None else SGLANG_DEFAULT
    d = decide(measured_at, evidence, run.bounds, tail=tail)
    value, source, verdict, reason = d.value, TuningSource.PILOT, d.verdict, d.reason
    clip, clip_reason = s.clip, ""
    if not s.source.tuned:
        value, source, verdict = measured_at, s.source, TuningVerdict.KEEP
        reason = f"{s.reason} (the figures say: {d.reason})"
    elif run.operator_clip:
        clip_reason = f"{CLIP_ENV} in [workers] env: the operator's"
    elif d.verdict == TuningVerdict.LOWER:
        at_clip, clip_reason = choose_clip(max_new_tokens, s.clip or CLIP_DEFAULT, value, clip_tails)
        if at_clip is not None:  # a server's restart judges the tail against the clip it runs with
            clip, tail = at_clip.clip, at_clip
    elif d.verdict == TuningVerdict.RAISE and s.clip is not None:
        clip, clip_reason = None, f"the pool ran out: SGLang's own clip {CLIP_DEFAULT} again"
    mixed, mixed_reason = s.mixed_chunk, s.mixed_reason
    if s.source.tuned and run.mixed_tuned and d.verdict == TuningVerdict.LOWER:
        mixed, mixed_reason = True, MIXED_WHY
    return TuningChoice(value=value, measured_at_value=measured_at, source=source, verdict=verdict, reason=reason,
                        low=run.bounds.low, high=run.bounds.high, evidence=evidence, clip=clip,
                        clip_reason=clip_reason, mixed_chunk=mixed, mixed_reason=mixed_reason, config_key=run.key,
                        answer_tail=tail)


def planned_choice(run: RunTuning) -> TuningChoice:
    """Without a pilot: what the run starts with, and why."""
    s = run.start
    return TuningChoice(value=s.value, measured_at_value=None, source=s.source, verdict=TuningVerdict.KEEP,
                        reason=s.reason, low=run.bounds.low, high=run.bounds.high, clip=s.clip,
                        clip_reason="the pilot's choice" if s.clip is not None else "", mixed_chunk=s.mixed_chunk,
                        mixed_reason=s.mixed_reason, config_key=run.key)


def record_pilot(run: RunTuning, choice: TuningChoice) -> str | None:
    """The pilot's choice into the run dir's record, for the run to start from (its servers' earlier values go);
    None, or why it could not be written."""
    if run.path is None or choice.source != TuningSource.PILOT:
        return None
    try:
        write_record(run.path, TuningRecord(config_key=run.key, pilot=choice))
    except OSError as exc:
        return f"cannot record the choice in {run.path} ({exc}): the run starts at SGLang's default {SGLANG_DEFAULT:g}"
    return None
