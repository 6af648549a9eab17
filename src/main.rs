//! The `inferd` command: parses flags into a validated configuration, runs
//! the chosen subcommand, and owns the exit code.

#[cfg(not(loom))]
fn main() -> std::process::ExitCode {
    use clap::Parser;

    let cli = inferd::cli::Cli::parse();
    inferd::cli::init_logging(cli.command.default_log_level());
    match inferd::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inferd: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A `--cfg loom` build exists only for the model-checked tests; the
/// command line (and the gRPC stack under it) is left out of it.
#[cfg(loom)]
fn main() {
    eprintln!("inferd: built with --cfg loom for model checking only");
}
