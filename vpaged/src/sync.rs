//! The synchronization primitives of the page cache's protocol, swappable for loom's.
//!
//! A normal build uses `std::sync`. Built with `RUSTFLAGS="--cfg vpaged_loom"`, the cache's
//! state lock and its in-flight cells use loom's models instead, so
//! `tests/loom_cache.rs` can explore every interleaving of leases, loads, waiters and
//! eviction. Only what the protocol's ordering depends on is swapped: `Arc` stays
//! `std::sync::Arc` (it carries no protocol state, and error values must keep their
//! public type, `Arc<dyn Error>` included, which loom's `Arc` cannot hold).

// `vpaged_loom` is not a cfg rustc knows; declaring it needs `check-cfg` in the workspace's
// `[workspace.lints.rust]` (a crate with `lints.workspace = true` cannot add its own),
// so until then the lint is allowed here.
#![allow(unexpected_cfgs)]

#[cfg(vpaged_loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(vpaged_loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};
