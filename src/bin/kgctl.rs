//! `kgctl`: inspect a Kilo mesh (graph, WireGuard configurations) from the Kubernetes API or a
//! cluster directory.

use std::process::ExitCode;

use clap::Parser;
use kilotun::kgctl::{self, Command, KgctlArgs};

fn main() -> ExitCode {
    let args = KgctlArgs::parse();
    if let Command::Connect(connect) = &args.command {
        let level = kilotun::agent::log_filter(&connect.log_level).unwrap_or("info");
        let filter =
            tracing_subscriber::EnvFilter::try_from_env("KGCTL_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(format!("{level},netlink_proto=error"))
            });
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kgctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let show = match &args.command {
            Command::Connect(connect) => {
                kgctl::connect::run(&args, connect).await?;
                return Ok((String::new(), String::new()));
            }
            Command::Graph => None,
            Command::Showconf(show) => Some(show),
        };
        let snapshot = kgctl::snapshot(&args).await?;
        let view = kgctl::view(
            &snapshot,
            &args.mesh_granularity,
            &args.topology_label,
            kgctl::now_unix(),
        )?;
        match show {
            None => Ok((kgctl::graph(&view)?, String::new())),
            Some(show) => kgctl::showconf(&view, show, args.port),
        }
    });
    match result {
        Ok((out, err)) => {
            print!("{out}");
            eprint!("{err}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kgctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}
