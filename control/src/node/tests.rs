//! Unit tests of `node`: the Kubernetes Node objects they translate and their helpers; the tests
//! live in the submodules.

use super::*;
use annotation as a;
use k8s_openapi::api::core::v1::{Node as KubeNode, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

mod dual_stack;
mod formats;
mod malformed;
mod readiness;
mod translation;

fn kube_node(
    annotations: &[(&str, &str)],
    labels: &[(&str, &str)],
    pod_cidr: Option<&str>,
) -> KubeNode {
    let map = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    };
    KubeNode {
        metadata: ObjectMeta {
            name: Some("n".into()),
            annotations: Some(map(annotations)),
            labels: Some(map(labels)),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: pod_cidr.map(str::to_string),
            ..Default::default()
        }),
        status: None,
    }
}

fn translate(annotations: &[(&str, &str)]) -> Node {
    translate_node(&kube_node(annotations, &[], None), DEFAULT_TOPOLOGY_LABEL).0
}

fn net(text: &str) -> IpNet {
    text.parse().unwrap()
}
