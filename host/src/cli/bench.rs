//! `kiln bench ops` (being written).

use std::process::ExitCode;

use clap::Subcommand;

use crate::{Error, Result};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// GEMM, elementwise and dispatch-overhead microbenchmarks on the GPU.
    Ops,
}

pub fn run(_cmd: BenchCommand) -> Result<ExitCode> {
    Err(Error::Unsupported("kiln bench ops: not available yet".into()))
}
