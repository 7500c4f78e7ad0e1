//! Nodes as the watch decodes them: only the fields kg reads.
//!
//! A Node from the API server carries much that kg never looks at: `managedFields` (one entry
//! per writer, each a JSON tree of field paths), `status.images`, `status.conditions`,
//! `status.nodeInfo`. Every Node event carries the whole object, and at 5,000 nodes the
//! check-in churn alone brings 167 of them a second; decoding each into a full
//! `k8s_openapi` Node allocates every one of those fields only for kg to drop them. [`SlimNode`]
//! names the fields kg reads, so serde skips the rest of the text without allocating, and turns
//! into a `k8s_openapi` Node holding those fields alone ([`SlimNode::into_node`]), which is what
//! the rest of kg (and the file backend) works with.
//!
//! Kept: `metadata.{name, namespace, uid, resourceVersion, labels, annotations}` (the
//! annotations and the topology label are what `control::translate_node` reads, and the
//! `resourceVersion` is how the watch resumes and how unchanged objects are recognised),
//! `spec.{podCIDR, podCIDRs}` (the subnet, and what IP detection excludes),
//! `spec.{unschedulable, taints}` (a leaving node hands leadership over) and
//! `status.addresses` (the `InternalIP`s detection prefers).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node as KubeNode, NodeAddress, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer};

/// A Node with only the fields kg reads (see the module documentation).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SlimNode {
    /// The kept part of `metadata`.
    #[serde(deserialize_with = "slim_meta", default)]
    pub metadata: ObjectMeta,
    /// The kept part of `spec`.
    #[serde(default)]
    pub spec: Option<SlimSpec>,
    /// The kept part of `status`.
    #[serde(default)]
    pub status: Option<SlimStatus>,
}

/// `metadata` as decoded: everything else (`managedFields`, `ownerReferences`, timestamps…)
/// is skipped unread.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

fn slim_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = SlimMeta::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        labels: m.labels,
        annotations: m.annotations,
        ..ObjectMeta::default()
    })
}

/// The kept part of a Node's `spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlimSpec {
    /// `spec.podCIDR`.
    #[serde(rename = "podCIDR", default)]
    pub pod_cidr: Option<String>,
    /// `spec.podCIDRs`.
    #[serde(rename = "podCIDRs", default)]
    pub pod_cidrs: Option<Vec<String>>,
    /// `spec.unschedulable` (a cordon hands leadership over).
    #[serde(default)]
    pub unschedulable: Option<bool>,
    /// `spec.taints`, keys and effects only (a removal taint hands leadership over).
    #[serde(default)]
    pub taints: Option<Vec<SlimTaint>>,
}

/// One of `spec.taints`: its key and effect.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SlimTaint {
    /// `key`.
    #[serde(default)]
    pub key: String,
    /// `effect`.
    #[serde(default)]
    pub effect: String,
}

/// The kept part of a Node's `status`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SlimStatus {
    /// `status.addresses`.
    #[serde(default)]
    pub addresses: Option<Vec<SlimAddress>>,
}

/// One of `status.addresses`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SlimAddress {
    /// `address`.
    #[serde(default)]
    pub address: String,
    /// `type` (`InternalIP`, `ExternalIP`, `Hostname`…).
    #[serde(rename = "type", default)]
    pub type_: String,
}

impl SlimNode {
    /// The `k8s_openapi` Node with the kept fields (every other field unset).
    pub fn into_node(self) -> KubeNode {
        KubeNode {
            metadata: self.metadata,
            spec: self.spec.map(|s| NodeSpec {
                pod_cidr: s.pod_cidr,
                pod_cidrs: s.pod_cidrs,
                unschedulable: s.unschedulable,
                taints: s.taints.map(|t| {
                    t.into_iter()
                        .map(|t| k8s_openapi::api::core::v1::Taint {
                            key: t.key,
                            effect: t.effect,
                            ..Default::default()
                        })
                        .collect()
                }),
                ..NodeSpec::default()
            }),
            status: self.status.map(|s| NodeStatus {
                addresses: s.addresses.map(|a| {
                    a.into_iter()
                        .map(|a| NodeAddress {
                            address: a.address,
                            type_: a.type_,
                        })
                        .collect()
                }),
                ..NodeStatus::default()
            }),
        }
    }
}

/// Watched and listed where Nodes are: the Node resource's identity, with this decoding.
impl kube::Resource for SlimNode {
    type DynamicType = ();
    type Scope = <KubeNode as kube::Resource>::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        KubeNode::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        KubeNode::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        KubeNode::version(dt)
    }

    fn api_version(dt: &()) -> Cow<'_, str> {
        KubeNode::api_version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        KubeNode::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Node as a v1.20 API server sends it after a kubelet registered it and Kilo patched it.
    const NODE: &str = r#"{
      "kind": "Node", "apiVersion": "v1",
      "metadata": {
        "name": "n-1", "uid": "0b1c", "resourceVersion": "4711",
        "creationTimestamp": "2026-11-23T18:00:00Z",
        "labels": {"kubernetes.io/hostname": "n-1", "topology.kubernetes.io/region": "east"},
        "annotations": {"kilo.squat.ai/last-seen": "1700000000", "kilo.squat.ai/location": "a"},
        "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
          "time": "2026-11-23T18:00:00Z", "fieldsType": "FieldsV1",
          "fieldsV1": {"f:metadata": {"f:annotations": {".": {}, "f:kilo.squat.ai/last-seen": {}}}}}]
      },
      "spec": {"podCIDR": "10.42.1.0/24", "podCIDRs": ["10.42.1.0/24", "fd00:1::/64"],
        "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}],
        "unschedulable": true},
      "status": {
        "addresses": [{"type": "InternalIP", "address": "192.168.0.1"},
          {"type": "Hostname", "address": "n-1"}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        "images": [{"names": ["registry/image:tag"], "sizeBytes": 1234}],
        "nodeInfo": {"kubeletVersion": "v1.20.2"}
      }
    }"#;

    #[test]
    fn keeps_what_kg_reads_and_nothing_else() {
        let slim: SlimNode = serde_json::from_str(NODE).unwrap();
        let node = slim.into_node();
        let full: KubeNode = serde_json::from_str(NODE).unwrap();
        assert_eq!(node.metadata.name, full.metadata.name);
        assert_eq!(node.metadata.uid, full.metadata.uid);
        assert_eq!(
            node.metadata.resource_version,
            full.metadata.resource_version
        );
        assert_eq!(node.metadata.labels, full.metadata.labels);
        assert_eq!(node.metadata.annotations, full.metadata.annotations);
        assert_eq!(node.metadata.managed_fields, None);
        assert_eq!(node.metadata.creation_timestamp, None);
        let (spec, full_spec) = (node.spec.unwrap(), full.spec.unwrap());
        assert_eq!(spec.pod_cidr, full_spec.pod_cidr);
        assert_eq!(spec.pod_cidrs, full_spec.pod_cidrs);
        assert_eq!(spec.taints, full_spec.taints);
        assert_eq!(spec.unschedulable, Some(true));
        let (status, full_status) = (node.status.unwrap(), full.status.unwrap());
        assert_eq!(status.addresses, full_status.addresses);
        assert_eq!(status.conditions, None);
        assert_eq!(status.images, None);
        // What kg computes from a Node is the same from either.
        let slim: SlimNode = serde_json::from_str(NODE).unwrap();
        let slim = slim.into_node();
        let full: KubeNode = serde_json::from_str(NODE).unwrap();
        assert_eq!(
            control::translate_node(&slim, "topology.kubernetes.io/region"),
            control::translate_node(&full, "topology.kubernetes.io/region"),
        );
    }

    #[test]
    fn a_bare_node_decodes() {
        let slim: SlimNode = serde_json::from_str(r#"{"metadata": {"name": "x"}}"#).unwrap();
        let node = slim.into_node();
        assert_eq!(node.metadata.name.as_deref(), Some("x"));
        assert!(node.spec.is_none() && node.status.is_none());
        let slim: SlimNode = serde_json::from_str(
            r#"{"metadata": {"name": "x", "annotations": null}, "spec": null}"#,
        )
        .unwrap();
        assert_eq!(slim.into_node().metadata.annotations, None);
    }
}
