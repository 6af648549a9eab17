//! The `inferd` command: parses flags into a validated configuration, runs
//! the chosen subcommand, and owns the exit code.

#[cfg(not(loom))]
fn main() -> std::process::ExitCode {
    use clap::Parser;

    // Mesa's Vulkan device-select layer connects to a Wayland or X display
    // to rank GPUs and prints errors on a headless host; inferd computes
    // headless and picks its own adapter. Set while the process has one
    // thread, and only when the operator has not chosen.
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
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
