"""What the importers share: reading a source line by line, the models they know, writing the log.

An importer turns a source into `Imported`: `Request`s (each a list of steps, each step the
routes of the layers recorded, in layer order); `write_log` writes them as a routing log
(docs/trace-format.md: `contents = "routes"`, a `trace.request` record before each request's
first `trace.route`). Imported logs have no times: every `t` is 0 and `seq` counts records.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

import msgspec

from qnpipe.errors import TraceImportError
from qnpipe.io.files import check_regular
from qnpipe.trace.format import (
    MAX_EXPERTS,
    MAX_LAYERS,
    SCHEMA_VERSION,
    Header,
    ModelShape,
    RequestStart,
    Route,
    TraceWriter,
)

T = TypeVar("T")
Progress = Callable[[int], None]  # called with the bytes of the source consumed since the last call

# What one import may read, decompressed (`import_log(max_bytes=)`, `--max-bytes`): the requests are
# held in memory, a few times the source's bytes, so this bounds the import's memory. The real
# sources are tens of MB; a larger one is allowed by raising it.
MAX_BYTES = 1 << 30
# The longest JSON line read: a routing record is ~200 bytes; a longer line is not one.
LINE_CAP = 1 << 20
# How far a compressed source may expand as it streams: bytes out <= MAX_RATIO x compressed bytes read
# + RATIO_SLACK. Routing tables gzip 3-10x; gzip of one repeated row or of zeros reaches 1000x, and a
# 4 MB such file would otherwise be parsed up to the 1 GiB import limit (minutes, gigabytes).
MAX_RATIO = 100
RATIO_SLACK = 1 << 20


class Budget:
    """The bytes an import may still read (decompressed), shared by its files; taken before they are read."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def take(self, n: int, where: str) -> None:
        """Take `n` bytes for `where` (the file, line or member), or TraceImportError naming it and the limit."""
        if n > self.left:
            raise TraceImportError(f"{where}: {n} more bytes would pass the import's limit of {self.limit} bytes "
                                   f"(decompressed, all files together; raise it with --max-bytes)")
        self.left -= n


def open_regular(path: Path, cap: int | None) -> IO[bytes]:
    """`path` opened for reading: a regular file of at most `cap` bytes, never a FIFO, device or directory.

    O_NONBLOCK: a FIFO swapped in after the check cannot block the open; fstat re-checks what was opened.
    """
    check_regular(path, cap=cap, error=TraceImportError)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TraceImportError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TraceImportError(f"{path}: not a regular file (replaced while opening)")
    return os.fdopen(fd, "rb")


class ShapeOverride(msgspec.Struct, frozen=True, kw_only=True):
    """The routing shape given for a source (`--shape NAME`, `--num-experts N --top-k K [--num-layers L]`), over
    what the source's model id says: a model no importer knows, or a variant with another shape."""

    name: str | None = None  # a known model's id (`KNOWN_SHAPES`, or a quantized or renamed variant of one)
    num_experts: int | None = None
    top_k: int | None = None
    num_layers: int | None = None  # every layer 0..L-1 a MoE layer


class Options(msgspec.Struct, frozen=True, kw_only=True):
    """What an import may be asked beyond its source: `experts` (csv: the expert count, else inferred), `batched`,
    `shape` (the routing shape over the source's model id)."""

    experts: int | None = None
    # each forward pass of the source one step of all the tokens it routed, the batch's requests not split apart
    batched: bool = False
    shape: ShapeOverride | None = None


class LayerRoute(msgspec.Struct, frozen=True):
    """One layer's routing in one step: token i chose `experts[i*k:(i+1)*k]` with `weights` (same layout)."""

    layer: int
    experts: tuple[int, ...]
    weights: tuple[float, ...] = ()


class Request(msgspec.Struct):
    """One request of the source: `steps[i]` = the routes of step i, in layer order."""

    name: str
    steps: list[list[LayerRoute]]


class Imported(msgspec.Struct, frozen=True, kw_only=True):
    """An importer's result, before it is written: the requests, and what was left out (reason -> routes)."""

    shape: ModelShape
    requests: list[Request]
    skipped: dict[str, int]
    sources: list[Path]  # the files read, for the fingerprint


class ImportSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What an import wrote, and what it left out and why (`skipped`: reason -> (token, layer) routes)."""

    format: str
    source: str
    log: str
    model: ModelShape
    layers: tuple[int, ...]
    requests: int
    steps: int
    routes: int  # trace.route records
    token_routes: int  # (token, layer) pairs
    skipped: dict[str, int]
    files: list[str] = []  # the source files read, in order (several: per-layer files merged)
    batched: bool = False


# The models whose logs the importers know: the routing shape of each (`hidden_size` for completeness).
MIXTRAL_8X7B = ModelShape(num_layers=32, moe_layers=tuple(range(32)), num_experts=8, top_k=2, hidden_size=4096)
QWEN15_MOE_A27B = ModelShape(num_layers=24, moe_layers=tuple(range(24)), num_experts=60, top_k=4, hidden_size=2048)
VLLM_MODELS = {"Qwen/Qwen1.5-MoE-A2.7B-Chat": QWEN15_MOE_A27B, "Qwen/Qwen1.5-MoE-A2.7B": QWEN15_MOE_A27B}
# FLAME-MoE's (docs in qnpipe.trace.importers.flame_pt): size 1024, layer 1 dense and 2..9 MoE, 64 experts top-6.
FLAME_MOE_290M = ModelShape(num_layers=10, moe_layers=tuple(range(2, 10)), num_experts=64, top_k=6, hidden_size=1024)
# Every model an importer knows by name, for `--shape NAME` too.
KNOWN_SHAPES = {"mistralai/Mixtral-8x7B-v0.1": MIXTRAL_8X7B, "mistralai/Mixtral-8x7B-Instruct-v0.1": MIXTRAL_8X7B,
                **VLLM_MODELS, "flame-moe-290m": FLAME_MOE_290M}


def _base_name(model_id: str) -> str:
    """A model id without its owner, lowercased: "Qwen/Qwen1.5-MoE-A2.7B-Chat" -> "qwen1.5-moe-a2.7b-chat"."""
    return model_id.rsplit("/", 1)[-1].strip().lower()


def known_shape(model_id: str, table: Mapping[str, ModelShape] = KNOWN_SHAPES) -> tuple[str, ModelShape] | None:
    """(the known id, its shape) of `model_id`: the id itself, or a quantized or renamed variant of one (another
    owner, a suffix such as -Chat-GPTQ-Int4, -AWQ, -MLX-4bit: quantizing or renaming keeps the router), matched as
    the longest known name, owner left out, that the id starts with before a "-". None: not known."""
    if model_id in table:
        return model_id, table[model_id]
    base = _base_name(model_id)
    found = [(len(_base_name(k)), k) for k in table
             if base == _base_name(k) or base.startswith(_base_name(k) + "-")]
    if not found:
        return None
    name = max(found)[1]
    return name, table[name]


def resolve_shape(where: str, source: ModelShape | None, opts: Options | None, *,
                  model: str = "", layers: Sequence[int] = (), field: str = "model") -> ModelShape:
    """The shape an import uses: `source`'s (its model's, None when not known) under `opts.shape`: a known model
    named (`name`), then `num_experts`, `top_k`, `num_layers` over it. A source of no known model needs them all but
    the layers, which `layers` (the layers it logs) may give. TraceImportError names `where` and what is missing."""
    ov = opts.shape if opts is not None else None
    shape = source
    if ov is not None and ov.name is not None:
        hit = known_shape(ov.name)
        if hit is None:
            raise TraceImportError(f"--shape {ov.name}: unknown, known: {', '.join(sorted(KNOWN_SHAPES))}")
        shape = hit[1]
    given = {} if ov is None else {k: v for k, v in (("num_experts", ov.num_experts), ("top_k", ov.top_k)) if v}
    if ov is not None and ov.num_layers:
        given |= {"num_layers": ov.num_layers, "moe_layers": tuple(range(ov.num_layers))}
    if shape is None:
        if not {"num_experts", "top_k"} <= given.keys() or not ({"num_layers"} & given.keys() or layers):
            raise TraceImportError(f"{where}: {field} {model!r}: unknown routing shape, known: "
                                   f"{', '.join(sorted(KNOWN_SHAPES))}; name one with --shape NAME, or give "
                                   "--num-experts N --top-k K (and --num-layers L when the source does not list "
                                   "its layers)")
        moe = tuple(sorted(set(layers)))
        shape = ModelShape(num_layers=moe[-1] + 1 if moe else 0, moe_layers=moe, num_experts=0, top_k=0, hidden_size=0)
    out = msgspec.structs.replace(shape, **given)
    if not 1 <= out.top_k <= out.num_experts <= MAX_EXPERTS or not 1 <= out.num_layers <= MAX_LAYERS:
        raise TraceImportError(f"{where}: shape {out.num_experts} experts top-{out.top_k} over {out.num_layers} "
                               f"layers: want 1 <= top_k <= experts <= {MAX_EXPERTS}, 1..{MAX_LAYERS} layers")
    return out


class _Metered:
    """The compressed file as gzip reads it, in small reads, counting them: `Expansion` compares the bytes
    gunzipped with these as they stream (gzip's own read-ahead of 128 kB would let a bomb expand 100 MB)."""

    CHUNK = 16 << 10

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.consumed = 0

    def read(self, n: int = -1) -> bytes:
        buf = self.raw.read(self.CHUNK if n is None or n < 0 else min(n, self.CHUNK))
        self.consumed += len(buf)
        return buf

    def seek(self, offset: int, whence: int = 0) -> int:  # gzip's file protocol; a line-by-line read never seeks
        return self.raw.seek(offset, whence)


class Expansion:
    """The cap on what a compressed source may decompress to, checked as it streams (`check`, each line)."""

    def __init__(self, path: Path, metered: _Metered | None) -> None:
        self.path = path
        self.metered = metered
        self.out = 0

    def check(self, n: int, line: int) -> None:
        if self.metered is None:
            return
        self.out += n
        cap = MAX_RATIO * self.metered.consumed + RATIO_SLACK
        if self.out > cap:
            raise TraceImportError(f"{self.path}: line {line}: {self.out} bytes decompressed from the first "
                                   f"{self.metered.consumed} compressed bytes, over the cap of {MAX_RATIO} times "
                                   f"the compressed bytes read + {RATIO_SLACK} (a routing table does not compress "
                                   f"that well: a gzip bomb? gunzip it first to import it under --max-bytes alone)")


def open_source(path: Path, cap: int) -> tuple[IO[bytes], IO[bytes] | gzip.GzipFile, Expansion]:
    """`(raw, text, expansion)`: the file as stored (for progress by its position), its content (gunzipped
    if `.gz`) and the cap on how far that content may expand (none for a file read as stored)."""
    raw = open_regular(path, cap)
    if path.suffix == ".gz":
        metered = _Metered(raw)
        return raw, gzip.GzipFile(fileobj=metered, mode="rb"), Expansion(path, metered)
    return raw, raw, Expansion(path, None)


def jsonl_lines(path: Path, progress: Progress | None = None,
                budget: Budget | None = None) -> Iterator[tuple[int, bytes]]:
    """`(line number from 1, line)` of a JSON-lines file, blank lines skipped; a torn `.gz` names the line.

    Streamed: a line longer than LINE_CAP is an error (read no further than that), the lines'
    bytes are taken from `budget` (whose limit also caps the file's size on disk), and a `.gz`
    may expand no further than MAX_RATIO times the compressed bytes read (`Expansion`).
    """
    budget = budget or Budget(MAX_BYTES)
    raw, f, expansion = open_source(path, budget.limit)
    done = 0
    n = 0
    try:
        with raw, f:
            while True:
                try:
                    line = f.readline(LINE_CAP + 1)
                except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
                    raise TraceImportError(f"{path}: line {n + 1}: cannot decompress ({e})") from None
                if not line:
                    break
                n += 1
                if len(line) > LINE_CAP:
                    raise TraceImportError(f"{path}: line {n}: longer than {LINE_CAP} bytes: not a routing record")
                expansion.check(len(line), n)
                budget.take(len(line), f"{path}: line {n}")
                if progress is not None and n % 4096 == 0:
                    pos = raw.tell()
                    progress(pos - done)
                    done = pos
                if line.strip():
                    yield n, line
            if progress is not None:
                progress(raw.tell() - done)
    except OSError as e:
        raise TraceImportError(f"{path}: line {n + 1}: cannot read ({e.strerror or e})") from None


def decode_line(path: Path, n: int, line: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """One JSON line as its typed record; TraceImportError names the file, the line and what was wrong."""
    try:
        return decoder.decode(line)
    except msgspec.ValidationError as e:
        raise TraceImportError(f"{path}: line {n}: {e}") from None
    except msgspec.DecodeError as e:
        raise TraceImportError(f"{path}: line {n}: not a JSON record ({e})") from None


def check_route(path: Path, where: str, shape: ModelShape, layer: int, experts: list[int],
                weights: list[float] | None) -> None:
    """A record's routing fits the model: a MoE layer, top_k distinct ids in range, as many weights as ids."""
    why = None
    if layer not in shape.moe_layers:
        why = f"layer {layer} is not a MoE layer of the model (0..{shape.num_layers - 1})"
    elif len(experts) != shape.top_k:
        why = f"{len(experts)} experts, the model routes each token to top_k={shape.top_k}"
    elif not all(0 <= e < shape.num_experts for e in experts):
        why = f"expert ids {experts}: outside 0..{shape.num_experts - 1}"
    elif len(set(experts)) != len(experts):
        why = f"expert ids {experts}: an expert chosen twice"
    elif weights is not None and len(weights) != len(experts):
        why = f"{len(weights)} weights for {len(experts)} experts"
    if why is not None:
        raise TraceImportError(f"{path}: {where}: {why}")


def fingerprint(paths: list[Path]) -> str:
    """The header's fingerprint of an imported log: sha256 of the source files' bytes, in order."""
    h = hashlib.sha256()
    for p in paths:
        with open_regular(p, None) as f:  # read before within their caps; streamed here
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return "import:" + h.hexdigest()


def cut(imp: Imported, max_steps: int) -> Imported:
    """The first `max_steps` steps of the log `imp` makes (its requests in order); the rest counted as skipped."""
    left, requests, dropped = max_steps, [], 0
    for r in imp.requests:
        keep = r.steps[:max(left, 0)]
        left -= len(keep)
        dropped += sum(len(lr.experts) for s in r.steps[len(keep):] for lr in s) // imp.shape.top_k
        requests.append(Request(r.name, keep))
    skipped = dict(imp.skipped)
    if dropped:
        skipped[f"(token, layer) routes after step {max_steps} (max_steps)"] = dropped
    return msgspec.structs.replace(imp, requests=requests, skipped=skipped)


def merge(parts: list[Imported]) -> Imported:
    """Per-layer imports of one run as one: step s of request r holds every part's layers of it, in layer order.

    The parts must have the same requests, each with the same steps, and a step's routes the
    same token count wherever two parts both have one; no layer may be in two parts; their
    model shapes must be equal. TraceImportError names the file.
    """
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    name0 = first.sources[0]
    owner: dict[int, Path] = {}
    for p in parts:
        where = p.sources[0]
        if p.shape != first.shape:
            raise TraceImportError(f"{where}: model shape {p.shape} differs from {name0.name}'s {first.shape}")
        for layer in sorted({lr.layer for r in p.requests for st in r.steps for lr in st}):
            if layer in owner:
                raise TraceImportError(f"{where}: layer {layer} is also in {owner[layer]}: the files of one run must "
                                       f"hold different layers")
            owner[layer] = where
        if len(p.requests) != len(first.requests):
            raise TraceImportError(f"{where}: {len(p.requests)} request(s), {name0.name} has {len(first.requests)}: "
                                   f"not the same run")
        for i, (a, b) in enumerate(zip(first.requests, p.requests, strict=True)):
            if len(a.steps) != len(b.steps):
                raise TraceImportError(f"{where}: request {i} ({b.name}) has {len(b.steps)} steps, {name0.name}'s has "
                                       f"{len(a.steps)}: not the same run")
    k = first.shape.top_k
    requests = []
    for i, req in enumerate(first.requests):
        steps = []
        for j in range(len(req.steps)):
            routes = [(lr, p.sources[0]) for p in parts for lr in p.requests[i].steps[j]]
            tokens = {len(lr.experts) // k for lr, _ in routes}
            if len(tokens) > 1:
                lr, where = next((lr, w) for lr, w in routes if len(lr.experts) // k != len(routes[0][0].experts) // k)
                raise TraceImportError(f"{where}: request {i} ({req.name}) step {j + 1}: layer {lr.layer} routes "
                                       f"{len(lr.experts) // k} tokens, layer {routes[0][0].layer} of "
                                       f"{routes[0][1].name} {len(routes[0][0].experts) // k}: not the same run")
            steps.append(sorted((lr for lr, _ in routes), key=lambda lr: lr.layer))
        requests.append(Request(req.name, steps))
    skipped: dict[str, int] = {}
    for p in parts:
        for why, n in p.skipped.items():
            skipped[why] = skipped.get(why, 0) + n
    return Imported(shape=first.shape, requests=requests, skipped=skipped, sources=[s for p in parts for s in p.sources])


def lockstep(requests: list[Request], name: str) -> Request:
    """Requests decoding together as one batch: step i routes, at each layer, every request's tokens of its step i.

    A request that has no step i any more has finished: the batch narrows. Token order in a
    step's route is the requests' order.
    """
    steps = []
    for i in range(max((len(r.steps) for r in requests), default=0)):
        by_layer: dict[int, list[LayerRoute]] = {}
        for r in requests:
            if i < len(r.steps):
                for lr in r.steps[i]:
                    by_layer.setdefault(lr.layer, []).append(lr)
        steps.append([LayerRoute(layer, tuple(e for lr in lrs for e in lr.experts),
                                 tuple(w for lr in lrs for w in lr.weights) if all(lr.weights for lr in lrs) else ())
                      for layer, lrs in sorted(by_layer.items())])
    return Request(name, steps)


def write_log(out: Path, imp: Imported, *, fmt: str, source: Path, batched: bool = False) -> ImportSummary:
    """Write `imp`'s requests one after another as a routing log at `out` (temp name, then renamed)."""
    shape, requests = imp.shape, imp.requests
    if not any(r.steps for r in requests):
        raise TraceImportError(f"{source}: no routing records left to import ({_why(imp.skipped)})")
    layers = tuple(sorted({lr.layer for r in requests for s in r.steps for lr in s}))
    header = Header(schema_version=SCHEMA_VERSION, fingerprint=fingerprint(imp.sources), model=shape,
                    clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes", layers=layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = TraceWriter(out, header)
    step = routes = token_routes = 0
    try:
        for i, req in enumerate(requests):
            if not req.steps:
                continue
            w.write(RequestStart(t=0.0, seq=w.records, request=i, first_step=step + 1, name=req.name))
            for s in req.steps:
                step += 1
                for lr in s:
                    w.write(Route(t=0.0, seq=w.records, step=step, layer=lr.layer, top_k=shape.top_k,
                                  experts=lr.experts, weights=lr.weights))
                    routes += 1
                    token_routes += len(lr.experts) // shape.top_k
        w.close(0, 0.0)
    except BaseException:
        w.abandon()
        w.partial.unlink(missing_ok=True)
        raise
    return ImportSummary(format=fmt, source=str(source), log=str(out), model=shape, layers=layers,
                         requests=sum(1 for r in requests if r.steps), steps=step, routes=routes,
                         token_routes=token_routes, skipped=dict(sorted(imp.skipped.items())),
                         files=[str(p) for p in imp.sources], batched=batched)


def _why(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} skipped: {k}" for k, n in sorted(skipped.items())) or "the source is empty"


def describe(s: ImportSummary) -> str:
    """The summary line the CLI prints."""
    lo, hi = (s.layers[0], s.layers[-1]) if s.layers else (0, 0)
    layers = f"layer {lo}" if lo == hi else f"{len(s.layers)} layers {lo}..{hi}"
    src = s.source if len(s.files) < 2 else f"{len(s.files)} files ({s.source})"
    mode = ", batched" if s.batched else ""
    line = (f"imported {src} ({s.format}{mode}): {s.requests} request(s), {s.steps} steps, {s.token_routes} "
            f"(token, layer) routes of {layers} -> {s.log}")
    if s.skipped:
        line += "; skipped " + ", ".join(f"{n} {k}" for k, n in s.skipped.items())
    return line
