"""Train the 1024-id byte-level BPE tokenizer of the tiny test models.

Writes ``qnpipe/data/tokenizer/{tokenizer.json,tokenizer_config.json}``. The corpus is the running
Python's own standard library sources, so the result depends on the Python version: run once and
commit the output rather than regenerating per machine.

Usage: ``python tools/train_tokenizer.py [OUT_DIR]``
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 1024
# Ids 0-2 are special (skipped when decoding); 3-8 are plain added tokens, as in Qwen (docs/model.md, "Chat template and special tokens").
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
MAX_FILE_BYTES = 16 * 1024
MAX_TOTAL_BYTES = 3 * 1024 * 1024
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
# Qwen2's pre-tokenizer regex (transformers' Qwen2Tokenizer rebuilds exactly this pipeline).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MODEL_MAX_LENGTH = 262144

# Qwen3-2507-Instruct style template (docs/model.md, "Chat template and special tokens"); no default system prompt.
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def corpus() -> Iterator[str]:
    """The stdlib's .py sources in sorted path order, each file and the total capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            data = (Path(dirpath) / name).read_bytes()[:MAX_FILE_BYTES]
            if total + len(data) > MAX_TOTAL_BYTES:
                return
            total += len(data)
            yield data.decode("utf-8", errors="ignore")


def train() -> Tokenizer:
    """Train the BPE model with Qwen2's normalizer, pre-tokenizer, post-processor and decoder."""
    bpe = models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def tokenizer_json(tok: Tokenizer) -> dict:
    """Serialised tokenizer with the tool/think tokens marked non-special, like Qwen's."""
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
        entry["normalized"] = False
    return data


def tokenizer_config(data: dict) -> dict:
    """The transformers tokenizer_config.json (Qwen2 layout, 1024 ids)."""
    decoder = {
        str(e["id"]): {
            "content": e["content"],
            "lstrip": e["lstrip"],
            "normalized": e["normalized"],
            "rstrip": e["rstrip"],
            "single_word": e["single_word"],
            "special": e["special"],
        }
        for e in data["added_tokens"]
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "qnpipe" / "data" / "tokenizer"
    tok = train()
    data = tokenizer_json(tok)
    if len(data["model"]["vocab"]) != VOCAB_SIZE:
        raise SystemExit(f"trained vocabulary has {len(data['model']['vocab'])} ids, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS + ADDED_TOKENS):
        if data["model"]["vocab"][t] != i:
            raise SystemExit(f"{t} has id {data['model']['vocab'][t]}, expected {i}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(data), ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    print(f"wrote {out}: {len(data['model']['vocab'])} ids, {len(data['model']['merges'])} merges")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
