"""Every Config field has a consumer in the code, or says that its feature is not there yet.

A consumer is an attribute access ``<x>.<section>.<field>`` (``cfg.pool.expert_slots``) or
``<section>_cfg.<field>`` in a module of qnpipe/ other than the config modules, which only
declare and load fields. A field without one must be in ``qnpipe.config.pending.NOT_YET_IMPLEMENTED``
(it then warns when set); a field with one must not be there any more.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

from qnpipe import config

PACKAGE = Path(__file__).resolve().parents[2] / "qnpipe"
CONFIG_MODULES = {"config/loader.py", "config/fields.py", "config/sources.py", "config/tree.py", "config/aliases.py",
                  "config/pending.py"}


def consumers(sources: Mapping[str, str], sections: Iterable[str]) -> dict[str, list[str]]:
    """Dotted field path -> "file:line" of each access, from Python sources by file name."""
    sections = set(sections)
    found: dict[str, list[str]] = {}
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=name)):
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            if isinstance(inner, ast.Attribute) and inner.attr in sections:
                section = inner.attr
            elif isinstance(inner, ast.Name) and inner.id.removesuffix("_cfg") in sections:
                section = inner.id.removesuffix("_cfg")
            else:
                continue
            found.setdefault(f"{section}.{node.attr}", []).append(f"{name}:{node.lineno}")
    return found


def problems(fields: Iterable[str], used: Mapping[str, list[str]], pending: Mapping[str, str]) -> list[str]:
    """What is wrong: a field with neither a consumer nor a pending entry, or with both."""
    out = []
    for path in fields:
        if path in used and path in pending:
            out.append(f"{path} is read at {', '.join(used[path])}: remove it from NOT_YET_IMPLEMENTED")
        elif path not in used and path not in pending:
            out.append(f"{path} has no consumer: wire it, or add it to qnpipe.config.pending.NOT_YET_IMPLEMENTED")
    out += [f"{path} in NOT_YET_IMPLEMENTED is not a Config field" for path in pending if path not in set(fields)]
    return out


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text(encoding="utf-8")
            for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).as_posix() not in CONFIG_MODULES}


def _fields() -> list[str]:
    return [s.path for s in config.field_specs()]


def test_every_field_has_a_consumer_or_warns_that_it_does_nothing_yet() -> None:
    sections = {p.split(".")[0] for p in _fields()}
    used = consumers(_package_sources(), sections)
    found = problems(_fields(), used, config.NOT_YET_IMPLEMENTED)
    assert not found, "\n".join(found)
    # The check saw real consumers, not an empty tree.
    assert {"model.model_dir", "forward.prefill_chunk_tokens", "mtp.bits"} <= set(used)


def test_the_check_fails_on_a_field_nobody_reads() -> None:
    sources = {"a.py": "def f(cfg):\n    return cfg.pool.expert_slots, pool_cfg.side_region_slots\n"}
    used = consumers(sources, {"pool", "read"})
    assert used == {"pool.expert_slots": ["a.py:2"], "pool.side_region_slots": ["a.py:2"]}
    fields = ["pool.expert_slots", "pool.side_region_slots", "read.workers", "read.nocache"]
    assert problems(fields, used, {"read.nocache": "the reader", "pool.gone": "x"}) == [
        "read.workers has no consumer: wire it, or add it to qnpipe.config.pending.NOT_YET_IMPLEMENTED",
        "pool.gone in NOT_YET_IMPLEMENTED is not a Config field",
    ]
    # Wired but still listed as pending: the warning would lie.
    assert problems(["pool.expert_slots"], used, {"pool.expert_slots": "the pool"}) == [
        "pool.expert_slots is read at a.py:2: remove it from NOT_YET_IMPLEMENTED"]

