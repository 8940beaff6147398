"""Float64 numpy references of healsweep's kernels: what ``healsweep doctor`` and the tests hold
the kernels to.

Each is written from the definition (the kernel's docstring, the audit's formulas, ggml's block
layouts), in float64 where arithmetic is involved, and imports nothing but numpy: no jax and no
healsweep helper, so a reference cannot share a bug with the code it checks. Where the float32
kernel may legitimately decide a discrete choice the other way (a quotient within float32 error
of a rounding edge, two seeds whose scores tie), the reference also returns the margin, and the
comparison (``compare_q2_0``) accepts a difference only where the margin explains it.
"""

from __future__ import annotations

import numpy as np

# --- Q2_0 --------------------------------------------------------------------------------------

Q2_SEEDS = (0.42, 0.55, 0.68, 0.81, 0.94, -0.42, -0.55, -0.68, -0.81, -0.94)
Q2_THRESHOLDS = np.array([-0.5, 0.5, 1.5])  # the only rounding edges that survive clip(-1, 2)
ROUND_TIE = 1e-5  # |w/d - edge| below which float32 may round the other way
SCORE_TIE = 1e-5  # relative score gap below which float32 may pick another seed
FP16_TIE = 1e-5  # relative distance of d to an fp16 rounding midpoint


def q2_0_search(w: np.ndarray, a: np.ndarray, gain: float):
    """The Q2_0 seed search over blocks ``w``, ``a`` [N, 64] (``a`` may be [64]) in float64.

    Returns ``(d64 [N], q [N, 64] int8, round_margin [N], score_gap [N])``: the unrounded stored
    scale, the codes, each block's smallest distance of a ``w/d`` to a rounding edge, and the
    relative gap between the winning score and the best seed with other codes (inf for all-zero
    blocks).
    """
    return _q2_0_search(w, a, gain)[:4]


def _q2_0_search(w, a, gain):
    """:func:`q2_0_search` and, last, the winner's refit ``d1`` (codes are ``rint(w/d1)``)."""
    w = w.astype(np.float64)
    a = np.broadcast_to(a, w.shape).astype(np.float64)
    n = w.shape[0]
    amax = np.abs(w).max(axis=1)
    live = amax > 0
    safe_amax = np.where(live, amax, 1.0)
    margin = np.full(n, np.inf)
    scores, qs, d1s = [], [], []

    def codes(d):
        x = w / d[:, None]
        near = np.abs(x[..., None] - Q2_THRESHOLDS).min(axis=(1, 2))
        return np.clip(np.rint(x), -1, 2), near

    for s in Q2_SEEDS:
        d0 = s * safe_amax
        q, near0 = codes(d0)
        sqw, sqq = (a * q * w).sum(1), (a * q * q).sum(1)
        d1 = np.where(sqq > 0, sqw / np.where(sqq > 0, sqq, 1), d0)
        q, near1 = codes(d1)
        sqw, sqq = (a * q * w).sum(1), (a * q * q).sum(1)
        scores.append(np.where(sqq > 0, sqw**2 / np.where(sqq > 0, sqq, 1), 0.0))
        margin = np.minimum(margin, np.minimum(near0, near1))
        qs.append(q)
        d1s.append(d1)
    scores = np.stack(scores, 1)  # [N, 10]
    best = np.argmax(scores, axis=1)  # argmax returns the first of equal maxima
    q = np.stack(qs, 1)[np.arange(n), best]
    same_codes = (np.stack(qs, 1) == q[:, None]).all(axis=2)
    top = scores[np.arange(n), best]
    rival = np.where(same_codes, -np.inf, scores).max(axis=1)
    score_gap = (top - rival) / np.maximum(top, 1e-300)
    sqw, sqq, saw2 = (a * q * w).sum(1), (a * q * q).sum(1), (a * w * w).sum(1)
    d_ls = np.where(sqq > 0, sqw / np.where(sqq > 0, sqq, 1), 0.0)
    r2 = np.where(saw2 > 0, top / np.where(saw2 > 0, saw2, 1), 1.0)
    d = np.where(live, d_ls * np.maximum(r2, 0.25) ** (-gain / 2), 0.0)
    q = np.where(live[:, None], q, 0).astype(np.int8)
    d1 = np.where(live, np.stack(d1s, 1)[np.arange(n), best], 0.0)
    return d, q, np.where(live, margin, np.inf), np.where(live, score_gap, np.inf), d1


def fp16_near_tie(d64: np.ndarray) -> np.ndarray:
    """True where float64 ``d`` lies within FP16_TIE (relative) of an fp16 rounding midpoint."""
    lo = d64.astype(np.float16)
    hi = np.nextafter(lo, np.where(d64 > lo, np.inf, -np.inf).astype(np.float16))
    mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
    return np.abs(d64 - mid) <= FP16_TIE * np.abs(d64)


def compare_q2_0(d: np.ndarray, q: np.ndarray, w: np.ndarray, a: np.ndarray, gain: float):
    """A Q2_0 result ``d [N]``, ``q [N, 64]`` of blocks ``w``, ``a`` against :func:`q2_0_search`.

    Returns ``(codes_differ, scales_differ, unexplained)``: blocks whose codes differ, blocks
    with the same codes whose fp16 scale differs, and how many of either no near-tie explains
    (a right kernel has none, and few of the others).
    """
    return q2_0_disagreements(d, q, q2_0_search(w, a, gain))


def q2_0_disagreements(d: np.ndarray, q: np.ndarray, found: tuple) -> tuple[int, int, int]:
    """:func:`compare_q2_0` given the search's result ``found`` (its four arrays)."""
    d64, q_ref, margin, gap = found
    codes_differ = (np.asarray(q) != q_ref).any(axis=1)
    explained = (margin < ROUND_TIE) | (gap < SCORE_TIE)
    d_differ = ~codes_differ & (np.asarray(d, np.float16) != d64.astype(np.float16))
    unexplained = (codes_differ & ~explained) | (d_differ & ~fp16_near_tie(d64))
    return int(codes_differ.sum()), int(d_differ.sum()), int(unexplained.sum())


def q2_0_plain(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Plain Q2_0 from its definition: ``d = fp16(signed amax / 2)`` per block of 64,
    ``q = clip(rint(w/d), -1, 2)`` (0 where ``d == 0``). ``w`` [..., in]."""
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, 64)
    at = np.abs(blocks).argmax(-1)[..., None]
    amax = np.take_along_axis(blocks, at, -1)[..., 0]
    d = (amax / 2).astype(np.float16)
    d64 = d.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d64 == 0, 0, np.clip(np.rint(blocks / d64), -1, 2))
    return d, q.astype(np.int8).reshape(w.shape)


def q2_0_values(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``q * d`` in float64: ``d`` [..., nb] fp16 scales of blocks of 64, ``q`` [..., nb*64]."""
    scale = np.repeat(np.asarray(d).astype(np.float64), 64, axis=-1)
    return np.asarray(q).astype(np.float64) * scale


def q2_0_codes_from_bytes(codes: np.ndarray) -> np.ndarray:
    """ggml type 42's code bytes ``uint8 [..., n/4]`` -> ``q [..., n]``: weight ``j`` at bits
    ``2*(j%4)`` of byte ``j//4``, ``q = code - 1``."""
    codes = np.asarray(codes).astype(np.int64)
    shifts = 2 * np.arange(4)
    q = ((codes[..., None] >> shifts) & 3) - 1
    return q.reshape(*codes.shape[:-1], -1).astype(np.int8)


def q2_0_block_bytes(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """ggml type 42 blocks ``uint8 [N, 18]`` of ``d [N]``, ``q [N, 64]``: fp16 ``d`` little-endian,
    then code ``c_j = q_j + 1`` at bits ``2*(j%4)`` of byte ``2 + j//4``."""
    c = (np.asarray(q).astype(np.int64) + 1).reshape(-1, 16, 4)
    body = (c[..., 0] | c[..., 1] << 2 | c[..., 2] << 4 | c[..., 3] << 6).astype(np.uint8)
    head = np.asarray(d, "<f2").reshape(-1, 1).view(np.uint8)
    return np.concatenate([head, body], axis=1)


def q2_0_from_bytes(rows: np.ndarray) -> np.ndarray:
    """Stored type-42 rows ``uint8 [R, nb*18]`` -> float64 ``[R, nb*64]`` (NaN/inf as stored)."""
    blocks = np.ascontiguousarray(rows).reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2")[:, 0].astype(np.float64)
    q = q2_0_codes_from_bytes(blocks[:, 2:]).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return (q * d[:, None]).reshape(rows.shape[0], -1)


# --- IQ4_NL ------------------------------------------------------------------------------------

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113.0])


def iq4_nearest(t: np.ndarray) -> np.ndarray:
    """Index of the codebook value nearest ``t``; an exact tie goes to the larger value."""
    dist = np.abs(t[..., None] - IQ4_VALUES)
    return len(IQ4_VALUES) - 1 - np.argmin(dist[..., ::-1], axis=-1)


def iq4_values(d: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``d * KVALUES[idx]`` in float64: ``d [..., N]`` fp16, ``idx [..., N, 32]``."""
    return np.asarray(d).astype(np.float64)[..., None] * IQ4_VALUES[np.asarray(idx)]


def iq4_best_sse(w: np.ndarray, a: np.ndarray, multipliers) -> tuple[np.ndarray, np.ndarray]:
    """``(best, rtn)``: per block ``w [N, 32]`` the smallest weighted SSE (weights ``a``) over the
    documented IQ4_NL candidates, each judged with its fp16 scale, and that of round-to-nearest
    at ``m/-127`` (``m`` the largest-magnitude weight): base scales ``m/-127`` and ``m/113``
    times each multiplier, nearest indices, then the weighted least-squares ``d``."""
    x = w.astype(np.float64)
    a = np.broadcast_to(a, x.shape).astype(np.float64)
    m = np.where(-x.min(1) > x.max(1), x.min(1), x.max(1))
    safe = np.where(m == 0, 1.0, m)

    def sse(d, v):
        d16 = np.where(m == 0, 0.0, d).astype(np.float16).astype(np.float64)
        return (a * (x - d16[:, None] * v) ** 2).sum(1)

    rtn = sse(safe / -127, IQ4_VALUES[iq4_nearest(x / (safe / -127)[:, None])])
    found = [rtn]
    for base in (safe / -127, safe / 113):
        for mult in multipliers:
            v = IQ4_VALUES[iq4_nearest(x / (base * mult)[:, None])]
            found.append(sse((a * v * x).sum(1) / (a * v * v).sum(1), v))
    return np.min(found, axis=0), rtn


def iq4_block_bytes(d: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """ggml ``block_iq4_nl`` bytes ``uint8 [N, 18]``: fp16 ``d``, then ``idx[j] | idx[j+16] << 4``."""
    idx = np.asarray(idx).astype(np.int64).reshape(-1, 32)
    body = (idx[:, :16] | idx[:, 16:] << 4).astype(np.uint8)
    return np.concatenate([np.asarray(d, "<f2").reshape(-1, 1).view(np.uint8), body], axis=1)


def q8_0_encode(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's reference Q8_0 quantizer in float64, each float32 step of its C rounded to float32
    where the C rounds (a division or product of two float32 values computed in float64 and
    rounded once is the float32 result: 53 >= 2·24 + 2 bits): per block of 32, ``d = max|x| /
    127``, ``q = roundf(x · (1/d))`` (half away from zero; 0 where d is 0), stored as fp16 ``d``
    then 32 int8 ``q``. Returns (bytes ``uint8 [rows, cols/32*34]``, values ``q · fp16(d)``)."""
    x = np.asarray(values, np.float32).astype(np.float64)
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 32, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float32).astype(np.float64)
    inverse = np.where(d == 0, 0.0, (1 / np.where(d == 0, 1, d)).astype(np.float32))
    scaled = (blocks * inverse).astype(np.float32).astype(np.float64)
    q = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)  # exact in float64 for |q| <= 127
    half = d.astype(np.float16)
    raw = np.concatenate([half.astype("<f2").view(np.uint8), q.astype(np.int8).view(np.uint8)],
                         axis=-1)  # fmt: skip
    stored = (q * half.astype(np.float64)).astype(np.float32)
    return raw.reshape(rows, -1), stored.reshape(rows, cols)


# --- KL divergence and the compact teacher record ----------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kld(teacher: np.ndarray, student: np.ndarray) -> np.ndarray:
    """KL(softmax(teacher) || softmax(student)) per row, float64 (0·log 0 taken as 0)."""
    lt, ls = log_softmax(teacher), log_softmax(student)
    p = np.exp(lt)
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (lt - ls), 0.0).sum(axis=-1)


def token_stats(teacher, student, next_ids) -> dict[str, np.ndarray]:
    """Per token: KLD, top-1 agreement, both argmaxes and both log-probs of the next token."""
    rows = np.arange(len(next_ids))
    lt, ls = log_softmax(teacher), log_softmax(student)
    arg_t, arg_s = np.argmax(teacher, axis=1), np.argmax(student, axis=1)
    return {
        "kld": kld(teacher, student),
        "top1_agree": arg_t == arg_s,
        "teacher_argmax": arg_t,
        "student_argmax": arg_s,
        "teacher_logp_next": lt[rows, next_ids],
        "student_logp_next": ls[rows, next_ids],
    }


def topk_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|A ∩ B| / |A ∪ B| of two id sets per row."""
    rows = zip(a, b, strict=True)
    return np.array([len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in rows])


def teacher_top(logprobs: np.ndarray, next_ids: np.ndarray, top_k: int):
    """``(logp, top_ids, top_logp, logp_next)`` of a compact record: the row's log-softmax, its
    ``top_k`` largest entries (a tie keeps the lower id first) and the next token's entry."""
    logp = log_softmax(logprobs)
    top_ids = np.argsort(-logp, axis=1, kind="stable")[:, :top_k]
    rows = np.arange(len(next_ids))
    return logp, top_ids, np.take_along_axis(logp, top_ids, 1), logp[rows, next_ids]


def tail_draws(logp: np.ndarray, top_ids: np.ndarray, strata: np.ndarray):
    """``(ids, logp at ids, tail mass, tail full)``: per row the float64 inverse CDF of the
    teacher's tail (p outside ``top_ids``) at ``strata [T, S] · P_tail`` (the first token whose
    running mass passes the target; the last positive token if rounding passes the end), the
    argmax where the tail is empty. The host path the compact record used before the device."""
    logp = np.asarray(logp, np.float32)
    ids = np.empty(strata.shape, np.int64)
    mass = np.zeros(len(logp))
    full = np.zeros(len(logp), bool)
    for row in range(len(logp)):
        p = np.exp(logp[row].astype(np.float64))
        p[top_ids[row]] = 0.0
        cdf = np.cumsum(p)
        mass[row] = cdf[-1]
        full[row] = np.isfinite(np.delete(logp[row], np.unique(top_ids[row]))).all()
        if cdf[-1] <= 0.0:
            ids[row] = top_ids[row, 0]
            continue
        picked = np.searchsorted(cdf, np.asarray(strata[row], np.float64) * cdf[-1], "right")
        ids[row] = np.minimum(picked, np.flatnonzero(p)[-1])
    return ids, np.take_along_axis(logp, ids, 1).astype(np.float64), mass, full


def tail_edge_misses(ids, logp, top_ids, strata, tol: float = 1e-5) -> tuple[float, int]:
    """``(fraction of draws unlike the float64 inverse CDF's, draws whose float64 interval
    misses the target by more than tol·P_tail)``: a float32 sampler may move a draw within its
    rounding of a token's edge to the neighbour (the first figure), never further (the second
    must be 0), and never onto a top-K token or one with p = 0 (counted there too)."""
    want = tail_draws(logp, top_ids, strata)[0]
    differ = np.argwhere(np.asarray(ids) != want)
    bad = 0
    for row, draw in differ:
        p = np.exp(np.asarray(logp[row], np.float64))
        p[top_ids[row]] = 0.0
        cdf = np.cumsum(p)
        token = int(ids[row, draw])
        target = float(strata[row, draw]) * cdf[-1]
        low = cdf[token - 1] if token else 0.0
        inside = low - tol * cdf[-1] <= target <= cdf[token] + tol * cdf[-1]
        bad += int(not inside or p[token] <= 0.0)
    return len(differ) / max(want.size, 1), bad


def compact_kld(top_ids, top_logp, tail_ids, tail_logp, tail_mass, tail_full, student, tail):
    """Per-token KL estimate of a compact record against ``student`` logits [T, V], float64.

    Top-K term ``Σ p (log p − log q)`` plus ``P_tail`` times the tail estimate: the mean of
    ``log p − log q`` over the draws (``plain``), plus ``beta`` times the control variate
    ``e^y − 1`` centred by its known mean (``y = log q − log p``; ``cv``: beta 1; ``adaptive``:
    per position the variance-minimising beta in [0, 1] from the other positions' draws).
    """
    logq = log_softmax(student)
    y_top = np.take_along_axis(logq, top_ids, 1) - top_logp
    p_top = np.exp(np.asarray(top_logp, np.float64))
    y_tail = np.take_along_axis(logq, tail_ids, 1) - tail_logp
    mass = np.asarray(tail_mass, np.float64)
    plain = mass * np.mean(-y_tail, axis=1)
    tail_term = plain
    if tail in ("cv", "adaptive"):
        usable = (mass > 0) & np.asarray(tail_full, bool)
        excess = np.sum(p_top * np.expm1(y_top), axis=1)
        centred = np.expm1(y_tail) + (excess / np.where(usable, mass, 1.0))[:, None]
        centred = np.where(usable[:, None], centred, 0.0)
        control = mass * np.mean(centred, axis=1)
        beta = np.ones_like(mass)
        if tail == "adaptive":
            num = mass**2 * np.mean(-y_tail * centred, axis=1)
            den = mass**2 * np.mean(centred**2, axis=1)
            rest_num, rest_den = num.sum() - num, den.sum() - den
            beta = np.clip(
                np.where(rest_den > 0, -rest_num / np.where(rest_den > 0, rest_den, 1), 0), 0, 1
            )
        tail_term = plain + beta * control
    return -np.sum(p_top * y_top, axis=1) + np.where(mass > 0, tail_term, 0.0)


# --- Part A: alpha ----------------------------------------------------------------------------


def alpha(y_ref: np.ndarray, y_q: np.ndarray, gamma: float) -> float:
    """``sign(cos)·|cos|^(1-gamma) / ratio`` over all entries, float64."""
    a, b = np.asarray(y_ref, np.float64).ravel(), np.asarray(y_q, np.float64).ravel()
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    ratio = np.linalg.norm(b) / np.linalg.norm(a)
    return float(np.sign(cos) * abs(cos) ** (1 - gamma) / ratio)


def expert_ffn(x, gate, up, down) -> np.ndarray:
    """Every expert's SwiGLU on every token: ``x [T, D]``, ``gate/up [E, F, D]``, ``down [E, D, F]``
    -> ``[E, T, D]``, float64."""
    x, gate, up, down = (np.asarray(v, np.float64) for v in (x, gate, up, down))
    g = np.einsum("td,nfd->ntf", x, gate)
    u = np.einsum("td,nfd->ntf", x, up)
    return np.einsum("ntf,ndf->ntd", g / (1 + np.exp(-g)) * u, down)


def routed_experts(x, ids, weights, gate, up, down) -> np.ndarray:
    """Σ_j weight_j · Wd_e (silu(Wg_e x) ⊙ Wu_e x) token by token: ``x [T, D]``, ``ids, weights
    [T, k]``, experts ``[E, F, D]`` / ``[E, D, F]`` -> ``[T, D]``, float64."""
    x, gate, up, down = (np.asarray(v, np.float64) for v in (x, gate, up, down))
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t], strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += float(w) * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


# --- Part B: the ridge in G's eigenbasis --------------------------------------------------------


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def normal_equations(z, target):
    """``(ZᵀZ, Zᵀ dY)``."""
    z, target = _f64(z, target)
    return z.T @ z, z.T @ target


def eigen_solve(basis, weights, rhs):
    """``V diag(w) Vᵀ B``."""
    v, w, b = _f64(basis, weights, rhs)
    return v @ (w[:, None] * (v.T @ b))


def coefficients(basis, rhs):
    """``Vᵀ B``."""
    v, b = _f64(basis, rhs)
    return v.T @ b


def gram_quadratic(basis, sigma, delta):
    """``tr(Δᵀ G Δ)`` with ``G = V diag(max(sigma, 0)) Vᵀ``."""
    v, s, d = _f64(basis, sigma, delta)
    return np.trace(d.T @ (v * np.maximum(s, 0)) @ v.T @ d)


def eigen_fit(basis, sigma, weights, coef):
    """``(V (w∘C), Σ_k w_k |C_k|², Σ_k max(sigma_k, 0) w_k² |C_k|²)``."""
    v, s, w, c = _f64(basis, sigma, weights, coef)
    energy = (c * c).sum(1)
    return v @ (w[:, None] * c), (w * energy).sum(), (np.maximum(s, 0) * w * w * energy).sum()


def fold_residual(u_fold, weights, coef, target):
    """``Y − U (w∘C)``."""
    u, w, c, y = _f64(u_fold, weights, coef, target)
    return y - u @ (w[:, None] * c)


def fold_leverage(u_fold, weights):
    """``U diag(w) Uᵀ``."""
    u, w = _f64(u_fold, weights)
    return (u * w) @ u.T


def fold_moments(u_fold, resid):
    """``(UᵀU, Uᵀe)``."""
    u, e = _f64(u_fold, resid)
    return u.T @ u, u.T @ e


# --- GPTQ and its refinement -------------------------------------------------------------------


def h_objective(w, d, q, h) -> np.ndarray:
    """``(w − q·d) H (w − q·d)ᵀ`` per row ``[E, out]``: ``d [E, out, in/64]``, ``h [E, in, in]``."""
    r = np.asarray(w, np.float64) - q2_0_values(d, q)
    return np.einsum("eoi,eij,eoj->eo", r, np.asarray(h, np.float64), r)


def gptq(w, u, importance, gain) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ Q2_0 in float64, column by column, every error applied to all later columns at once.

    ``w [E, out, in]``, ``u [E, in, in]`` the upper factor of each damped H⁻¹ (``uᵀu``),
    ``importance [E, in]``. Each 64-column block's scale is :func:`q2_0_search` on the weights
    as they are at the block's start; its columns are rounded with the winner's step ``1/d1``
    and each error ``(w_j − q_j·d)/u_jj`` is taken off the later columns through row ``j`` of u.
    """
    w = np.array(w, np.float64)
    u = np.asarray(u, np.float64)
    n_exp, n_out, n_in = w.shape
    d_out = np.zeros((n_exp, n_out, n_in // 64), np.float16)
    q_out = np.zeros((n_exp, n_out, n_in), np.int8)
    for e in range(n_exp):
        for b in range(n_in // 64):
            cols = slice(64 * b, 64 * b + 64)
            blocks = w[e, :, cols]
            d64, _, _, _, d1 = _q2_0_search(blocks, importance[e, cols], gain)
            d16 = d64.astype(np.float16)
            step = np.where(d1 != 0, 1.0 / np.where(d1 != 0, d1, 1.0), 0.0)
            d_out[e, :, b] = d16
            for j in range(64 * b, 64 * b + 64):
                qj = np.clip(np.rint(w[e, :, j] * step), -1, 2)
                q_out[e, :, j] = qj
                err = (w[e, :, j] - qj * d16.astype(np.float64)) / u[e, j, j]
                w[e, :, j + 1 :] -= np.outer(err, u[e, j, j + 1 :])
    return d_out, q_out


def grid_values(scale, offset, shift: int, n_codes: int) -> np.ndarray:
    """Every code's value ``scale·(c − shift) − offset`` of an affine grid ``[..., n_codes]``."""
    levels = np.arange(n_codes, dtype=np.float64) - shift
    return (
        np.asarray(scale, np.float64)[..., None] * levels
        - np.asarray(offset, np.float64)[..., None]
    )


def gptq_grid(w, scale, offset, u, shift: int, n_codes: int) -> np.ndarray:
    """Classic GPTQ's codes on a fixed affine grid (ggml's Q2_K / Q3_K: ``scale``, ``offset``
    [E, out, in/16]) in float64, one row at a time: each column rounded to its nearest grid
    value, its error ``(w_j − v_j)/u_jj`` taken off the later columns through row ``j`` of ``u``
    (``uᵀu = H⁻¹``). The kernel computes the LDLQ form of the same (QuIP: equal codes)."""
    w = np.asarray(w, np.float64)
    u = np.asarray(u, np.float64)
    values = np.repeat(grid_values(scale, offset, shift, n_codes), 16, axis=2)  # [E, out, in, K]
    codes = np.zeros(w.shape, np.int32)
    for e in range(w.shape[0]):
        for o in range(w.shape[1]):
            row = w[e, o].copy()
            for j in range(w.shape[2]):
                codes[e, o, j] = np.argmin(np.abs(values[e, o, j] - row[j]))
                err = (row[j] - values[e, o, j, codes[e, o, j]]) / u[e, j, j]
                row[j + 1 :] -= err * u[e, j, j + 1 :]
    return codes


def code_descent(w, h, d, q, sweeps: int) -> np.ndarray:
    """``sweeps`` passes of coordinate descent over the codes in float64, one column at a time,
    the residual recomputed at each step; a column whose scale is 0 keeps its code."""
    w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
    q = q.astype(np.float64).copy()
    d_full = np.repeat(np.asarray(d, np.float64), 64, axis=-1)
    for _ in range(sweeps):
        for j in range(w.shape[2]):
            r = w - q * d_full
            hr = np.einsum("eoi,ei->eo", r, h[:, :, j])
            target = q[:, :, j] * d_full[:, :, j] + hr / h[:, j, j][:, None]
            dj = d_full[:, :, j]
            new = np.clip(np.rint(target / np.where(dj == 0, 1, dj)), -1, 2)
            q[:, :, j] = np.where(dj == 0, q[:, :, j], new)
    return q.astype(np.int8)


def scale_system(w, h, q) -> tuple[np.ndarray, np.ndarray]:
    """``(A = QᵀHQ [E, out, nb, nb], b = QᵀHw [E, out, nb])`` with ``Q [in, nb]`` a row's codes,
    block ``c``'s in column ``c``; built explicitly."""
    w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
    n_exp, n_out, n_in = q.shape
    nb = n_in // 64
    big_q = np.zeros((n_exp, n_out, n_in, nb))
    for c in range(nb):
        big_q[:, :, 64 * c : 64 * c + 64, c] = q[:, :, 64 * c : 64 * c + 64]
    hq = np.einsum("eij,eojc->eoic", h, big_q)
    return np.einsum("eoib,eoic->eobc", big_q, hq), np.einsum("eoib,eoi->eob", hq, w)


# --- One MoE layer of a model, from its weights -------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis times a per-channel gain, float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, base: float, n_rot: int, kind: str) -> np.ndarray:
    """Rotary embedding of the first ``n_rot`` dims of each head of ``x [T, H, hd]`` at
    positions 0..T-1: ``neox`` pairs dim i with i + n_rot/2, ``norm`` dims 2i and 2i+1; pair i
    turns by ``position · base^(-2i/n_rot)``."""
    half = n_rot // 2
    angle = np.arange(x.shape[0])[:, None] * base ** (-2.0 * np.arange(half) / n_rot)  # [T, n/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    out = np.array(x, np.float64)
    if kind == "neox":
        x1, x2 = x[..., :half], x[..., half:n_rot]
        out[..., :half], out[..., half:n_rot] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


def moe_layer_logits(tokens: np.ndarray, w: dict[str, np.ndarray], config: dict) -> dict:
    """A one-layer MoE model's forward in float64: embedding, attention (q/k/v biases and q/k
    norms where the weights have them, RoPE, causal grouped-query softmax attention), the
    router (softmax, top-k by probability, weights renormalized if ``norm_topk_prob``), the
    routed SwiGLU experts, the shared expert (scaled by ``sigmoid(x·w_gate_inp_shexp)`` where
    that weight exists), the output norm and head.

    ``w`` holds the layer's tensors by suffix (``attn_q.weight`` ...) and the model's
    ``token_embd``, ``output_norm`` and ``output`` (``[out, in]``, as gguf-py gives them);
    ``config``: ``n_head, n_head_kv, n_rot, rope_kind, rope_base, eps, n_expert_used,
    norm_topk_prob``. Returns the logits and what the forward captures of the layer, with the
    probability gap between each token's k-th and (k+1)-th expert (a near-tie may route either
    way in float32).
    """
    c = config
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    t = len(tokens)
    h = w["token_embd"][np.asarray(tokens)]  # [T, D]

    def project(x, name):
        out = x @ w[f"{name}.weight"].T
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    def heads(x, n, norm):
        x = x.reshape(t, n, -1)
        return rms_norm(x, w[norm], c["eps"]) if norm in w else x

    x = rms_norm(h, w["attn_norm.weight"], c["eps"])
    q = heads(project(x, "attn_q"), c["n_head"], "attn_q_norm.weight")  # [T, H, hd]
    k = heads(project(x, "attn_k"), c["n_head_kv"], "attn_k_norm.weight")  # [T, Hkv, hd]
    v = project(x, "attn_v").reshape(t, c["n_head_kv"], -1)
    q, k = (rope(a, c["rope_base"], c["n_rot"], c["rope_kind"]) for a in (q, k))
    group = c["n_head"] // c["n_head_kv"]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("hts,shd->thd", probs, v).reshape(t, -1)
    h = h + attended @ w["attn_output.weight"].T
    x = rms_norm(h, w["ffn_norm.weight"], c["eps"])  # [T, D]
    router_logits = x @ w["ffn_gate_inp.weight"].T  # [T, E]
    p = np.exp(router_logits - router_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=1, kind="stable")
    ids = order[:, : c["n_expert_used"]]
    ranked = np.take_along_axis(p, order, 1)
    gap = ranked[:, c["n_expert_used"] - 1] - ranked[:, c["n_expert_used"]]
    weights = np.take_along_axis(p, ids, 1)
    if c["norm_topk_prob"]:
        weights = weights / weights.sum(1, keepdims=True)
    routed = routed_experts(
        x, ids, weights, w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"],
        w["ffn_down_exps.weight"],
    )  # fmt: skip
    out = {"ffn_input": x, "router_logits": router_logits, "topk_ids": ids}
    out.update(topk_weights=weights, routed_output=routed, shexp_gate=np.zeros(0))
    h = h + routed
    if "ffn_gate_shexp.weight" in w:
        g, u = x @ w["ffn_gate_shexp.weight"].T, x @ w["ffn_up_shexp.weight"].T
        shared = (g / (1 + np.exp(-g)) * u) @ w["ffn_down_shexp.weight"].T
        gate = np.ones(t)
        if "ffn_gate_inp_shexp.weight" in w:
            gate = 1 / (1 + np.exp(-(x @ w["ffn_gate_inp_shexp.weight"])))
        out["shexp_gate"] = gate
        h = h + shared * gate[:, None]
    logits = rms_norm(h, w["output_norm"], c["eps"]) @ w["output"].T
    return {"logits": logits, **out, "routing_gap": gap}
