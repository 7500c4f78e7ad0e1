//! The `real` tier: kilotun and kg against real third-party parts, each skipped with a message
//! when absent unless `CI` is set: a real kube-apiserver and etcd (`real_kube`,
//! `kube_backend`), real kubelets and containerd (`real_kubelet`), Debian's kernels in virtual
//! machines (`kernel_vm`), the container image under podman (`image`), the ARM build under
//! qemu-user (`cross_arch`) and a real Prometheus (`prometheus`).

#[path = "../common/mod.rs"]
mod common;

mod cross_arch;
mod helm;
mod image;
mod kernel_vm;
mod kube_backend;
mod prometheus;
mod real_kube;
mod real_kubelet;
