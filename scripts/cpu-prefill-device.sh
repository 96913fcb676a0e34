#!/usr/bin/env bash
# Prefill of a SmolLM2-shaped model, vOOM's CPU backend against llama.cpp, on the
# accelerator machine's CPU (the `device` tool: an Intel Xeon with AVX-512, no
# network, no Rust toolchain). The weights are random (transformers initialises a
# LlamaForCausalLM from SmolLM2-135M's config.json, in BF16), converted to GGUF for
# llama.cpp with llama.cpp's own converter: speed does not depend on the values.
# Prepared on the development machine, in .device/cpu.tar.xz:
#   voom (release, stripped; voom-base: the same for the commit compared against),
#   llama-bench (the build README's llama.cpp figures use; -DGGML_NATIVE=ON on the
#   development machine, libgomp/libssl beside it in lib/), llama.cpp's
#   convert_hf_to_gguf.py with conversion/ and gguf-py/ (llama/), and SmolLM2's
#   config.json, generation_config.json and tokenizer files (smollm2/).
# Run: `run` with carry [".device"] and command `bash scripts/cpu-prefill-device.sh`.
set -x
D=/tmp/voomcpu
mkdir -p $D/home
[ -x $D/voom ] || tar xJf .device/cpu.tar.xz -C $D || exit 1
export LD_LIBRARY_PATH=$D/lib
lscpu | tee $OUT/lscpu.txt | grep -iE 'model name|^cpu\(s\)|flags' | cut -c1-400
if [ ! -e $D/model.gguf ]; then
  python3 - <<PY || exit 1
import torch, transformers
cfg = transformers.AutoConfig.from_pretrained("$D/smollm2")
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained("$D/model")
PY
  cp $D/smollm2/tokenizer* $D/model/
  PYTHONPATH=$D/llama/gguf-py python3 $D/llama/convert_hf_to_gguf.py $D/model \
    --outtype bf16 --outfile $D/model.gguf 2>&1 | tail -5
fi
ls -la $D/model $D/model.gguf
cd $D
for T in ${THREADS:-2 16}; do
  for V in ${VOOMS:-voom voom-base}; do
    VOOM_HOME=$D/home timeout ${LIMIT:-250} ./$V bench --model $D/model --synthetic-gb 0 \
      --threads $T --prompt-tokens ${TOKENS:-2048} --decode-tokens 4 --runs 2 \
      --llama-bench $D/llama-bench --llama-gguf $D/model.gguf 2>&1 \
      | tee $OUT/bench-$V-$T.txt | tail -8
  done
done
