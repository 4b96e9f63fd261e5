//! `kiln conformance`.

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

use crate::conformance::{run_test, summary, test_dirs, Outcome};
use crate::ep::{Runtime, SessionOptions};
use crate::{Error, Result};

use super::{choose_device, registry, DeviceArg, PackageArgs};

#[derive(clap::Args, Debug)]
pub struct ConformanceArgs {
    /// A folder of ONNX node tests (onnx/backend/test/data/node), or one test folder.
    pub dir: PathBuf,
    #[arg(long, value_enum, default_value_t)]
    pub device: DeviceArg,
    /// Only tests whose folder name contains this (comma-separated: any of them, as in
    /// `--filter test_lstm,test_gru`).
    #[arg(long)]
    pub filter: Option<String>,
    /// On the CPU, also run every node's GPU dispatch and validate its launch plan.
    #[arg(long)]
    pub check_dispatch: bool,
    /// Write every test's result as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub packages: PackageArgs,
}

pub fn run(a: ConformanceArgs) -> Result<ExitCode> {
    super::output::check_path("--json", &a.json)?;
    let human = super::output::Human::new(&[&a.json]);
    let device = choose_device(a.device)?;
    if a.dir.is_file() {
        return Err(Error::Input(format!(
            "{} is a file: give a folder of node tests (test_*/model.onnx) or one test folder",
            a.dir.display()
        )));
    }
    let dirs = test_dirs(&a.dir, a.filter.as_deref())?;
    if dirs.is_empty() {
        return Err(Error::Input(match &a.filter {
            Some(f) if !test_dirs(&a.dir, None)?.is_empty() => format!(
                "{}: no test folder's name contains {f:?} (names are matched as written, e.g. test_lpnormalization_default)",
                a.dir.display()
            ),
            _ => format!("{}: no test folders (test_*/model.onnx) found", a.dir.display()),
        }));
    }
    let rt = Runtime::new(registry(&a.packages)?, super::sandbox_config())?;
    let options = SessionOptions {
        device,
        check_dispatch: a.check_dispatch,
        small_integer_nodes_on_host: false,
        ..SessionOptions::default()
    };
    let progress = super::progress::Progress::bar(dirs.len() as u64, "conformance");
    let results: Vec<_> = dirs
        .iter()
        .map(|d| {
            progress.message(&d.file_name().unwrap_or_default().to_string_lossy());
            let r = run_test(&rt, d, &options);
            progress.step("");
            r
        })
        .collect();
    drop(progress);
    human.print(&summary(&results));
    if let Some(p) = &a.json {
        let count = |f: fn(&Outcome) -> bool| results.iter().filter(|r| f(&r.outcome)).count();
        let doc = json!({
            "device": device.to_string(),
            "passed": count(|o| matches!(o, Outcome::Passed)),
            "failed": count(|o| matches!(o, Outcome::Failed(_))),
            "unsupported": count(|o| matches!(o, Outcome::Unsupported(_))),
            "tests": results,
        });
        super::output::write_json(p, &doc)?;
    }
    let failed = results.iter().any(|r| matches!(r.outcome, Outcome::Failed(_)));
    Ok(super::exit::checks(failed))
}
