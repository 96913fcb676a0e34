//! The `voom` subcommands, one module each.

pub mod bench;
pub mod budget;
pub mod common;
pub mod generate;
pub mod list;
pub mod llama_cpp;
pub mod long_context_bench;
pub mod out_of_core;
pub mod perplexity;
pub mod plan;
pub mod prefix_bench;
pub mod profiles;
pub mod pull;
pub mod run;
pub mod spec_bench;
