// The C ABI vOOM calls MLX through (libvoom::backend::mlx::ffi).
//
// An activation is an `mx::array*` made here (`new`) and freed by `voom_mlx_free`:
// a node of MLX's lazy graph, always float32 and two-dimensional (rows x cols).
// Every function but `voom_mlx_version`, `voom_mlx_device` and `voom_mlx_free`
// returns 0 on success, or -1 with a message in `err` (MLX throws C++ exceptions,
// which must not cross into Rust). The Rust side serialises every call.
//
// Memory borrowed from the caller (a weight page, a KV cache page) is wrapped
// without a copy where MLX can (Metal), and copied where it cannot (MLX's CPU and
// CUDA builds copy when the array is made). A weight page comes with a keep-alive
// (the caller's lease), released when MLX frees the wrapping buffer, so a product
// stays in the lazy graph; memory wrapped with no keep-alive (KV pages) is read by
// an evaluation before the function returns. Functions that evaluate say so in
// `evaluated`, so the caller can count graph evaluations.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

// A weight matrix as the Rust side describes it (`ffi::VoomWeight`): `rows x cols`
// elements at `w` in `format`: 0 float32, 1 bfloat16, 2 float16 (one element
// each); 3 FP8 e4m3 (a byte each) with one scale per `block_rows x block_cols`
// block, `scale_rows x scale_cols` of them (row-major, `scale_dtype` 0 float32 or
// 1 bfloat16), the view's row 0 being row `row0` of the first block row; 4 MXFP4
// (two e2m1 elements a byte, the low nibble first) with one e8m0 byte per 32
// elements of a row (`scale_rows = rows`, `scale_cols = cols / 32`). The scales
// are copied (at most 1/16 of the weight's bytes); the elements borrowed.
struct VoomWeight {
    const void* w;
    int format;
    int rows;
    int cols;
    const void* scales;
    int scale_dtype;
    int scale_rows;
    int scale_cols;
    int block_rows;
    int block_cols;
    int row0;
};

namespace {

int fail(const char* what, char* err, int errlen) {
    if (err && errlen > 0) {
        std::strncpy(err, what, errlen - 1);
        err[errlen - 1] = 0;
    }
    return -1;
}

// Runs `f`, turning an exception into -1 and its message.
template <class F>
int guard(char* err, int errlen, F f) {
    try {
        f();
        return 0;
    } catch (const std::exception& e) {
        return fail(e.what(), err, errlen);
    } catch (...) {
        return fail("unknown C++ exception from MLX", err, errlen);
    }
}

mx::array& arr(void* h) { return *static_cast<mx::array*>(h); }

void* own(mx::array a) { return new mx::array(std::move(a)); }

// Dtype codes the Rust side passes: 0 float32, 1 bfloat16, 2 float16.
mx::Dtype dtype_of(int code) {
    switch (code) {
        case 0:
            return mx::float32;
        case 1:
            return mx::bfloat16;
        case 2:
            return mx::float16;
        default:
            throw std::invalid_argument("unknown weight dtype code");
    }
}

// The caller's keep-alive of borrowed memory: `release(ctx)` runs once, when the
// last copy of the shared pointer goes (the array's buffer freed, or at once when
// MLX copied the memory).
struct Keep {
    void* ctx;
    void (*release)(void*);
    Keep(void* c, void (*r)(void*)) : ctx(c), release(r) {}
    Keep(const Keep&) = delete;
    Keep& operator=(const Keep&) = delete;
    ~Keep() {
        if (release) release(ctx);
    }
};

// Takes ownership of `ctx`: released even when making the pointer fails.
std::shared_ptr<Keep> keep_of(void* ctx, void (*release)(void*)) {
    Keep* k;
    try {
        k = new Keep(ctx, release);
    } catch (...) {
        if (release) release(ctx);
        throw;
    }
    // Should making the control block fail, the pointer is deleted: released.
    return std::shared_ptr<Keep>(k);
}

// `rows x cols` elements of `dtype` at `p`, borrowed: wrapped without a copy where
// MLX can, `keep` alive until MLX frees the buffer. `copied` is raised by the bytes
// MLX copied; `wrapped` says whether it did not.
mx::array borrow(const void* p, int rows, int cols, mx::Dtype dtype, std::shared_ptr<Keep> keep,
                 uint64_t* copied, bool* wrapped) {
    mx::array a(const_cast<void*>(p), {rows, cols}, dtype, [keep](void*) {});
    bool in_place = a.data<void>() == p;
    if (copied && !in_place) {
        *copied += a.nbytes();
    }
    if (wrapped) *wrapped = in_place;
    return a;
}

// Evaluates `v`; 1 in `evaluated` when any of it was not computed yet.
void eval_counted(std::vector<mx::array> v, int* evaluated) {
    bool pending = false;
    for (auto& a : v) pending = pending || !a.is_available();
    mx::eval(v);
    if (evaluated) *evaluated = pending ? 1 : 0;
}

// Widened exactly to float32 (BF16 and F16 are subsets of it).
mx::array widen(mx::array a) {
    return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32);
}

// Float32 products on NVIDIA GPUs would otherwise use TF32 tensor cores, which round
// each factor to 10 mantissa bits: not the reference's arithmetic. MLX reads the
// variable once, at its first product; this runs when the program is loaded, before
// any thread exists, and overrides any value set.
[[maybe_unused]] const bool tf32_off = [] {
    setenv("MLX_ENABLE_TF32", "0", 1);
    return true;
}();

// A copy of `n` elements of `dtype` at `p`, any alignment, as float32 (`uint8`:
// kept as bytes).
mx::array copied_scales(const void* p, int rows, int cols, int dtype) {
    size_t n = size_t(rows) * size_t(cols);
    switch (dtype) {
        case 0: {
            std::vector<float> v(n);
            std::memcpy(v.data(), p, n * sizeof(float));
            return mx::array(v.data(), {rows, cols}, mx::float32);
        }
        case 1: {
            std::vector<uint16_t> v(n);
            std::memcpy(v.data(), p, n * sizeof(uint16_t));
            mx::array bits(v.data(), {rows, cols}, mx::uint16);
            return mx::astype(mx::view(bits, mx::bfloat16), mx::float32);
        }
        case 5:
            return mx::array(static_cast<const uint8_t*>(p), {rows, cols}, mx::uint8);
        default:
            throw std::invalid_argument("unknown scale dtype code");
    }
}

// An FP8 weight as float32: each e4m3 element (exact in float32) times its block's
// scale, one rounding, as the CPU's specification (`WeightView::get`).
mx::array fp8_weight(const VoomWeight& q, mx::array bytes) {
    mx::array e = mx::from_fp8(bytes, mx::float32);
    mx::array s = copied_scales(q.scales, q.scale_rows, q.scale_cols, q.scale_dtype);
    // The scales of each row: block row (row0 + r) / block_rows.
    std::vector<int32_t> ri(q.rows);
    for (int r = 0; r < q.rows; r++) ri[r] = (q.row0 + r) / q.block_rows;
    mx::array per_row = mx::take(s, mx::array(ri.data(), {q.rows}, mx::int32), 0);
    if (q.cols % q.block_cols == 0) {
        int nb = q.cols / q.block_cols;
        mx::array y = mx::multiply(mx::reshape(e, {q.rows, nb, q.block_cols}),
                                   mx::reshape(per_row, {q.rows, nb, 1}));
        return mx::reshape(y, {q.rows, q.cols});
    }
    std::vector<int32_t> ci(q.cols);
    for (int c = 0; c < q.cols; c++) ci[c] = c / q.block_cols;
    return mx::multiply(e, mx::take(per_row, mx::array(ci.data(), {q.cols}, mx::int32), 1));
}

}  // namespace

extern "C" {

// MLX's version ("0.32.4").
const char* voom_mlx_version() {
    static std::string v = mx::version();
    return v.c_str();
}

// The device MLX computes on by default: "gpu" or "cpu".
const char* voom_mlx_device() {
    try {
        return mx::default_device() == mx::Device::gpu ? "gpu" : "cpu";
    } catch (...) {
        return "cpu";
    }
}

void voom_mlx_free(void* h) { delete static_cast<mx::array*>(h); }

// `rows x cols` zeros.
int voom_mlx_zeros(int rows, int cols, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] { *out = own(mx::zeros({rows, cols}, mx::float32)); });
}

// A copy of `rows x cols` floats of host memory.
int voom_mlx_upload(const float* data, int rows, int cols, void** out, char* err,
                    int errlen) {
    return guard(err, errlen, [&] {
        *out = own(mx::array(data, {rows, cols}, mx::float32));
    });
}

// Evaluates `h` and copies its `len` floats, row-major, to `dst`.
int voom_mlx_download(void* h, float* dst, size_t len, int* evaluated, char* err,
                      int errlen) {
    return guard(err, errlen, [&] {
        bool pending = !arr(h).is_available();
        mx::array c = mx::contiguous(arr(h));
        mx::eval(c);
        if (evaluated) *evaluated = pending ? 1 : 0;
        if (c.size() != len) {
            throw std::invalid_argument("download length differs from the array's size");
        }
        std::memcpy(dst, c.data<float>(), sizeof(float) * len);
    });
}

// Evaluates the `n` arrays `hs` together.
int voom_mlx_eval(void* const* hs, int n, int* evaluated, char* err, int errlen) {
    return guard(err, errlen, [&] {
        std::vector<mx::array> v;
        v.reserve(n);
        for (int i = 0; i < n; i++) v.push_back(arr(hs[i]));
        eval_counted(std::move(v), evaluated);
    });
}

// Rows `start..end` of `h`.
int voom_mlx_rows(void* h, int start, int end, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        mx::array& a = arr(h);
        *out = own(mx::slice(a, {start, 0}, {end, a.shape(1)}));
    });
}

// `parts` one after the other (row-wise).
int voom_mlx_stack(void* const* parts, int n, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        std::vector<mx::array> v;
        v.reserve(n);
        for (int i = 0; i < n; i++) v.push_back(arr(parts[i]));
        *out = own(mx::concatenate(v, 0));
    });
}

// `x` times the weight `q` (elements borrowed, kept alive by `keep_ctx` until
// `keep_release(keep_ctx)`, which runs exactly once, failure or not; `keep_release`
// null: no keep-alive): `x · wᵀ` (`transposed == 0`: x is n x cols), or `x · w`
// (`transposed != 0`: x is n x rows). Plain and FP8 weights are widened to float32
// and multiplied by MLX's float32 product; MXFP4 by MLX's `quantized_matmul`
// (mode "mxfp4", groups of 32), which dequantizes inside its kernel (e2m1 times
// 2^(e - 127): exact) and accumulates in float32. Left in the lazy graph when the
// weight was copied or is kept alive; evaluated before it returns when it is
// wrapped with nothing keeping it.
int voom_mlx_matmul(void* x, const VoomWeight* q, int transposed, void* keep_ctx,
                    void (*keep_release)(void*), uint64_t* copied, int* evaluated, void** out,
                    char* err, int errlen) {
    // Owned from here, whatever happens next.
    std::shared_ptr<Keep> keep;
    int rc = guard(err, errlen, [&] { keep = keep_of(keep_ctx, keep_release); });
    if (rc != 0) return rc;
    return guard(err, errlen, [&] {
        if (evaluated) *evaluated = 0;
        bool wrapped = false;
        mx::array y(0.0f);
        switch (q->format) {
            case 0:
            case 1:
            case 2:
            case 3: {
                mx::array wf =
                    q->format == 3
                        ? fp8_weight(*q, borrow(q->w, q->rows, q->cols, mx::uint8,
                                                std::move(keep), copied, &wrapped))
                        : widen(borrow(q->w, q->rows, q->cols, dtype_of(q->format),
                                       std::move(keep), copied, &wrapped));
                y = transposed ? mx::matmul(arr(x), wf) : mx::matmul(arr(x), mx::transpose(wf));
                break;
            }
            case 4: {
                if (q->cols % 32 != 0 || q->scale_rows != q->rows || q->scale_cols != q->cols / 32) {
                    throw std::invalid_argument("MXFP4 scales do not match the weight's shape");
                }
                mx::array packed = borrow(q->w, q->rows, q->cols / 8, mx::uint32, std::move(keep),
                                          copied, &wrapped);
                mx::array s = copied_scales(q->scales, q->scale_rows, q->scale_cols, 5);
                y = mx::quantized_matmul(arr(x), packed, s, std::nullopt, transposed == 0, 32, 4,
                                         "mxfp4");
                break;
            }
            default:
                throw std::invalid_argument("unknown weight format code");
        }
        if (wrapped && !keep_release) eval_counted({y}, evaluated);
        *out = own(std::move(y));
    });
}

// `x + b` for every row (`b` has `x`'s columns).
int voom_mlx_add_row(void* x, const float* b, int len, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        mx::array bias(b, {1, len}, mx::float32);
        *out = own(mx::add(arr(x), bias));
    });
}

// RMSNorm of each `group`-sized piece of every row, as transformers computes it:
// `w * (x * rsqrt(mean(x²) + eps))`.
int voom_mlx_rms_norm(void* x, const float* w, int group, float eps, void** out, char* err,
                      int errlen) {
    return guard(err, errlen, [&] {
        mx::array& a = arr(x);
        mx::array g = mx::reshape(a, {-1, group});
        mx::array var = mx::mean(mx::square(g), -1, true);
        mx::array y = mx::multiply(g, mx::rsqrt(mx::add(var, mx::array(eps))));
        y = mx::multiply(mx::array(w, {1, group}, mx::float32), y);
        *out = own(mx::reshape(y, a.shape()));
    });
}

// Rotary embedding of `2 * half` floats from `offset` of every `head_dim`-sized head
// of row `t`, by `cos[t * half + i]` and `sin[t * half + i]`: rotate-half pairs
// `(x[i], x[i + half])`, or interleaved pairs `(x[2i], x[2i + 1])` written back
// de-interleaved. Each product is rounded, then the sum (no fused multiply-add).
int voom_mlx_rope(void* x, const float* cos, const float* sin, int half, int head_dim,
                  int offset, int interleaved, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        mx::array& a = arr(x);
        int n = a.shape(0), cols = a.shape(1), heads = cols / head_dim;
        mx::array h = mx::reshape(a, {n, heads, head_dim});
        mx::array c(cos, {n, 1, half}, mx::float32);
        mx::array s(sin, {n, 1, half}, mx::float32);
        mx::array x1(0.0f), x2(0.0f);
        if (interleaved) {
            mx::array p = mx::slice(h, {0, 0, offset}, {n, heads, offset + 2 * half});
            p = mx::reshape(p, {n, heads, half, 2});
            x1 = mx::reshape(mx::slice(p, {0, 0, 0, 0}, {n, heads, half, 1}), {n, heads, half});
            x2 = mx::reshape(mx::slice(p, {0, 0, 0, 1}, {n, heads, half, 2}), {n, heads, half});
        } else {
            x1 = mx::slice(h, {0, 0, offset}, {n, heads, offset + half});
            x2 = mx::slice(h, {0, 0, offset + half}, {n, heads, offset + 2 * half});
        }
        mx::array o1 = mx::subtract(mx::multiply(x1, c), mx::multiply(x2, s));
        mx::array o2 = mx::add(mx::multiply(x2, c), mx::multiply(x1, s));
        std::vector<mx::array> parts;
        if (offset > 0) parts.push_back(mx::slice(h, {0, 0, 0}, {n, heads, offset}));
        parts.push_back(o1);
        parts.push_back(o2);
        if (offset + 2 * half < head_dim) {
            parts.push_back(mx::slice(h, {0, 0, offset + 2 * half}, {n, heads, head_dim}));
        }
        *out = own(mx::reshape(mx::concatenate(parts, 2), {n, cols}));
    });
}

int voom_mlx_add(void* x, void* y, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] { *out = own(mx::add(arr(x), arr(y))); });
}

// `silu(g) * u`, SiLU as torch computes it on the CPU: `g / (1 + exp(-g))`.
int voom_mlx_silu_mul(void* g, void* u, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        mx::array& a = arr(g);
        mx::array s = mx::divide(a, mx::add(mx::array(1.0f), mx::exp(mx::negative(a))));
        *out = own(mx::multiply(s, arr(u)));
    });
}

// gpt-oss's clamped SwiGLU, as transformers computes it: `g = min(gate, limit)`,
// `u = clip(up, -limit, limit)`, `(u + 1) * (g * (1 / (1 + exp(-(g * alpha)))))`.
int voom_mlx_clamped_swiglu(void* g, void* u, float alpha, float limit, void** out, char* err,
                            int errlen) {
    return guard(err, errlen, [&] {
        mx::array gc = mx::minimum(arr(g), mx::array(limit));
        mx::array uc = mx::clip(arr(u), mx::array(-limit), mx::array(limit));
        mx::array s = mx::divide(mx::array(1.0f),
                                 mx::add(mx::array(1.0f),
                                         mx::exp(mx::negative(mx::multiply(gc, mx::array(alpha))))));
        *out = own(mx::multiply(mx::add(uc, mx::array(1.0f)), mx::multiply(gc, s)));
    });
}

int voom_mlx_clamp(void* x, float limit, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        *out = own(mx::clip(arr(x), mx::array(-limit), mx::array(limit)));
    });
}

// Softmax of each row: the maximum subtracted, exponentials, each divided by their
// sum.
int voom_mlx_softmax(void* x, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        mx::array& a = arr(x);
        mx::array e = mx::exp(mx::subtract(a, mx::max(a, -1, true)));
        *out = own(mx::divide(e, mx::sum(e, -1, true)));
    });
}

// `1 / (1 + exp(-x))`.
int voom_mlx_sigmoid(void* x, void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        mx::array& a = arr(x);
        *out = own(mx::divide(mx::array(1.0f), mx::add(mx::array(1.0f), mx::exp(mx::negative(a)))));
    });
}

// Causal attention of the `n` queries `q` (n x heads*dk, positions pos0..pos0+n)
// over cached positions `lo..pos0+n`, borrowed from host pages: segment `i` holds
// `seg_len[i]` consecutive positions of `width` floats from `k_seg[i]` (keys) and
// `v_seg[i]` (values). A position's key is `kv_heads * dk` floats from `k_off`, its
// value `kv_heads * dv` floats from `v_off`; query head `h` reads key/value head
// `h / (heads / kv_heads)`. Query `t` attends positions `max(lo_t, ...)..=pos0+t`
// with `lo_t = pos0 + t + 1 - window` (`window <= 0`: from 0). Scores are the dot
// product times `scale`; the softmax as `voom_mlx_softmax`, its sum a product with
// ones (each row summed in increasing position, so positions masked off add exact
// zeros after the last); with `sinks` (one logit per query head, gpt-oss), the
// maximum is taken over the scores and the head's sink, and `exp(sink - max)` is
// added to the sum after the scores' (the sink's probability attends nothing);
// the output is the probabilities times the values.
// The pages are the cache's, with no keep-alive: evaluated before it returns when
// MLX wrapped any of them, left in the graph when it copied them all.
int voom_mlx_attention(void* q, const float* const* k_seg, const float* const* v_seg,
                       const int* seg_len, int nseg, int width, int k_off, int v_off, int dk,
                       int dv, int heads, int kv_heads, int pos0, int lo, int window,
                       float scale, const float* sinks, uint64_t* copied, int* evaluated,
                       void** out, char* err, int errlen) {
    return guard(err, errlen, [&] {
        if (evaluated) *evaluated = 0;
        bool any_wrapped = false;
        mx::array& qa = arr(q);
        int n = qa.shape(0);
        int group = heads / kv_heads;
        std::vector<mx::array> ks, vs;
        int total = 0;
        for (int i = 0; i < nseg; i++) {
            bool kw = false, vw = false;
            ks.push_back(borrow(k_seg[i], seg_len[i], width, mx::float32, nullptr, copied, &kw));
            vs.push_back(borrow(v_seg[i], seg_len[i], width, mx::float32, nullptr, copied, &vw));
            any_wrapped = any_wrapped || kw || vw;
            total += seg_len[i];
        }
        if (total != pos0 + n - lo) {
            throw std::invalid_argument("cached positions do not cover the queries");
        }
        mx::array kc = nseg == 1 ? ks[0] : mx::concatenate(ks, 0);
        mx::array vc = nseg == 1 ? vs[0] : mx::concatenate(vs, 0);
        int T = total;
        // [T, kv_heads, d] -> [kv_heads, T, d]
        mx::array keys = mx::transpose(
            mx::reshape(mx::slice(kc, {0, k_off}, {T, k_off + kv_heads * dk}), {T, kv_heads, dk}),
            {1, 0, 2});
        mx::array vals = mx::transpose(
            mx::reshape(mx::slice(vc, {0, v_off}, {T, v_off + kv_heads * dv}), {T, kv_heads, dv}),
            {1, 0, 2});
        // [n, kv_heads, group, dk] -> [kv_heads, group * n, dk] (rows head-major)
        mx::array qh = mx::reshape(
            mx::transpose(mx::reshape(qa, {n, kv_heads, group, dk}), {1, 2, 0, 3}),
            {kv_heads, group * n, dk});
        mx::array scores =
            mx::multiply(mx::matmul(qh, mx::transpose(keys, {0, 2, 1})), mx::array(scale));
        // Query t (row r: t = r % n) sees absolute positions lo_t..=pos0+t.
        mx::array pos = mx::arange(lo, lo + T, mx::int32);
        mx::array qpos = mx::reshape(mx::arange(pos0, pos0 + n, mx::int32), {n, 1});
        mx::array see = mx::less_equal(mx::reshape(pos, {1, T}), qpos);
        if (window > 0) {
            see = mx::logical_and(
                see, mx::greater(mx::reshape(pos, {1, T}), mx::subtract(qpos, mx::array(window))));
        }
        scores = mx::reshape(scores, {kv_heads, group, n, T});
        scores = mx::where(see, scores, mx::array(-std::numeric_limits<float>::infinity()));
        mx::array m = mx::max(scores, -1, true);
        std::optional<mx::array> sink;
        if (sinks) {
            // Query head h = kv * group + g: its sink beside each of its rows' scores.
            sink = mx::array(sinks, {kv_heads, group, 1, 1}, mx::float32);
            m = mx::maximum(m, *sink);
        }
        mx::array e = mx::exp(mx::subtract(scores, m));
        mx::array sum = mx::matmul(e, mx::ones({T, 1}, mx::float32));
        if (sink) sum = mx::add(sum, mx::exp(mx::subtract(*sink, m)));
        mx::array p = mx::reshape(mx::divide(e, sum), {kv_heads, group * n, T});
        mx::array o = mx::matmul(p, vals);  // [kv_heads, group * n, dv]
        o = mx::transpose(mx::reshape(o, {kv_heads, group, n, dv}), {2, 0, 1, 3});
        mx::array y = mx::reshape(o, {n, heads * dv});
        if (any_wrapped) eval_counted({y}, evaluated);
        *out = own(std::move(y));
    });
}

}  // extern "C"
