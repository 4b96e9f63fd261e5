//! `kiln kernels …`.

use std::process::ExitCode;

use clap::Subcommand;

use crate::Result;

use super::PackageArgs;

#[derive(Subcommand, Debug)]
pub enum KernelsCommand {
    /// List the packages kiln can use: name, version, origin, ops and dtypes.
    List {
        #[command(flatten)]
        packages: PackageArgs,
    },
}

pub fn run(cmd: KernelsCommand) -> Result<ExitCode> {
    match cmd {
        KernelsCommand::List { packages } => {
            let (reg, errors) = crate::packages::registry(&crate::packages::search_path(&packages.packages));
            for p in reg.packages() {
                let m = &p.manifest;
                println!("{} {}  ({})", m.package.name, m.package.version, p.origin);
                if !m.package.description.is_empty() {
                    println!("  {}", m.package.description);
                }
                for op in &m.ops {
                    let domain = if op.domain.is_empty() { "ai.onnx" } else { &op.domain };
                    let until = op.until_opset.map_or(String::new(), |u| u.to_string());
                    println!(
                        "  {domain} opset {}..{until}: {}\n    dtypes: {}  max rank {}",
                        op.since_opset,
                        op.op_types.join(", "),
                        op.dtypes.join(", "),
                        op.max_rank
                    );
                }
            }
            for e in &errors {
                println!("BROKEN: {e}");
            }
            Ok(if errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
    }
}
