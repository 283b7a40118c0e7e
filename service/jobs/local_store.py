"""The local job store (`LocalJobStore`): files, batch records and chunk results on local disk for one API
process (`<dir>/files`, `<dir>/batches`, `<dir>/chunks`); every write goes to a `.tmp` file renamed into place,
a chunk is committed with a create-if-absent link, and leases always succeed (nothing to arbitrate)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from latentlm.service.jobs.jsonl import READ_CHUNK, read_chunks
from latentlm.service.jobs.store import (
    LIVE,
    TERMINAL,
    ModelIdentities,
    StagedFile,
    StorageError,
    is_expired,
    output_file_ids,
    valid_id,
    visible,
)

log = logging.getLogger("latentlm.jobs")


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class LocalJobStore:
    """The same interface on local disk (one API process): `<dir>/files`, `<dir>/batches`, `<dir>/chunks`.

    A write the disk refuses (full, read-only) raises `StorageError` and leaves no `.tmp` file behind. A batch
    that fails because of it is marked failed in memory when even that cannot be written (`_pending`, shown by
    the routes, written to disk as soon as the disk takes it)."""

    max_output_bytes = 1 << 62

    def __init__(self, root: Path, model_identities: ModelIdentities | None = None):
        """`model_identities`: the API's models, recorded with each batch (`JobStore.model_identities`)."""
        self.root = Path(root)
        self.model_identities = model_identities
        for d in ("files", "batches", "chunks"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._pending: dict[str, dict] = {}
        self._bytes: dict[str, int] = {}  # batch -> output bytes over its committed chunks (`output_bytes`)
        self.clean_tmp(max_age_s=0)  # one process owns the directory: every .tmp left is from a crash

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(e) from e

    def clean_tmp(self, max_age_s: float = 600) -> int:
        """Remove `.tmp` files older than `max_age_s` (a crash between write and rename leaves them)."""
        n, cutoff = 0, time.time() - max_age_s
        for pattern in ("files/.*.tmp", "batches/.*.tmp", "chunks/*/.*.tmp"):
            for p in self.root.glob(pattern):
                try:
                    if p.stat().st_mtime <= cutoff:
                        p.unlink()
                        n += 1
                except OSError:
                    pass
        return n

    # -- files
    def put_file(self, meta: dict, content: bytes) -> None:
        body = self.root / "files" / f"{meta['id']}.content"
        self._write(body, content)
        try:
            self._write(self.root / "files" / f"{meta['id']}.json", json.dumps(meta).encode())
        except StorageError:
            _unlink(body)
            raise

    def file_meta(self, fid: str) -> dict | None:
        if not valid_id(fid, "file"):
            return None
        p = self.root / "files" / f"{fid}.json"
        try:
            meta = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        if is_expired(meta):
            self._drop_expired("file", fid, self.delete_file)
            return None
        return meta

    def file_content(self, fid: str) -> bytes | None:
        if self.file_meta(fid) is None:
            return None
        try:
            return (self.root / "files" / f"{fid}.content").read_bytes()
        except FileNotFoundError:
            return None

    def put_file_stream(self, meta: dict, chunks: Iterable[bytes]) -> None:
        """Write a file from its chunks (to a `.tmp` file, renamed once complete, then the metadata);
        `meta["bytes"]` is set from what was written. An error while reading leaves nothing behind."""
        body = self.root / "files" / f"{meta['id']}.content"
        tmp = body.with_name(f".{body.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
            os.replace(tmp, body)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(e) from e
        except BaseException:
            _unlink(tmp)
            raise
        meta["bytes"] = size
        try:
            self._write(self.root / "files" / f"{meta['id']}.json", json.dumps(meta).encode())
        except StorageError:
            _unlink(body)
            raise

    def iter_file(self, fid: str, start: int = 0, end: int | None = None) -> Iterator[bytes] | None:
        """The file's content (bytes `start` to `end`, default all) in chunks of `READ_CHUNK`, or None when there
        is no such file."""
        if self.file_meta(fid) is None:
            return None
        try:
            f = open(self.root / "files" / f"{fid}.content", "rb")
        except FileNotFoundError:
            return None
        if not start and end is None:
            return read_chunks(f)
        f.seek(start)

        def part(left: int) -> Iterator[bytes]:
            try:
                while left > 0 and (chunk := f.read(min(READ_CHUNK, left))):
                    left -= len(chunk)
                    yield chunk
            finally:
                f.close()

        return part((1 << 62) if end is None else end - start)

    def stage_file(self, fid: str) -> StagedFile:
        """A file written to a `.tmp` file beside the files, renamed into place by `transition`."""
        return _Staged(self.root / "files" / f".{fid}.content.{os.getpid()}.{threading.get_ident()}.tmp")

    def delete_file(self, fid: str) -> bool:
        if not valid_id(fid, "file"):
            return False
        meta = self.root / "files" / f"{fid}.json"
        existed = meta.is_file()
        for p in (meta, self.root / "files" / f"{fid}.content"):
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                raise StorageError(e) from e
        return existed

    # -- batches
    def put_batch(self, batch: dict) -> None:
        with self._lock:
            self._write(self.root / "batches" / f"{batch['id']}.json", json.dumps(batch).encode())
            self._pending.pop(batch["id"], None)

    def _read_batch(self, bid: str) -> dict | None:
        if bid in self._pending:
            return dict(self._pending[bid])
        try:
            return json.loads((self.root / "batches" / f"{bid}.json").read_text())
        except FileNotFoundError:
            return None

    def get_batch(self, bid: str) -> dict | None:
        if not valid_id(bid, "batch"):
            return None
        with self._lock:
            b = self._read_batch(bid)
        if b is not None and is_expired(b):
            self._drop_expired("batch", bid, self.delete_batch)
            return None
        return b

    @staticmethod
    def _drop_expired(kind: str, ident: str, delete) -> None:
        """Delete an expired file or batch on access; a store that refuses (read-only disk) only logs."""
        try:
            delete(ident)
        except StorageError as e:
            log.warning("expired %s %s not deleted: %s", kind, ident, e.message)

    def transition(self, bid: str, fields: dict, token: str | None = None,
                   files: list[tuple[dict, bytes | StagedFile]] = ()) -> bool:
        """If the batch exists and is not finished: write `files` (bytes, or staged: renamed into place), set
        `fields` (one process: no lease)."""
        with self._lock:
            b = self.get_batch(bid)
            if b is None or b["status"] in TERMINAL:
                return False
            for meta, data in files:
                if isinstance(data, _Staged):
                    data.place(self.root / "files" / f"{meta['id']}.content")
                    self._write(self.root / "files" / f"{meta['id']}.json", json.dumps(meta).encode())
                else:
                    self.put_file(meta, data)
            self.put_batch({**b, **fields})
            return True

    def fail(self, bid: str, fields: dict, token: str | None) -> bool:
        """As `transition`, but a disk that refuses the write keeps the failed record in memory (shown by the
        routes, written by `flush`) rather than leave the batch in_progress."""
        with self._lock:
            try:
                return self.transition(bid, fields, token)
            except StorageError as e:
                b = self.get_batch(bid)
                if b is None or b["status"] in TERMINAL:
                    return False
                self._pending[bid] = {**b, **fields}
                log.error("batch %s: failed status kept in memory until the disk takes it (%s)", bid, e.message)
                return True

    def flush(self) -> int:
        """Write the batch records `fail` kept in memory; returns how many are still pending."""
        with self._lock:
            for rec in list(self._pending.values()):
                try:
                    self.put_batch(rec)
                    self.delete_chunks(rec["id"])  # what the failure could not delete then
                except (StorageError, OSError):
                    break
            return len(self._pending)

    def _all_batches(self) -> list[dict]:
        with self._lock:
            out = dict(self._pending)
            for p in (self.root / "batches").glob("batch_*.json"):
                if p.stem not in out:
                    try:
                        out[p.stem] = json.loads(p.read_text())
                    except (OSError, ValueError):
                        continue
        return list(out.values())

    def list_batches(self, limit: int, owner: str | None = None) -> tuple[list[dict], bool]:
        now = time.time()
        bs = [b for b in self._all_batches() if visible(b, owner) and not is_expired(b, now)]
        bs.sort(key=lambda b: b["created_at"], reverse=True)
        return bs[:limit], len(bs) > limit

    def active(self) -> list[str]:
        return sorted(b["id"] for b in self._all_batches() if b["status"] in LIVE and not is_expired(b))

    def forget_active(self, bid: str) -> None:
        return None

    def delete_batch(self, bid: str) -> bool:
        if not valid_id(bid, "batch"):
            return False
        with self._lock:
            p = self.root / "batches" / f"{bid}.json"
            existed = p.is_file() or bid in self._pending
            try:
                for fid in output_file_ids(bid):
                    self.delete_file(fid)
                self.delete_chunks(bid)
                p.unlink(missing_ok=True)
            except OSError as e:
                raise StorageError(e) from e
            self._pending.pop(bid, None)
            return existed

    def sweep(self, now: float | None = None) -> int:
        """Delete expired files and batches, chunk directories of batches that are gone, and stale `.tmp`
        files; returns how many files and batches were deleted."""
        now = time.time() if now is None else now
        n = 0
        for b in self._all_batches():
            if is_expired(b, now):
                n += self.delete_batch(b["id"])
        for p in (self.root / "files").glob("file*.json"):
            try:
                meta = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if is_expired(meta, now):
                n += self.delete_file(meta["id"])
        for d in (self.root / "chunks").glob("batch_*"):
            if valid_id(d.name, "batch") and d.name not in self._pending and \
                    not (self.root / "batches" / f"{d.name}.json").exists():
                shutil.rmtree(d, ignore_errors=True)
        self.clean_tmp()
        return n

    # -- chunks
    def put_plan(self, bid: str, plan: dict, expires_at: int | None = None) -> dict:
        """Write the chunk plan (`<chunks>/<batch>/plan`) unless one is there; the plan recorded."""
        path = self._chunk_dir(bid, create=True) / "plan"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            self._write(path, json.dumps(plan).encode())
            return plan

    def get_plan(self, bid: str) -> dict | None:
        try:
            return json.loads((self._chunk_dir(bid) / "plan").read_text())
        except FileNotFoundError:
            return None

    def _chunk_dir(self, bid: str, create: bool = False) -> Path:
        if not valid_id(bid, "batch"):
            raise ValueError(f"not a batch id: {bid!r}")
        d = self.root / "chunks" / bid
        if create:
            try:
                d.mkdir(exist_ok=True)
            except OSError as e:
                raise StorageError(e) from e
        return d

    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int,
                     expires_at: int | None = None) -> int:
        """1 committed, 0 committed before, -1 no such batch, -2 batch already finished."""
        b = self.get_batch(bid)
        if b is None:
            return -1
        if b["status"] in TERMINAL:
            return -2
        d = self._chunk_dir(bid, create=True)
        tmp = d / f".{index}.{threading.get_ident()}.tmp"
        rec = {"lines": lines, "completed": completed, "failed": failed,
               "bytes": sum(len(ln.encode()) + 1 for ln in lines)}
        try:
            tmp.write_text(json.dumps(rec))
            os.link(tmp, d / f"{index}.json")  # atomic create-if-absent
            with self._lock:
                if bid in self._bytes:
                    self._bytes[bid] += rec["bytes"]
            return 1
        except FileExistsError:
            return 0
        except OSError as e:
            raise StorageError(e) from e
        finally:
            _unlink(tmp)

    def _records(self, bid: str) -> dict[int, dict]:
        out = {}
        for p in self._chunk_dir(bid).glob("*.json"):
            try:
                out[int(p.stem)] = json.loads(p.read_text())
            except FileNotFoundError:
                continue
        return out

    def chunk_indices(self, bid: str) -> set[int]:
        return {int(p.stem) for p in self._chunk_dir(bid).glob("*.json")}

    def chunk(self, bid: str, index: int) -> list[str] | None:
        try:
            return json.loads((self._chunk_dir(bid) / f"{index}.json").read_text())["lines"]
        except FileNotFoundError:
            return None

    def counts(self, bid: str) -> tuple[int, int]:
        rs = self._records(bid).values()
        return sum(r["completed"] for r in rs), sum(r["failed"] for r in rs)

    def output_bytes(self, bid: str) -> int:
        """Read from the chunk files once, then kept up to date by `commit_chunk` (O(1))."""
        with self._lock:
            if bid not in self._bytes:
                self._bytes[bid] = sum(r.get("bytes", 0) for r in self._records(bid).values())
            return self._bytes[bid]

    def delete_chunks(self, bid: str) -> None:
        with self._lock:
            self._bytes.pop(bid, None)
        d = self._chunk_dir(bid)
        if d.exists():
            shutil.rmtree(d)

    # -- chunk claims (one process, one runner thread: nothing to arbitrate)
    def claim_chunk(self, bid: str, index: int, token: str, ttl_s: float) -> int:
        return -1 if (self._chunk_dir(bid) / f"{index}.json").exists() else 1

    def refresh_claim(self, bid: str, index: int, token: str, ttl_s: float) -> bool:
        return True

    def release_claim(self, bid: str, index: int, token: str) -> None:
        return None

    # -- leases (one process: nothing to arbitrate)
    def acquire_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return True

    def refresh_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return True

    def release_lease(self, bid: str, token: str) -> None:
        return None


class _Staged:
    """A file written to a `.tmp` path (`LocalJobStore.stage_file`), renamed into place by `place`."""

    def __init__(self, path: Path):
        self.path, self.size = path, 0
        try:
            self.f = open(path, "wb")
        except OSError as e:
            raise StorageError(e) from e

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            raise StorageError(e) from e
        self.size += len(data)

    def place(self, dst: Path) -> None:
        try:
            self.f.close()
            os.replace(self.path, dst)
        except OSError as e:
            raise StorageError(e) from e

    def discard(self) -> None:
        self.f.close()
        _unlink(self.path)
