//! `kvota`: one binary for every role. This file only parses arguments and dispatches;
//! the work lives in the library crates.

/// `println!` that ends the process quietly when stdout is gone (`kvota tenants | head`)
/// instead of panicking on a broken pipe.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($t)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// `print!` with the same behaviour as [`out!`].
macro_rules! outp {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if write!(std::io::stdout(), $($t)*).is_err() {
            std::process::exit(0);
        }
    }};
}

mod admin_cmd;
mod agent_cmd;
mod certs_cmd;
mod cli;
mod dashboard_cmd;
mod demo;
mod journal_v0;
mod server_cmd;
mod sim_cmd;

use std::process::ExitCode;

use clap::Parser;

/// The allocator of every kvota process. In a 64-client control-plane benchmark glibc's
/// malloc and free took about a seventh of the busy CPU; with mimalloc the control plane
/// commits 18 % more reports there (docs/benchmarks.md, "mimalloc").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    // Logs to stderr; RUST_LOG overrides the default (info for kvota's crates, warn elsewhere).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,kvota=info,kvota_control_plane=info,kvota_member_agent=info")
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = match args.log_format {
        cli::LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .try_init(),
        cli::LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init(),
    };
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvota: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
