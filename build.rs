//! Records the target triple the binaries are built for, so `--version` and kg's startup log
//! can name it (a cross-built binary on the wrong host is otherwise only an `exec format error`),
//! and generates the gRPC code of the kubelet's device plugin API (`v1beta1`) that
//! `kg device-plugin` serves and calls. The services are described here and their messages are
//! written by hand in `src/device_plugin/api.rs`, so the build needs no `protoc`.

use tonic_build::manual::{Builder, Method, Service};

/// One method of the API, its messages named relative to the generated module's parent
/// (`src/device_plugin/api.rs`).
fn method(name: &str, route: &str, input: &str, output: &str, streaming: bool) -> Method {
    let builder = Method::builder()
        .name(name)
        .route_name(route)
        .input_type(format!("super::{input}"))
        .output_type(format!("super::{output}"))
        .codec_path("tonic_prost::ProstCodec");
    if streaming {
        builder.server_streaming().build()
    } else {
        builder.build()
    }
}

fn main() {
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown".to_string());
    println!("cargo:rustc-env=KILOTUN_TARGET={target}");
    println!("cargo:rerun-if-changed=build.rs");

    // The kubelet's k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto, services only.
    let registration = Service::builder()
        .name("Registration")
        .package("v1beta1")
        .method(method(
            "register",
            "Register",
            "RegisterRequest",
            "Empty",
            false,
        ))
        .build();
    let device_plugin = Service::builder()
        .name("DevicePlugin")
        .package("v1beta1")
        .method(method(
            "get_device_plugin_options",
            "GetDevicePluginOptions",
            "Empty",
            "DevicePluginOptions",
            false,
        ))
        .method(method(
            "list_and_watch",
            "ListAndWatch",
            "Empty",
            "ListAndWatchResponse",
            true,
        ))
        .method(method(
            "get_preferred_allocation",
            "GetPreferredAllocation",
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            false,
        ))
        .method(method(
            "allocate",
            "Allocate",
            "AllocateRequest",
            "AllocateResponse",
            false,
        ))
        .method(method(
            "pre_start_container",
            "PreStartContainer",
            "PreStartContainerRequest",
            "PreStartContainerResponse",
            false,
        ))
        .build();
    Builder::new().compile(&[registration, device_plugin]);
}
