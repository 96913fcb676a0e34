// The C ABI vOOM calls MLX through (libvoom::backend::mlx). Every function returns
// 0 on success, or -1 with a message in `err` (MLX throws C++ exceptions, which must
// not cross into Rust).
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include "mlx/mlx.h"

namespace mx = mlx::core;

static int fail(const std::exception& e, char* err, int errlen) {
    if (err && errlen > 0) {
        std::strncpy(err, e.what(), errlen - 1);
        err[errlen - 1] = 0;
    }
    return -1;
}

extern "C" {

// MLX's version ("0.32.4").
const char* voom_mlx_version() {
    static std::string v = mx::version();
    return v.c_str();
}

// out[n][m] = sum_k x[n][k] * w[m][k]: f32 activations `x` (n x k) times BF16
// weights `w` (m x k, row-major as checkpoints store them) widened to f32, on MLX's
// default device.
int voom_mlx_matmul_bf16(const float* x, int n, int k, const uint16_t* w, int m,
                         float* out, char* err, int errlen) {
    try {
        mx::array xa(x, {n, k}, mx::float32);
        mx::array wa(reinterpret_cast<const mx::bfloat16_t*>(w), {m, k}, mx::bfloat16);
        mx::array y = mx::matmul(xa, mx::transpose(mx::astype(wa, mx::float32)));
        mx::eval(y);
        std::memcpy(out, y.data<float>(), sizeof(float) * static_cast<size_t>(n) * m);
        return 0;
    } catch (const std::exception& e) {
        return fail(e, err, errlen);
    }
}

}  // extern "C"
