"""A parked session on disk: its cache slices (K/V rows, index planes and scales, tails, its own calibration), its
length and tokens, written with orbax (tensorstore underneath).

A save is a directory: ``arrays/`` (the orbax checkpoint: one array per cache leaf) and ``session.json`` (the pool
signature the session needs, its tokens, and every leaf's path, shape, dtype and CRC-32), written last. It is made
under a temporary name beside ``path`` and renamed into place only when complete, so a save interrupted midway
leaves the previous one intact. A load reads and checks everything (signature, every leaf's shape, dtype and
checksum) before returning, so a damaged, partial or foreign save raises :class:`SessionFileError` and nothing is
loaded.
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
ARRAYS = "arrays"
FORMAT = 1


class SessionFileError(ValueError):
    """A saved session that cannot be loaded (missing, partial, damaged, or made by another pool layout)."""


CHUNK = 64 << 20  # bytes per checksum: the chunks of a large leaf are summed on every core (zlib frees the GIL)


def _crc(x: np.ndarray) -> list[int]:
    """CRC-32 of each ``CHUNK`` bytes of ``x``."""
    flat = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    pieces = [flat[i:i + CHUNK] for i in range(0, max(flat.size, 1), CHUNK)]
    with concurrent.futures.ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1)) as pool:
        return list(pool.map(zlib.crc32, pieces))


def _leaves(tree):
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save(path: str | os.PathLike, session, *, tokens: list[int], prompt_length: int, signature: dict) -> None:
    """Write ``session`` (a one-sequence cache tree, in host memory) with its tokens to the directory ``path``."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    arrays = {f"leaf_{i:03d}": np.asarray(x) for i, (_, x) in enumerate(_leaves(session))}
    manifest = dict(format=FORMAT, signature=signature, tokens=[int(t) for t in tokens],
                    prompt_length=int(prompt_length),
                    leaves=[dict(path=p, shape=list(a.shape), dtype=str(a.dtype), crc32=_crc(a))
                            for (p, _), a in zip(_leaves(session), arrays.values())])
    tmp = f"{path}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(os.path.join(tmp, ARRAYS), arrays)
            ckpt.wait_until_finished()
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise SessionFileError(f"no saved session at {path} (no {MANIFEST}: missing, or a save that never finished)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        tokens, prompt_length, leaves = manifest["tokens"], manifest["prompt_length"], manifest["leaves"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SessionFileError(f"the saved session at {path} has a damaged {MANIFEST} ({err})") from err
    if manifest.get("format") != FORMAT or manifest.get("signature") != signature:
        raise SessionFileError(f"the saved session at {path} was made by another pool layout: it has "
                               f"{manifest.get('signature')}, this pool {signature}")
    expected = _leaves(template)
    if [leaf["path"] for leaf in leaves] != [p for p, _ in expected]:
        raise SessionFileError(f"the saved session at {path} holds leaves {[x['path'] for x in leaves]}, this pool's "
                               f"sessions {[p for p, _ in expected]}")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            arrays = ckpt.restore(os.path.join(path, ARRAYS))
    except Exception as err:  # orbax surfaces damage as JSON, tensorstore or OS errors from deep inside
        raise SessionFileError(f"cannot read the arrays of the saved session at {path} ({type(err).__name__}: "
                               f"{err}); it is truncated or damaged") from err
    out = []
    for i, (leaf, (p, like)) in enumerate(zip(leaves, expected)):
        x = np.asarray(arrays.get(f"leaf_{i:03d}")) if f"leaf_{i:03d}" in arrays else None
        if x is None or x.shape != tuple(like.shape) or x.dtype != np.dtype(like.dtype):
            got = "nothing" if x is None else f"{x.dtype}{list(x.shape)}"
            raise SessionFileError(f"the saved session at {path}: leaf {p} should be {np.dtype(like.dtype)}"
                                   f"{list(like.shape)}, found {got}")
        if _crc(x) != leaf["crc32"]:
            raise SessionFileError(f"the saved session at {path}: leaf {p} fails its checksum (damaged)")
        out.append(x)
    session = jax.tree.unflatten(jax.tree.structure(template), out)
    return session, dict(tokens=[int(t) for t in tokens], prompt_length=int(prompt_length))
