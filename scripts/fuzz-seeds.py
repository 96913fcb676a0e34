#!/usr/bin/env python3
"""Writes the committed seed inputs of the fuzz targets (scripts/fuzz loads them
beside each target's corpus): small valid inputs of every format, so the fuzzers start
from the shapes real files have instead of from nothing. Deterministic; run from the
repository root after a format changes: scripts/fuzz-seeds.py [VPACK_MODEL_DIR]

Inputs that exist as files elsewhere are not copied here: scripts/fuzz adds the
committed fixtures' config.json files (config_json) itself. vpack bodies come from a
store packed by `vpagectl pack` (VPACK_MODEL_DIR, a packed copy of a fixture); without
it the vpack seeds are left as they are.
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def out(crate, target, name, data):
    d = os.path.join(ROOT, crate, "fuzz", "seeds", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- safetensors: u64 header length, JSON header, data -------------------------------
def safetensors(tensors, metadata=None, pad=b""):
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode() + pad
    return struct.pack("<Q", len(h)) + h + data


st = "safetensors_header"
out("formats", st, "f32_bf16_f16.safetensors", safetensors([
    ("model.embed_tokens.weight", "BF16", [4, 2], bytes(range(16))),
    ("model.norm.weight", "F32", [2], struct.pack("<2f", 1.0, -2.5)),
    ("lm_head.weight", "F16", [2, 2], bytes(8)),
], metadata={"format": "pt"}))
out("formats", st, "empty_and_scalar.safetensors", safetensors([
    ("empty", "F32", [0, 3], b""),
    ("scalar", "I64", [], struct.pack("<q", -7)),
    ("flags", "BOOL", [3], b"\x00\x01\x00"),
    ("bytes", "U8", [2, 2], b"abcd"),
], pad=b"   "))
out("formats", st, "header_only.safetensors", safetensors([]))


# --- GGUF v3 --------------------------------------------------------------------------
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gkv(key, ty, payload):
    return gstr(key) + struct.pack("<I", ty) + payload


def gguf(kvs, tensors, version=3, alignment=32):
    b = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    b += b"".join(kvs)
    data, infos = b"", b""
    for name, ty, dims, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        infos += gstr(name) + struct.pack("<I", len(dims)) + b"".join(
            struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ty, len(data))
        data += raw
    b += infos
    b += b"\0" * (-len(b) % alignment)
    return b + data


def q4_0_block(scale_f16=0x3C00):  # 32 elements: f16 scale, 16 bytes of nibbles
    return struct.pack("<H", scale_f16) + bytes((i * 17) & 0xFF for i in range(16))


def q8_0_block():  # 32 elements: f16 scale, 32 int8
    return struct.pack("<H", 0x3800) + bytes((i * 7) & 0xFF for i in range(32))


def q4_1_block():  # 32 elements: f16 scale, f16 min, 16 bytes
    return struct.pack("<HH", 0x3C00, 0xBC00) + bytes(range(16))


kvs = [
    gkv("general.architecture", 8, gstr("llama")),
    gkv("general.name", 8, gstr("fuzz")),
    gkv("llama.block_count", 4, struct.pack("<I", 1)),
    gkv("llama.context_length", 4, struct.pack("<I", 64)),
    gkv("llama.embedding_length", 4, struct.pack("<I", 32)),
    gkv("llama.attention.head_count", 4, struct.pack("<I", 2)),
    gkv("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
    gkv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
    gkv("tokenizer.ggml.model", 8, gstr("gpt2")),
    gkv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + gstr("a") + gstr("b") + gstr("ab")),
    gkv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, -1, -2)),
    gkv("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, 1, 1)),
    gkv("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 0)),
    gkv("general.file_type", 4, struct.pack("<I", 1)),
    gkv("flag", 7, b"\x01"),
    gkv("big", 10, struct.pack("<Q", 1 << 40)),
    gkv("neg", 11, struct.pack("<q", -1)),
    gkv("pi", 12, struct.pack("<d", 3.14159)),
    gkv("small", 0, b"\x07"),
    gkv("i16", 3, struct.pack("<h", -3)),
]
out("formats", "gguf", "llama_mixed_types.gguf", gguf(kvs, [
    ("token_embd.weight", 1, [32, 2], bytes(128)),                  # F16
    ("output_norm.weight", 0, [32], struct.pack("<32f", *[1.0] * 32)),  # F32
    ("blk.0.attn_q.weight", 2, [32, 2], q4_0_block() * 2),           # Q4_0
    ("blk.0.attn_k.weight", 3, [32], q4_1_block()),                  # Q4_1
    ("blk.0.ffn_up.weight", 8, [32], q8_0_block()),                  # Q8_0
    ("blk.0.ffn_down.weight", 30, [4, 2], bytes(range(16))),         # BF16
]))
out("formats", "gguf", "v2_aligned_64.gguf", gguf(
    [gkv("general.alignment", 4, struct.pack("<I", 64)),
     gkv("general.architecture", 8, gstr("llama"))],
    [("t", 0, [3], struct.pack("<3f", 1, 2, 3)), ("u", 1, [2, 1], bytes(4))],
    version=2, alignment=64))
out("formats", "gguf", "no_tensors.gguf", gguf([gkv("general.architecture", 8, gstr("llama"))], []))


# --- vpaged frames: u32 len, u16 type, u16 flags, u32 request id, payload ------------
def frame(ty, payload=b"", flags=0, rid=1):
    return struct.pack("<IHHI", 8 + len(payload), ty, flags, rid) + payload


def pstr(s):
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def pages(ids):
    return struct.pack("<I", len(ids)) + b"".join(struct.pack("<I", i) for i in ids)


session = b"".join([
    frame(0x0001, struct.pack("<HHI", 1, 2, 0x01020304) + pstr("voom 0.1.0"), rid=1),
    frame(0x0002, pstr("/models/tiny"), rid=2),
    frame(0x0003, struct.pack("<I", 0) + pages([0, 1, 2]), rid=3),
    frame(0x0004, struct.pack("<I", 0) + pages([3]), flags=1, rid=4),
    frame(0x0005, struct.pack("<I", 0) + pages([0, 1, 2]), flags=1, rid=5),
    frame(0x0006, rid=6),
    frame(0x0008, struct.pack("<IQ", 0, 1 << 20), rid=7),
    frame(0x0009, struct.pack("<I", 0), rid=8),
    frame(0x0007, rid=9),
])
replies = b"".join([
    frame(0x8001, struct.pack("<HHQQ", 1, 2, 1 << 30, 0xDEADBEEF), rid=1),
    frame(0x8002, struct.pack("<II", 0, 21) + bytes(range(32)), rid=2),
    frame(0x8003, struct.pack("<II", 0, 2) + struct.pack("<IQQ", 0, 0, 16384)
          + struct.pack("<IQQ", 1, 16384, 128), rid=3),
    frame(0x8004, rid=4),
    frame(0x8005, pstr('{"detail": "full", "pages": 1}'), rid=6),
    frame(0x8000, struct.pack("<H", 4) + pstr("bad request"), rid=7),
])
# The first byte of a frame_decode input is the chunk size the decoder is fed in.
out("vpaged", "frame_decode", "client_session.bin", b"\x05" + session)
out("vpaged", "frame_decode", "server_replies.bin", b"\x40" + replies)
out("vpaged", "frame_decode", "hello_one_byte_chunks.bin",
    b"\x01" + frame(0x0001, struct.pack("<HHI", 1, 0, 7) + pstr("ab"), rid=9))


# --- vpack bodies, from a packed store -------------------------------------------------
if len(sys.argv) > 1:
    store = sys.argv[1]
    m = json.load(open(os.path.join(store, "voom-manifest.json")))
    bodies = []
    for p in m["pages"]:
        for e in p.get("encoded", []):
            if e["encoding"] == "vpack":
                with open(os.path.join(store, e["file"]), "rb") as f:
                    f.seek(e["offset"])
                    bodies.append((e["len"], p["name"], p["dtype"], f.read(e["len"])))
    bodies.sort()
    for n, name, dtype, body in bodies[:3] + [b for b in bodies if b[0] <= 8192][-2:]:
        out("formats", "vpack", f"{name}.{dtype}.vpack", body)


# --- config.json: shapes the fixtures lack (they are added by scripts/fuzz) -----------
base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512}
configs = {
    "qwen2_window_from_layer_1.json": {"model_type": "qwen2", **base, "num_key_value_heads": 2,
        "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
        "eos_token_id": [1, 2], "bos_token_id": None},
    "layer_types.json": {"model_type": "qwen3", **base, "head_dim": 32, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"]},
    "rope_parameters_llama3.json": {"model_type": "llama", **base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": True,
        "hidden_act": "silu", "pretraining_tp": 1, "partial_rotary_factor": 1.0,
        "rms_norm_eps": 1e-5, "architectures": ["LlamaForCausalLM"]},
    "mistral_null_window.json": {"model_type": "mistral", **base, "sliding_window": None,
        "rope_scaling": {"type": "default"}, "rope_theta": 1e6},
}
for name, c in configs.items():
    out("libvoom", "config_json", name, json.dumps(c, indent=2))


# --- request bodies of every dialect (both voom-server targets) ----------------------
# They name the fixture model `tiny_chat`, which request_prepare serves.
M = "tiny_chat"
weather = {"type": "object", "properties": {"city": {"type": "string"},
           "unit": {"enum": ["C", "F"]}}, "required": ["city"], "additionalProperties": False}
person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 150},
          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
bodies = {
    "chat_plain.json": {"model": M, "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "chat_system_history_stop.json": {"model": M, "max_completion_tokens": 4, "top_p": 0.9,
        "top_k": 5, "seed": 7, "stop": ["\n", "."], "n": 1, "logprobs": False,
        "presence_penalty": 0, "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "input_text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again", "name": "bob"}]},
    "chat_stream_usage.json": {"model": M, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Count to three."}]},
    "chat_tools_auto_history.json": {"model": M, "temperature": 0, "max_tokens": 16,
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "description": "Weather in a city", "parameters": weather, "strict": True}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
            {"role": "user", "content": "And Paris?"}]},
    "chat_tools_required.json": {"model": M, "max_tokens": 32, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
                  {"type": "function", "function": {"name": "now"}}],
        "messages": [{"role": "user", "content": "Call a tool."}]},
    "chat_tool_named.json": {"model": M, "max_tokens": 32,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
        "messages": [{"role": "user", "content": "Oslo"}]},
    "chat_json_schema.json": {"model": M, "max_tokens": 32, "response_format": {"type": "json_schema",
        "json_schema": {"name": "person", "strict": True, "schema": person}},
        "messages": [{"role": "user", "content": "A person, as JSON."}]},
    "chat_json_object_tools_auto.json": {"model": M, "max_tokens": 16,
        "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
        "messages": [{"role": "user", "content": "JSON please."}]},
    "completion_text.json": {"model": M, "prompt": "Once upon a time", "max_tokens": 4,
        "temperature": 0.5, "echo": False, "best_of": 1},
    "completion_ids.json": {"model": M, "prompt": [1, 42, 7, 300], "max_tokens": 2},
    "completion_list_json.json": {"model": M, "prompt": ["{\"a\":"], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "o",
                            "schema": {"type": "object", "properties": {"a": {"type": "number"}}}}}},
    "messages_plain.json": {"model": M, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]},
    "messages_system_blocks_stop.json": {"model": M, "max_tokens": 8, "top_p": 0.5, "top_k": 3,
        "stop_sequences": ["END"], "metadata": {"user_id": "u1"}, "service_tier": "auto",
        "thinking": {"type": "disabled"}, "cache_control": {"type": "ephemeral"},
        "system": [{"type": "text", "text": "Rules."}, {"type": "text", "text": "More rules."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
    "messages_tools_history.json": {"model": M, "max_tokens": 32, "stream": True,
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": weather}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "12 C"}], "is_error": False}]}]},
    "messages_tool_any.json": {"model": M, "max_tokens": 32, "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": weather}],
        "messages": [{"role": "user", "content": "Oslo"}]},
    "messages_tool_named.json": {"model": M, "max_tokens": 32,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "tools": [{"name": "get_weather", "input_schema": weather}],
        "messages": [{"role": "user", "content": "Oslo"}]},
    "messages_prefill.json": {"model": M, "max_tokens": 8, "seed": 3, "messages": [
        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]},
    "messages_output_format.json": {"model": M, "max_tokens": 32,
        "output_config": {"format": {"type": "json_schema", "schema": person}},
        "messages": [{"role": "user", "content": "A person."}]},
    "responses_string.json": {"model": M, "input": "Hi", "instructions": "Be brief.",
        "max_output_tokens": 8, "temperature": 0, "store": False, "truncation": "disabled",
        "metadata": {"k": "v"}, "user": "u", "reasoning": {"effort": None}},
    "responses_items.json": {"model": M, "max_output_tokens": 7, "stream": True, "input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": weather, "strict": True}]},
    "responses_tool_required.json": {"model": M, "input": "Oslo", "tool_choice": "required",
        "parallel_tool_calls": True,
        "tools": [{"type": "function", "name": "get_weather", "description": "W", "parameters": weather}]},
    "responses_tool_named.json": {"model": M, "input": "Oslo",
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [{"type": "function", "name": "get_weather", "parameters": weather}]},
    "responses_text_format.json": {"model": M, "input": "A person.", "text": {"format": {
        "type": "json_schema", "name": "person", "schema": person, "strict": True}, "verbosity": "medium"}},
    "responses_json_object.json": {"model": M, "input": "JSON.", "text": {"format": {"type": "json_object"}}},
}
for name, b in bodies.items():
    out("voom-server", "request", name, json.dumps(b))


# --- libFuzzer dictionaries: the keys and words the parsers look for -----------------
def dictionary(crate, target, words):
    d = os.path.join(ROOT, crate, "fuzz", "dicts")
    os.makedirs(d, exist_ok=True)
    lines = []
    for w in words:
        esc = w.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'"{esc}"')
    with open(os.path.join(d, f"{target}.dict"), "w") as f:
        f.write("# JSON keys and words " + target + " reads (scripts/fuzz-seeds.py).\n")
        f.write("\n".join(lines) + "\n")


json_words = ["{", "}", "[", "]", ":", ",", "null", "true", "false", "0", "-1", "1.5",
              "1e308", "1e-50", "18446744073709551616", "4294967296", "\\u0000", "\\ud800"]
config_keys = ["model_type", "architectures", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "rope_scaling", "rope_parameters", "rope_type", "type", "factor",
               "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act",
               "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
               "partial_rotary_factor", "quantization_config", "bos_token_id", "eos_token_id",
               "pretraining_tp"]
config_values = ["llama", "mistral", "qwen2", "qwen3", "llama3", "default", "silu",
                 "full_attention", "sliding_attention", "65536", "65537", "16777216", "16777217",
                 "4294967295"]
dictionary("libvoom", "config_json", json_words + [f'"{k}"' for k in config_keys]
           + [f'"{v}"' for v in config_values[:9]] + config_values[9:])
request_keys = [
    "model", "messages", "role", "content", "name", "tool_call_id", "tool_calls", "function",
    "arguments", "id", "type", "text", "stream", "stream_options", "include_usage",
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "n", "best_of", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "echo", "suffix", "functions", "function_call",
    "audio", "prediction", "modalities", "tools", "tool_choice", "parallel_tool_calls",
    "description", "parameters", "strict", "response_format", "json_schema", "schema",
    "prompt", "system", "stop_sequences", "metadata", "output_config", "format", "effort",
    "service_tier", "cache_control", "thinking", "input_schema", "disable_parallel_tool_use",
    "tool_use", "tool_use_id", "tool_result", "is_error", "input", "container",
    "mcp_servers", "context_management", "instructions", "max_output_tokens", "store",
    "previous_response_id", "conversation", "background", "include", "reasoning",
    "truncation", "user", "safety_identifier", "prompt_cache_key", "max_tool_calls",
    "call_id", "output", "status", "annotations", "verbosity", "properties", "required",
    "items", "enum", "const", "pattern", "minimum", "maximum", "minLength", "maxLength",
    "minItems", "maxItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not",
    "$ref", "$defs", "definitions", "$schema", "format", "x-guidance", "prefixItems",
    "uniqueItems", "multipleOf", "exclusiveMinimum", "propertyNames", "if", "then", "else"]
request_values = ["tiny_chat", "user", "assistant", "system", "developer", "tool", "function",
                  "auto", "none", "required", "any", "text", "input_text", "output_text",
                  "json_object", "json_schema", "message", "function_call",
                  "function_call_output", "image", "disabled", "object", "string", "integer",
                  "number", "boolean", "array", "#", "#/$defs/a", "<tool_call>", "</tool_call>",
                  "<|im_start|>", "<|im_end|>", "<|endoftext|>", "date-time", "email", "uuid"]
words = json_words + [f'"{k}"' for k in request_keys] + [f'"{v}"' for v in request_values]
dictionary("voom-server", "request_body", words)
dictionary("voom-server", "request_prepare", words)
