/* Miss-ratio curves in one pass, per layer: the loops of qnpipe/replay/mrc.py (`belady_layers` and
 * `lru_one_pass` there are the reference, tested equal), as a plain shared library loaded with ctypes
 * (no Python API). First Belady's OPT stack:
 *
 * req  [S, L, W] int64: each layer-step's distinct experts, left-aligned, -1 padding (a row of -1: no request)
 * hits [L, E + 2] int64, zeroed: hits[l][p + 1] += 1 for an access found at stack position p (a hit at
 *      every capacity > p); the caller's cumulative sum gives the hits by capacity.
 * Returns 0, -1 when memory runs out, -3 when a request repeats an expert or names one outside 0..E-1. */
#include <stdint.h>
#include <stdlib.h>

/* 0 when every row's experts (up to its first -1) are distinct and in 0..E-1; -3 otherwise (the loops
 * index arrays of E entries by them), -1 when memory runs out. */
static int check_requests(const int64_t *req, int64_t S, int64_t L, int64_t W, int64_t E) {
    char *mark = calloc((size_t)(E > 0 ? E : 1), 1);
    int bad = 0;
    if (!mark) return -1;
    for (int64_t row = 0; row < S * L && !bad; row++) {
        const int64_t *r = req + row * W;
        int64_t rr = 0;
        while (rr < W && r[rr] >= 0) rr++;
        for (int64_t j = 0; j < rr; j++) {
            if (r[j] >= E || mark[r[j]]) { bad = 1; rr = j; break; }
            mark[r[j]] = 1;
        }
        for (int64_t j = 0; j < rr; j++) mark[r[j]] = 0;
    }
    free(mark);
    return bad ? -3 : 0;
}

int qnpipe_belady_layers(const int64_t *req, int64_t S, int64_t L, int64_t W, int64_t E, int64_t *hits) {
    int checked = check_requests(req, S, L, W, E);
    if (checked) return checked;
    /* an access's priority: the step of the expert's next use (never: 2^40), then its id (ties evict the higher) */
    const int64_t never = (int64_t)1 << 40;
    int64_t *prio = malloc(sizeof(int64_t) * (size_t)(S * W > 0 ? S * W : 1));
    int64_t *stack = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    int64_t *key = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    int64_t *buf = malloc(sizeof(int64_t) * (size_t)(W > 0 ? W : 1));
    char *in_r = calloc((size_t)(E > 0 ? E : 1), 1);
    if (!stack || !pos || !key || !buf || !in_r || !prio) {
        free(stack); free(pos); free(key); free(buf); free(in_r); free(prio);
        return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t depth = 0, *h = hits + l * (E + 2);
        for (int64_t e = 0; e < E; e++) pos[e] = never;  /* here: the next step using e, scanning backwards */
        for (int64_t s = S - 1; s >= 0; s--) {
            const int64_t *r = req + (s * L + l) * W;
            for (int64_t j = 0; j < W && r[j] >= 0; j++) { prio[s * W + j] = pos[r[j]] * (E + 1) + r[j]; pos[r[j]] = s; }
        }
        for (int64_t e = 0; e < E; e++) { pos[e] = -1; key[e] = 0; }
        for (int64_t s = 0; s < S; s++) {
            const int64_t *r = req + (s * L + l) * W, *pr = prio + s * W;
            int64_t rr = 0, deep = -1, cold = 0, nb = 0;
            while (rr < W && r[rr] >= 0) rr++;
            if (!rr) continue;
            for (int64_t j = 0; j < rr; j++) {
                int64_t p = pos[r[j]];
                if (p >= 0) { h[p + 1]++; if (p > deep) deep = p; } else cold++;
                in_r[r[j]] = 1;
            }
            if (cold) deep = depth - 1;
            /* the buffer: the old top's entries the request displaces; its best (smallest key) leaves first */
            for (int64_t c = 0; c < rr && c < depth; c++) if (!in_r[stack[c]]) buf[nb++] = stack[c];
            for (int64_t c = rr; c <= deep && nb; c++) {
                int64_t x = stack[c], bi = 0;
                for (int64_t i = 1; i < nb; i++) if (key[buf[i]] < key[buf[bi]]) bi = i;
                if (in_r[x]) { stack[c] = buf[bi]; pos[buf[bi]] = c; buf[bi] = buf[--nb]; }
                else if (key[x] > key[buf[bi]]) { stack[c] = buf[bi]; pos[buf[bi]] = c; buf[bi] = x; }
            }
            /* experts new to the stack: what the buffer still carries goes below the old stack, best first */
            for (int64_t at = rr > depth ? rr : depth; nb; at++) {
                int64_t bi = 0;
                for (int64_t i = 1; i < nb; i++) if (key[buf[i]] < key[buf[bi]]) bi = i;
                stack[at] = buf[bi]; pos[buf[bi]] = at; buf[bi] = buf[--nb];
            }
            for (int64_t j = 0; j < rr; j++) { stack[j] = r[j]; pos[r[j]] = j; in_r[r[j]] = 0; key[r[j]] = pr[j]; }
            depth += cold;
        }
    }
    free(stack); free(pos); free(key); free(buf); free(in_r); free(prio);
    return 0;
}

/* The pool's LRU hits at every capacity, per layer, in one pass: `lru_one_pass` of qnpipe/replay/mrc.py (its
 * reference; the module doc says why a step's hits and misses need the band). req as above, W - 1 <= 62.
 * above [L, E + 2]: above[l][c] += 1 for an access that hits at every capacity >= c;
 * band  [L, E + 2]: band[l][c] += 1 for an access that hits at capacity c only (c in its band).
 * Returns 0, -1 when memory runs out, -2 when a request is wider than 63 experts, -3 as for Belady. */
static int64_t fen_prefix(const int64_t *fen, int64_t i) { /* sum of counts at steps 0..i */
    int64_t acc = 0;
    for (i++; i > 0; i -= i & -i) acc += fen[i];
    return acc;
}

static void fen_add(int64_t *fen, int64_t n, int64_t i, int64_t v) {
    for (i++; i <= n; i += i & -i) fen[i] += v;
}

/* Bit j - 1 set where the access recorded as (lo, hi, bits) hit at capacity d + j, j = 1..band. */
static uint64_t hit_window(int64_t lo, int64_t hi, uint64_t bits, int64_t d, int64_t band) {
    uint64_t full = ((uint64_t)1 << band) - 1, above, between;
    int64_t a = hi - d, shift = d - lo;
    a = a < 0 ? 0 : (a > band ? band : a);
    above = full & ~(((uint64_t)1 << a) - 1);  /* every capacity past hi */
    if (shift >= 0) between = shift > 63 ? 0 : bits >> shift;
    else between = -shift > 63 ? 0 : bits << -shift;
    return (above | between) & full;
}

int qnpipe_lru_layers(const int64_t *req, int64_t S, int64_t L, int64_t W, int64_t E, int64_t *above, int64_t *band) {
    if (W - 1 > 62) return -2;
    int checked = check_requests(req, S, L, W, E);
    if (checked) return checked;
    int64_t n = S > 0 ? S : 1, En = E > 0 ? E : 1, Wn = W > 0 ? W : 1;
    int64_t *last = malloc(sizeof(int64_t) * (size_t)En), *lo = malloc(sizeof(int64_t) * (size_t)En);
    int64_t *hi = malloc(sizeof(int64_t) * (size_t)En), *fen = malloc(sizeof(int64_t) * (size_t)(n + 1));
    uint64_t *bits = malloc(sizeof(uint64_t) * (size_t)En);
    int64_t *n_lo = malloc(sizeof(int64_t) * (size_t)Wn), *n_hi = malloc(sizeof(int64_t) * (size_t)Wn);
    uint64_t *n_bits = malloc(sizeof(uint64_t) * (size_t)Wn);
    if (!last || !lo || !hi || !fen || !bits || !n_lo || !n_hi || !n_bits) {
        free(last); free(lo); free(hi); free(fen); free(bits); free(n_lo); free(n_hi); free(n_bits);
        return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t seen = 0, *ab = above + l * (E + 2), *bd = band + l * (E + 2);
        for (int64_t e = 0; e < E; e++) { last[e] = -1; lo[e] = E; hi[e] = E; bits[e] = 0; }
        for (int64_t i = 0; i <= n; i++) fen[i] = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t *r = req + (s * L + l) * W;
            int64_t rr = 0;
            while (rr < W && r[rr] >= 0) rr++;
            if (!rr) continue;
            for (int64_t a = 0; a < rr; a++) {
                int64_t e = r[a], t = last[e];
                n_lo[a] = E; n_hi[a] = E; n_bits[a] = 0;
                if (t < 0) continue;
                int64_t d = seen - fen_prefix(fen, t), q = 0;  /* distinct experts used since step t */
                const int64_t *m = req + (t * L + l) * W;
                int64_t mates[63];
                for (int64_t b = 0; b < W && m[b] >= 0; b++)
                    if (m[b] != e && last[m[b]] == t) mates[q++] = m[b];
                uint64_t hb = 0;
                if (q) {
                    /* at each capacity of the band: a mate is newer when it missed and e hit, or both alike and
                     * its id is higher; e hits at d + j when fewer than j mates are newer */
                    uint64_t full = ((uint64_t)1 << q) - 1;
                    uint64_t miss_e = ~hit_window(lo[e], hi[e], bits[e], d, q) & full;
                    int64_t rank[63] = {0};
                    for (int64_t i = 0; i < q; i++) {
                        int64_t g = mates[i];
                        uint64_t miss_g = ~hit_window(lo[g], hi[g], bits[g], d, q) & full;
                        uint64_t newer = (miss_g & ~miss_e) | (~(miss_g ^ miss_e) & (g > e ? full : 0));
                        for (newer &= full; newer; newer &= newer - 1) rank[__builtin_ctzll(newer)]++;
                    }
                    for (int64_t j = 1; j <= q; j++)
                        if (rank[j - 1] < j) { hb |= (uint64_t)1 << (j - 1); bd[d + j]++; }
                }
                ab[d + q + 1]++;
                n_lo[a] = d; n_hi[a] = d + q; n_bits[a] = hb;
            }
            for (int64_t a = 0; a < rr; a++) {
                int64_t e = r[a];
                if (last[e] >= 0) fen_add(fen, n, last[e], -1); else seen++;
                fen_add(fen, n, s, 1);
                last[e] = s; lo[e] = n_lo[a]; hi[e] = n_hi[a]; bits[e] = n_bits[a];
            }
        }
    }
    free(last); free(lo); free(hi); free(fen); free(bits); free(n_lo); free(n_hi); free(n_bits);
    return 0;
}
