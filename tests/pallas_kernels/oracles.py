"""Independent numpy oracles of the kernel ops (loops over the store semantics, no shared code)."""

import numpy as np


def unpack_plane(words):
    """uint32 words [W] -> bits [32 W] (token i is bit i % 32 of word i // 32)."""
    words = np.asarray(words, np.uint64)
    return ((words[:, None] >> np.arange(32, dtype=np.uint64)) & 1).reshape(-1).astype(np.int64)


def plane_scan(q, planes, scales, length, channels, depths):
    """Scores [R, G, n] of q [R, G, D] against planes [R, D, 4, W] at the listed channels' depths."""
    q, planes, scales = np.asarray(q, np.float64), np.asarray(planes), np.asarray(scales, np.float64)
    r_, g, _ = q.shape
    n = planes.shape[-1] * 32
    out = np.zeros((r_, g, n))
    for r in range(r_):
        for j, t in zip(np.asarray(channels[r]), np.asarray(depths[r])):
            if t == 0:
                continue
            code = sum(unpack_plane(planes[r, j, p]) << (t - 1 - p) for p in range(t))
            half = 2.0 ** (t - 1)
            value = (code + 0.5 - half) * np.repeat(scales[r, j], 64) / half
            value[int(length[r]):] = 0.0
            out[r] += np.outer(q[r, :, j], value)
    return out


def nibble_scan(q, nibbles, scales, length, channels):
    q, nibbles, scales = np.asarray(q, np.float64), np.asarray(nibbles, np.uint64), np.asarray(scales, np.float64)
    r_, g, _ = q.shape
    n = nibbles.shape[-1] * 8
    out = np.zeros((r_, g, n))
    for r in range(r_):
        for j in np.asarray(channels[r]):
            code = ((nibbles[r, j][:, None] >> (4 * np.arange(8, dtype=np.uint64))) & 15).reshape(-1).astype(np.float64)
            value = (code - 7.5) * np.repeat(scales[r, j], 64) / 8
            value[int(length[r]):] = 0.0
            out[r] += np.outer(q[r, :, j], value)
    return out


def run_gather(planes, scales, channels, depths):
    planes, scales = np.asarray(planes), np.asarray(scales)
    r_, c = np.asarray(channels).shape
    sp = np.zeros((r_, c) + planes.shape[-2:], planes.dtype)
    ss = np.zeros((r_, c, scales.shape[-1]), scales.dtype)
    for r in range(r_):
        for s, (j, t) in enumerate(zip(np.asarray(channels[r]), np.asarray(depths[r]))):
            sp[r, s, :t] = planes[r, j, :t]
            if t > 0:
                ss[r, s] = scales[r, j]
    return sp, ss


def row_fetch(rows, index):
    rows, index = np.asarray(rows), np.asarray(index)
    out = np.zeros(index.shape + rows.shape[-1:], rows.dtype)
    for r in range(index.shape[0]):
        for s, i in enumerate(index[r]):
            if 0 <= i < rows.shape[1]:
                out[r, s] = rows[r, i]
    return out


def cache_write(dst, src, start, axis, layer):
    out = np.array(dst, copy=True)
    src = np.asarray(src)
    for l in range(src.shape[0]):
        for r in range(src.shape[1]):
            for m in range(src.shape[axis]):
                at = int(start[r]) + m
                if at >= dst.shape[axis]:
                    continue
                d_idx = [layer + l, r] + [slice(None)] * (dst.ndim - 2)
                s_idx = [l, r] + [slice(None)] * (dst.ndim - 2)
                d_idx[axis], s_idx[axis] = at, m
                out[tuple(d_idx)] = src[tuple(s_idx)]
    return out


def tier_write(hot, cold, resident, src, start, layer):
    """Tiers after writing plane words ``src [Ls, R, D, 4, M]`` of layers ``layer ..``: plane i of layer l goes to the
    hot rows if i < resident[l], else to the cold ones, each tier's rows in layer order (words past W dropped)."""
    hot, cold, src = np.array(hot, copy=True), np.array(cold, copy=True), np.asarray(src)
    hot_rows, cold_rows = {}, {}
    for l, p in enumerate(resident):
        for i in range(4):
            (hot_rows if i < p else cold_rows)[l, i] = len(hot_rows) if i < p else len(cold_rows)
    w = hot.shape[-1]
    for l in range(src.shape[0]):
        for i in range(4):
            key = (layer + l, i)
            dst, row = (hot, hot_rows[key]) if key in hot_rows else (cold, cold_rows[key])
            for r in range(src.shape[1]):
                for m in range(src.shape[4]):
                    if int(start[r]) + m < w:
                        dst[row, r, :, int(start[r]) + m] = src[l, r, :, i, m]
    return hot, cold


def select(scores, length, k, sink=4, local=32):
    """Selected positions (a set) per row: forced sink/local, then the best of the rest."""
    forced = [p for p in range(length) if p < sink or p >= length - local]
    rest = [p for p in np.argsort(-np.asarray(scores)[:length], kind="stable") if p not in forced]
    return set(forced) | set(int(p) for p in rest[: max(k - len(forced), 0)])
