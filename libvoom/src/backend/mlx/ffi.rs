//! The shim's C ABI (`shim.cpp`) and the one handle type over it.
//!
//! MLX is not safe to drive from several threads at once, so every call into the
//! shim, and every free of an array, holds one process-wide lock ([`lock`]).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use crate::backend::KernelError;

/// A weight matrix for `voom_mlx_matmul` (`shim.cpp`'s `VoomWeight` says what each
/// field means): `format` 0 F32, 1 BF16, 2 F16, 3 FP8 e4m3 block-scaled, 4 MXFP4;
/// `scale_dtype` 0 F32, 1 BF16, 5 U8.
#[repr(C)]
#[derive(Debug)]
pub struct VoomWeight {
    pub w: *const c_void,
    pub format: c_int,
    pub rows: c_int,
    pub cols: c_int,
    pub scales: *const c_void,
    pub scale_dtype: c_int,
    pub scale_rows: c_int,
    pub scale_cols: c_int,
    pub block_rows: c_int,
    pub block_cols: c_int,
    pub row0: c_int,
}

extern "C" {
    pub fn voom_mlx_version() -> *const c_char;
    pub fn voom_mlx_device() -> *const c_char;
    pub fn voom_mlx_free(h: *mut c_void);
    pub fn voom_mlx_zeros(
        rows: c_int,
        cols: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_upload(
        data: *const f32,
        rows: c_int,
        cols: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_download(
        h: *mut c_void,
        dst: *mut f32,
        len: usize,
        evaluated: *mut c_int,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_eval(
        hs: *const *mut c_void,
        n: c_int,
        evaluated: *mut c_int,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_rows(
        h: *mut c_void,
        start: c_int,
        end: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_stack(
        parts: *const *mut c_void,
        n: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_matmul(
        x: *mut c_void,
        w: *const VoomWeight,
        transposed: c_int,
        keep_ctx: *mut c_void,
        keep_release: Option<unsafe extern "C" fn(*mut c_void)>,
        copied: *mut u64,
        evaluated: *mut c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_add_row(
        x: *mut c_void,
        b: *const f32,
        len: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_rms_norm(
        x: *mut c_void,
        w: *const f32,
        group: c_int,
        eps: f32,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_rope(
        x: *mut c_void,
        cos: *const f32,
        sin: *const f32,
        half: c_int,
        head_dim: c_int,
        offset: c_int,
        interleaved: c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_add(
        x: *mut c_void,
        y: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_silu_mul(
        g: *mut c_void,
        u: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_clamped_swiglu(
        g: *mut c_void,
        u: *mut c_void,
        alpha: f32,
        limit: f32,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_clamp(
        x: *mut c_void,
        limit: f32,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_softmax(
        x: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_sigmoid(
        x: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
    pub fn voom_mlx_attention(
        q: *mut c_void,
        k_seg: *const *const f32,
        v_seg: *const *const f32,
        seg_len: *const c_int,
        nseg: c_int,
        width: c_int,
        k_off: c_int,
        v_off: c_int,
        dk: c_int,
        dv: c_int,
        heads: c_int,
        kv_heads: c_int,
        pos0: c_int,
        lo: c_int,
        window: c_int,
        scale: f32,
        sinks: *const f32,
        copied: *mut u64,
        evaluated: *mut c_int,
        out: *mut *mut c_void,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
}

static MLX: Mutex<()> = Mutex::new(());

/// The lock every call into MLX holds.
pub fn lock() -> MutexGuard<'static, ()> {
    MLX.lock().unwrap_or_else(|e| e.into_inner())
}

/// A static string the shim returned.
pub fn static_str(p: *const c_char) -> String {
    // SAFETY: the shim returns pointers to static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An MLX array made by the shim, freed when dropped.
#[derive(Debug)]
pub struct Handle(NonNull<c_void>);

// SAFETY: the array is only read or freed by calls into the shim, and every such
// call holds the process-wide lock (`lock`), so no two threads touch MLX at once.
unsafe impl Send for Handle {}
// SAFETY: as for `Send`: shared references only reach the array through locked calls.
unsafe impl Sync for Handle {}

impl Handle {
    pub fn ptr(&self) -> *mut c_void {
        self.0.as_ptr()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let _g = lock();
        // SAFETY: the pointer came from the shim (`new mx::array`) and is freed once,
        // here, under the lock.
        unsafe { voom_mlx_free(self.0.as_ptr()) }
    }
}

/// An `int` argument of the shim; `what` names it when it does not fit.
pub fn int(what: &'static str, v: usize) -> Result<c_int, KernelError> {
    c_int::try_from(v).map_err(|_| KernelError::Backend(format!("MLX: {what} {v} exceeds i32")))
}

/// Calls a shim function `f(out, err, errlen)` that makes one array, under the lock.
pub fn make(
    f: impl FnOnce(*mut *mut c_void, *mut c_char, c_int) -> c_int,
) -> Result<Handle, KernelError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    status(|err, len| f(&mut out, err, len))?;
    NonNull::new(out)
        .map(Handle)
        .ok_or_else(|| KernelError::Backend("MLX returned no array".into()))
}

/// Calls a shim function `f(err, errlen)` under the lock; its message on failure.
pub fn status(f: impl FnOnce(*mut c_char, c_int) -> c_int) -> Result<(), KernelError> {
    let mut err = [0 as c_char; 512];
    let rc = {
        let _g = lock();
        f(err.as_mut_ptr(), err.len() as c_int)
    };
    if rc != 0 {
        // SAFETY: the shim NUL-terminates its message within the buffer's length,
        // and the buffer starts zeroed.
        let why = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        return Err(KernelError::Backend(format!("MLX: {why}")));
    }
    Ok(())
}
