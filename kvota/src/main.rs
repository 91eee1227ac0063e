//! `kvota`: one binary for every role. This file only parses arguments and dispatches;
//! the work lives in the library crates.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvota: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
