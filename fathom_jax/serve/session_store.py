"""A parked session on disk: its cache slices (K/V rows, index planes and scales, tails, its own calibration), its
length and tokens.

A save is a directory: ``arrays.bin`` (every leaf's bytes, C order, each at a 4 KiB-aligned offset) and
``session.json`` (the pool signature the session needs, its tokens, and every leaf's path, shape, dtype, offset and
CRC-32 per ``CHUNK`` bytes), written last. Leaves go straight to the file with ``os.pwrite``, each chunk summed as it
is written, on every core: an orbax checkpoint of the same tree wrote and read at a fraction of the disk's rate
(NOTES.md), so orbax stays for the calibrations and not here. A save is made under a temporary name beside ``path``,
flushed to disk and renamed into place only when complete, so a save interrupted midway leaves the previous one
intact. A load reads and checks everything (signature, file size, every leaf's shape, dtype and checksums) before
returning, so a damaged, partial or foreign save raises :class:`SessionFileError` and nothing is loaded.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import uuid
import zlib

import jax
import numpy as np

MANIFEST = "session.json"
ARRAYS = "arrays.bin"
FORMAT = 2
ALIGN = 4096  # leaf offsets: page-aligned, so each leaf's reads and writes start on a page
MODEL_STATE = "model_state"  # a session's key for what its model keeps beside the cache (Gemma 3's window rings)


class SessionFileError(ValueError):
    """A saved session that cannot be loaded (missing, partial, damaged, or made by another pool layout)."""


CHUNK = 64 << 20  # bytes per checksum and per write or read: the chunks move on every core (zlib and I/O free the GIL)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _chunks(nbytes: int) -> list[tuple[int, int]]:
    return [(i, min(i + CHUNK, nbytes)) for i in range(0, max(nbytes, 1), CHUNK)]


def _crc(x: np.ndarray) -> list[int]:
    """CRC-32 of each ``CHUNK`` bytes of ``x``."""
    flat = _bytes(x)
    return [zlib.crc32(flat[a:b]) for a, b in _chunks(flat.size)]


def _leaves(tree):
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each leaf's offset in ``arrays.bin`` (aligned) and the file's size."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += -(-n // ALIGN) * ALIGN
    return out, at


def _pool(tasks: int):
    return concurrent.futures.ThreadPoolExecutor(max(1, min(tasks, os.cpu_count() or 1)))


def _write_chunk(fd: int, flat: np.ndarray, offset: int, a: int, b: int) -> int:
    piece = flat[a:b]
    view, at = memoryview(piece), offset + a
    while view.nbytes:  # pwrite may write less than asked
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done
    return zlib.crc32(piece)


def save(path: str | os.PathLike, session, *, tokens: list[int], prompt_length: int, signature: dict) -> None:
    """Write ``session`` (a one-sequence cache tree, with the model's own state under ``MODEL_STATE`` where it has
    one; in host memory) with its tokens to the directory ``path``."""
    path = os.path.abspath(os.fspath(path))
    leaves = [(p, np.asarray(x)) for p, x in _leaves(session)]  # from device or pinned memory: one copy, here
    flats = [_bytes(x) for _, x in leaves]
    offsets, size = _offsets([f.size for f in flats])
    tmp = f"{path}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        fd = os.open(os.path.join(tmp, ARRAYS), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            jobs = [(i, a, b) for i, f in enumerate(flats) for a, b in _chunks(f.size) if b > a]
            with _pool(len(jobs)) as pool:
                sums = list(pool.map(lambda j: _write_chunk(fd, flats[j[0]], offsets[j[0]], j[1], j[2]), jobs))
            os.ftruncate(fd, size)  # the last leaf's padding (the gaps between leaves are holes)
            os.fsync(fd)
        finally:
            os.close(fd)
        crcs = [[zlib.crc32(b"")] if f.size == 0 else [] for f in flats]
        for (i, _, _), crc in zip(jobs, sums):
            crcs[i].append(crc)
        manifest = dict(format=FORMAT, signature=signature, tokens=[int(t) for t in tokens],
                        prompt_length=int(prompt_length), size=size,
                        leaves=[dict(path=p, shape=list(x.shape), dtype=str(x.dtype), offset=o,
                                     crc32=c) for (p, x), o, c in zip(leaves, offsets, crcs)])
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, path)
        _sync_dir(os.path.dirname(path))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sync_dir(path: str) -> None:
    """The rename itself on disk (a directory's entries are flushed by an fsync of the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: str, path: str) -> None:
    """``tmp`` renamed to ``path``; a previous save there is moved aside first and removed after."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    old = f"{path}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load(path: str | os.PathLike, template, *, signature: dict):
    """``(session, meta)`` from a save at ``path``: the session a tree like ``template`` (shapes and dtypes of one
    session of this pool) of numpy arrays, ``meta`` its ``tokens`` and ``prompt_length``. Raises
    :class:`SessionFileError` before returning anything when the save does not check out."""
    path = os.path.abspath(os.fspath(path))
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise SessionFileError(f"no saved session at {path} (no {MANIFEST}: missing, or a save that never finished)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        tokens, prompt_length, leaves = manifest["tokens"], manifest["prompt_length"], manifest["leaves"]
        if not isinstance(leaves, list) or not all(isinstance(leaf, dict) and isinstance(leaf.get("offset"), int)
                                                   and isinstance(leaf.get("crc32"), list) for leaf in leaves):
            raise TypeError("its leaves are not a list of entries with offsets and checksums")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SessionFileError(f"the saved session at {path} has a damaged {MANIFEST} ({err})") from err
    if manifest.get("format") != FORMAT:
        raise SessionFileError(f"the saved session at {path} is in format {manifest.get('format')!r} (format 1: an "
                               f"orbax checkpoint); this version reads format {FORMAT}")
    if manifest.get("signature") != signature:
        raise SessionFileError(f"the saved session at {path} was made by another pool layout: it has "
                               f"{manifest.get('signature')}, this pool {signature}")
    expected = _leaves(template)
    own = f"['{MODEL_STATE}']"
    if any(p.startswith(own) for p, _ in expected) and not any(str(x.get("path")).startswith(own) for x in leaves):
        raise SessionFileError(f"the saved session at {path} holds no model state ({MODEL_STATE}), which this pool's "
                               "model keeps beside the cache: it cannot be decoded from the cache alone")
    if [leaf.get("path") for leaf in leaves] != [p for p, _ in expected]:
        raise SessionFileError(f"the saved session at {path} holds leaves {[x.get('path') for x in leaves]}, this "
                               f"pool's sessions {[p for p, _ in expected]}")
    arrays_path = os.path.join(path, ARRAYS)
    try:
        got = os.path.getsize(arrays_path)
    except OSError as err:
        raise SessionFileError(f"the saved session at {path} has no {ARRAYS} ({err})") from err
    if got != manifest.get("size"):
        raise SessionFileError(f"the saved session at {path}: {ARRAYS} holds {got} bytes, its manifest says "
                               f"{manifest.get('size')} (truncated or damaged)")
    out, flats, jobs = [], [], []
    for i, (leaf, (p, like)) in enumerate(zip(leaves, expected)):
        want = (list(like.shape), str(np.dtype(like.dtype)))
        if (leaf.get("shape"), leaf.get("dtype")) != want:
            raise SessionFileError(f"the saved session at {path}: leaf {p} should be {want[1]}{want[0]}, found "
                                   f"{leaf.get('dtype')}{leaf.get('shape')}")
        x = np.empty(like.shape, like.dtype)
        out.append(x)
        flats.append(_bytes(x))
        chunks = [(a, b) for a, b in _chunks(x.nbytes) if b > a]
        if len(leaf["crc32"]) != max(1, len(chunks)) or not 0 <= leaf["offset"] <= got - x.nbytes:
            raise SessionFileError(f"the saved session at {path}: leaf {p} has a damaged manifest entry")
        jobs += [(i, a, b) for a, b in chunks]
    fd = os.open(arrays_path, os.O_RDONLY)
    try:
        with _pool(len(jobs)) as pool:
            sums = list(pool.map(lambda j: _read_chunk(fd, flats[j[0]], leaves[j[0]]["offset"], j[1], j[2]), jobs))
    finally:
        os.close(fd)
    for (i, a, _), crc in zip(jobs, sums):
        if crc is None or crc != leaves[i]["crc32"][a // CHUNK]:
            raise SessionFileError(f"the saved session at {path}: leaf {expected[i][0]} fails its checksum (damaged)")
    session = jax.tree.unflatten(jax.tree.structure(template), out)
    return session, dict(tokens=[int(t) for t in tokens], prompt_length=int(prompt_length))


def _read_chunk(fd: int, flat: np.ndarray, offset: int, a: int, b: int) -> int | None:
    """CRC-32 of the chunk read into ``flat[a:b]``; None when the file ends first."""
    view, at = memoryview(flat[a:b]), offset + a
    while view.nbytes:
        done = os.preadv(fd, [view], at)
        if done == 0:
            return None
        view, at = view[done:], at + done
    return zlib.crc32(flat[a:b])
