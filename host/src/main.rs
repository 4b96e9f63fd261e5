//! The `kiln` command.
fn main() -> std::process::ExitCode {
    kiln_host::cli::main()
}
