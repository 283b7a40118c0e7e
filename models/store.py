"""The model store: `<store>/<name>/{manifest.json, vocab.txt, weights.safetensors}`, verified on load.

This is the only contract between training (which writes artifacts) and the service (which reads them).
No pickle anywhere: tensors are safetensors, metadata is JSON, the vocabulary is plain text.

Its length (over 600 lines) is the contract kept in one place: the artifact's layout, its atomic write, every check
made before a model is served (hashes, shapes, normalisation, the tokenizer) and the shared verified snapshots.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import functools
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save_file

from latentlm.models.checks import Validator, all_finite, mark_stored_stats, row_stats, unmark_stored_stats
from latentlm.models.errors import ArtifactError, ModelNotFound
from latentlm.models.tokenizer import TOKENIZER_FILE, TextTokenizer
from latentlm.models.vocab import Preprocessing, Vocabulary

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VOCAB = "vocab.txt"
WEIGHTS = "weights.safetensors"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_store() -> Path:
    """`$LATENTLM_STORE` or `./artifacts`."""
    return Path(os.environ.get("LATENTLM_STORE", "artifacts"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_name(name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise ArtifactError(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit",
            param="name",
        )
    return name


@dataclass
class Artifact:
    """A verified model directory: manifest, vocabulary and its tensors (on the device it was read onto)."""

    path: Path
    manifest: dict[str, Any]
    vocab: Vocabulary
    tensors: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.get("config", {})

    @functools.cached_property
    def content_hash(self) -> str:
        return content_hash(self.manifest["files"])


def content_hash(files: dict[str, str]) -> str:
    """A model's identity: SHA-256 over the manifest's per-file hashes, so it changes whenever any byte of
    the model changes; computable from the manifest alone (the service checks for changes that way)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_artifact(
    store: Path | str,
    name: str,
    family: str,
    tensors: dict[str, torch.Tensor],
    vocab: Vocabulary,
    *,
    validate: Validator,
    config: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    extra_files: dict[str, bytes] | None = None,
    overwrite: bool = True,
) -> Path:
    """Check with `validate` (the family's schema check) and write an artifact atomically; returns its
    directory. `extra_files` (e.g. `curve.png`, `clusters.txt`) are written beside the weights and hashed too.
    Use `latentlm.models.registry.save_artifact`, which passes the family's check."""
    check_name(name)
    store = Path(store)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    config = dict(config or {})
    validate(tensors, config, len(vocab), WEIGHTS)
    store.mkdir(parents=True, exist_ok=True)
    final = store / name
    if final.exists() and not overwrite:
        raise ArtifactError(f"{final}: a model of that name already exists", param="name")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=store))
    try:
        save_file(tensors, str(tmp / WEIGHTS))
        (tmp / VOCAB).write_text(vocab.to_text(), encoding="utf-8")
        for fname, data in (extra_files or {}).items():
            if "/" in fname or fname in (MANIFEST, VOCAB, WEIGHTS):
                raise ArtifactError(f"extra file name {fname!r} is not allowed", param="extra_files")
            (tmp / fname).write_bytes(data)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        manifest = {
            "name": name,
            "family": family,
            "format_version": FORMAT_VERSION,
            "vocab_size": len(vocab),
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()},
            "config": config,
            "preprocessing": vocab.preprocessing.to_dict(),
            "provenance": {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                           **(provenance or {})},
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        if final.exists():
            old = store / f".{name}.old.{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{mpath}: missing manifest", param="manifest")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: not valid JSON ({e})", param="manifest") from None
    for key in ("name", "family", "format_version", "vocab_size", "shapes", "files", "preprocessing"):
        if key not in manifest:
            raise ArtifactError(f"{mpath}: missing field {key!r}", param="manifest")
    if manifest["format_version"] != FORMAT_VERSION:
        raise ArtifactError(
            f"{mpath}: format_version {manifest['format_version']!r} is not supported "
            f"(this build reads {FORMAT_VERSION})",
            param="manifest",
        )
    return manifest


def manifest_files(path: Path, manifest: dict[str, Any]) -> dict[str, Path]:
    """The manifest's files as paths, each checked to be a plain file name (no '/', '\\' or '..') naming a
    regular file (not a symbolic link) directly inside the model directory `path`; ArtifactError otherwise."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{path / MANIFEST}: 'files' must be an object of file name -> SHA-256", param="manifest")
    out = {}
    for fname, digest in files.items():
        if not isinstance(fname, str) or fname in ("", ".", "..") or any(c in fname for c in "/\\\0"):
            raise ArtifactError(f"{path / MANIFEST}: file name {fname!r} is not a plain name inside the model "
                                "directory", param="manifest")
        if not isinstance(digest, str):
            raise ArtifactError(f"{path / MANIFEST}: hash of {fname!r} is not a string", param="manifest")
        fpath = path / fname
        if fpath.is_symlink():
            raise ArtifactError(f"{fpath}: is a symbolic link; model files must be regular files inside the model "
                                "directory", param=fname)
        if not fpath.is_file():
            raise ArtifactError(f"{fpath}: file listed in the manifest is missing", param=fname)
        out[fname] = fpath
    return out


def verify_files(path: Path, manifest: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    """Every file the manifest lists is a regular file inside `path` (`manifest_files`) whose SHA-256 matches
    the manifest (ArtifactError naming the file otherwise). What `read_artifact` checks first (all but the
    weights, which `read_weights` hashes as it loads them: `skip`); a service re-runs it to notice bytes
    changed under an unchanged manifest."""
    for fname, fpath in manifest_files(path, manifest).items():
        if fname in skip:
            continue
        digest = manifest["files"][fname]
        actual = sha256_file(fpath)
        if actual != digest:
            raise ArtifactError(
                f"{fpath}: SHA-256 mismatch (manifest {digest[:12]}…, file {actual[:12]}…)", param=fname
            )


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on its JSON header
READ_CHUNK = 16 << 20  # bytes per read (and per host-to-device copy); a staged load holds two such slabs


def read_weights(fpath: Path, digest: str, device: torch.device | str = "cpu", staged: bool | None = None,
                 cast: Mapping[str, torch.dtype] | None = None,
                 snapshots: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read once, straight into tensors on `device`, while the same bytes
    are hashed: the SHA-256 checked against `digest` (the manifest's) is that of exactly the bytes loaded (no
    window in which the file could change between a check and a read), and there is one copy of the weights
    in memory. On CUDA the bytes go through two READ_CHUNK staging slabs (pinned), so host memory does not
    grow with the model. Not memory-mapped: a mapping would make the served weights the file's pages, and a
    file truncated in place under a serving process would then kill it (SIGBUS) instead of being refused at
    the next reload. `staged` (default: for every device but the CPU) reads through the staging slabs; tests
    force it on the CPU, so the accelerator path runs in CI. ArtifactError (naming the file) for a malformed
    header, offsets that leave holes or run past the end, trailing bytes, or a hash mismatch. O(file size)
    time.

    Floating tensors are read a slab of whole rows at a time (`_read_rows`), each slab's row sums and minimum
    taken as it is read: every such tensor carries the statistics of its stored values
    (`checks.mark_stored_stats`), from which `checks.all_finite` and `checks.check_distribution` check it
    without another pass. `cast` (name -> floating dtype) converts those tensors as they are read, so a model
    kept in another precision never holds its stored one whole (a bfloat16 copy of a float32 matrix is read in
    half the float32 size, a float64 one in 2x instead of 3x), and a narrowed tensor is still checked as
    stored.

    `snapshots` (a directory the caller owns; CPU only): the tensors are pages of a verified snapshot of the file
    there instead (`map_weights`), shared by every process that maps it."""
    dev = torch.device(device)
    if snapshots is not None and dev.type == "cpu":
        return map_weights(fpath, digest, snapshots, cast)
    staged = dev.type != "cpu" if staged is None else staged
    with _BackgroundHash() as h:
        tensors = _read_safetensors(fpath, h, dev, staged, cast or {})
        actual = h.hexdigest()
    if actual != digest:
        raise ArtifactError(f"{fpath}: SHA-256 mismatch (manifest {digest[:12]}…, file {actual[:12]}…)", param=WEIGHTS)
    return tensors


class _BackgroundHash:
    """SHA-256 of the buffers given to `update`, in order, on one helper thread (hashlib releases the GIL on
    large buffers), so that hashing a slab overlaps reading the next (3.5 s of a 4 GiB load on one core).
    `update` returns the buffer's future: a buffer may be written again only once it is done. A context
    manager: leaving it stops the thread (after the pending buffers)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="latentlm-hash")
        self._last: Future | None = None

    def update(self, buf: bytes | memoryview) -> Future:
        self._last = self._pool.submit(self._h.update, buf)
        return self._last

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._h.hexdigest()

    def __enter__(self) -> _BackgroundHash:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)


def _read_safetensors(fpath: Path, h: _BackgroundHash, dev: torch.device, staged: bool,
                      cast: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """`read_weights`' reading: every tensor of the file, its bytes given to `h` in file order."""

    def bad(why: str) -> ArtifactError:
        return ArtifactError(f"{fpath}: cannot read tensors ({why})", param=WEIGHTS)

    with open(fpath, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"header length {n} exceeds the file")
        raw = f.read(n)
        h.update(head)
        h.update(raw)
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape, _ in _layout(raw, size - 8 - n, cast, bad):
            tensors[name] = _read_rows(f, h, name, shape, dtype, cast.get(name, dtype), dev, staged, bad)
    return tensors


def _layout(raw: bytes, data_len: int, cast: Mapping[str, torch.dtype], bad: Callable[[str], ArtifactError]
            ) -> list[tuple[str, torch.dtype, list[int], int]]:
    """(name, stored dtype, shape, first byte within the data) of every tensor of a safetensors header, in file
    order, once the layout is checked: no holes or overlaps, sizes that match shapes, nothing past the data's
    `data_len` bytes or after the last tensor, and `cast` only between floating dtypes."""
    out, pos = [], 0
    for name, (dtype, shape, begin, end) in sorted(_safetensors_entries(raw, bad).items(), key=lambda kv: kv[1][2]):
        if begin != pos:
            raise bad(f"tensor {name!r} starts at byte {begin}, expected {pos} (holes or overlaps)")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise bad(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype}")
        if end > data_len:
            raise bad(f"tensor {name!r} runs past the end of the file")
        target = cast.get(name, dtype)
        if target != dtype and not (dtype.is_floating_point and target.is_floating_point):
            raise bad(f"tensor {name!r}: cannot be read as {target} (stored as {dtype})")
        out.append((name, dtype, shape, begin))
        pos = end
    if pos != data_len:
        raise bad(f"{data_len - pos} bytes after the last tensor")
    return out


def map_weights(fpath: Path, digest: str, snapshots: Path,
                cast: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as pages of a snapshot of it, `<snapshots>/<digest>.safetensors`,
    memory-mapped copy-on-write: every process that maps the same snapshot shares one copy of the weights in
    memory (the page cache's), so N API workers hold a model once, not N times.

    The snapshot is made from `fpath` by the first process that needs it (copied while hashed, refused unless
    the bytes match `digest`, then made read-only and renamed into place, so a reader never sees half of one)
    and is re-hashed by every later process that maps it, so what is served is always exactly the verified
    bytes. It belongs to the service, not the user: the model file itself may be rewritten or truncated in place
    without touching a serving process (a mapping of the user's file would die of SIGBUS instead). A tensor
    named in `cast` is converted (a private copy); a tensor whose bytes are not aligned to its dtype is copied.
    No row statistics are marked: the artifact checks take their own pass over the mapped pages. ArtifactError
    as `read_weights`. O(file size) time; memory: the shared pages, plus what is converted."""
    snapshots.mkdir(parents=True, exist_ok=True)
    snap = snapshots / f"{digest}.safetensors"
    made = False
    for _ in range(2):
        if not snap.is_file():
            with open(snapshots / f".{digest}.lock", "a") as lock:  # workers starting together make it once
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not snap.is_file():
                    _snapshot(fpath, snap, digest)
                    made = True
        try:
            with open(snap, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:  # pruned by another process meanwhile: made again
            continue
        if made or _sha256(memoryview(mm)) == digest:
            break
        mm.close()
        snap.unlink(missing_ok=True)  # damaged on disk: made again from the model file
    else:
        raise ArtifactError(f"{snap}: cannot make a verified snapshot of {fpath}", param=WEIGHTS)

    def bad(why: str) -> ArtifactError:
        return ArtifactError(f"{fpath}: cannot read tensors ({why})", param=WEIGHTS)

    size = len(mm)
    n = int.from_bytes(mm[:8], "little") if size >= 8 else -1
    if not 0 <= n <= min(MAX_HEADER_BYTES, size - 8):
        raise bad("header length exceeds the file")
    base = 8 + n
    cast = cast or {}
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin in _layout(mm[8:base], size - base, cast, bad):
        count, at = math.prod(shape), base + begin
        if count == 0:
            t = torch.empty(shape, dtype=dtype)
        elif at % dtype.itemsize == 0:
            t = torch.frombuffer(mm, dtype=dtype, count=count, offset=at).view(shape)
        else:  # misaligned (after an odd-sized tensor): a private copy
            t = torch.frombuffer(bytearray(mm[at: at + count * dtype.itemsize]), dtype=dtype).view(shape)
        target = cast.get(name, dtype)
        tensors[name] = t if target == dtype else t.to(target)
    return tensors


def _sha256(buf: memoryview) -> str:
    h = hashlib.sha256()
    for lo in range(0, len(buf), READ_CHUNK):
        h.update(buf[lo: lo + READ_CHUNK])
    return h.hexdigest()


def _snapshot(src: Path, dest: Path, digest: str) -> None:
    """Copy `src` to `dest` while hashing it; the copy is renamed into place (read-only) only when its SHA-256 is
    `digest` (ArtifactError otherwise: the model file changed since its manifest was written)."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(READ_CHUNK):
                h.update(chunk)
                fout.write(chunk)
        if h.hexdigest() != digest:
            raise ArtifactError(f"{src}: SHA-256 mismatch (manifest {digest[:12]}…, file {h.hexdigest()[:12]}…)",
                                param=WEIGHTS)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def prune_snapshots(snapshots: Path, keep: set[str]) -> list[str]:
    """Delete the snapshots in `snapshots` whose digest is not in `keep` (the weights digests of the models served
    now); a process that still maps one keeps its pages until it lets go. Returns the digests deleted."""
    gone = []
    for p in snapshots.glob("*.safetensors") if snapshots.is_dir() else []:
        if p.stem not in keep:
            p.unlink(missing_ok=True)
            (snapshots / f".{p.stem}.lock").unlink(missing_ok=True)
            gone.append(p.stem)
    return gone


def _read_rows(f: BinaryIO, h: _BackgroundHash, name: str, shape: list[int], stored: torch.dtype, target: torch.dtype,
               device: torch.device, staged: bool, bad: Callable[[str], ArtifactError]) -> torch.Tensor:
    """Tensor `name` of `shape`, stored as `stored` at the file's position, read into a new `target` tensor on
    `device` a slab of whole rows (about READ_CHUNK bytes; a row longer than that in pieces) at a time: each
    slab is hashed into `h` (on its thread), converted and, for a floating tensor, its `checks.row_stats`
    taken while it is fresh in cache. Straight into the tensor when it is on the CPU in its stored dtype and
    not `staged`, otherwise through two host slabs in turn (pinned for CUDA; one is read while the other is
    hashed). A floating result carries the statistics of its stored values (`checks.mark_stored_stats`), so
    the artifact checks need no second pass and check a narrowed tensor as stored. O(size) time; memory: the
    result and at most two slabs."""
    out = torch.empty(shape, dtype=target, device=device)
    row, rows = (shape[-1], math.prod(shape[:-1])) if shape else (1, 1)
    width = max(1, min(row, READ_CHUNK // stored.itemsize))  # columns per piece: whole rows unless one is too long
    per = max(1, READ_CHUNK // max(1, row * stored.itemsize)) if width >= row else 1  # rows per piece
    direct = device.type == "cpu" and target == stored and not staged
    slabs = [] if direct else [torch.empty(min(per, rows) * width, dtype=stored, pin_memory=device.type == "cuda")
                               for _ in range(2)]
    hashed: list[Future | None] = [None, None]  # each slab's pending hash: it is read into again once done
    flat = out.view(-1)
    sums, low = torch.zeros(rows, dtype=torch.float64), math.inf
    turn = 0
    for lo in range(0, rows, per):
        n = min(per, rows - lo)
        for col in range(0, row, width):
            w = min(width, row - col)
            at = lo * row + col  # n rows of w entries from here, contiguous (n = 1 or w = row)
            if slabs and hashed[turn] is not None:
                hashed[turn].result()
            part = slabs[turn][: n * w] if slabs else flat[at: at + n * w]
            buf = memoryview(part.view(torch.uint8).numpy())
            if f.readinto(buf) != len(buf):
                raise bad(f"file ended inside tensor {name!r}")
            hashed[turn] = h.update(buf)
            if stored.is_floating_point:
                part_sums, part_low = row_stats(part.view(n, w))
                sums[lo: lo + n] += part_sums
                low = min(low, part_low)
            if slabs:  # synchronous copy; the other slab is read into next
                flat[at: at + n * w].copy_(part)
                turn = 1 - turn
    if stored.is_floating_point:
        mark_stored_stats(out, sums.reshape(shape[:-1]), low)
    return out


def _safetensors_entries(raw: bytes, bad: Callable[[str], ArtifactError]
                         ) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, begin, end) from a safetensors JSON header (its `__metadata__` ignored)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {name!r}: dtype {info.get('dtype') if isinstance(info, dict) else info!r} "
                      "is not supported")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
        out[name] = (SAFETENSORS_DTYPES[info["dtype"]], shape, offsets[0], offsets[1])
    return out


def check_model_dir(store: Path | str, name: str) -> Path:
    """`<store>/<name>` when it is a real directory of the store with a regular manifest file: a model
    directory (or manifest) that is a symbolic link may point anywhere, so it is refused (ArtifactError)."""
    check_name(name)
    path = Path(store) / name
    if path.is_symlink():
        raise ArtifactError(f"{path}: the model directory is a symbolic link; only directories inside the store "
                            "are served", param="model")
    if not path.is_dir():
        raise ModelNotFound(f"{path}: no such model directory", param="model")
    if (path / MANIFEST).is_symlink():
        raise ArtifactError(f"{path / MANIFEST}: is a symbolic link; model files must be regular files inside "
                            "the model directory", param="manifest")
    return path


def file_signature(path: Path, manifest: dict[str, Any]) -> tuple:
    """(name, device, inode, size, mtime, ctime) of the manifest and every file it lists, without following
    links: any write, replacement or `touch` of a model file changes it (ctime cannot be set back), so a
    reader can skip re-hashing files whose signature it verified before."""
    names = [MANIFEST, *sorted(manifest.get("files", {}))] if isinstance(manifest.get("files"), dict) else [MANIFEST]
    sig = []
    for fname in names:
        try:
            st = os.lstat(path / fname)
        except OSError:
            sig.append((fname, None))
            continue
        sig.append((fname, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(sig)


def read_artifact(path: Path | str, validate_for: Callable[[str], Validator],
                  device: torch.device | str = "cpu",
                  cast_for: Callable[[str, dict[str, Any]], Mapping[str, torch.dtype]] | None = None,
                  snapshots: Path | None = None) -> Artifact:
    """Read and verify a model directory: file hashes, tensor shapes against the manifest, finiteness
    and the family's own checks (`validate_for(family)`: normalisation of every distribution within 1e-4).
    The weights are read once, straight onto `device` (`read_weights`: hashed as they are read, one copy),
    each tensor named by `cast_for(family, config)` converted to its dtype as it is read (checked as stored).
    `snapshots`: the weights are mapped from a verified snapshot in that directory (`map_weights`), shared by
    the processes that map it. Use `latentlm.models.registry.load_artifact`, which looks the family up."""
    path = Path(path)
    if not path.is_dir():
        raise ModelNotFound(f"{path}: no such model directory", param="model")
    manifest = read_manifest(path)
    for required in (WEIGHTS, VOCAB):
        if required not in manifest["files"]:
            raise ArtifactError(f"{path / MANIFEST}: no hash recorded for {required}", param=required)
    verify_files(path, manifest, skip=(WEIGHTS,))  # every listed file checked to be a regular file inside
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    cast = cast_for(manifest["family"], config) if cast_for is not None else None
    tensors = read_weights(path / WEIGHTS, manifest["files"][WEIGHTS], device, cast=cast, snapshots=snapshots)
    expected = manifest["shapes"]
    if set(expected) != set(tensors):
        raise ArtifactError(
            f"{path / WEIGHTS}: tensors {sorted(tensors)} do not match the manifest's {sorted(expected)}",
            param=WEIGHTS,
        )
    for k, t in tensors.items():
        if list(t.shape) != list(expected[k]):
            raise ArtifactError(
                f"{path / WEIGHTS}: tensor {k!r} has shape {list(t.shape)}, manifest says {expected[k]}",
                param=k,
            )
        if t.is_floating_point() and not all_finite(t):
            raise ArtifactError(f"{path / WEIGHTS}: tensor {k!r} has NaN or infinite entries", param=k)
    vocab = Vocabulary.read(path / VOCAB, Preprocessing.from_dict(manifest["preprocessing"]),
                            read_tokenizer(path, manifest))
    if len(vocab) != manifest["vocab_size"]:
        raise ArtifactError(
            f"{path / VOCAB}: {len(vocab)} tokens, manifest says vocab_size {manifest['vocab_size']}",
            param=VOCAB,
        )
    validate_for(manifest["family"])(tensors, manifest.get("config", {}), len(vocab), str(path / WEIGHTS))
    for t in tensors.values():
        unmark_stored_stats(t)
    return Artifact(path=path, manifest=manifest, vocab=vocab, tensors=tensors)


def read_tokenizer(path: Path, manifest: dict[str, Any]) -> TextTokenizer | None:
    """The model's tokenizer when its preprocessing names "tokenizer.json": the file's bytes read once and checked
    against the manifest's SHA-256 (the bytes checked are the bytes used). ArtifactError naming `tokenizer.json`
    when it is not listed, differs or cannot be reproduced exactly (`TextTokenizer`). None for word-level models."""
    pre = manifest["preprocessing"]
    if not isinstance(pre, dict) or pre.get("tokenizer") != TOKENIZER_FILE:
        return None
    digest = manifest["files"].get(TOKENIZER_FILE)
    if digest is None:
        raise ArtifactError(f"{path / MANIFEST}: preprocessing names {TOKENIZER_FILE} but no hash is recorded for "
                            "it", param=TOKENIZER_FILE)
    fpath = manifest_files(path, {"files": {TOKENIZER_FILE: digest}})[TOKENIZER_FILE]
    data = fpath.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise ArtifactError(f"{fpath}: SHA-256 mismatch (manifest {digest[:12]}…, file {actual[:12]}…)",
                            param=TOKENIZER_FILE)
    return TextTokenizer.from_bytes(data, source=str(fpath))


def list_models(store: Path | str) -> list[str]:
    """Names of the model directories in the store (those with a manifest), sorted."""
    store = Path(store)
    if not store.is_dir():
        return []
    return sorted(p.name for p in store.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file())


def model_path(store: Path | str, name: str) -> Path:
    check_name(name)
    path = Path(store) / name
    if not (path / MANIFEST).is_file():
        raise ModelNotFound(f"model {name!r} not found in store {store}", param="model")
    return path
