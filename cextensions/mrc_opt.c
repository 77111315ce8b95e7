/* Belady's hits at every capacity, per layer, in one pass: the OPT stack of qnpipe/replay/mrc.py
 * (`belady_layers`, its reference), as a plain shared library loaded with ctypes (no Python API).
 *
 * req  [S, L, W] int64: each layer-step's distinct experts, left-aligned, -1 padding (a row of -1: no request)
 * prio [S, L, W] int64: each access's priority, the next use (smaller = kept), unique per expert of a layer
 * hits [L, E + 2] int64, zeroed: hits[l][p + 1] += 1 for an access found at stack position p (a hit at
 *      every capacity > p); the caller's cumulative sum gives the hits by capacity.
 * Returns 0, or -1 when memory runs out. */
#include <stdint.h>
#include <stdlib.h>

int qnpipe_belady_layers(const int64_t *req, const int64_t *prio, int64_t S, int64_t L, int64_t W, int64_t E,
                         int64_t *hits) {
    int64_t *stack = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    int64_t *key = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    int64_t *buf = malloc(sizeof(int64_t) * (size_t)(W > 0 ? W : 1));
    char *in_r = calloc((size_t)(E > 0 ? E : 1), 1);
    if (!stack || !pos || !key || !buf || !in_r) {
        free(stack); free(pos); free(key); free(buf); free(in_r);
        return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t depth = 0, *h = hits + l * (E + 2);
        for (int64_t e = 0; e < E; e++) { pos[e] = -1; key[e] = 0; }
        for (int64_t s = 0; s < S; s++) {
            const int64_t *r = req + (s * L + l) * W, *pr = prio + (s * L + l) * W;
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
    free(stack); free(pos); free(key); free(buf); free(in_r);
    return 0;
}
