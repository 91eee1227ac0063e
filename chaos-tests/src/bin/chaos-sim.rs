//! `chaos-sim`: run deterministic-simulation seeds from the command line.
//!
//! ```text
//! chaos-sim --seed 1234 [--bug make-before-break]   # replay one seed (verbose)
//! chaos-sim --from 1000 --count 500                 # seeds 1000..1500
//! ```
//! Exits 1 if any seed fails, printing each failing seed and its replay command.

use std::process::ExitCode;

use kvota_chaos_tests::{run, Bugs};

fn usage() -> ExitCode {
    eprintln!("usage: chaos-sim (--seed N | --from N --count N) [--bug NAME]");
    eprintln!("bugs: none {}", kvota_chaos_tests::BUG_NAMES.join(" "));
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut seed = None;
    let mut from = None;
    let mut count = 1u64;
    let mut bugs = Bugs::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let val = it.next();
        match (a.as_str(), val) {
            ("--seed", Some(v)) => seed = v.parse::<u64>().ok(),
            ("--from", Some(v)) => from = v.parse::<u64>().ok(),
            ("--count", Some(v)) => match v.parse() {
                Ok(n) => count = n,
                Err(_) => return usage(),
            },
            ("--bug", Some(v)) => match Bugs::parse(v) {
                Some(b) => bugs = b,
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    let (start, count, verbose) = match (seed, from) {
        (Some(s), None) => (s, 1, true),
        (None, Some(f)) => (f, count, false),
        _ => return usage(),
    };
    let mut failed = 0u64;
    for s in start..start.saturating_add(count) {
        match run(s, bugs) {
            Ok(sum) => {
                if verbose {
                    println!("seed {s} passed: {sum:?}");
                }
            }
            Err(f) => {
                failed += 1;
                println!("{f}");
            }
        }
    }
    if !verbose {
        println!("{count} seeds from {start}: {failed} failed");
    }
    if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
