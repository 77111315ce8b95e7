"""`qnpipe convert OWNER/NAME` reads config.json and the file list first: a family qnpipe does not run, or a
checkpoint too large for the free disk, is refused having fetched config.json alone (issue 39 item 1).

The Hub is this test's own HTTP server on 127.0.0.1 (HF_ENDPOINT), answering the calls the real
`huggingface_hub` makes (repository info, the file tree, HEAD and GET of a file) from a directory,
and counting every file whose bytes it sends; nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.cli_harness import run_cli

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
REPO = "qnpipe-test/fake-hub-model"
HANG_GUARD_S = 180.0


class FakeHub:
    """A Hub endpoint serving REPO from `files` (name -> bytes); `claimed` overrides the sizes the file list
    gives (a checkpoint bigger than any disk without writing one). `fetched` lists each file body sent."""

    def __init__(self, files: dict[str, bytes], claimed: dict[str, int] | None = None, *, down: bool = False) -> None:
        self.files, self.claimed, self.down = files, claimed or {}, down  # down: HTTP 500 to everything
        self.fetched: list[str] = []
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def size(self, name: str) -> int:
        return self.claimed.get(name, len(self.files[name]))

    def answer(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append(f"{h.command} {path}")
        info = f"/api/models/{REPO}/revision/"
        tree = f"/api/models/{REPO}/tree/"
        resolve = f"/{REPO}/resolve/"
        if self.down:
            h.send_response(500)
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif path == f"/api/models/{REPO}" or path.startswith(info):
            self.send_json(h, {"id": REPO, "modelId": REPO, "sha": COMMIT, "private": False,
                               "siblings": [{"rfilename": n} for n in self.files]}, body)
        elif path.startswith(tree):
            self.send_json(h, [{"type": "file", "path": n, "size": self.size(n), "oid": hashlib.sha1(d).hexdigest(),
                                **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": self.size(n),
                                            "pointerSize": 134}} if n.endswith(".safetensors") else {})}
                               for n, d in self.files.items()], body)
        elif path.startswith(resolve) and path[len(resolve):].split("/", 1)[-1] in self.files:
            name = path[len(resolve):].split("/", 1)[1]
            data = self.files[name]
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.end_headers()
            if body:
                self.fetched.append(name)
                h.wfile.write(data)
        else:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.send_header("X-Error-Code", "EntryNotFound")
            h.end_headers()

    @staticmethod
    def send_json(h: BaseHTTPRequestHandler, obj: object, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    made: list[FakeHub] = []

    def start(files: dict[str, bytes], claimed: dict[str, int] | None = None, *, down: bool = False) -> FakeHub:
        made.append(FakeHub(files, claimed, down=down))
        return made[-1]

    yield start
    for hub in made:
        hub.stop()


def _files(src: Path, **config_changes: object) -> dict[str, bytes]:
    files = {f.name: f.read_bytes() for f in sorted(src.iterdir()) if f.is_file()}
    if config_changes:
        files["config.json"] = json.dumps({**json.loads(files["config.json"]), **config_changes}).encode()
    files["README.md"] = b"# a file convert never reads\n"
    return files


def _env(tmp: Path, hub: FakeHub) -> tuple[tuple[str, str], ...]:
    return (("HF_ENDPOINT", hub.url), ("HF_HUB_CACHE", str(tmp / "hub")), ("HF_HOME", str(tmp / "hf-home")),
            ("HF_HUB_OFFLINE", "0"), ("NO_PROXY", "*"), ("no_proxy", "*"), ("HF_HUB_DISABLE_XET", "1"),
            ("HF_HUB_DISABLE_TELEMETRY", "1"))


def _convert(tmp: Path, hub: FakeHub, *extra: str) -> tuple[int, str]:
    r = run_cli(["convert", REPO, "--out", tmp / "qn", *extra], env=_env(tmp, hub), timeout=HANG_GUARD_S)
    err = r.stderr.decode()
    assert "Traceback" not in err, err[-3000:]
    return r.returncode, err


@pytest.mark.parametrize(("case", "changes", "needles"), [
    ("dense", {"model_type": "llama"}, ("model_type 'llama' is not a mixture-of-experts family", "qwen3_moe")),
    ("unsupported", {"model_type": "dbrx"}, ("a dbrx model, which qnpipe does not run", "SwitchGLU")),
    ("own code", {"model_file": "modeling_x.py"}, ("asks to import model code",)),
    ("cannot build", {"model_type": "qwen3_moe", "num_experts": "many"}, ("mlx-lm cannot build a qwen3_moe model",)),
    ("no experts", {"model_type": "qwen3_moe", "num_experts": 0}, ("has no routed experts",)),
])
def test_a_family_qnpipe_does_not_run_is_refused_after_config_json_alone(
        tmp_path: Path, tiny_hf: Path, serve: object, case: str, changes: dict[str, object],
        needles: tuple[str, ...]) -> None:
    hub = serve(_files(tiny_hf, **changes))  # type: ignore[operator]
    rc, err = _convert(tmp_path, hub)
    assert rc == 2 and f"SRC {REPO}" in err and all(n in err for n in needles), (err, hub.requests)
    assert hub.fetched == ["config.json"], hub.requests
    assert not (tmp_path / "qn").exists()


def test_a_repository_without_safetensors_weights_is_refused_after_config_json_alone(
        tmp_path: Path, tiny_hf: Path, serve: object) -> None:
    files = _files(tiny_hf)
    files["pytorch_model.bin"] = files.pop("model.safetensors")
    hub = serve(files)  # type: ignore[operator]
    rc, err = _convert(tmp_path, hub)
    assert rc == 2 and "no *.safetensors weights" in err, (err, hub.requests)
    assert hub.fetched == ["config.json"], hub.requests


def test_a_checkpoint_larger_than_the_free_disk_is_refused_after_config_json_alone(
        tmp_path: Path, tiny_hf: Path, serve: object) -> None:
    files = _files(tiny_hf)
    hub = serve(files, claimed={"model.safetensors": 1 << 60})  # type: ignore[operator]
    rc, err = _convert(tmp_path, hub)
    assert rc == 2 and "not enough free disk space" in err and "Nothing but its config.json was downloaded" in err, err
    assert "1048576.00 TiB" in err and "--bits 4" in err, err
    assert hub.fetched == ["config.json"], hub.requests
    assert not (tmp_path / "qn").exists()


def test_the_mlx_lm_conversion_step_is_counted_for_another_family_hf_checkpoint(tmp_path: Path) -> None:
    from qnpipe.convert.hub_check import RemoteCheckpoint, disk_needs

    def needs(config: dict[str, object], **kw: object) -> tuple[int, int, int]:
        r = RemoteCheckpoint(where="SRC x/y", config=config, files={"config.json": 100, "model.safetensors": 16 << 30},
                             cached=frozenset({"config.json"}), cache_dir=tmp_path)
        n = disk_needs(r, **kw)  # type: ignore[arg-type]
        return n.download, n.output, n.mlx_lm

    gib = 1 << 30
    assert needs({"model_type": "qwen3_moe", "torch_dtype": "bfloat16"}) == (16 * gib, 16 * gib, 16 * gib)
    assert needs({"model_type": "qwen3_moe", "torch_dtype": "bfloat16"}, bits=4) == (16 * gib, 4.5 * gib, 4.5 * gib)
    assert needs({"model_type": "qwen3_next", "torch_dtype": "bfloat16"}, bits=4) == (16 * gib, 4.5 * gib, 0)
    # an mlx-lm directory (quantized by mlx-lm): re-laid out at its size, no mlx-lm step
    assert needs({"model_type": "qwen3_moe", "quantization": {"bits": 4, "group_size": 64}}) == (16 * gib, 16 * gib, 0)


@pytest.mark.slow
def test_a_checkpoint_that_passes_is_downloaded_and_converted(tmp_path: Path, tiny_hf: Path, serve: object) -> None:
    hub = serve(_files(tiny_hf))  # type: ignore[operator]
    rc, err = _convert(tmp_path, hub, "-q")
    assert rc == 0, err[-3000:]
    assert hub.fetched[0] == "config.json" and "README.md" not in hub.fetched, hub.fetched
    assert {"model.safetensors", "config.json"} <= set(hub.fetched)
    assert (tmp_path / "qn" / "experts" / "index.json").is_file()
    # the same bytes as a convert of the directory itself
    ref = tmp_path / "ref"
    assert run_cli(["convert", tiny_hf, "--out", ref, "-q"], timeout=HANG_GUARD_S).returncode == 0
    for f in sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file()):
        assert (tmp_path / "qn" / f).read_bytes() == (ref / f).read_bytes(), f
    shutil.rmtree(tmp_path / "hub")


def test_convert_prints_no_blas_warning(tmp_path: Path, tiny_hf: Path) -> None:
    r = run_cli(["convert", tiny_hf, "--out", tmp_path / "qn", "-q"], timeout=HANG_GUARD_S,
                env=(("PYTHONWARNINGS", "error::UserWarning"),))
    err = r.stderr.decode()
    assert r.returncode == 0 and "BlasWarning" not in err and "BLAS" not in err, err[-2000:]


@pytest.mark.slow
def test_a_hub_that_is_down_still_lets_a_fully_cached_repository_convert(tmp_path: Path, tiny_hf: Path,
                                                                          serve: object) -> None:
    from tests.convert.test_hub import REPO as CACHED
    from tests.convert.test_hub import _hub_cache

    hub = serve({}, down=True)  # type: ignore[operator]
    env = (*_env(tmp_path, hub), ("HF_HUB_CACHE", str(_hub_cache(tmp_path / "cache", tiny_hf))))
    r = run_cli(["convert", CACHED, "--out", tmp_path / "qn", "-q"], env=env, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert hub.fetched == [] and hub.requests, hub.requests  # asked, answered 500, the cache used
    assert (tmp_path / "qn" / "experts" / "index.json").is_file()
