#!/usr/bin/env bash
# The MLX backend on an NVIDIA GPU (MLX's CUDA build), run on the accelerator machine
# (the `device` tool: an H200, CUDA 13, no network), which has no Rust toolchain.
# Prepared on the development machine:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_35_x86_64 -d /tmp/w mlx-cuda-13==0.32.4
#   (cd /tmp/x && unzip -q /tmp/w/mlx_cuda_13-*.whl && tar cf - mlx mlx_cuda_13.libs) \
#       | xz -6 > mlx.tar.xz; split -b 38000000 mlx.tar.xz mlxpart.   (aa, ab)
#   CARGO_TARGET_DIR=target/mlx cargo test --no-run -p libvoom --features mlx \
#       --test mlx_backend --test conformance_tiny --test conformance_hybrid
#   CARGO_TARGET_DIR=target/mlx cargo build --release -p voom-server --features mlx
#   the three test binaries and voom, stripped, in .dev3/bins.tar.xz with this script
# Then three calls in a row (a call carries 64 MiB at most; the machine keeps /tmp
# while it is held): `cp .dev1/mlxpart.aa /tmp/voomdev/` (carry .dev1),
# `cp .dev2/mlxpart.ab /tmp/voomdev/` (carry .dev2), `bash .dev3/run.sh` (carry .dev3).
# The binaries load the CUDA build's libmlx through LD_LIBRARY_PATH, its CUDA
# libraries from the machine's PyTorch.
set -x
D=/tmp/voomdev
mkdir -p $D/site $D/bin $D/home
if [ ! -e $D/site/mlx/lib/libmlx.so ]; then
  cat $D/mlxpart.aa $D/mlxpart.ab | xz -d | tar x -C $D/site || exit 1
fi
SP=$(python3 -c "import nvidia,os;print(os.path.dirname(list(nvidia.__path__)[0]))")
ln -sfn "$SP/nvidia" $D/site/nvidia
export LD_LIBRARY_PATH=$D/site/mlx/lib:$D/site/mlx_cuda_13.libs
mkdir -p /work && ln -sfn "$PWD" /work/main
tar xJf .dev3/bins.tar.xz -C $D/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
cd $D/bin
for t in mlx_backend conformance_tiny conformance_hybrid; do
  timeout 240 ./$t --test-threads 4 2>&1 | tee $OUT/$t.log | tail -25
done
# The GPU's memory bandwidth, measured in this run: a device-to-device copy of
# 4 GiB (bytes read + written), the median of 10.
python3 - <<'PY' | tee $OUT/gpu_bw.txt
import torch, statistics
x = torch.empty(1 << 30, dtype=torch.float32, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = []
for _ in range(10):
    a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); torch.cuda.synchronize(); t.append(a.elapsed_time(b) / 1e3)
s = statistics.median(t); print(f"copy read+write {2 * x.numel() * 4 / s / 1e9:.0f} GB/s; read {x.numel() * 4 / s / 1e9:.0f} GB/s")
PY
VOOM_HOME=$D/home timeout 420 ./voom bench --synthetic-only --synthetic-gb 1.5 --backend cpu,mlx \
  --threads 16 --prompt-tokens 256 --decode-tokens 16 --runs 3 2>&1 | tee $OUT/bench.txt | tail -6
