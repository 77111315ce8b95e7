/* cblas_shim: exports the three CBLAS entry points MLX's CPU backend calls (cblas_sgemm,
 * cblas_dgemm, cblas_cgemm) and forwards them to another BLAS bound at run time.
 *
 * Why: the optimized BLAS a wheel provides (scipy-openblas32) prefixes its symbols
 * (scipy_cblas_sgemm), so it cannot stand in for MLX's bundled reference BLAS by itself.
 * qnpipe/compute/blas.py loads this library RTLD_GLOBAL before MLX is imported, so the
 * dynamic linker resolves libmlx's cblas_* here first, then binds the targets with
 * qnpipe_cblas_bind. The targets are plain pointers set at run time, not a link-time
 * dependency, so building needs no BLAS and the install never records a build-time path.
 * Integers are 32-bit (LP64 interface), as in libmlx's reference BLAS and scipy-openblas32.
 *
 * Batch-invariant mode (qnpipe_cblas_set_exact(1)): an optimized sgemm's result for one row
 * of C depends on how many rows and columns the call has (OpenBLAS picks other kernels and
 * blockings for other shapes, and they sum in other orders), so a token computed alone
 * (decode) and among others (an MTP verify, a prefill chunk, a resumed tail) differs in the
 * last bits. In this mode sgemm runs fixed_sgemm below instead: every element of C is summed
 * in one order that depends on K alone (eight interleaved partial sums over k, combined in a
 * fixed tree, or one sequential sum when B is not transposed), never on M, N, the element's
 * place or the other rows; zeros appended to k (masked attention) leave it unchanged. So a
 * row's bits are the same in every call it appears in, as with the reference BLAS. */

#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, LANES = 8 };

typedef float v8 __attribute__((vector_size(LANES * sizeof(float))));
typedef float v8u __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));  /* unaligned load */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int, const double *, int, double,
                         double *, int);
typedef void (*cgemm_fn)(int, int, int, int, int, int, const void *, const void *, int, const void *, int,
                         const void *, void *, int);

static sgemm_fn target_sgemm;
static dgemm_fn target_dgemm;
static cgemm_fn target_cgemm;

/* Returns 0 when all three targets are set; qnpipe never lets MLX run before this succeeds. */
int qnpipe_cblas_bind(void *sgemm, void *dgemm, void *cgemm) {
    if (!sgemm || !dgemm || !cgemm) return -1;
    target_sgemm = (sgemm_fn)sgemm;
    target_dgemm = (dgemm_fn)dgemm;
    target_cgemm = (cgemm_fn)cgemm;
    return 0;
}

static int exact;  /* 0: pass every call through to the bound BLAS */

void qnpipe_cblas_set_exact(int on) { exact = on != 0; }

int qnpipe_cblas_exact(void) { return exact; }

static inline __attribute__((always_inline)) v8 load8(const float *p, int count) {  /* count < LANES: the rest is zero */
    if (count == LANES) return *(const v8u *)p;
    v8 v = {0};
    for (int i = 0; i < count; i++) v[i] = p[i];
    return v;
}

static inline __attribute__((always_inline)) float sum8(v8 v) {  /* the one combining order of the eight partial sums */
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

static inline __attribute__((always_inline)) void store(float *c, float acc, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * acc : alpha * acc + beta * *c;
}

/* One clone per instruction set, chosen once per process by the loader: the order of every sum is
 * the same in each, and within a process only one runs. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif

/* C[i][j] = sum_k A[i][k] * B[j][k] (B transposed: x @ W.T of a linear layer, q @ k.T). Blocks of
 * BR rows x BC columns share their loads; a block at the edge repeats its last row or column and
 * drops the copies, so every element runs the very same instructions wherever it sits. */
enum { BR = 2, BC = 4 };  /* the loop below is written out for these */

KERNEL static void dot_rows(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                            float beta, float *c, int ldc) {
    int kv = k - k % LANES;
    if (m == 1) {  /* one row (decode): the same sums as a row of a block, without a copy of the row */
        for (int j0 = 0; j0 < n; j0 += BC) {
            const float *bp[BC];
            for (int q = 0; q < BC; q++) bp[q] = b + (size_t)(j0 + q < n ? j0 + q : n - 1) * ldb;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int p = 0; p < kv; p += LANES) {
                v8 x0 = *(const v8u *)(a + p);
                a0 += x0 * *(const v8u *)(bp[0] + p); a1 += x0 * *(const v8u *)(bp[1] + p);
                a2 += x0 * *(const v8u *)(bp[2] + p); a3 += x0 * *(const v8u *)(bp[3] + p);
            }
            v8 acc[BC] = {a0, a1, a2, a3};
            if (kv < k)
                for (int q = 0; q < BC; q++) acc[q] += load8(a + kv, k - kv) * load8(bp[q] + kv, k - kv);
            for (int q = 0; q < BC && j0 + q < n; q++) store(c + j0 + q, sum8(acc[q]), alpha, beta);
        }
        return;
    }
    for (int j0 = 0; j0 < n; j0 += BC) {
        const float *bp[BC];
        for (int q = 0; q < BC; q++) bp[q] = b + (size_t)(j0 + q < n ? j0 + q : n - 1) * ldb;
        for (int i0 = 0; i0 < m; i0 += BR) {
            const float *ap[BR];
            for (int r = 0; r < BR; r++) ap[r] = a + (size_t)(i0 + r < m ? i0 + r : m - 1) * lda;
            v8 acc[BR][BC] = {{{0}}};
            /* Written out so the eight sums stay in registers. */
            v8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
            for (int p = 0; p < kv; p += LANES) {
                v8 x0 = *(const v8u *)(ap[0] + p), x1 = *(const v8u *)(ap[1] + p);
                v8 w0 = *(const v8u *)(bp[0] + p), w1 = *(const v8u *)(bp[1] + p);
                v8 w2 = *(const v8u *)(bp[2] + p), w3 = *(const v8u *)(bp[3] + p);
                a00 += x0 * w0; a01 += x0 * w1; a02 += x0 * w2; a03 += x0 * w3;
                a10 += x1 * w0; a11 += x1 * w1; a12 += x1 * w2; a13 += x1 * w3;
            }
            acc[0][0] = a00; acc[0][1] = a01; acc[0][2] = a02; acc[0][3] = a03;
            acc[1][0] = a10; acc[1][1] = a11; acc[1][2] = a12; acc[1][3] = a13;
            if (kv < k)
                for (int r = 0; r < BR; r++)
                    for (int q = 0; q < BC; q++) acc[r][q] += load8(ap[r] + kv, k - kv) * load8(bp[q] + kv, k - kv);
            for (int r = 0; r < BR && i0 + r < m; r++)
                for (int q = 0; q < BC && j0 + q < n; q++)
                    store(c + (size_t)(i0 + r) * ldc + j0 + q, sum8(acc[r][q]), alpha, beta);
        }
    }
}

/* C[i][j] = sum_k A[i][k] * B[k][j] (B not transposed: attention weights @ V), summed in k order. */
KERNEL static void axpy_rows(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta,
                      float *c, int ldc) {
    for (int i = 0; i < m; i++) {
        const float *ai = a + (size_t)i * lda;
        float *ci = c + (size_t)i * ldc;
        for (int j = 0; j < n; j += LANES) {
            int cols = n - j < LANES ? n - j : LANES;
            v8 acc = {0};
            for (int p = 0; p < k; p++) {
                v8 bv = load8(b + (size_t)p * ldb + j, cols);
                acc += ai[p] * bv;
            }
            for (int q = 0; q < cols; q++) store(ci + j + q, acc[q], alpha, beta);
        }
    }
}

/* Scratch of the calling thread for a transposed A (MLX's CPU stream threads call sgemm). */
static __thread float *scratch;
static __thread size_t scratch_len;

static int fixed_sgemm(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                       int ldb, float beta, float *c, int ldc) {
    if (ta != NO_TRANS) {  /* op(A) = A^T, A stored k x m: copy it row-major */
        size_t need = (size_t)m * k;
        if (need > scratch_len) {
            float *p = realloc(scratch, need * sizeof(float));
            if (!p) return -1;
            scratch = p;
            scratch_len = need;
        }
        for (int p = 0; p < k; p++)
            for (int i = 0; i < m; i++) scratch[(size_t)i * k + p] = a[(size_t)p * lda + i];
        a = scratch;
        lda = k;
    }
    if (tb == NO_TRANS)
        axpy_rows(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else
        dot_rows(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return 0;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    /* Column-major never comes from MLX; an allocation failure falls back rather than fail the matmul. */
    if (exact && order == ROW_MAJOR && m > 0 && n > 0 && k > 0
        && fixed_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == 0)
        return;
    target_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda,
                 const double *b, int ldb, double beta, double *c, int ldc) {
    target_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda,
                 const void *b, int ldb, const void *beta, void *c, int ldc) {
    target_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
