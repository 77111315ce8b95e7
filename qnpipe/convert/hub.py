"""A convert source given as a Hugging Face repository id (`Qwen/Qwen3-Next-80B-A3B-Instruct`).

`huggingface_hub.snapshot_download` fetches only the files convert reads (`CONVERT_FILES`) into
the hub cache, resuming a download cut short and skipping what is already there, with its own
progress bars; it honours the hub's settings (`HF_HUB_OFFLINE`, `HF_HUB_CACHE`, `HF_HOME`,
`HF_TOKEN`), which it reads itself. Offline, a repository in the cache is used as it is; one that
is not (or only partly) cached is an error naming it, before any work.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from qnpipe.convert.plan import TOKENIZER_GLOBS
from qnpipe.errors import CheckpointError

# What convert reads from a checkpoint: its config, tensors, and the tokenizer files it copies.
CONVERT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_GLOBS)
# owner/name[@revision], as the Hub spells them (huggingface_hub.utils.validate_repo_id's rules).
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w][\w.-]{0,95})(?:@(?P<rev>[\w./-]{1,255}))?$")


def hub_id(src: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """(repository id, revision or None) when `src` names a Hub repository rather than a local path."""
    s = os.fspath(src)
    if Path(s).exists() or s.startswith((".", "/", "~")):
        return None
    m = _REPO_ID.match(s)
    if m is None or ".." in m["repo"] or m["repo"].endswith((".", "-")):
        return None
    return m["repo"], m["rev"]


def fetch(src: str | os.PathLike[str], *, what: str = "SRC", progress: bool = True) -> Path:
    """`src` itself when it is a local path; else the cached snapshot of the Hub repository it names."""
    named = hub_id(src)
    if named is None:
        return Path(src)
    repo, revision = named
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import disable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        folder = huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=list(CONVERT_FILES))
    except errors.IncompleteSnapshotError as e:
        raise CheckpointError(f"{what} {src}: the hub cache holds only part of it and the Hub cannot be reached "
                              f"({_first_line(e)})") from None
    except errors.LocalEntryNotFoundError:
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        raise CheckpointError(f"{what} {src}: not in the hub cache ({huggingface_hub.constants.HF_HUB_CACHE}) and "
                              + ("HF_HUB_OFFLINE is set: download it with network access first, or give a "
                                 "local checkpoint directory" if offline else
                                 "the Hub could not be reached: check the network, or give a local checkpoint "
                                 "directory")) from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{what} {src}: the Hub has no revision {revision!r} of {repo}") from None
    except errors.GatedRepoError:
        raise CheckpointError(f"{what} {src}: a gated repository: accept its terms on huggingface.co and log in "
                              "(`hf auth login` or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"{what} {src}: no such repository on the Hub (nor a local directory of that name; "
                              "a private one needs `hf auth login` or HF_TOKEN)") from None
    except errors.HfHubHTTPError as e:
        raise CheckpointError(f"{what} {src}: the Hub answered {_first_line(e)}") from None
    return Path(folder)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
