"""A lossy model through the official SDKs: a GGUF written by llama.cpp's own Python
package (gguf-py: its writer, and its reference quantizers for Q8_0, Q4_0, Q5_1 and
MXFP4), imported by `voom import` with its blocks kept, and served. Every response
says it is not exact and names the scheme (headers, the `voom` object); `voom list`
and `voom generate --json` say so too; and the import refuses an id that does not
begin with `lossy-`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import gguf
import numpy as np
from conftest import _Server, voom_bin

EMBD, FF, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = EMBD // HEADS


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = {}, 0
    for b in range(256):
        if b in bs:
            cs[b] = chr(b)
        else:
            cs[b] = chr(256 + n)
            n += 1
    return [cs[b] for b in range(256)]


def write_gguf(path: Path) -> None:
    """A random llama in GGUF, its matrices quantized by gguf-py to four types."""
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(7)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_alphabet() + ["\u0120t"]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("lossy tiny")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * 257)
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    types = [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.MXFP4]
    n = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal n
        t = types[n % len(types)]
        n += 1
        data = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)

    def norm(name: str) -> None:
        w.add_tensor(name, rng.uniform(0.5, 1.5, EMBD).astype(np.float32))

    matrix("token_embd.weight", len(tokens), EMBD)
    norm("output_norm.weight")
    for layer in range(LAYERS):
        norm(f"blk.{layer}.attn_norm.weight")
        norm(f"blk.{layer}.ffn_norm.weight")
        for name, rows, cols in [
            ("attn_q", EMBD, EMBD),
            ("attn_k", KV_HEADS * HEAD_DIM, EMBD),
            ("attn_v", KV_HEADS * HEAD_DIM, EMBD),
            ("attn_output", EMBD, EMBD),
            ("ffn_gate", FF, EMBD),
            ("ffn_up", FF, EMBD),
            ("ffn_down", EMBD, FF),
        ]:
            matrix(f"blk.{layer}.{name}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def voom(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOOM_")}
    env["VOOM_HOME"] = str(home)
    return subprocess.run([str(voom_bin()), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def lossy_home():
    with tempfile.TemporaryDirectory(prefix="voom-lossy-") as d:
        home = Path(d)
        gguf_path = home / "Tiny.Q8_0.gguf"
        write_gguf(gguf_path)
        # An id that hides the lossiness is refused, and nothing is written.
        r = voom(home, "import", str(gguf_path), "tiny")
        assert r.returncode == 1, r.stderr
        assert "lossy-" in r.stderr and "quantized" in r.stderr, r.stderr
        assert not (home / "models" / "tiny").exists()
        r = voom(home, "import", str(gguf_path))
        assert r.returncode == 0, r.stderr
        assert "lossy, q8_0" in r.stderr, r.stderr
        yield home


MODEL = "lossy-tiny.q8_0"


def test_cli_labels_the_lossy_model(lossy_home: Path) -> None:
    r = voom(lossy_home, "list", "--json")
    assert r.returncode == 0, r.stderr
    details = {d["name"]: d for d in json.loads(r.stdout)["details"]}
    assert details[MODEL]["exact"] is False and details[MODEL]["scheme"] == "q8_0", details
    r = voom(lossy_home, "generate", "--model", MODEL, "--prompt", "Hello", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exact"] is False and out["scheme"] == "q8_0", out
    assert len(out["ids"]) == 4
    # `voom generate --model FILE.gguf` imports the file once, then reuses it.
    import shutil

    gguf_path = str(lossy_home / "Other.Q8_0.gguf")
    shutil.copy(lossy_home / "Tiny.Q8_0.gguf", gguf_path)
    runs = [
        voom(lossy_home, "generate", "--model", gguf_path, "--prompt", "Hello", "--max-new-tokens", "4", "--json")
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1])["ids"] == out["ids"]
    assert "importing" in runs[0].stderr and "importing" not in runs[1].stderr, runs[1].stderr
    assert (lossy_home / "models" / "lossy-other.q8_0").is_dir()
    # The same weights under an exact-looking id are refused, not run.

    shutil.copytree(lossy_home / "models" / MODEL, lossy_home / "models" / "tiny-renamed")
    r = voom(lossy_home, "generate", "--model", "tiny-renamed", "--prompt", "Hi", "--max-new-tokens", "1")
    shutil.rmtree(lossy_home / "models" / "tiny-renamed")
    assert r.returncode == 1 and "does not begin with 'lossy-'" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def lossy_server(lossy_home: Path):
    s = _Server(fixture=lossy_home / "models" / MODEL, model_id=MODEL)
    yield s
    s.stop()


def test_every_response_says_it_is_not_exact(lossy_server) -> None:
    import anthropic
    import openai

    client = openai.OpenAI(base_url=lossy_server.base_url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert raw.headers["x-voom-exact"] == "false"
    assert raw.headers["x-voom-scheme"] == "q8_0"
    r = raw.parse()
    assert r.model_extra["voom"]["exact"] is False
    assert r.model_extra["voom"]["scheme"] == "q8_0"
    assert r.usage.completion_tokens == 5
    # Streamed: the final chunk's usage carries the same label.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.usage.model_extra["voom"]["provenance"]["exact"] is False
    m = client.models.retrieve(MODEL)
    assert m.model_extra["voom"]["scheme"] == "q8_0"
    ac = anthropic.Anthropic(base_url=lossy_server.base_url, api_key="unused", max_retries=0)
    raw = ac.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert raw.headers["x-voom-exact"] == "false"
    msg = raw.parse()
    assert msg.model_extra["voom"]["exact"] is False and msg.model_extra["voom"]["scheme"] == "q8_0"
    assert "lossy: q8_0" in lossy_server.log()
