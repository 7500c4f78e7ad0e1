//! Why kg is stopping, read from the API server: its Pod's owning DaemonSet still exists (kg is
//! being replaced: a rollout, a restart, an eviction) or not (kilotun is being uninstalled).
//! The Pod is named by the downward API (`POD_NAME`, `POD_NAMESPACE` in the manifests).

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};

use crate::backend::Departure;

/// The environment variables that name kg's own Pod.
pub const POD_NAME_ENV: &str = "POD_NAME";
/// See [`POD_NAME_ENV`].
pub const POD_NAMESPACE_ENV: &str = "POD_NAMESPACE";

/// Reads kg's Pod and its DaemonSet. Anything that cannot be read counts as removal (Kilo's
/// behaviour on every exit), with the reason.
pub async fn departure(client: &Client) -> Departure {
    let (Ok(pod_name), Ok(namespace)) = (
        std::env::var(POD_NAME_ENV),
        std::env::var(POD_NAMESPACE_ENV),
    ) else {
        return Departure::Removed {
            why: format!(
                "{POD_NAME_ENV} and {POD_NAMESPACE_ENV} are not set, so kg cannot tell a restart from an uninstall (the manifests set them from the downward API)"
            ),
        };
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = match pods.get(&pod_name).await {
        Ok(pod) => pod,
        Err(e) => {
            return Departure::Removed {
                why: format!("reading its Pod {namespace}/{pod_name} failed: {e}"),
            }
        }
    };
    let owner = pod
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .find(|o| {
            o.kind == "DaemonSet"
                && o.api_version.starts_with("apps/")
                && o.controller == Some(true)
        });
    let Some(owner) = owner else {
        return Departure::Removed {
            why: format!("its Pod {namespace}/{pod_name} is not run by a DaemonSet"),
        };
    };
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), &namespace);
    match daemon_sets.get_opt(&owner.name).await {
        Ok(Some(ds)) if ds.metadata.uid.as_deref() != Some(owner.uid.as_str()) => {
            Departure::Removed {
                why: format!(
                    "its DaemonSet {namespace}/{} was deleted (one of that name was created since)",
                    owner.name
                ),
            }
        }
        Ok(Some(ds)) if ds.metadata.deletion_timestamp.is_none() => Departure::Replaced {
            by: format!("DaemonSet {namespace}/{}", owner.name),
        },
        Ok(Some(_)) | Ok(None) => Departure::Removed {
            why: format!("its DaemonSet {namespace}/{} is deleted", owner.name),
        },
        Err(e) => Departure::Removed {
            why: format!(
                "reading its DaemonSet {namespace}/{} failed: {e}",
                owner.name
            ),
        },
    }
}
