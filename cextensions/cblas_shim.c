/* cblas_shim: exports the three CBLAS entry points MLX's CPU backend calls (cblas_sgemm,
 * cblas_dgemm, cblas_cgemm) and forwards them to another BLAS bound at run time.
 *
 * Why: the optimized BLAS a wheel provides (scipy-openblas32) prefixes its symbols
 * (scipy_cblas_sgemm), so it cannot stand in for MLX's bundled reference BLAS by itself.
 * qnpipe/compute/blas.py loads this library RTLD_GLOBAL before MLX is imported, so the
 * dynamic linker resolves libmlx's cblas_* here first, then binds the targets with
 * qnpipe_cblas_bind. The targets are plain pointers set at run time, not a link-time
 * dependency, so building needs no BLAS and the install never records a build-time path.
 * Integers are 32-bit (LP64 interface), as in libmlx's reference BLAS and scipy-openblas32. */

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

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
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
