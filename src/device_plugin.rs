//! `kg device-plugin`: a Kubernetes device plugin that hands `/dev/net/tun` to the containers
//! that ask for it (`resources.limits: squat.ai/tun: 1`), for runtimes whose default device
//! rules leave the TUN out (runc 1.2.0 to 1.2.3, crun from 2022 to 2025). A container that gets
//! one of its devices has the node created in it and allowed by the runtime, whatever the
//! runtime's defaults; kg then runs unprivileged there. The resource name is the one
//! squat/generic-device-plugin users already request, so either plugin serves the same
//! manifests.
//!
//! It serves the kubelet's device plugin API (`v1beta1`) on a socket in the kubelet's
//! device plugin directory, registers with the kubelet there, and registers again whenever the
//! kubelet has restarted (a kubelet removes every plugin's socket when it starts). Kubelets
//! before 1.26 send a path as their calls' `:authority`, which the HTTP/2 stack refuses; each
//! connection is mended on the way in (`authority.rs`).

mod api;
mod authority;
mod service;

use std::future::Future;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;
use tonic::transport::{Endpoint, Server, Uri};

pub use api::{device_plugin_client, registration_server};
pub use api::{
    AllocateRequest, ContainerAllocateRequest, DeviceSpec, Empty, ListAndWatchResponse,
    RegisterRequest, HEALTHY, UNHEALTHY, VERSION,
};
pub use service::{Inventory, TunDevicePlugin};

/// The most devices `--count` may offer (each is listed to the kubelet at every change).
const MAX_COUNT: u32 = 1024;
/// How often the plugin looks at the device node and at its own and the kubelet's sockets.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long one registration attempt may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause between registration attempts while the kubelet does not answer.
const REGISTER_RETRY: Duration = Duration::from_secs(2);

/// `kg device-plugin`'s flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kg device-plugin",
    about = "Offer /dev/net/tun to containers as an extended resource (a Kubernetes device plugin)"
)]
pub struct DevicePluginArgs {
    /// The extended resource containers request, `domain/name`.
    #[arg(long, default_value = "squat.ai/tun")]
    pub resource_name: String,
    /// The device node given to containers, at the same path on the host and in the container.
    #[arg(long, default_value = "/dev/net/tun")]
    pub device: PathBuf,
    /// How many containers of a node may hold the device at once.
    #[arg(long, default_value_t = 64)]
    pub count: u32,
    /// The kubelet's device plugin directory (its `kubelet.sock` and the plugins' sockets).
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    pub plugin_dir: PathBuf,
    /// Log level to use. Possible values: all, debug, info, warn, error, none.
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

impl DevicePluginArgs {
    /// The inventory these flags describe, or what is wrong with them (naming the flag).
    pub fn inventory(&self) -> Result<Inventory> {
        let (domain, name) = self.resource_name.split_once('/').with_context(|| {
            format!(
                "--resource-name={:?}: an extended resource is domain/name, such as squat.ai/tun",
                self.resource_name
            )
        })?;
        let label = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        };
        if !domain.contains('.') || !label(domain) || !label(name) {
            bail!(
                "--resource-name={:?}: an extended resource is a DNS domain, a slash and a name \
                 of letters, digits, '-', '.' or '_', such as squat.ai/tun",
                self.resource_name
            );
        }
        if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
            bail!(
                "--resource-name={:?}: the kubernetes.io domain is reserved for Kubernetes",
                self.resource_name
            );
        }
        if domain.len() > 253 || name.len() > 63 {
            bail!(
                "--resource-name={:?}: the domain may have 253 characters and the name 63",
                self.resource_name
            );
        }
        if !(1..=MAX_COUNT).contains(&self.count) {
            bail!(
                "--count={}: the plugin offers 1 to {MAX_COUNT} devices",
                self.count
            );
        }
        let device = self
            .device
            .to_str()
            .filter(|d| d.starts_with('/'))
            .with_context(|| {
                format!(
                    "--device={}: an absolute path in UTF-8",
                    self.device.display()
                )
            })?;
        Ok(Inventory {
            resource_name: self.resource_name.clone(),
            device: device.to_string(),
            count: self.count,
        })
    }

    /// The plugin's socket in the plugin directory: `kilotun-squat.ai-tun.sock`.
    pub fn socket_name(&self) -> String {
        format!("kilotun-{}.sock", self.resource_name.replace('/', "-"))
    }
}

/// Whether `path` is a character device now.
fn is_char_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device())
}

/// The identity of the file at `path` (device and inode), if there is one: a socket that was
/// removed and made again by a restarted kubelet has a new one.
fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// A gRPC channel over the unix socket at `path`.
async fn unix_channel(path: &Path) -> Result<tonic::transport::Channel> {
    let path = path.to_path_buf();
    // The URI is required and ignored: every connection goes to the socket.
    let channel = Endpoint::try_from("http://kubelet.invalid")?
        .connect_timeout(REGISTER_TIMEOUT)
        .timeout(REGISTER_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await?;
    Ok(channel)
}

/// One registration with the kubelet's socket at `kubelet`.
async fn register(kubelet: &Path, request: RegisterRequest) -> Result<()> {
    let channel = unix_channel(kubelet)
        .await
        .with_context(|| format!("connecting to {}", kubelet.display()))?;
    api::registration_client::RegistrationClient::new(channel)
        .register(request)
        .await
        .with_context(|| format!("registering with {}", kubelet.display()))?;
    Ok(())
}

/// Why one incarnation of the plugin ended.
enum Ended {
    /// The caller asked the plugin to stop.
    Stopped,
    /// The kubelet restarted (our socket is gone or the kubelet's is new): start again.
    KubeletRestarted,
    /// The gRPC server stopped by itself: the plugin exits (and its pod restarts).
    ServerFailed,
}

/// Runs `kg device-plugin` until SIGTERM or SIGINT.
pub async fn run(args: DevicePluginArgs) -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    serve(args, stop).await
}

/// Serves the plugin and keeps it registered until `stop` completes; then removes its socket.
pub async fn serve(args: DevicePluginArgs, stop: impl Future<Output = ()>) -> Result<()> {
    let inventory = args.inventory()?;
    let socket = args.plugin_dir.join(args.socket_name());
    let kubelet = args.plugin_dir.join("kubelet.sock");
    tracing::info!(
        resource = %inventory.resource_name,
        device = %inventory.device,
        count = inventory.count,
        socket = %socket.display(),
        "kg device-plugin starting"
    );
    tokio::pin!(stop);
    loop {
        match incarnation(&args, &inventory, &socket, &kubelet, &mut stop).await? {
            Ended::Stopped => {
                let _ = std::fs::remove_file(&socket);
                tracing::info!("kg device-plugin stopped");
                return Ok(());
            }
            Ended::KubeletRestarted => {
                tracing::info!("the kubelet restarted: serving and registering again");
            }
            Ended::ServerFailed => {
                let _ = std::fs::remove_file(&socket);
                bail!("the plugin's gRPC server on {} stopped", socket.display());
            }
        }
    }
}

/// One socket and one registration, until the kubelet restarts or `stop` completes.
async fn incarnation(
    args: &DevicePluginArgs,
    inventory: &Inventory,
    socket: &Path,
    kubelet: &Path,
    stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<Ended> {
    match std::fs::remove_file(socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing the old {}", socket.display()));
        }
        _ => {}
    }
    let listener = UnixListener::bind(socket)
        .with_context(|| format!("listening on {} (--plugin-dir)", socket.display()))?;
    let ours = identity(socket);
    let mut healthy_now = is_char_device(&args.device);
    let (health, healthy) = watch::channel(healthy_now);
    let (quit, quitting) = oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .add_service(api::device_plugin_server::DevicePluginServer::new(
                TunDevicePlugin::new(inventory.clone(), healthy),
            ))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener).map(|c| c.map(authority::mended)),
                async {
                    let _ = quitting.await;
                },
            ),
    );
    let request = RegisterRequest {
        version: VERSION.to_string(),
        endpoint: args.socket_name(),
        resource_name: inventory.resource_name.clone(),
        options: Some(api::DevicePluginOptions::default()),
    };
    let mut registered: Option<(u64, u64)> = None;
    let mut complained = false;
    let mut tick = crate::periodic::periodic(CHECK_EVERY);
    let ended = loop {
        tokio::select! {
            _ = stop.as_mut() => break Ended::Stopped,
            _ = tick.tick() => {}
        }
        if server.is_finished() {
            break Ended::ServerFailed;
        }
        // A kubelet that starts removes every plugin's socket, ours included, even before
        // we have registered with it.
        if identity(socket) != ours {
            break Ended::KubeletRestarted;
        }
        if registered.is_none() {
            // The kubelet's socket as it is before the call: if it is replaced after, the
            // kubelet that answered is gone.
            let theirs = identity(kubelet);
            let attempt = tokio::select! {
                _ = stop.as_mut() => break Ended::Stopped,
                attempt = register(kubelet, request.clone()) => attempt,
            };
            match attempt {
                Ok(()) => {
                    tracing::info!(
                        resource = %inventory.resource_name,
                        healthy = healthy_now,
                        "registered with the kubelet"
                    );
                    registered = theirs;
                }
                Err(e) => {
                    // Once per incarnation: a kubelet that is still starting is normal.
                    if !complained {
                        tracing::warn!("{e:#}; retrying every {REGISTER_RETRY:?}");
                        complained = true;
                    }
                    tokio::select! {
                        _ = stop.as_mut() => break Ended::Stopped,
                        _ = tokio::time::sleep(REGISTER_RETRY) => {}
                    }
                }
            }
            continue;
        }
        if identity(kubelet) != registered {
            break Ended::KubeletRestarted;
        }
        let healthy_then = healthy_now;
        healthy_now = is_char_device(&args.device);
        if healthy_now != healthy_then {
            tracing::warn!(
                device = %inventory.device,
                healthy = healthy_now,
                "the device node changed: telling the kubelet"
            );
            let _ = health.send(healthy_now);
        }
    };
    // Dropping the sender ends every ListAndWatch stream, so the server's graceful stop does
    // not wait on them.
    drop(health);
    let _ = quit.send(());
    match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(Ok(Err(e))) => tracing::warn!("the plugin's gRPC server: {e}"),
        Ok(Err(e)) => tracing::warn!("the plugin's gRPC server task: {e}"),
        Err(_) => tracing::warn!("the plugin's gRPC server did not stop within 5 s"),
        Ok(Ok(Ok(()))) => {}
    }
    Ok(ended)
}

/// A `DevicePlugin` client over the plugin's socket at `path` (for tests and diagnostics).
pub async fn connect(
    path: &Path,
) -> Result<device_plugin_client::DevicePluginClient<tonic::transport::Channel>> {
    Ok(device_plugin_client::DevicePluginClient::new(
        unix_channel(path).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> DevicePluginArgs {
        let mut argv = vec!["kg device-plugin"];
        argv.extend_from_slice(extra);
        DevicePluginArgs::parse_from(argv)
    }

    #[test]
    fn the_defaults_offer_the_tun_under_generic_device_plugins_name() {
        let a = args(&[]);
        assert_eq!(
            a.inventory().unwrap(),
            Inventory {
                resource_name: "squat.ai/tun".into(),
                device: "/dev/net/tun".into(),
                count: 64
            }
        );
        assert_eq!(a.socket_name(), "kilotun-squat.ai-tun.sock");
    }

    #[test]
    fn bad_flags_are_refused_naming_the_flag_and_value() {
        for (flags, needle) in [
            (vec!["--resource-name=tun"], "--resource-name=\"tun\""),
            (vec!["--resource-name=nodomain/tun"], "DNS domain"),
            (vec!["--resource-name=squat.ai/t un"], "--resource-name"),
            (vec!["--resource-name=kubernetes.io/tun"], "reserved"),
            (vec!["--count=0"], "--count=0"),
            (vec!["--count=5000"], "--count=5000"),
            (vec!["--device=dev/net/tun"], "--device=dev/net/tun"),
        ] {
            let err = args(&flags).inventory().unwrap_err().to_string();
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
    }
}
