"""A convert source given as a Hugging Face repository id (`Qwen/Qwen3-Next-80B-A3B-Instruct`).

`huggingface_hub.snapshot_download` fetches only the files convert reads (`CONVERT_FILES`) into
the hub cache, resuming a download cut short and skipping what is already there, with its own
progress bars; it honours the hub's settings (`HF_HUB_OFFLINE`, `HF_HUB_CACHE`, `HF_HOME`,
`HF_TOKEN`, `HF_ENDPOINT`, the proxy variables), which it reads itself. Offline, a repository in
the cache is used as it is; one that is not (or only partly) cached is an error naming it, before
any work.

Every connect and every read on the way waits at most `net.hub_timeout_s`: huggingface_hub asks
for the file list with no timeout at all, so a Hub endpoint or proxy that accepts and never
answers would stall the convert for good. An endpoint that times out, answers an HTTP error,
bytes that are not HTTP or a body that is not the Hub's JSON is an error naming the endpoint, the
bound and the remedies.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qnpipe.config.tree import HUB_TIMEOUT_S
from qnpipe.convert.hub_check import RemoteCheckpoint
from qnpipe.convert.plan import TOKENIZER_GLOBS
from qnpipe.errors import CheckpointError
from qnpipe.io.outdir import human_bytes

# What convert reads from a checkpoint: its config, tensors, and the tokenizer files it copies
# (plus what mlx-lm's loader reads of another family's checkpoint: NVIDIA ModelOpt's quantization).
CONVERT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_GLOBS, "hf_quant_config.json")
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


def fetch(src: str | os.PathLike[str], *, what: str = "SRC", progress: bool = True,
          timeout_s: float = HUB_TIMEOUT_S, log: Callable[[str], None] | None = None,
          check: Callable[[RemoteCheckpoint], None] | None = None) -> Path:
    """`src` itself when it is a local path; else the cached snapshot of the Hub repository it names.

    Every connect and read waits at most `timeout_s`; `log` is told what is asked of which endpoint
    before the first wait. Online, `check` is given the repository's config.json and file list
    (`qnpipe.convert.hub_check`) before anything else is downloaded, and may refuse it by raising."""
    named = hub_id(src)
    if named is None:
        return Path(src)
    repo, revision = named
    import huggingface_hub
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import disable_progress_bars

    if not progress:
        disable_progress_bars()
    endpoint = constants.ENDPOINT
    if log is not None and not constants.is_offline_mode():
        log(f"qnpipe convert: asking {endpoint} for {repo}'s files (timeout {timeout_s:g} s for each connect "
            "and read: net.hub_timeout_s)")
    unreachable = _Unreachable(f"{what} {src}", endpoint, timeout_s)
    try:
        with _bounded_requests(timeout_s):
            cached = None
            if check is not None and not constants.is_offline_mode():
                cached = _checked_first(repo, revision, f"{what} {src}", check, unreachable, log)
            folder = cached or huggingface_hub.snapshot_download(repo, revision=revision,
                                                                 allow_patterns=list(CONVERT_FILES))
    except errors.IncompleteSnapshotError as e:
        if constants.is_offline_mode() or e.__cause__ is None:
            raise CheckpointError(f"{what} {src}: the hub cache holds only part of it and the Hub cannot be "
                                  f"reached ({_first_line(e)})") from None
        raise unreachable.error(e.__cause__, f"the hub cache holds only part of it ({_first_line(e)}) and ") from None
    except errors.LocalEntryNotFoundError as e:
        if constants.is_offline_mode():
            raise CheckpointError(f"{what} {src}: not in the hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
                                  "is set: download it with network access first, or give a local checkpoint "
                                  "directory") from None
        raise unreachable.error(e.__cause__ or e, f"not in the hub cache ({constants.HF_HUB_CACHE}) and ") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{what} {src}: the Hub has no revision {revision!r} of {repo}") from None
    except errors.GatedRepoError:
        raise CheckpointError(f"{what} {src}: a gated repository: accept its terms on huggingface.co and log in "
                              "(`hf auth login` or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"{what} {src}: no such repository on the Hub (nor a local directory of that name; "
                              "a private one needs `hf auth login` or HF_TOKEN)") from None
    except (errors.HfHubHTTPError, *_transport_errors(), json.JSONDecodeError) as e:
        raise unreachable.error(e) from None
    return Path(folder)


def _checked_first(repo: str, revision: str | None, where: str, check: Callable[[RemoteCheckpoint], None],
                   unreachable: _Unreachable, log: Callable[[str], None] | None) -> str | None:
    """Refuse the repository by `check` before its download; None once it passes. A Hub that cannot be
    reached checks nothing: the cached snapshot when the cache holds all of it (returned), as
    snapshot_download would use it, else the error naming the endpoint."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    try:
        remote, commit = _before_download(repo, revision, where, log)
    except (errors.HfHubHTTPError, *_transport_errors(), json.JSONDecodeError) as e:
        if isinstance(e, (errors.RepositoryNotFoundError, errors.GatedRepoError, errors.RevisionNotFoundError)):
            raise
        try:
            return huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=list(CONVERT_FILES),
                                                     local_files_only=True)
        except errors.IncompleteSnapshotError as part:
            raise unreachable.error(e, f"the hub cache holds only part of it ({_first_line(part)}) and ") from None
        except errors.LocalEntryNotFoundError:
            raise unreachable.error(e, f"not in the hub cache ({constants.HF_HUB_CACHE}) and ") from None
    check(remote)  # the family and the disk: refused here, when only config.json has been fetched
    _check_index(repo, commit, remote)
    return None


def _before_download(repo: str, revision: str | None, where: str,
                     log: Callable[[str], None] | None) -> tuple[RemoteCheckpoint, str]:
    """The repository's file list and config.json (the one file fetched), and the commit they are of."""
    from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    commit = api.repo_info(repo, revision=revision).sha or revision or "main"
    listing = {f.path: f.size for f in api.list_repo_tree(repo, recursive=True, revision=commit)
               if isinstance(f, RepoFile)}
    files = {name: listing[name] for name in filter_repo_objects(listing, allow_patterns=list(CONVERT_FILES))}
    if "config.json" not in files:
        raise CheckpointError(f"{where}: the repository has no config.json: not a model checkpoint")
    if log is not None:
        log(f"qnpipe convert: {repo} has {len(files)} files for convert ({human_bytes(sum(files.values()))}); reading its "
            "config.json first")
    config = _json_file(hf_hub_download(repo, "config.json", revision=commit), where, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: its config.json is not a JSON object")
    cached = frozenset(n for n in files if isinstance(try_to_load_from_cache(repo, n, revision=commit), str))
    return RemoteCheckpoint(where=where, config=config, files=files, cached=cached,
                            cache_dir=Path(constants.HF_HUB_CACHE)), commit


def _check_index(repo: str, commit: str, remote: RemoteCheckpoint) -> None:
    """A weight index that names shards the repository lacks is refused before the shards are fetched."""
    from huggingface_hub import hf_hub_download

    for name in (n for n in remote.files if n.endswith(".safetensors.index.json")):
        index = _json_file(hf_hub_download(repo, name, revision=commit), remote.where, name)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{remote.where}: its {name} has no weight_map")
        missing = sorted({str(f) for f in weight_map.values() if f not in remote.files})
        if missing:
            raise CheckpointError(f"{remote.where}: its {name} names files the repository does not have: "
                                  f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")


def _json_file(path: str, where: str, name: str) -> Any:
    try:
        return json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: its {name} is not JSON ({e})") from None


def _transport_errors() -> tuple[type[Exception], ...]:
    import httpx2  # huggingface_hub's HTTP client

    return (httpx2.HTTPError,)


@contextlib.contextmanager
def _bounded_requests(timeout_s: float) -> Iterator[None]:
    """Every request huggingface_hub sends meanwhile waits at most `timeout_s` to connect and for each read.

    Its calls cannot be given one timeout: `snapshot_download` asks for the file list with none (an
    endpoint that accepts and never answers holds it for good) and reads its download timeout from
    the environment. A request hook on its shared HTTP client bounds them all, proxies included (the
    hook runs before a transport is chosen). The client is its default one (`default_client_factory`,
    not exported, hence `_http`) with the hook added, put in place by its public `set_client_factory`
    and replaced by the plain default afterwards (qnpipe sets no other factory).
    """
    from huggingface_hub.utils import _http, set_client_factory

    def bound_request(request: Any) -> None:
        # huggingface_hub's own shorter timeouts stay (3 s for its agent registry); None becomes the bound.
        asked = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            k: timeout_s if asked.get(k) is None else min(asked[k], timeout_s)
            for k in ("connect", "read", "write", "pool")}

    def make_client() -> Any:
        client = _http.default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks.get("request", []), bound_request]}
        return client

    set_client_factory(make_client)
    try:
        yield
    finally:
        set_client_factory(_http.default_client_factory)


class _Unreachable:
    """The error for a Hub endpoint that did not give what was asked: what it did, and what to do."""

    def __init__(self, subject: str, endpoint: str, timeout_s: float) -> None:
        self.subject, self.endpoint, self.timeout_s = subject, endpoint, timeout_s

    def why(self, cause: BaseException) -> str:
        import httpx2
        from huggingface_hub import errors

        if isinstance(cause, httpx2.TimeoutException):
            return (f"no answer from {self.endpoint} within {self.timeout_s:g} s (net.hub_timeout_s; "
                    f"{type(cause).__name__})")
        if isinstance(cause, httpx2.ProxyError):
            return f"the proxy to {self.endpoint} refused ({_first_line(cause)})"
        if isinstance(cause, httpx2.ConnectError):
            return f"cannot connect to {self.endpoint} ({_first_line(cause)})"
        if isinstance(cause, (httpx2.RemoteProtocolError, httpx2.DecodingError)):
            return f"{self.endpoint} answered bytes that are not HTTP ({_first_line(cause)}): check HF_ENDPOINT"
        if isinstance(cause, errors.HfHubHTTPError) and cause.response is not None:
            return f"{self.endpoint} answered HTTP {cause.response.status_code} ({_first_line(cause)})"
        if isinstance(cause, json.JSONDecodeError):
            return (f"{self.endpoint} answered something that is not the Hub's JSON ({_first_line(cause)}): "
                    "check HF_ENDPOINT")
        return f"{self.endpoint} could not be used ({type(cause).__name__}: {_first_line(cause)})"

    def error(self, cause: BaseException, context: str = "") -> CheckpointError:
        return CheckpointError(f"{self.subject}: {context}{self.why(cause)}; check the network and the proxy "
                               "(HTTPS_PROXY, HTTP_PROXY, ALL_PROXY), set HF_HUB_OFFLINE=1 to use the hub cache "
                               "alone, or give a local checkpoint directory")


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
