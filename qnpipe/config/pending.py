"""Config fields whose feature does not exist yet, each with the feature's name (data only).

``qnpipe.config.loader`` warns once per process (``NotImplementedConfigWarning``) when one of these
is set away from its default, so a setting whose feature is missing says so instead of being
silently ignored. Whoever wires a field removes its entry here; tests/config/test_config_consumers.py
fails while a field has neither a consumer in the code nor an entry, or has both.
"""

from __future__ import annotations

from collections.abc import Mapping

# The feature names, shared so that one feature's warnings read the same.
SIDE_REGION_COPY = "a side region copied into the resident region (qnpipe's is always read in place)"
# MTP itself is implemented (docs/model.md, "MTP speculation"); the hidden state its drafter reads is `mtp.hidden`.
HIDDEN_VARIANT = "a choice of the hidden state the main model records and feeds onward (MTP's drafter reads mtp.hidden)"
PROBES = "the diagnostic probes (recorder's event log)"
LOADER_PATHS = "a model config.json outside the model directory (the loader reads <model_dir>/config.json)"

NOT_YET_IMPLEMENTED: Mapping[str, str] = {
    # -- later features
    "model.config_path": LOADER_PATHS,
    "model.hidden_variant": HIDDEN_VARIANT,
    "pool.side_region_zerocopy": SIDE_REGION_COPY,
    **{f"diag.{f}": PROBES for f in (
        "window_prof", "stream_prof", "prefetch_tprof", "miss_attrib")},
}
