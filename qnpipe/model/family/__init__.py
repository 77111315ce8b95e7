"""Every MoE family of mlx-lm through the pool: mlx-lm's own model class, its switches pooled.

`switches` finds the `SwitchGLU`/`SwitchMLP` instances of an mlx-lm model by type and names
their expert tensors; `tiny` builds tiny random models of each family (tests, `make-tiny`).
Design: docs/architecture.md (the family seam) and docs/model.md (supported families).
"""
