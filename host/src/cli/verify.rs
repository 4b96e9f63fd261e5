//! `kiln verify PACKAGE` (being written).

use std::process::ExitCode;

use crate::{Error, Result};

#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The package name (e.g. kiln-unary) or folder.
    pub package: String,
}

pub fn run(a: VerifyArgs) -> Result<ExitCode> {
    Err(Error::Unsupported(format!("kiln verify {}: not available yet", a.package)))
}
