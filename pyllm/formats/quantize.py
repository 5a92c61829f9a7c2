"""pyllm's own weight quantizers: float32 rows -> raw GGUF blocks (uint8 [N, row_bytes]).

Vectorized numpy ports of llama.cpp's reference quantizers (ggml-quants.c ``quantize_row_*_ref``), kept in float32
like the C code so results match it. Q8_0 and Q4_0 equal ``gguf.quants.quantize`` bit for bit (tested); Q4_K and
Q6_K, which ``gguf.quants`` cannot produce, follow make_qkx2_quants / make_qx_quants step by step and are checked
by dequantizing with ``gguf.quants``. (C++ versions would be faster; the kernels engineer owns csrc/, so these
stay numpy: a 0.5B model quantizes in about a minute.)
"""

from __future__ import annotations

import numpy as np

from .gguf import GGMLType

QK_K = 256
_F32 = np.float32


def _nearest_int(x: np.ndarray) -> np.ndarray:
    # llama.cpp's nearest_int adds 1.5 * 2^23: round half to even, like np.rint on float32.
    return np.rint(x).astype(np.int32)


def _roundf(x: np.ndarray) -> np.ndarray:
    # C roundf: half away from zero.
    return np.sign(x) * np.floor(np.abs(x) + _F32(0.5))


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    b = x.reshape(-1, 32).astype(_F32)
    d = np.abs(b).max(axis=1, keepdims=True) / _F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)
    qs = _roundf(b * inv).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), qs], axis=1).reshape(n, -1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    b = x.reshape(-1, 32).astype(_F32)
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = np.take_along_axis(b, imax, axis=1) / _F32(-8)  # the signed extreme maps to -8
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)
    q = np.minimum(np.trunc(b * inv + _F32(8.5)), 15).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([_f16_bytes(d), qs], axis=1).reshape(n, -1)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin=-1.0, rdelta=0.1, nstep=20):
    """make_qkx2_quants over rows of x [B, n] with weights w: returns (scale [B], -min [B], L [B, n] uint8)."""
    x, w = x.astype(_F32), w.astype(_F32)
    mn = mn0 = np.minimum(x.min(axis=1), 0).astype(_F32)
    mx = x.max(axis=1).astype(_F32)
    sum_w = w.sum(axis=1, dtype=_F32)
    sum_x = (w * x).sum(axis=1, dtype=_F32)
    flat = mx == mn
    rng = np.where(flat, _F32(1), mx - mn).astype(_F32)
    iscale = (_F32(nmax) / rng).astype(_F32)
    scale = (_F32(1) / iscale).astype(_F32)
    L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    err = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(axis=1, dtype=_F32)
    for step in range(nstep + 1):
        isc = ((_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / rng).astype(_F32)
        La = np.clip(_nearest_int(isc[:, None] * (x - mn[:, None])), 0, nmax).astype(_F32)
        sl = (w * La).sum(axis=1, dtype=_F32)
        sl2 = (w * La * La).sum(axis=1, dtype=_F32)
        sxl = (w * La * x).sum(axis=1, dtype=_F32)
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, _F32(1))
        this_scale = (sum_w * sxl - sum_x * sl) / Ds
        this_min = (sl2 * sum_x - sl * sxl) / Ds
        pos = this_min > 0
        this_scale = np.where(pos, sxl / np.where(sl2 > 0, sl2, _F32(1)), this_scale).astype(_F32)
        this_min = np.where(pos, _F32(0), this_min).astype(_F32)
        cur = (w * (this_scale[:, None] * La + this_min[:, None] - x) ** 2).sum(axis=1, dtype=_F32)
        better = ok & (cur < err)
        L = np.where(better[:, None], La.astype(L.dtype), L)
        err = np.where(better, cur, err)
        scale = np.where(better, this_scale, scale).astype(_F32)
        mn = np.where(better, this_min, mn).astype(_F32)
    scale = np.where(flat, _F32(0), scale)
    mn = np.where(flat, mn0, mn)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(_F32), (-mn).astype(_F32), L.astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: 8 sub-blocks of 32 with 6-bit scales and mins per 256-value super-block."""
    n, k = x.shape
    sb = x.reshape(-1, 8, 32).astype(_F32)  # [NB, 8, 32]
    nb = sb.shape[0]
    av = np.sqrt((sb * sb).sum(axis=2, dtype=_F32) / _F32(32))  # [NB, 8]
    wts = av[..., None] + np.abs(sb)
    sc, mins, L0 = _make_qkx2(sb.reshape(-1, 32), wts.reshape(-1, 32), 15)
    sc, mins = sc.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = sc.max(axis=1), mins.max(axis=1)
    inv_s = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, 1), _F32(0)).astype(_F32)
    inv_m = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, 1), _F32(0)).astype(_F32)
    ls = np.minimum(_nearest_int(inv_s[:, None] * sc), 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_m[:, None] * mins), 63).astype(np.uint8)
    d16 = (max_scale / _F32(63)).astype(np.float16)
    dm16 = (max_min / _F32(63)).astype(np.float16)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = ls[:, 0:4]
    scales[:, 4:8] = lm[:, 0:4]
    scales[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    scales[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    scales[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    # Requantize with the rounded scales, as the C code does.
    d = d16.astype(_F32)[:, None] * ls.astype(_F32)  # [NB, 8]
    dm = dm16.astype(_F32)[:, None] * lm.astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = _nearest_int((sb + dm[..., None]) / np.where(d == 0, _F32(1), d)[..., None])
    # A zero scale keeps the first search's levels (the C code skips such sub-blocks).
    L = np.where((d == 0)[..., None], L0.reshape(nb, 8, 32), np.clip(L, 0, 15)).astype(np.uint8)
    L = L.reshape(nb, 4, 2, 32)  # pairs of sub-blocks share bytes: low nibble first, high nibble second
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(nb, 2), dm16.view(np.uint8).reshape(nb, 2), scales, qs], 1)
    return out.reshape(n, -1)


def _make_qx(x: np.ndarray, nmax: int):
    """make_qx_quants(rmse_type=1, no quant weights) over rows of x [B, n]: returns (scale [B], L [B, n])."""
    x = x.astype(_F32)
    imax = np.abs(x).argmax(axis=1)[:, None]
    mx = np.take_along_axis(x, imax, axis=1)[:, 0]
    tiny = np.abs(mx) < _F32(1e-15)
    mxs = np.where(tiny, _F32(1), mx).astype(_F32)
    w = x * x

    def trial(iscale):
        l = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(_F32)
        return l, (w * x * l).sum(axis=1, dtype=_F32), (w * l * l).sum(axis=1, dtype=_F32)

    l, sumlx, suml2 = trial((_F32(-nmax) / mxs).astype(_F32))
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), _F32(0)).astype(_F32)
    best = (scale * sumlx).astype(_F32)
    L = l
    for s in range(-9, 10):
        if s == 0:
            continue
        l2, slx, sl2 = trial((-(_F32(nmax) + _F32(0.1) * _F32(s)) / mxs).astype(_F32))
        better = (sl2 > 0) & (slx * slx > best * sl2)
        sc2 = slx / np.where(sl2 > 0, sl2, 1)
        L = np.where(better[:, None], l2, L)
        scale = np.where(better, sc2, scale).astype(_F32)
        best = np.where(better, sc2 * slx, best).astype(_F32)
    scale = np.where(tiny, _F32(0), scale)
    return scale, np.where(tiny[:, None], 0, L + nmax).astype(np.int32)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: 16 sub-blocks of 16 with int8 scales per 256-value super-block."""
    n, k = x.shape
    sb = x.reshape(-1, 16, 16).astype(_F32)
    nb = sb.shape[0]
    sc, L0 = _make_qx(sb.reshape(-1, 16), 32)
    sc = sc.reshape(nb, 16)
    imax = np.abs(sc).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(sc, imax, axis=1)[:, 0]
    zero = np.abs(max_scale) < _F32(1e-15)
    iscale = (_F32(-128) / np.where(zero, _F32(1), max_scale)).astype(_F32)
    d16 = np.where(zero, _F32(0), _F32(1) / iscale).astype(np.float16)
    scales = np.minimum(_nearest_int(iscale[:, None] * sc), 127).astype(np.int8)
    scales = np.where(zero[:, None], 0, scales).astype(np.int8)
    d = d16.astype(_F32)[:, None] * scales.astype(_F32)  # [NB, 16]
    with np.errstate(divide="ignore", invalid="ignore"):
        L = _nearest_int(sb / np.where(d == 0, _F32(1), d)[..., None])
    L = np.where((d == 0)[..., None], L0.reshape(nb, 16, 16), np.clip(L, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    # Per 128-value half: ql holds the low nibbles of quarters (0,2) and (1,3); qh the 2-bit high parts of all 4.
    lo, hi = L & 0xF, L >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)  # [NB,2,64]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [NB, 2, 32]
    out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), scales.view(np.uint8),
                          d16.view(np.uint8).reshape(nb, 2)], axis=1)
    return out.reshape(n, -1)


_MXFP4_VALUES = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=_F32)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """quantize_row_mxfp4_ref: per 32 values the E8M0 exponent e = floor(log2(max|x|)) - 2 + 127 (0 for an all-zero
    block; clamped to 0..255 where C's cast of an out-of-range float is undefined), then each value's nearest
    doubled E2M1 value times 2^(e - 128), the first of equals on a tie (best_index_mxfp4)."""
    n, k = x.shape
    b = x.reshape(-1, 32).astype(_F32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0)
    e = np.clip(e, 0, 255).astype(np.uint8)
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << np.uint32(23))
    d = bits.astype(np.uint32).view(_F32)  # [NB, 1]
    err = np.abs(d[:, :, None] * _MXFP4_VALUES[None, None, :] - b[:, :, None])  # [NB, 32, 16]
    q = err.argmin(axis=2).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([e, qs], axis=1).reshape(n, -1)


QUANTIZERS = {
    GGMLType.Q8_0: (32, quantize_q8_0),
    GGMLType.Q4_0: (32, quantize_q4_0),
    GGMLType.Q4_K: (QK_K, quantize_q4_k),
    GGMLType.Q6_K: (QK_K, quantize_q6_k),
    GGMLType.MXFP4: (32, quantize_mxfp4),
}


def quantize(x: np.ndarray, qtype: GGMLType, chunk_rows: int = 1024) -> np.ndarray:
    """x: float [N, K] -> uint8 [N, row_bytes] raw blocks of ``qtype`` (F32/F16 pass through as bytes)."""
    x = np.asarray(x)
    if qtype == GGMLType.F32:
        return np.ascontiguousarray(x.astype(np.float32)).view(np.uint8)
    if qtype == GGMLType.F16:
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)
    if qtype not in QUANTIZERS:
        raise ValueError(f"no quantizer for {qtype.name}")
    bs, fn = QUANTIZERS[qtype]
    if x.ndim != 2 or x.shape[1] % bs:
        raise ValueError(f"shape {x.shape} does not hold whole {qtype.name} blocks of {bs}")
    # Chunks bound the temporaries (the K-quant searches keep several [rows, K] float32 arrays alive).
    return np.concatenate([fn(np.ascontiguousarray(x[i:i + chunk_rows], dtype=np.float32))
                           for i in range(0, x.shape[0], chunk_rows)], axis=0)
