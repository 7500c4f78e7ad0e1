//! `kgctl`: inspect a Kilo mesh (graph, WireGuard configurations, diagnosis) from the Kubernetes
//! API or a cluster directory.

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
                return Ok((String::new(), String::new(), ExitCode::SUCCESS));
            }
            Command::Diagnose(diagnose) => {
                let (out, wrong) = kgctl::diagnose::run(&args, diagnose).await?;
                let code = if wrong {
                    ExitCode::FAILURE
                } else {
                    ExitCode::SUCCESS
                };
                return Ok((out, String::new(), code));
            }
            Command::RotateKey(rotate) => {
                let out = kgctl::rotate::run(&args, rotate).await?;
                return Ok((out, String::new(), ExitCode::SUCCESS));
            }
            Command::Uninstall(uninstall) => {
                let out = kgctl::uninstall::run(&args, uninstall).await?;
                return Ok((out, String::new(), ExitCode::SUCCESS));
            }
            Command::Graph => None,
            Command::Showconf(show) => Some(show),
        };
        let snapshot = kgctl::snapshot(&args).await?;
        let view = kgctl::view_with_ipam(
            &snapshot,
            &args.mesh_granularity,
            &args.topology_label,
            kgctl::now_unix(),
            args.ipam,
        )?;
        let (out, err) = match show {
            None => (kgctl::graph(&view)?, String::new()),
            Some(show) => {
                let live = if show.live {
                    let status =
                        kgctl::diagnose::node_status(&args, &snapshot, &show.name, show.kg_port)
                            .await?;
                    Some(status)
                } else {
                    None
                };
                kgctl::showconf(&view, show, args.port, live.as_ref())?
            }
        };
        anyhow::Ok((out, err, ExitCode::SUCCESS))
    });
    match result {
        Ok((out, err, code)) => {
            print!("{out}");
            eprint!("{err}");
            code
        }
        Err(e) => {
            eprintln!("kgctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}
