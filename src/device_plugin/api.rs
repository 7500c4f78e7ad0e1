//! The kubelet's device plugin API, version `v1beta1` (Kubernetes' `api.proto` in
//! `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`): its messages, written here with prost's
//! derive and the proto's field numbers, and the client and server code that `build.rs`
//! generates for its two services, `Registration` (the kubelet's) and `DevicePlugin` (ours).
// The generated client and server code below has no doc comments of its own.
#![allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]

use std::collections::HashMap;

/// The API version a plugin names when it registers.
pub const VERSION: &str = "v1beta1";
/// A device the kubelet may hand out.
pub const HEALTHY: &str = "Healthy";
/// A device the kubelet must not hand out.
pub const UNHEALTHY: &str = "Unhealthy";

/// No fields: the argument or result of calls that need none.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// What the plugin asks of the kubelet besides `Allocate`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DevicePluginOptions {
    /// Whether the kubelet must call `PreStartContainer` before each container starts.
    #[prost(bool, tag = "1")]
    pub pre_start_required: bool,
    /// Whether the kubelet may ask `GetPreferredAllocation`.
    #[prost(bool, tag = "2")]
    pub get_preferred_allocation_available: bool,
}

/// A plugin's registration with the kubelet.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterRequest {
    /// The API version, [`VERSION`].
    #[prost(string, tag = "1")]
    pub version: String,
    /// The plugin's socket, relative to the kubelet's device plugin directory.
    #[prost(string, tag = "2")]
    pub endpoint: String,
    /// The extended resource, `domain/name`.
    #[prost(string, tag = "3")]
    pub resource_name: String,
    /// What the plugin asks of the kubelet.
    #[prost(message, optional, tag = "4")]
    pub options: Option<DevicePluginOptions>,
}

/// The devices of a resource, sent whenever they change.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListAndWatchResponse {
    /// Every device of the resource.
    #[prost(message, repeated, tag = "1")]
    pub devices: Vec<Device>,
}

/// NUMA placement of a device.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TopologyInfo {
    /// The NUMA nodes the device is close to.
    #[prost(message, repeated, tag = "1")]
    pub nodes: Vec<NumaNode>,
}

/// One NUMA node.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NumaNode {
    /// The NUMA node's number.
    #[prost(int64, tag = "1")]
    pub id: i64,
}

/// One device of the resource.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Device {
    /// The device's ID, unique within the resource.
    #[prost(string, tag = "1")]
    pub id: String,
    /// [`HEALTHY`] or [`UNHEALTHY`].
    #[prost(string, tag = "2")]
    pub health: String,
    /// Where the device sits, if that matters.
    #[prost(message, optional, tag = "3")]
    pub topology: Option<TopologyInfo>,
}

/// The devices of a container about to start (sent only if asked for in the options).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PreStartContainerRequest {
    /// The devices the container was given.
    #[prost(string, repeated, tag = "1")]
    pub devices_ids: Vec<String>,
}

/// No fields: the container may start.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PreStartContainerResponse {}

/// Which devices the plugin would choose, per container (asked only if offered).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PreferredAllocationRequest {
    /// One request per container.
    #[prost(message, repeated, tag = "1")]
    pub container_requests: Vec<ContainerPreferredAllocationRequest>,
}

/// One container's choice to make.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerPreferredAllocationRequest {
    /// The devices the kubelet may choose from.
    #[prost(string, repeated, tag = "1")]
    pub available_device_ids: Vec<String>,
    /// The devices the choice must include.
    #[prost(string, repeated, tag = "2")]
    pub must_include_device_ids: Vec<String>,
    /// How many devices to choose.
    #[prost(int32, tag = "3")]
    pub allocation_size: i32,
}

/// The plugin's choices, per container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PreferredAllocationResponse {
    /// One answer per container, in the request's order.
    #[prost(message, repeated, tag = "1")]
    pub container_responses: Vec<ContainerPreferredAllocationResponse>,
}

/// One container's choice.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerPreferredAllocationResponse {
    /// The devices preferred.
    #[prost(string, repeated, tag = "1")]
    pub device_ids: Vec<String>,
}

/// The devices the kubelet chose for each container of a pod.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AllocateRequest {
    /// One request per container of the pod.
    #[prost(message, repeated, tag = "1")]
    pub container_requests: Vec<ContainerAllocateRequest>,
}

/// The devices chosen for one container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAllocateRequest {
    /// The devices the kubelet chose for the container.
    #[prost(string, repeated, tag = "1")]
    pub devices_ids: Vec<String>,
}

/// What each container gets, in the order of the request's containers.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AllocateResponse {
    /// One answer per container, in the request's order.
    #[prost(message, repeated, tag = "1")]
    pub container_responses: Vec<ContainerAllocateResponse>,
}

/// What one container gets: environment, mounts, device nodes, annotations.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAllocateResponse {
    /// Environment variables to set in the container.
    #[prost(map = "string, string", tag = "1")]
    pub envs: HashMap<String, String>,
    /// Host paths to mount in the container.
    #[prost(message, repeated, tag = "2")]
    pub mounts: Vec<Mount>,
    /// Device nodes to create in the container and allow.
    #[prost(message, repeated, tag = "3")]
    pub devices: Vec<DeviceSpec>,
    /// Annotations to pass to the runtime.
    #[prost(map = "string, string", tag = "4")]
    pub annotations: HashMap<String, String>,
}

/// A host path mounted in the container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mount {
    /// Where in the container.
    #[prost(string, tag = "1")]
    pub container_path: String,
    /// What on the host.
    #[prost(string, tag = "2")]
    pub host_path: String,
    /// Whether the mount is read-only.
    #[prost(bool, tag = "3")]
    pub read_only: bool,
}

/// A device node the runtime creates in the container and allows in its device rules.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeviceSpec {
    /// The node's path in the container.
    #[prost(string, tag = "1")]
    pub container_path: String,
    /// The node's path on the host.
    #[prost(string, tag = "2")]
    pub host_path: String,
    /// Cgroup permissions: some of `r`, `w`, `m`.
    #[prost(string, tag = "3")]
    pub permissions: String,
}

include!(concat!(env!("OUT_DIR"), "/v1beta1.Registration.rs"));
include!(concat!(env!("OUT_DIR"), "/v1beta1.DevicePlugin.rs"));
