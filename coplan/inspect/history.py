"""The history database: every recorded ``coplan inspect``, ``run`` and ``estimate``, in SQLite.

One table, ``records``, holds each record whole (``body``, the JSON the command printed, with
``record_id`` set) beside the columns that select and summarise it: kind, model, graph fingerprint,
torch version and build, device, hardware preset, the git commit of the user's repository, the time
it was made, and its kernel, fallback and unfused-pattern counts and step times. A ``meta`` table
names the file as a coplan history and gives its schema version, so any other SQLite file is refused.

Durability: the file is in WAL mode with ``synchronous=FULL`` and each record is one
``BEGIN IMMEDIATE`` transaction, so a process killed while writing leaves the database consistent
and loses at most the record it was writing; a record whose id was returned is on disk. Writers
from several processes (parallel CI jobs) wait for each other up to ``BUSY_TIMEOUT_S``.

A record is named by a *ref* (``History.get``): its integer id (``12`` or ``#12``), ``latest``,
``latest~N`` (N records before the newest), a git commit prefix of at least 7 hex digits, or a
graph fingerprint prefix of at least 4 (each the newest match). Only the standard library is used.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import sqlite3
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from coplan.errors import CoplanError

#: Version of the tables below; a file written by a newer coplan is refused, not misread.
SCHEMA_VERSION = 1
#: Written into ``meta`` so an unrelated SQLite file with a ``records`` table is not taken for ours.
FORMAT = "coplan-history"
#: How long a writer waits for another process's transaction before giving up.
BUSY_TIMEOUT_S = 10.0
#: ``git rev-parse`` must not stall a command (a network file system, a huge repository).
GIT_TIMEOUT_S = 2.0
#: The columns of ``rows()``: a record's summary, without its body.
SUMMARY_COLUMNS = (
    "id",
    "kind",
    "model",
    "fingerprint",
    "torch",
    "build",
    "device",
    "hardware",
    "git_commit",
    "created",
    "kernels",
    "fallbacks",
    "unfused",
    "predicted_step_s",
    "measured_step_s",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    fingerprint TEXT,
    torch TEXT,
    build TEXT,
    device TEXT,
    hardware TEXT,
    git_commit TEXT,
    created TEXT NOT NULL,
    kernels INTEGER,
    fallbacks INTEGER,
    unfused INTEGER,
    predicted_step_s REAL,
    measured_step_s REAL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_model_kind_created ON records (model, kind, created);
CREATE INDEX IF NOT EXISTS records_fingerprint ON records (fingerprint);
CREATE INDEX IF NOT EXISTS records_git_commit ON records (git_commit);
"""

# "newest" everywhere: the latest creation time, and of equal times (one-second resolution) the
# later insertion
_NEWEST = "ORDER BY created DESC, id DESC"
_HEX = re.compile(r"[0-9a-f]+")
_LATEST = re.compile(r"latest(?:~(\d+))?")


class HistoryError(CoplanError):
    """A history database that cannot be used, or a ref that names no record (one line, exit 2)."""

    exit_code = 2


def default_db_path() -> Path:
    """``$COPLAN_DB`` if set, else ``$XDG_DATA_HOME/coplan/history.sqlite``, else
    ``~/.local/share/coplan/history.sqlite``."""
    env = os.environ.get("COPLAN_DB")
    if env:
        return Path(os.path.expanduser(env))
    data = os.environ.get("XDG_DATA_HOME")
    if data:
        return Path(os.path.expanduser(data)) / "coplan" / "history.sqlite"
    try:
        base = Path.home() / ".local" / "share"
    except RuntimeError:  # no HOME and no password entry: a bare container
        raise HistoryError("no home folder for the history: set COPLAN_DB or pass --db") from None
    return base / "coplan" / "history.sqlite"


def now_utc() -> str:
    """The current time as ISO-8601 UTC to the second, ``2026-11-27T11:30:00Z``."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_commit(cwd: Path | str | None = None) -> str | None:
    """``git rev-parse HEAD`` of the repository holding ``cwd`` (default: the current folder);
    None outside a repository, without git, or when git does not answer in time."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    head = done.stdout.strip().lower()
    return head if done.returncode == 0 and _HEX.fullmatch(head) else None


def torch_build() -> tuple[str | None, str | None]:
    """(``torch.__version__``, build): the build is ``cpu``, ``cuda X.Y`` or ``rocm X.Y``; both
    None where torch cannot be imported."""
    try:
        import torch
    except ImportError:
        return None, None
    version = str(torch.__version__)
    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    if hip:
        return version, f"rocm {hip}"
    if cuda:
        return version, f"cuda {cuda}"
    return version, "cpu"


def record_context() -> dict[str, Any]:
    """What every record carries about where it was made: torch version and build, the git commit
    of the current folder's repository (or None) and the time (ISO-8601 UTC)."""
    version, build = torch_build()
    return {"torch": version, "build": build, "git_commit": git_commit(), "created": now_utc()}


def command_record(
    kind: str,
    *,
    model: str,
    batch: int | None,
    seq: int | None,
    device: str | None,
    hardware: str | None,
    fingerprint: str | None,
    predicted_step_s: float | None,
    measured: dict[str, Any] | None,
    payload: dict[str, Any],
) -> dict[str, Any]:
    """The history record of a ``run`` or ``estimate``: the job, its times, where it was made, and
    the command's own ``--json`` object as ``payload``."""
    return {
        "schema": 1,
        "kind": kind,
        "model": model,
        "batch": batch,
        "seq": seq,
        "device": device,
        "hardware": hardware,
        "fingerprint": fingerprint,
        "predicted_step_s": predicted_step_s,
        "measured": measured,
        **record_context(),
        "payload": payload,
    }


def check_writable(path: Path | str, option: str = "--db") -> Path:
    """Refuse, before any work, a history path that could not be recorded to: an existing file
    that is not a coplan history, or a new one whose folder cannot be made or written. Creates
    nothing. Returns the path (``~`` expanded)."""
    p = Path(os.path.expanduser(str(path)))
    label = f"{option} {p}"
    try:
        if p.exists():
            if p.is_dir():
                raise HistoryError(f"{label}: is a directory, not a history database")
            if not os.access(p, os.R_OK | os.W_OK):
                raise HistoryError(f"{label}: is not writable")
            with History(p, create=False):
                pass
            return p
        folder = p.parent
        while not folder.exists():  # the folders add() would make: the first existing one decides
            folder = folder.parent
        if not folder.is_dir():
            raise HistoryError(f"{label}: {folder} is not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise HistoryError(f"{label}: folder {folder} is not writable")
    except OSError as err:
        raise HistoryError(f"{label}: cannot write there: {err.strerror or err}") from None
    except ValueError as err:  # an embedded NUL
        raise HistoryError(f"{label}: not a usable path: {err}") from None
    return p


def store(path: Path | str, record: dict[str, Any]) -> int:
    """Add ``record`` to the history at ``path`` (made if missing); its new id."""
    with History(path) as history:
        return history.add(record)


def _finite(x: Any) -> Any:
    """NaN and infinity as null (JSON has neither; a diverged run still records)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _float(x: Any) -> float | None:
    if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def _text(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def _count(x: Any) -> int | None:
    """A list's length (fallbacks, unfused patterns); None where the record has no such list."""
    return len(x) if isinstance(x, list) else None


class History:
    """A coplan history database at ``path``; ``create=False`` for read-only commands, where a
    missing file is the error ``no history at PATH``. Every failure is a one-line ``HistoryError``
    naming the path. Use as a context manager, or call ``close()``."""

    def __init__(self, path: Path | str, *, create: bool = True) -> None:
        self.path = Path(os.path.expanduser(str(path)))
        self.readonly = False
        self._conn = self._open(create)
        try:
            self._prepare(create)
        except sqlite3.OperationalError as err:  # locked past the busy timeout, disk full, I/O
            self._conn.close()
            raise HistoryError(f"cannot use history at {self.path}: {err}") from None
        except sqlite3.DatabaseError as err:
            self._conn.close()
            raise HistoryError(f"{self.path} is not a coplan history database ({err})") from None
        except HistoryError:
            self._conn.close()
            raise

    # --- opening ---------------------------------------------------------------------------------

    def _open(self, create: bool) -> sqlite3.Connection:
        p = self.path
        try:
            if p.is_dir():
                raise HistoryError(f"{p} is a directory, not a history database")
            if not p.exists():
                if not create:
                    raise HistoryError(f"no history at {p}")
                p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise HistoryError(f"cannot create history at {p}: {err.strerror or err}") from None
        except ValueError as err:
            raise HistoryError(f"not a usable history path {p!r}: {err}") from None
        uri = "file:" + quote(str(p.absolute()))
        try:
            conn = self._connect(uri + ("?mode=rwc" if create else "?mode=rw"))
        except sqlite3.OperationalError as err:
            if create or not p.exists():
                raise HistoryError(f"cannot open history at {p}: {err}") from None
            try:  # a file the user may read but not write: enough for list, show, diff, check
                conn = self._connect(uri + "?mode=ro")
            except sqlite3.OperationalError as err2:
                raise HistoryError(f"cannot open history at {p}: {err2}") from None
            self.readonly = True
        return conn

    @staticmethod
    def _connect(uri: str) -> sqlite3.Connection:
        # autocommit (isolation_level None): the transactions are the explicit BEGIN IMMEDIATEs
        return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)

    def _prepare(self, create: bool) -> None:
        conn = self._conn
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            if not create:
                raise HistoryError(f"{self.path} is not a coplan history database (it is empty)")
            self._create()
        else:
            self._check_meta(tables)
        if not self.readonly:
            conn.execute("PRAGMA synchronous = FULL")

    def _create(self) -> None:
        conn = self._conn
        # WAL: a writer killed mid-transaction leaves only an uncommitted tail of the log, which the
        # next opener discards; readers (history list in CI) never block the writer
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):  # not executescript: it would commit first
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (FORMAT,))
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _check_meta(self, tables: set[str]) -> None:
        if not {"meta", "records"} <= tables:
            raise HistoryError(f"{self.path} is not a coplan history database (no coplan tables)")
        meta = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("format") != FORMAT:
            raise HistoryError(f"{self.path} is not a coplan history database")
        try:
            version = int(meta.get("schema_version", ""))
        except ValueError:
            raise HistoryError(
                f"{self.path}: unreadable schema version {meta.get('schema_version')!r}"
            ) from None
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"{self.path} has history schema {version}; this coplan reads up to {SCHEMA_VERSION} "
                "(upgrade coplan)"
            )

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> History:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- writing -----------------------------------------------------------------------------------

    def add(self, record: dict[str, Any]) -> int:
        """Store ``record`` (a dict with at least ``kind`` and ``model``) in one transaction; its new
        id, also set as the stored body's ``record_id``. ``created`` defaults to now."""
        if not isinstance(record, dict):
            raise HistoryError(f"a history record is a JSON object, got {type(record).__name__}")
        kind, model = record.get("kind"), record.get("model")
        if not isinstance(kind, str) or not kind or not isinstance(model, str) or not model:
            raise HistoryError("a history record needs a 'kind' and a 'model' (non-empty strings)")
        if self.readonly:
            raise HistoryError(f"cannot write history at {self.path}: the file is read-only")
        body = _finite(record)
        body["created"] = _text(body.get("created")) or now_utc()
        measured = body.get("measured")
        columns = (
            kind,
            model,
            _text(body.get("fingerprint")),
            _text(body.get("torch")),
            _text(body.get("build")),
            _text(body.get("device")),
            _text(body.get("hardware")),
            _text(body.get("git_commit")),
            body["created"],
            _int(body.get("kernels")),
            _count(body.get("fallbacks")),
            _count(body.get("unfused")),
            _float(body.get("predicted_step_s")),
            _float(measured.get("step_s")) if isinstance(measured, dict) else None,
        )
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")  # the write lock now: the id below stays ours
            try:
                (last,) = conn.execute("SELECT COALESCE(MAX(id), 0) FROM records").fetchone()
                rid = int(last) + 1
                body["record_id"] = rid
                try:
                    text = json.dumps(body, allow_nan=False)
                except (TypeError, ValueError) as err:
                    raise HistoryError(f"record cannot be stored as JSON: {err}") from None
                conn.execute(
                    "INSERT INTO records (id, kind, model, fingerprint, torch, build, device, hardware, "
                    "git_commit, created, kernels, fallbacks, unfused, predicted_step_s, measured_step_s, "
                    "body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (rid, *columns, text),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as err:
            raise HistoryError(f"cannot write history at {self.path}: {err}") from None
        return rid

    # --- reading -----------------------------------------------------------------------------------

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        try:
            cur = self._conn.cursor()
            cur.row_factory = sqlite3.Row
            return list(cur.execute(sql, args).fetchall())
        except sqlite3.Error as err:
            raise HistoryError(f"cannot read history at {self.path}: {err}") from None

    def _body(self, row: sqlite3.Row) -> dict[str, Any]:
        try:
            body = json.loads(row["body"])
        except (TypeError, ValueError):
            raise HistoryError(f"record #{row['id']} in {self.path} is not valid JSON") from None
        if not isinstance(body, dict):
            raise HistoryError(f"record #{row['id']} in {self.path} is not a JSON object")
        body["record_id"] = row["id"]
        return body

    def resolve(self, ref: str | int) -> int:
        """The id of the record ``ref`` names (see the module docstring); HistoryError if none."""
        text = str(ref).strip().lower()
        found = self._resolve(ref if isinstance(ref, int) and not isinstance(ref, bool) else text)
        if found is None:
            raise HistoryError(f"no record {str(ref)!r} in {self.path}")
        return found

    def _resolve(self, ref: str | int) -> int | None:
        one = "SELECT id FROM records WHERE {} " + _NEWEST + " LIMIT 1"
        if isinstance(ref, int):
            rows = self._query("SELECT id FROM records WHERE id = ?", (ref,))
            return int(rows[0]["id"]) if rows else None
        latest = _LATEST.fullmatch(ref)
        if latest:
            back = int(latest.group(1) or 0)
            rows = self._query(f"SELECT id FROM records {_NEWEST} LIMIT 1 OFFSET ?", (back,))
            return int(rows[0]["id"]) if rows else None
        digits = ref[1:] if ref.startswith("#") else ref
        if digits.isdigit():
            rows = self._query("SELECT id FROM records WHERE id = ?", (int(digits),))
            if rows or ref.startswith("#"):
                return int(rows[0]["id"]) if rows else None
        if not _HEX.fullmatch(ref):
            return None
        # hex only, so the LIKE pattern holds no wildcard but the one added
        if len(ref) >= 7:
            rows = self._query(one.format("git_commit LIKE ?"), (ref + "%",))
            if rows:
                return int(rows[0]["id"])
        if len(ref) >= 4:
            rows = self._query(one.format("fingerprint LIKE ?"), (ref + "%",))
            if rows:
                return int(rows[0]["id"])
        return None

    def get(self, ref: str | int) -> dict[str, Any]:
        """The whole record ``ref`` names: an id, ``latest``, ``latest~N``, a git commit prefix
        (7+ hex digits) or a fingerprint prefix (4+), each the newest match."""
        rid = self.resolve(ref)
        return self._body(self._query("SELECT id, body FROM records WHERE id = ?", (rid,))[0])

    def rows(
        self, *, model: str | None = None, kind: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """The summary columns (``SUMMARY_COLUMNS``) of the records, newest first, optionally of
        one model and/or kind, at most ``limit`` of them."""
        where, args = self._where(model, kind)
        sql = f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM records{where} {_NEWEST}"
        if limit is not None:
            sql += " LIMIT ?"
            args += (max(0, int(limit)),)
        return [dict(row) for row in self._query(sql, args)]

    @staticmethod
    def _where(model: str | None, kind: str | None) -> tuple[str, tuple[Any, ...]]:
        terms = [(col, v) for col, v in (("model", model), ("kind", kind)) if v is not None]
        if not terms:
            return "", ()
        return " WHERE " + " AND ".join(f"{col} = ?" for col, _ in terms), tuple(v for _, v in terms)

    def models(self) -> list[str]:
        """Every model with a record, sorted."""
        return [row["model"] for row in self._query("SELECT DISTINCT model FROM records ORDER BY model")]

    def previous(self, record_id: int) -> dict[str, Any] | None:
        """The newest record of the same model and kind made before ``record_id``: what it is
        compared with by default. None when it is the first."""
        return self._beside(record_id, "<")

    def newer(self, record_id: int) -> dict[str, Any] | None:
        """The newest record of the same model and kind made after ``record_id``; None if none is."""
        return self._beside(record_id, ">")

    def _beside(self, record_id: int, side: str) -> dict[str, Any] | None:
        """The newest record of ``record_id``'s model and kind on ``side`` ("<" before, ">" after)
        of it in (created, id) order."""
        rid = self.resolve(record_id)
        (row,) = self._query("SELECT model, kind, created FROM records WHERE id = ?", (rid,))
        rows = self._query(
            f"SELECT id, body FROM records WHERE model = ? AND kind = ? AND (created, id) {side} (?, ?) "
            + _NEWEST
            + " LIMIT 1",
            (row["model"], row["kind"], row["created"], rid),
        )
        return self._body(rows[0]) if rows else None

    def __len__(self) -> int:
        return int(self._query("SELECT COUNT(*) AS n FROM records")[0]["n"])
