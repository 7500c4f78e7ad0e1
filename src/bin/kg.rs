//! `kg`: the Kilo node agent with an embedded userspace WireGuard engine.

use std::process::ExitCode;

use clap::Parser;
use kilotun::agent::{self, args::KgArgs};
use kilotun::device_plugin::{self, DevicePluginArgs};
use kilotun::webhook::{self, WebhookArgs};

/// What this invocation runs: the agent, `kg webhook` or `kg device-plugin`.
enum Job {
    Agent(Box<agent::args::Settings>),
    Webhook(WebhookArgs),
    DevicePlugin(DevicePluginArgs),
}

fn main() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let job = if argv.get(1).is_some_and(|a| a == "webhook") {
        argv.remove(1);
        Job::Webhook(WebhookArgs::parse_from(argv))
    } else if argv.get(1).is_some_and(|a| a == "device-plugin") {
        argv.remove(1);
        Job::DevicePlugin(DevicePluginArgs::parse_from(argv))
    } else {
        match KgArgs::parse_from(argv).settings() {
            Ok(s) => Job::Agent(Box::new(s)),
            Err(e) => {
                eprintln!("kg: {e:#}");
                return ExitCode::from(2);
            }
        }
    };
    let log_level = match &job {
        Job::Agent(s) => s.args.log_level.clone(),
        Job::Webhook(w) => w.log_level.clone(),
        Job::DevicePlugin(d) => d.log_level.clone(),
    };
    let level = agent::log_filter(&log_level).unwrap_or("info");
    // KG_LOG replaces --log-level; either way the libraries' own chatter stays out unless
    // named (agent::QUIET_LIBRARIES).
    let directives = std::env::var("KG_LOG").unwrap_or_else(|_| level.to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(agent::with_quiet_libraries(&directives))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(agent::with_quiet_libraries(level)));
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
    let outcome = match job {
        Job::Agent(settings) => runtime.block_on(agent::run(*settings)),
        Job::Webhook(args) => runtime.block_on(webhook::run(args)),
        Job::DevicePlugin(args) => runtime.block_on(device_plugin::run(args)),
    };
    // Dropping the runtime would wait for every blocking task, such as a name lookup stuck in
    // the resolver's timeout; the work is done, so the process exits within a moment instead
    // (the kubelet and the next kg of a rollout wait on it).
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kg: {e:#}");
            ExitCode::FAILURE
        }
    }
}
