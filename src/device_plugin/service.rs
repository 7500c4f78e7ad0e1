//! The `DevicePlugin` service: a fixed set of interchangeable devices that all stand for one
//! device node of the host (`/dev/net/tun`), healthy while that node exists. Each container
//! the kubelet gives one of them gets the node created in it and allowed by the runtime's
//! device rules, which is what a runtime that leaves the node out of its defaults needs.

use std::pin::Pin;

use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::api::{self, device_plugin_server::DevicePlugin};

/// What the plugin offers: `count` devices of one resource, each the same device node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// The extended resource, `domain/name` (`squat.ai/tun`).
    pub resource_name: String,
    /// The device node, the same path on the host and in the container.
    pub device: String,
    /// How many containers of the node may hold the device at once.
    pub count: u32,
}

impl Inventory {
    /// The devices' IDs: `tun-0`, `tun-1`, … (named after the node's file name).
    pub fn ids(&self) -> Vec<String> {
        let stem = self.device.rsplit('/').next().unwrap_or("device");
        (0..self.count).map(|i| format!("{stem}-{i}")).collect()
    }

    /// The list the kubelet is sent: every device, healthy or not as `healthy` says.
    pub fn listing(&self, healthy: bool) -> api::ListAndWatchResponse {
        let health = if healthy {
            api::HEALTHY
        } else {
            api::UNHEALTHY
        };
        api::ListAndWatchResponse {
            devices: self
                .ids()
                .into_iter()
                .map(|id| api::Device {
                    id,
                    health: health.to_string(),
                    topology: None,
                })
                .collect(),
        }
    }

    /// What the containers of an `Allocate` get: the device node, read and write (opening a
    /// TUN needs both). An ID this plugin never listed is refused, naming it.
    pub fn allocate(
        &self,
        request: &api::AllocateRequest,
    ) -> Result<api::AllocateResponse, Status> {
        let ids = self.ids();
        let mut responses = Vec::with_capacity(request.container_requests.len());
        for container in &request.container_requests {
            if let Some(unknown) = container.devices_ids.iter().find(|id| !ids.contains(id)) {
                return Err(Status::invalid_argument(format!(
                    "device {unknown:?} is not one of {}'s ({} devices named {}…)",
                    self.resource_name,
                    self.count,
                    ids.first().map(String::as_str).unwrap_or("")
                )));
            }
            responses.push(api::ContainerAllocateResponse {
                devices: vec![api::DeviceSpec {
                    container_path: self.device.clone(),
                    host_path: self.device.clone(),
                    permissions: "rw".to_string(),
                }],
                ..Default::default()
            });
        }
        Ok(api::AllocateResponse {
            container_responses: responses,
        })
    }
}

/// The service the kubelet calls: the inventory, and whether the device node exists now (a
/// `ListAndWatch` stream sends the list again whenever that changes, and ends when the plugin
/// drops the sender).
#[derive(Debug, Clone)]
pub struct TunDevicePlugin {
    inventory: Inventory,
    healthy: watch::Receiver<bool>,
}

impl TunDevicePlugin {
    /// A service over `inventory` whose health follows `healthy`.
    pub fn new(inventory: Inventory, healthy: watch::Receiver<bool>) -> Self {
        Self { inventory, healthy }
    }
}

/// The stream `ListAndWatch` answers with.
type Listings = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for TunDevicePlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(api::DevicePluginOptions::default()))
    }

    type ListAndWatchStream = Listings;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let inventory = self.inventory.clone();
        let stream = WatchStream::new(self.healthy.clone())
            .map(move |healthy| Ok(inventory.listing(healthy)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        // Not offered in the options (every device is the same), answered all the same: the
        // first devices the kubelet has, after those it must include.
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let size = usize::try_from(c.allocation_size).unwrap_or(0);
                let mut ids = c.must_include_device_ids.clone();
                ids.extend(
                    c.available_device_ids
                        .into_iter()
                        .filter(|id| !c.must_include_device_ids.contains(id)),
                );
                ids.truncate(size);
                api::ContainerPreferredAllocationResponse { device_ids: ids }
            })
            .collect();
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        self.inventory
            .allocate(request.get_ref())
            .map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tun(count: u32) -> Inventory {
        Inventory {
            resource_name: "squat.ai/tun".into(),
            device: "/dev/net/tun".into(),
            count,
        }
    }

    #[test]
    fn every_device_is_listed_with_the_health_of_the_node() {
        let listing = tun(3).listing(true);
        let ids: Vec<&str> = listing.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["tun-0", "tun-1", "tun-2"]);
        assert!(listing.devices.iter().all(|d| d.health == api::HEALTHY));
        assert!(tun(2)
            .listing(false)
            .devices
            .iter()
            .all(|d| d.health == api::UNHEALTHY));
    }

    #[test]
    fn a_container_gets_the_node_read_write_and_an_unknown_id_is_named() {
        let request = api::AllocateRequest {
            container_requests: vec![
                api::ContainerAllocateRequest {
                    devices_ids: vec!["tun-1".into()],
                },
                api::ContainerAllocateRequest {
                    devices_ids: vec!["tun-0".into(), "tun-2".into()],
                },
            ],
        };
        let response = tun(3).allocate(&request).unwrap();
        assert_eq!(response.container_responses.len(), 2);
        for container in &response.container_responses {
            assert_eq!(
                container.devices,
                [api::DeviceSpec {
                    container_path: "/dev/net/tun".into(),
                    host_path: "/dev/net/tun".into(),
                    permissions: "rw".into(),
                }]
            );
        }
        let bad = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec!["tun-7".into()],
            }],
        };
        let err = tun(3).allocate(&bad).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("\"tun-7\""), "{}", err.message());
        assert!(err.message().contains("squat.ai/tun"), "{}", err.message());
    }
}
