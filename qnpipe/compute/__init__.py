"""Process-wide compute setup that must happen before MLX is imported: `blas` (compute.cpu_blas)."""
