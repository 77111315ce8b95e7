"""What `Engine` and `open_engine` are given, made usable: settings to a Config, generation arguments checked.

Settings come as keywords (`expert_slots=32`, `memory__mlx_cache_limit_gb=2`: a double underscore
stands for the dot a keyword cannot hold), as sections (`memory={"mlx_cache_limit_gb": 2}`) or as
one mapping of any names (`settings={"memory.mlx_cache_limit_gb": 2}`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from qnpipe.builtin_models import resolve_model_dir
from qnpipe.config import Config
from qnpipe.config.validate import check_generate_args
from qnpipe.errors import ConfigError

Prompt = str | Sequence[int]

_DOTTED = re.compile(r"\b([a-z_]+)\.([a-z_0-9]+)\b")


def settings_of(settings: Mapping[str, Any] | None, keywords: dict[str, Any]) -> dict[str, Any]:
    """One override mapping of `settings` and the keyword settings (`section__field` read as `section.field`)."""
    out = dict(settings or {})
    for key, value in keywords.items():
        out[key.replace("__", ".") if "__" in key else key] = value
    return out


def _keyword_error(e: ConfigError) -> ConfigError:
    """A config error about a keyword setting, its suggested names spelled as keywords can be."""
    msg = str(e)
    for lead in ("did you mean ", "use one of "):
        head, sep, tail = msg.partition(lead)
        if sep:
            msg = head + sep + _DOTTED.sub(r"\1__\2", tail)
    return ConfigError(f"{msg}; as a keyword, a dotted name is written section__field "
                       "(or pass settings={'section.field': value})")


def resolve(model_dir: str | Path | None, cfg: Config | None, overrides: dict[str, Any]) -> Config:
    """The engine's Config: `cfg` (or defaults < TOML < environment) + `overrides` + `model_dir`."""
    from qnpipe import config as config_mod

    if model_dir is not None:
        overrides = {**overrides, "model.model_dir": resolve_model_dir(str(model_dir))}
    try:
        if cfg is None:
            return config_mod.load(overrides=overrides)
        return config_mod.with_overrides(cfg, overrides) if overrides else cfg
    except ConfigError as e:
        if "override" in str(e):
            raise _keyword_error(e) from None
        raise


def planned(cfg: Config, distributed: bool | None) -> tuple[Config, Any]:
    """`cfg` with its `plan.memory` plan applied, and the plan (qnpipe.plan.startup; imported only when asked)."""
    if not cfg.plan.memory:
        return cfg, None
    from qnpipe.plan.startup import plan_at_startup

    return plan_at_startup(cfg, distributed=distributed)


def gen_kwargs(prompt: Prompt, max_tokens: int, temperature: float, top_p: float, seed: int | None,
               stop_at_eos: bool, top_k: int = 0, min_p: float = 0.0) -> dict[str, Any]:
    """The checked generation arguments (ValueError naming the first bad one: qnpipe.config.validate)."""
    check_generate_args(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                        top_k=top_k, min_p=min_p)
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
            "stop_at_eos": stop_at_eos, "top_k": top_k, "min_p": min_p}


TRIO_ONLY = ("open_engine is trio only (it runs under trio.run); from asyncio or plain code use the "
             "synchronous qnpipe.Engine, e.g. `await asyncio.to_thread(eng.generate, prompt)`")


def check_trio() -> None:
    """RuntimeError saying what to use instead when `open_engine` is entered outside trio (asyncio, say)."""
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        raise RuntimeError(TRIO_ONLY) from None
