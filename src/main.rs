//! The `inferd` command: parses flags into a validated configuration, runs
//! the chosen subcommand, and owns the exit code.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = inferd::cli::Cli::parse();
    inferd::cli::init_logging(cli.command.default_log_level());
    match inferd::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inferd: {e}");
            ExitCode::FAILURE
        }
    }
}
