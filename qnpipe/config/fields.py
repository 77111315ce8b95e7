"""The table of ``Config``'s leaf fields, read from the tree's types: path, type, default, doc, allowed values.

Everything that names a field (the environment and TOML readers, override keys, error messages,
docs/config.md's generated tables) looks it up here, so a field exists once: where ``qnpipe.config.tree``
declares it. Its bounds are in its type (``Meta(ge=...)``, ``tree._cap``), which msgspec enforces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import msgspec

from qnpipe.config.tree import Config

__all__ = ["COUNT_BOUNDS", "ENV_PREFIX", "FIELDS", "FLAT", "FieldSpec", "SECTIONS", "describe_allowed", "field_specs",
           "unwrap"]

ENV_PREFIX = "QNPIPE_"


class FieldSpec(NamedTuple):
    """One leaf field of ``Config``: dotted path, msgspec type info, default, description."""

    path: str
    type: msgspec.inspect.Type
    default: object
    doc: str
    allowed: str  # what the field accepts, in words (describe_allowed, or the field's own Meta(extra={"allowed"}))

    @property
    def env_name(self) -> str:
        """The ``QNPIPE_<SECTION>__<FIELD>`` environment name of this field."""
        section, field = self.path.split(".")
        return f"{ENV_PREFIX}{section.upper()}__{field.upper()}"


def unwrap(t: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, str]:
    """`t` without its msgspec Metadata wrappers, and the description they carry."""
    doc = ""
    while isinstance(t, msgspec.inspect.Metadata):
        doc = (t.extra_json_schema or {}).get("description", doc)
        t = t.type
    return t, doc


def _cap(t: msgspec.inspect.Type) -> int | None:
    """The count cap (``tree._cap``) of a field's type, or None."""
    cap = None
    while isinstance(t, msgspec.inspect.Metadata):
        cap = (t.extra or {}).get("cap", cap)
        t = t.type
    return cap


def describe_allowed(t: msgspec.inspect.Type) -> str:
    """A short English description of the values a field of type ``t`` accepts."""
    cap = _cap(t)
    t, _ = unwrap(t)
    if isinstance(t, msgspec.inspect.BoolType):
        return "true or false (1 or 0)"
    if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        noun = "an integer" if isinstance(t, msgspec.inspect.IntType) else "a number"
        bounds = [f"{op} {v}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le))
                  if v is not None and not (op == "<=" and v == cap)]
        text = f"{noun} {' and '.join(bounds)}".strip()
        return text if cap is None else f"{text}, at most {cap}"
    if isinstance(t, msgspec.inspect.EnumType):
        return "one of " + ", ".join(str(m.value) for m in t.cls)
    if isinstance(t, msgspec.inspect.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, msgspec.inspect.StrType):
        return "a string"
    if isinstance(t, msgspec.inspect.UnionType):
        parts = ["empty (none)" if isinstance(a, msgspec.inspect.NoneType) else describe_allowed(a) for a in t.types]
        return ", or ".join(parts)
    if isinstance(t, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        item, _ = unwrap(t.item_type)
        if isinstance(item, msgspec.inspect.IntType):
            return "a layer set such as 0-3,5,8 (empty = all layers)"
        return "a comma-separated list (empty = none)"
    return type(t).__name__


def _field_cap(t: msgspec.inspect.Type) -> int | None:
    """The cap of a field's type, also when it is an optional count (the cap is inside the union)."""
    inner, _ = unwrap(t)
    arms = inner.types if isinstance(inner, msgspec.inspect.UnionType) else (t,)
    return next((c for c in map(_cap, arms) if c is not None), None)


def _build_fields() -> tuple[dict[str, FieldSpec], dict[str, int]]:
    out: dict[str, FieldSpec] = {}
    caps: dict[str, int] = {}
    root = msgspec.inspect.type_info(Config)
    assert isinstance(root, msgspec.inspect.StructType)
    for sf in root.fields:
        section_t, _ = unwrap(sf.type)
        assert isinstance(section_t, msgspec.inspect.StructType)
        for f in section_t.fields:
            path = f"{sf.name}.{f.name}"
            t, doc = unwrap(f.type)
            default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            # A field whose type does not say it all (pool.evict_policy, a str) says it in its Meta.
            allowed = f.type.extra.get("allowed") if isinstance(f.type, msgspec.inspect.Metadata) and f.type.extra else None
            out[path] = FieldSpec(path, t, default, doc, str(allowed) if allowed else describe_allowed(f.type))
            cap = _field_cap(f.type)
            if cap is not None:
                caps[path] = cap
    return out, caps


FIELDS, _CAPS = _build_fields()
SECTIONS: frozenset[str] = frozenset(p.split(".")[0] for p in FIELDS)
# Field name -> dotted paths; a name with one path works as a flat override key.
FLAT: dict[str, list[str]] = {}
for _path in FIELDS:
    FLAT.setdefault(_path.split(".")[1], []).append(_path)
del _path
# The upper bound of each count that sizes something, as the tree's types declare it (tree._cap).
COUNT_BOUNDS: Mapping[str, int] = _CAPS


def field_specs() -> tuple[FieldSpec, ...]:
    """Every leaf field of ``Config`` in declaration order (used to generate docs/config.md)."""
    return tuple(FIELDS.values())
