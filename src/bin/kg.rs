//! `kg`: the Kilo node agent with an embedded userspace WireGuard engine.

use std::process::ExitCode;

use clap::Parser;
use kilotun::agent::{self, args::KgArgs};

fn main() -> ExitCode {
    let settings = match KgArgs::parse().settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kg: {e:#}");
            return ExitCode::from(2);
        }
    };
    let level = agent::log_filter(&settings.args.log_level).unwrap_or("info");
    // netlink-proto's own chatter is not kg's to report.
    let filter = tracing_subscriber::EnvFilter::try_from_env("KG_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "{level},netlink_proto=error,hickory_net=warn,hickory_resolver=warn,hickory_proto=warn"
        ))
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kg: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(agent::run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kg: {e:#}");
            ExitCode::FAILURE
        }
    }
}
