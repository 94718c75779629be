"""Settings: one frozen dataclass, read from the environment only at the edge
(``Settings.from_env()``, through the one parser in ``env``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import platformdirs

from .backends.honcho import HonchoConfig
from .env import PARSE, read_env
from .errors import ConfigurationError
from .fence import FENCE_TAGS, TAG_NAME
from .logs import redact_credentials
from .procedural.extract import OutcomeRules
from .procedural.format import ContextSettings
from .templates.model import TemplateSettings

OverflowPolicy = Literal["defer", "reject"]
OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = ("defer", "reject")
BackendName = Literal["null", "honcho", "postgres"]
BACKENDS: tuple[BackendName, ...] = ("null", "honcho", "postgres")
KvBackendName = Literal["auto", "local", "null", "honcho"]
KV_BACKENDS: tuple[KvBackendName, ...] = ("auto", "local", "null", "honcho")
Role = Literal["embedded", "producer", "worker"]
ROLES: tuple[Role, ...] = ("embedded", "producer", "worker")
SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
SSL_MODES: tuple[SslMode, ...] = (
    "disable", "allow", "prefer", "require", "verify-ca", "verify-full")
POSTGRES_SCHEMES = ("postgresql://", "postgres://")

APP_NAME = "hermes-async-memory"
# Fields set in code only, never from text (the environment or a config file): structured
# values; Honcho's come from HONCHO_* variables through HonchoConfig.
STRUCTURED_FIELDS = ("honcho", "tool_outcome_rules", "procedural_context", "templates")
ENV_PREFIX = "HERMES_MEMORY_"
# The conventional variable for a database URL (Heroku, Render, Fly, docker-compose files).
DATABASE_URL = "DATABASE_URL"
MIB = 1024 * 1024
# Tags of the library's own blocks (procedural/format.py): a fence tag may not be one of them,
# or the blocks would lose their structure.
OWN_TAGS = frozenset({"procedural_memory", "procedural_guidance", "success_template",
                      "procedural_memory_summary", "tool"})


def default_db_path() -> Path:
    """The store file in the user's data directory."""
    return platformdirs.user_data_path(APP_NAME) / "memory.db"


def parse_backend(text: str) -> BackendName:
    """``HERMES_MEMORY_BACKEND`` (and a config file's ``backend``), read as seed 000 reads
    its variable of that name, case and spaces aside: ``local`` is the local SQLite store
    alone, i.e. no replica (``null``, the name this library had for it, still reads the
    same); ``honcho`` and ``postgres`` are the replicas.

    Raises:
        ValueError: another value.
    """
    name = text.strip().lower()
    if name == "local":
        return "null"
    for backend in BACKENDS:
        if name == backend:
            return backend
    raise ValueError(f"must be one of local, honcho, postgres (null: the same as local), "
                     f"got {text!r:.40}")


def parse_fence_tags(text: str) -> tuple[str, ...]:
    """``HERMES_MEMORY_FENCE_TAGS``: tag names separated by commas (empty: none)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the pipeline can be tuned by. Build it once and pass it in."""

    db_path: Path = field(default_factory=default_db_path)
    # Group commit: a batch closes at max_batch turns or max_wait_ms after its first turn.
    max_batch: int = 2000
    max_wait_ms: float = 2.0
    # A batch also closes at this many bytes of turns (at least one turn, whatever its size).
    # The commit's script is one string, put together on the loop in one step (~0.1 ms a
    # MiB, ~1 ms a MiB where its pages are new): 2 MiB holds 2,000 plain turns, ~570 with
    # five tool calls each.
    max_batch_bytes: int = 2 * MIB
    # The backlog: turns accepted and not yet committed (they wait in the outbox on disk, and
    # cost no memory but their bytes in its mapping). Past either bound the overflow policy
    # applies: "defer" accepts the turn all the same and its receipt says deferred (the writer
    # is behind); "reject" raises QueueFullError and stores nothing.
    max_queued_turns: int = 100_000
    max_queued_bytes: int = 256 * MIB
    overflow: OverflowPolicy = "defer"
    # A turn larger than this (encoded) is refused with InvalidTurnError.
    max_turn_bytes: int = 16 * MIB
    # The outbox is a memory-mapped append log split into segments of this size.
    outbox_segment_bytes: int = 16 * MIB
    # Writer retries: a busy, locked or full store is retried with backoff from this base
    # (doubling, capped at 5 s); a record the store refuses for a cause of its own goes to the
    # dead letters at once, alone (its batch is bisected down to it).
    commit_retry_base_s: float = 0.05
    # A replica backend's turns: after this many failed writes a turn is a dead letter of
    # that backend (an outage with the backend's circuit open counts no attempts).
    replica_max_attempts: int = 8
    # Recall.
    recall_workers: int = 2
    recall_limit: int = 5
    # The recall block's lines hold whole messages: each hit, then the messages beside it,
    # within this many characters a hit (recall_limit times it for the block).
    recall_chars_per_hit: int = 380
    # PostgreSQL's recall shows a snippet of each hit: its length in tokens.
    recall_snippet_tokens: int = 16
    recall_max_terms: int = 8
    # A query term found in more messages than max(frequent_term_rows, frequent_term_ratio *
    # all messages) is too common to rank on, and is dropped: bm25 works on every row it
    # matches, and FTS5 reads a term's whole posting list for its weight. (At 1M messages,
    # bm25 alone: 0.51 ms p50 / 0.82 ms p99 with a 1 % cut-off, 0.79 / 1.71 ms with 2 %;
    # no cut-off costs ~45 ms.) Below a few thousand rows that work is small, and the word may
    # be the one that answers (stopwords are dropped by a list): hence the floor. The set is
    # refreshed off the hot path.
    frequent_term_rows: int = 5_000
    frequent_term_ratio: float = 0.01
    frequent_terms_refresh_s: float = 30.0
    max_pending_recalls: int = 10_000
    # Cache warm-ups waiting (a resumed session's stored turns); past it, requests are shed.
    max_pending_warms: int = 1_000
    # The prefetch cache: the last few committed turns of a session plus its last recall.
    recent_turns: int = 3
    recent_chars: int = 400
    cache_max_sessions: int = 10_000
    # The tags a prefetch block may be wrapped in (Hermes Agent's: memory-context). Stored
    # text in a block never holds one, in any case or spacing: its angle brackets become the
    # look-alikes U+2039 and U+203A (fence.py). Empty: stored text is shown as it is.
    fence_tags: tuple[str, ...] = field(default=FENCE_TAGS,
                                        metadata={PARSE: parse_fence_tags})
    # SQLite.
    busy_timeout_ms: int = 10_000
    source: str = "api"
    # Shutdown.
    shutdown_deadline_s: float = 10.0
    # Several processes on one store file (docs/multi-process.md):
    # "embedded" does everything in this process; "producer" (a gateway) only makes turns
    # durable, hands them to the shared file's inbox and reads recalls a worker wrote;
    # "worker" (python -m workers) also drains the inbox and serves the producers' recalls.
    role: Role = "embedded"
    # A worker's claim on inbox turns expires after lease_s unless it commits them; claims of
    # a worker process that is gone (same host) are taken back at once.
    lease_s: float = 30.0
    # How often an idle worker looks for new inbox turns and recall requests, and a
    # producer for recall results.
    shared_poll_ms: float = 20.0
    # The replica backend built when the pipeline is given none: "null" (the local store
    # only), "honcho", configured by ``honcho`` (from HONCHO_* variables in from_env), or
    # "postgres", the shared store at ``postgres_dsn`` (key-value writes mirrored too).
    # HERMES_MEMORY_BACKEND sets it with seed 000's values: "local" is "null" (parse_backend).
    backend: BackendName = field(default="null", metadata={PARSE: parse_backend})
    honcho: HonchoConfig | None = None
    # The key-value memory's backend (``pipeline.memory``): "local" (this store), "honcho"
    # (this store, each write mirrored to Honcho: needs backend "honcho"), "null" (stores
    # nothing), or "auto": honcho when the pipeline replicates to Honcho, else local.
    kv_backend: KvBackendName = "auto"
    # Procedural memory: each committed turn's tool calls are logged (``pipeline.procedural``),
    # judged a success or a failure by ``tool_outcome_rules`` (see procedural.extract); a
    # user's log keeps its newest ``tool_log_max_per_user`` calls; a success within
    # ``tool_fix_window_s`` of a failure of the same tool, with other arguments, fixed it.
    tool_log: bool = True
    tool_log_max_per_user: int = 10_000
    tool_fix_window_s: float = 3600.0
    tool_outcome_rules: OutcomeRules = field(default_factory=OutcomeRules)
    # The procedural block each recall appends for its session (the record of the tools its
    # last turns used; guidance when one just failed), rendered by these options within
    # their budget; None: no block.
    procedural_context: ContextSettings | None = field(
        default_factory=lambda: ContextSettings(max_chars=1200))
    # Warm-start templates (``pipeline.templates``): classification, extraction, choice, the
    # outcome rules of a session started from one, automatic creation (off by default).
    # From HERMES_MEMORY_TEMPLATE_* variables in from_env (``TemplateSettings.from_env``).
    templates: TemplateSettings = field(default_factory=TemplateSettings)
    # The Hermes provider's system prompt block also carries a compact summary of the user's
    # tools (their success rates and frequent errors).
    procedural_summary: bool = False
    # The shared PostgreSQL store (the postgres extra): a postgresql:// URL, from
    # HERMES_MEMORY_POSTGRES_DSN, else DATABASE_URL. It holds the password, so it is left out
    # of repr and of parse errors, and logs and errors show it redacted
    # (postgres.dsn.redact_dsn).
    postgres_dsn: str | None = field(default=None, repr=False)
    # The connection pool of each process: it keeps min_size connections open and opens up to
    # max_size under load (a gateway's replication and recall share it).
    postgres_pool_min_size: int = 1
    postgres_pool_max_size: int = 10
    postgres_connect_timeout_s: float = 10.0
    # TLS: libpq's sslmode and the root certificate that verify-ca / verify-full check the
    # server's certificate against; None keeps the DSN's own (else asyncpg's default, prefer).
    postgres_sslmode: SslMode | None = None
    postgres_sslrootcert: Path | None = None
    # Shared jobs (backend "postgres"). With postgres_recall_jobs a gateway's queued recalls
    # are jobs that worker processes on any machine answer (``hermes-memory worker``); its
    # prefetch cache takes each answer when its NOTIFY comes, and the local recall answers
    # while the database is down. A worker holds a job for postgres_job_lease_s, renewed
    # while it runs (a crashed worker's jobs are taken over once that runs out), and runs up
    # to postgres_job_concurrency jobs at once.
    postgres_recall_jobs: bool = False
    postgres_job_lease_s: float = 30.0
    postgres_job_concurrency: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "db_path", Path(self.db_path).expanduser())
        self._check_fence_tags()
        positive = (
            "max_batch", "max_batch_bytes", "max_pending_warms", "max_queued_turns",
            "max_queued_bytes", "max_turn_bytes",
            "outbox_segment_bytes", "replica_max_attempts",
            "recall_workers", "recall_limit",
            "recall_chars_per_hit", "recall_snippet_tokens", "recall_max_terms",
            "frequent_term_rows",
            "max_pending_recalls", "cache_max_sessions", "tool_log_max_per_user",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
        non_negative = (
            "max_wait_ms", "commit_retry_base_s", "frequent_terms_refresh_s", "frequent_term_ratio",
            "shutdown_deadline_s", "busy_timeout_ms", "recent_turns", "recent_chars",
            "tool_fix_window_s",
        )
        if self.backend not in BACKENDS:
            raise ConfigurationError(
                f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigurationError(
                f"kv_backend must be one of {', '.join(KV_BACKENDS)}, got {self.kv_backend!r}")
        if self.kv_backend == "honcho" and self.backend != "honcho":
            raise ConfigurationError("kv_backend 'honcho' mirrors key-value memory through the "
                                     "Honcho replica: it needs backend 'honcho'")
        if self.backend == "postgres" and not self.postgres_dsn:
            raise ConfigurationError(
                "backend 'postgres' needs a database: set postgres_dsn (or DATABASE_URL, or "
                "HERMES_MEMORY_POSTGRES_DSN), e.g. postgresql://USER:PASSWORD@HOST:5432/DB")
        if self.role not in ROLES:
            raise ConfigurationError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        for name in ("lease_s", "shared_poll_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive number, got {value!r}")
        for name in non_negative:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"{name} must be a non-negative number, got {value!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigurationError(
                f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {self.overflow!r}"
            )
        if self.outbox_segment_bytes < 64 * 1024:
            raise ConfigurationError("outbox_segment_bytes must be at least 64 KiB")
        self._check_postgres()
        self._check_tool_rules()

    def _check_tool_rules(self) -> None:
        """``tool_outcome_rules`` judges every tool answer on the writer's path: a pattern
        that does not compile, or a key list given as one string (read letter by letter),
        is refused here rather than misjudging every answer later."""
        rules = self.tool_outcome_rules
        if not isinstance(rules, OutcomeRules):
            raise ConfigurationError(
                f"tool_outcome_rules must be an OutcomeRules, got {type(rules).__name__}")
        for f in dataclasses.fields(rules):
            value = getattr(rules, f.name)
            name = f"tool_outcome_rules.{f.name}"
            if f.name == "exception_pattern":
                if not isinstance(value, str):
                    raise ConfigurationError(f"{name} must be a string, got {value!r}")
                try:
                    re.compile(value)
                except re.error as exc:
                    raise ConfigurationError(
                        f"{name} is not a regular expression: {exc}") from None
            elif isinstance(value, (str, bytes)) or not (
                    isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
                raise ConfigurationError(f"{name} must be a tuple of strings, got {value!r}")

    def _check_fence_tags(self) -> None:
        tags = self.fence_tags
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise ConfigurationError(f"fence_tags must be a sequence of tag names, got {tags!r}")
        object.__setattr__(self, "fence_tags", tuple(tags))
        for tag in tags:
            if not TAG_NAME.fullmatch(tag):
                raise ConfigurationError(f"fence_tags: {tag!r} is not a tag name")
            if tag.lower() in OWN_TAGS:
                raise ConfigurationError(
                    f"fence_tags: {tag!r} is a tag of the library's own procedural block")

    def _check_postgres(self) -> None:
        dsn = self.postgres_dsn
        if dsn is not None and not dsn.lower().startswith(POSTGRES_SCHEMES):
            # Shown redacted: a DSN in another form still holds its password.
            raise ConfigurationError(
                f"postgres_dsn must be a postgresql:// URL, got {redact_credentials(dsn)!r}")
        low, high = self.postgres_pool_min_size, self.postgres_pool_max_size
        for name, value in (("postgres_pool_min_size", low), ("postgres_pool_max_size", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"{name} must be a non-negative integer, got {value!r}")
        if high < 1 or low > high:
            raise ConfigurationError(
                f"postgres_pool_max_size must be at least 1 and at least postgres_pool_min_size "
                f"({low}), got {high}")
        timeout = self.postgres_connect_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigurationError(
                f"postgres_connect_timeout_s must be a positive number, got {timeout!r}")
        lease = self.postgres_job_lease_s
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not lease > 0:
            raise ConfigurationError(
                f"postgres_job_lease_s must be a positive number, got {lease!r}")
        jobs = self.postgres_job_concurrency
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ConfigurationError(
                f"postgres_job_concurrency must be a positive integer, got {jobs!r}")
        if self.postgres_sslmode is not None and self.postgres_sslmode not in SSL_MODES:
            raise ConfigurationError(f"postgres_sslmode must be one of {', '.join(SSL_MODES)}, "
                                     f"got {self.postgres_sslmode!r}")

    @property
    def outbox_dir(self) -> Path:
        """Where the outbox segments live, beside the store file."""
        return self.db_path.with_name(self.db_path.name + ".outbox")

    def producer_outbox_dir(self, slot: int) -> Path:
        """A producer's own outbox: each producer process holds one slot (a locked folder);
        a restarted producer takes a free slot and commits what a dead one left there."""
        return self.db_path.with_name(f"{self.db_path.name}.outbox-p{slot}")

    def replace(self, **changes: object) -> Settings:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``HERMES_MEMORY_<FIELD>`` variables (e.g. ``HERMES_MEMORY_DB_PATH``), the
        ``HERMES_MEMORY_TEMPLATE_*`` ones (see ``TemplateSettings``), with
        ``HERMES_MEMORY_BACKEND=honcho`` the ``HONCHO_*`` ones (see ``HonchoConfig``), and
        ``DATABASE_URL`` as the PostgreSQL DSN when it is a postgresql:// URL and
        ``HERMES_MEMORY_POSTGRES_DSN`` is not set.

        ``HERMES_MEMORY_BACKEND`` is seed 000's variable, with its meaning: ``local`` keeps
        memory in the local SQLite store alone (``backend`` "null": nothing replicated; the
        key-value memory, ``kv_backend`` "auto", is then the local store), ``honcho`` mirrors
        it to Honcho. The replicas' values still select them: ``null`` reads as ``local``,
        ``postgres`` is the shared PostgreSQL store (``parse_backend``). Set explicitly, it
        wins over ``HONCHO_API_KEY``; unset, the key picks Honcho (``auto_backend``).

        Raises:
            ConfigurationError: a variable does not parse as its field's type.
        """
        env = os.environ if environ is None else environ
        values = read_env(cls, env, ENV_PREFIX, skip=STRUCTURED_FIELDS)  # HONCHO_* below
        values.update(overrides)
        url = env.get(DATABASE_URL, "").strip()
        # DATABASE_URL is anyone's: one naming another kind of database is not for us.
        if "postgres_dsn" not in values and url.lower().startswith(POSTGRES_SCHEMES):
            values["postgres_dsn"] = url
        values.setdefault("backend", auto_backend(values, env))
        if values.get("backend") == "honcho" and values.get("honcho") is None:
            values["honcho"] = HonchoConfig.from_env(env)
        if "templates" not in values:
            values["templates"] = TemplateSettings.from_env(env)
        return cls(**values)  # type: ignore[arg-type]



def auto_backend(chosen: Mapping[str, object], environ: Mapping[str, str]) -> BackendName:
    """The backend when none is set explicitly, in seed 000's order: Honcho when the
    key-value backend asks for it, or when ``HONCHO_API_KEY`` is set and the honcho extra is
    installed; else the local store alone ("null": nothing replicated). Read from the
    settings and environment given, never from a process-wide default."""
    kv = chosen.get("kv_backend", "auto")
    if kv == "honcho":
        return "honcho"
    if kv == "auto" and environ.get("HONCHO_API_KEY") and honcho_installed():
        return "honcho"
    return "null"


def honcho_installed() -> bool:
    """Whether the honcho extra (honcho-ai) is installed. No import, no I/O beyond a look
    at the installed packages."""
    return importlib.util.find_spec("honcho") is not None
