//! The `vl` command; see the `vl_cli` crate documentation.

use std::process::ExitCode;

fn main() -> ExitCode {
    vl_cli::main_with(std::env::args_os())
}
