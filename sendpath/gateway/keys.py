"""API keys and the daily usage ledger, in SQLite under the data directory.

Keys look like ``sk-sp-<40 url-safe characters>`` and are shown once, at creation. Only
their SHA-256 is stored, and a presented key's hash is compared in constant time.
A key found is kept in the process with the ``keys_version`` it was read at: a counter
that triggers in the file raise on every change to the keys table (a revocation, a new
limit, by any process or any SQLite client), so a lookup is one read of that counter,
and the key's row is read again only when it moved. Revoking a key thus still takes
effect on the next request, in every gateway process that shares the store. Each thread
keeps one connection open; the file is in WAL mode with ``synchronous=NORMAL``,
so a commit does not wait for the disk (a power cut can lose the last moments of the
usage ledger, never corrupt it).

The daily quota is reserved and settled like the per-minute token limit, atomically in
SQLite (``BEGIN IMMEDIATE`` transactions, each for one or several requests, answered in
order as if alone; ``ledger.py`` batches them): admission reserves what a request may
use; it is admitted only if the day's usage plus every open reservation plus its own stays
within the quota; settling replaces the reservation with the tokens really used. So
concurrent requests, in any number of gateway processes on the store, cannot overrun the
quota by more than what one request uses beyond its reservation. A reservation left by a
process that died expires after ``RESERVATION_TTL_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["ApiKey", "KeyStore", "KeyStoreError", "default_data_dir"]

PREFIX = "sk-sp-"
RESERVATION_TTL_S = 2 * 3600.0
BUSY_TIMEOUT_S = 30  # how long a write waits for another process's
_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    name TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    hint TEXT NOT NULL,
    rpm INTEGER, tpm INTEGER, daily_tokens INTEGER,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS usage (
    name TEXT NOT NULL, day TEXT NOT NULL, tokens INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (name, day)
);
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL, day TEXT NOT NULL, tokens INTEGER NOT NULL, expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS keys_version (
    id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL
);
INSERT OR IGNORE INTO keys_version VALUES (0, 0);
CREATE TRIGGER IF NOT EXISTS keys_inserted AFTER INSERT ON keys
    BEGIN UPDATE keys_version SET version = version + 1; END;
CREATE TRIGGER IF NOT EXISTS keys_updated AFTER UPDATE ON keys
    BEGIN UPDATE keys_version SET version = version + 1; END;
CREATE TRIGGER IF NOT EXISTS keys_deleted AFTER DELETE ON keys
    BEGIN UPDATE keys_version SET version = version + 1; END;
"""
_KEY_COLUMNS = "name, hint, rpm, tpm, daily_tokens, created_at, revoked_at, max_tokens"
# a key's tokens of the day so far: used, and reserved by requests still open
_TAKEN = (
    "SELECT COALESCE((SELECT tokens FROM usage WHERE name = ? AND day = ?), 0) + "
    "COALESCE((SELECT SUM(tokens) FROM reservations WHERE name = ? AND day = ?), 0)"
)
MAX_CACHED_KEYS = 4096  # keys kept in the process (all dropped when more are found)


class KeyStoreError(ValueError):
    """A key operation that cannot be done as asked (duplicate name, unknown key)."""


def default_data_dir() -> Path:
    """``$SENDPATH_DATA_DIR``, else ``$XDG_DATA_HOME/sendpath`` or ``~/.local/share/sendpath``."""
    if env := os.environ.get("SENDPATH_DATA_DIR"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sendpath"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def today() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True)
class ApiKey:
    """A key's name and limits (``None`` = unlimited); never its secret."""

    name: str
    hint: str  # the first characters, to recognise a key in a list
    rpm: int | None
    tpm: int | None
    daily_tokens: int | None
    created_at: float
    revoked_at: float | None
    max_tokens: int | None = None  # the answer cap for requests that set none (None: the gateway's)

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class KeyStore:
    """Keys and usage in one SQLite file (safe to share between processes)."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "keys.sqlite3"
        self._local = threading.local()  # this thread's open connections
        # hash -> (keys_version when read, the key): see the module docstring
        self._found: dict[str, tuple[int, ApiKey]] = {}
        with self._connect() as db:
            db.executescript(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(keys)")}
            if "max_tokens" not in columns:  # a store made before the per-key cap
                db.execute("ALTER TABLE keys ADD COLUMN max_tokens INTEGER")

    def _connect(self, wait: bool = True) -> sqlite3.Connection:
        """This thread's connection (used as ``with``: a failed transaction rolls back);
        ``wait=False``: its second one, which raises rather than waits for a lock."""
        name = "db" if wait else "reader"
        db: sqlite3.Connection | None = getattr(self._local, name, None)
        if db is None:
            timeout = BUSY_TIMEOUT_S if wait else 0
            db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            setattr(self._local, name, db)
        return db

    def create(
        self,
        name: str,
        rpm: int | None = None,
        tpm: int | None = None,
        daily_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key; returns it and its secret (shown once, stored only hashed)."""
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise KeyStoreError(f"key name {name!r}: use letters, digits, '-' and '_'.")
        for label, value in (
            ("rpm", rpm),
            ("tpm", tpm),
            ("daily-tokens", daily_tokens),
            ("max-tokens", max_tokens),
        ):
            if value is not None and value < 1:
                raise KeyStoreError(
                    f"--{label} must be >= 1 (or left out for no limit), got {value}."
                )
        secret = PREFIX + secrets.token_urlsafe(30)
        key = ApiKey(name, secret[:10], rpm, tpm, daily_tokens, time.time(), None, max_tokens)
        try:
            with self._connect() as db:
                db.execute(
                    "INSERT INTO keys (name, key_hash, hint, rpm, tpm, daily_tokens, "
                    "created_at, revoked_at, max_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?)",
                    (name, _hash(secret), key.hint, rpm, tpm, daily_tokens, key.created_at,
                     max_tokens),
                )  # fmt: skip
        except sqlite3.IntegrityError as exc:
            raise KeyStoreError(f"a key named {name!r} already exists; pick another name.") from exc
        return key, secret

    def verify(self, secret: str) -> ApiKey | None:
        """The active key this secret belongs to, or ``None``."""
        key = self.lookup(secret)
        return key if key is not None and key.active else None

    def lookup(self, secret: str, wait: bool = True) -> ApiKey | None:
        """The key this secret belongs to, revoked or not, or ``None``. ``wait=False``:
        raise ``sqlite3.OperationalError`` rather than wait for a lock (a read in WAL mode
        all but never meets one), for a caller on the event loop."""
        digest = _hash(secret)
        with self._connect(wait) as db:
            # read before the row: a change between the two reads is seen next time
            (version,) = db.execute("SELECT version FROM keys_version").fetchone()
            found = self._found.get(digest)
            if found is not None and found[0] == version:
                return found[1]
            row = db.execute(
                f"SELECT key_hash, {_KEY_COLUMNS} FROM keys WHERE key_hash = ?", (digest,)
            ).fetchone()
        if row is None or not hmac.compare_digest(row[0], digest):
            return None
        if len(self._found) >= MAX_CACHED_KEYS:
            self._found.clear()
        key = ApiKey(*row[1:])
        self._found[digest] = (version, key)
        return key

    def is_empty(self) -> bool:
        with self._connect() as db:
            count: int = db.execute("SELECT COUNT(*) FROM keys").fetchone()[0]
        return count == 0

    def list(self) -> list[ApiKey]:
        with self._connect() as db:
            rows = db.execute(f"SELECT {_KEY_COLUMNS} FROM keys ORDER BY created_at").fetchall()
        return [ApiKey(*r) for r in rows]

    def revoke(self, name: str) -> None:
        with self._connect() as db:
            cur = db.execute(
                "UPDATE keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                (time.time(), name),
            )
        if cur.rowcount == 0:
            raise KeyStoreError(f"no active key named {name!r} (`sendpath keys list` shows them).")

    def record_usage(
        self, name: str, tokens: int, day: str | None = None, reservation: int | None = None
    ) -> None:
        """Add one finished request's tokens to the key's ledger for the day (UTC), and
        drop its quota reservation (``reserve_daily``'s id) in the same transaction."""
        self.record_usages([(name, tokens, reservation)], day)

    def record_usages(
        self, entries: Sequence[tuple[str, int, int | None]], day: str | None = None
    ) -> None:
        """``record_usage`` for several finished requests (key name, tokens, reservation),
        in one transaction: one row written per key, whatever the number of requests."""
        day = day or today()
        per_key: dict[str, tuple[int, int]] = {}  # name -> (tokens, requests)
        for name, tokens, _ in entries:
            total, requests = per_key.get(name, (0, 0))
            per_key[name] = (total + tokens, requests + 1)
        reservations = [(r,) for _, _, r in entries if r is not None]
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            if reservations:
                db.executemany("DELETE FROM reservations WHERE id = ?", reservations)
            db.executemany(
                "INSERT INTO usage VALUES (?, ?, ?, ?) ON CONFLICT(name, day) DO UPDATE SET "
                "tokens = tokens + excluded.tokens, requests = requests + excluded.requests",
                [(name, day, tokens, n) for name, (tokens, n) in per_key.items()],
            )
            db.execute("COMMIT")

    def reserve_daily(self, name: str, tokens: int, quota: int) -> tuple[int | None, int]:
        """Reserve ``tokens`` of the key's daily ``quota``: (reservation id, tokens left
        after it), or (``None``, tokens left now) when they do not fit. Settle the id with
        ``record_usage`` (or drop it with ``release``)."""
        return self.reserve_dailies([(name, tokens, quota)])[0]

    def reserve_dailies(
        self, asks: Sequence[tuple[str, int, int]]
    ) -> Sequence[tuple[int | None, int]]:
        """``reserve_daily`` for several requests (key name, tokens, quota), in one
        transaction: each answered as if alone, in order (a later one sees the earlier
        ones' reservations)."""
        now, day = time.time(), today()
        answers: list[tuple[int | None, int]] = []
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM reservations WHERE expires_at < ?", (now,))
            for name, tokens, quota in asks:
                (taken,) = db.execute(_TAKEN, (name, day, name, day)).fetchone()
                left = quota - taken
                if tokens > left:
                    answers.append((None, max(0, left)))
                    continue
                cur = db.execute(
                    "INSERT INTO reservations (name, day, tokens, expires_at) VALUES (?, ?, ?, ?)",
                    (name, day, tokens, now + RESERVATION_TTL_S),
                )
                answers.append((cur.lastrowid, left - tokens))
            db.execute("COMMIT")
        return answers

    def release(self, reservation: int) -> None:
        """Drop a quota reservation that was never used (the request was refused)."""
        with self._connect() as db:
            db.execute("DELETE FROM reservations WHERE id = ?", (reservation,))

    def usage(self, name: str | None = None, day: str | None = None) -> dict[str, tuple[int, int]]:
        """(tokens, requests) per key name for the day (UTC, today by default)."""
        query = "SELECT name, tokens, requests FROM usage WHERE day = ?"
        args: tuple[str, ...] = (day or today(),)
        if name is not None:
            query, args = query + " AND name = ?", (*args, name)
        with self._connect() as db:
            return {n: (t, r) for n, t, r in db.execute(query, args).fetchall()}
