//! `kg device-plugin` against a kubelet's registration service on a unix socket, in process and
//! without root: what it registers, what it lists and allocates, that it follows the device
//! node's health, and that it registers again when the kubelet restarts. The kubelet here is an
//! in-memory twin of its `Registration` service (the real kubelet cannot be started without
//! root, a container runtime and an API server); `tests/real/real_kubelet/` runs the plugin as a
//! DaemonSet under real kubelets, where kg gets `/dev/net/tun` from it on a runtime that leaves
//! the TUN out of its default devices.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use kilotun::device_plugin::{
    self, registration_server, AllocateRequest, ContainerAllocateRequest, DevicePluginArgs,
    DeviceSpec, Empty, RegisterRequest, HEALTHY, UNHEALTHY,
};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

/// The kubelet's side of registration: every request it receives goes to the test.
struct Kubelet {
    seen: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl registration_server::Registration for Kubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.seen.send(request.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// Starts a kubelet twin on `dir/kubelet.sock`; dropping the sender stops it.
fn start_kubelet(
    dir: &Path,
) -> (
    mpsc::UnboundedReceiver<RegisterRequest>,
    oneshot::Sender<()>,
) {
    let path = dir.join("kubelet.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let (seen, registrations) = mpsc::unbounded_channel();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(registration_server::RegistrationServer::new(Kubelet {
                seen,
            }))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    (registrations, stop)
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kilotun-dp-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>, what: &str) -> T {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("no {what} within 10 s"))
        .unwrap_or_else(|| panic!("the channel of {what} closed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_registers_lists_allocates_and_follows_the_kubelet_and_the_device() {
    let dir = scratch("all");
    // The "device node": a symlink to /dev/null, a character device that the test can take
    // away and give back without root.
    let device = dir.join("tun");
    std::os::unix::fs::symlink("/dev/null", &device).unwrap();
    let (mut registrations, kubelet) = start_kubelet(&dir);

    let args = DevicePluginArgs::parse_from([
        "kg device-plugin",
        "--plugin-dir",
        dir.to_str().unwrap(),
        "--device",
        device.to_str().unwrap(),
        "--count=3",
    ]);
    let (stop_plugin, plugin_stopped) = oneshot::channel::<()>();
    let plugin = tokio::spawn(device_plugin::serve(args, async {
        let _ = plugin_stopped.await;
    }));

    // Registration: the API version, our socket's name in the directory, the resource.
    let first = next(&mut registrations, "registration").await;
    assert_eq!(first.version, "v1beta1");
    assert_eq!(first.resource_name, "squat.ai/tun");
    assert_eq!(first.endpoint, "kilotun-squat.ai-tun.sock");
    let socket = dir.join(&first.endpoint);
    assert!(socket.exists(), "{} missing", socket.display());

    // What the kubelet does next: list and watch, then allocate.
    let mut client = device_plugin::connect(&socket).await.unwrap();
    let mut listings = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let listing = listings.message().await.unwrap().unwrap();
    let ids: Vec<&str> = listing.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["tun-0", "tun-1", "tun-2"]);
    assert!(listing.devices.iter().all(|d| d.health == HEALTHY));

    let allocated = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["tun-2".into()],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        allocated.container_responses[0].devices,
        [DeviceSpec {
            container_path: device.to_str().unwrap().into(),
            host_path: device.to_str().unwrap().into(),
            permissions: "rw".into(),
        }]
    );
    let refused = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["gpu-0".into()],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

    // The node goes: every device unhealthy; it comes back: healthy again.
    std::fs::remove_file(&device).unwrap();
    let gone = tokio::time::timeout(Duration::from_secs(5), listings.message())
        .await
        .expect("no new listing within 5 s of the device node's removal")
        .unwrap()
        .unwrap();
    assert!(
        gone.devices.iter().all(|d| d.health == UNHEALTHY),
        "{gone:?}"
    );
    std::os::unix::fs::symlink("/dev/null", &device).unwrap();
    let back = tokio::time::timeout(Duration::from_secs(5), listings.message())
        .await
        .expect("no new listing within 5 s of the device node's return")
        .unwrap()
        .unwrap();
    assert!(back.devices.iter().all(|d| d.health == HEALTHY), "{back:?}");

    // A kubelet restart: the old kubelet goes, the new one removes every plugin socket and
    // listens anew; the plugin serves and registers again.
    drop(kubelet);
    tokio::time::sleep(Duration::from_millis(200)).await;
    std::fs::remove_file(&socket).unwrap();
    let (mut registrations, kubelet) = start_kubelet(&dir);
    let again = next(
        &mut registrations,
        "registration after the kubelet's restart",
    )
    .await;
    assert_eq!(again, first);
    tokio::time::timeout(Duration::from_secs(5), async {
        while !socket.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the plugin's socket did not come back");
    let mut client = device_plugin::connect(&socket).await.unwrap();
    let options = client.get_device_plugin_options(Empty {}).await.unwrap();
    assert!(!options.get_ref().pre_start_required);

    // Stopped: it returns and leaves no socket behind.
    stop_plugin.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), plugin)
        .await
        .expect("the plugin did not stop within 10 s")
        .unwrap()
        .unwrap();
    assert!(!socket.exists(), "the plugin left {}", socket.display());
    drop(kubelet);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_starts_after_the_plugin_gets_it_registered() {
    let dir = scratch("late");
    let args = DevicePluginArgs::parse_from([
        "kg device-plugin",
        "--plugin-dir",
        dir.to_str().unwrap(),
        "--device=/dev/null",
    ]);
    let socket = dir.join(args.socket_name());
    let (stop_plugin, plugin_stopped) = oneshot::channel::<()>();
    let plugin = tokio::spawn(device_plugin::serve(args, async {
        let _ = plugin_stopped.await;
    }));
    // No kubelet yet: the plugin serves and keeps trying.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        socket.exists(),
        "no plugin socket while the kubelet is away"
    );
    // The kubelet starts: it removes every socket in the directory, then listens.
    std::fs::remove_file(&socket).unwrap();
    let (mut registrations, kubelet) = start_kubelet(&dir);
    let registered = next(&mut registrations, "registration with the late kubelet").await;
    assert_eq!(registered.resource_name, "squat.ai/tun");
    // The socket it registered is there to be dialled (made again after the removal).
    tokio::time::timeout(Duration::from_secs(5), async {
        while device_plugin::connect(&socket).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the registered socket does not answer");
    stop_plugin.send(()).unwrap();
    plugin.await.unwrap().unwrap();
    drop(kubelet);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn bad_flags_stop_the_plugin_before_it_touches_the_directory() {
    let dir = scratch("bad");
    let args = DevicePluginArgs::parse_from([
        "kg device-plugin",
        "--plugin-dir",
        dir.to_str().unwrap(),
        "--resource-name=tun",
    ]);
    let err = device_plugin::serve(args, std::future::pending())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("--resource-name=\"tun\""), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
