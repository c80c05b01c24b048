//! Caption images: the same flags, output and exit codes as `vl caption`.
//!
//! `cargo run --release --example caption -- [OPTIONS] <IMAGE|DIR>...`
//!
//! The `vl` binary (`cargo install --path crates/vl-cli`) is the installed
//! form of this demo; see `vl caption --help`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `caption ARGS` → `vl caption ARGS`.
    args.insert(1, "caption".into());
    vl_cli::main_with(args)
}
