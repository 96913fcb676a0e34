//! The `voom` binary's implementation, as a library so that its fuzz targets and
//! benchmarks reach its parsers: the one-shot commands ([`cli`]), runtime profiles
//! ([`profile`]), the local model store ([`store`]) and the HTTP server ([`serve`]).
//! It is the binary's inside, not a published API: errors are `anyhow` in the
//! commands, typed ([`serve::error::ApiError`]) in the server.

pub mod blockdev;
pub mod cgroup;
pub mod cli;
pub mod memory;
pub mod profile;
pub mod registry;
pub mod serve;
pub mod staging;
pub mod store;
pub mod synth;
