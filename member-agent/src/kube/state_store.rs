//! [`ConfigMapStore`]: the agent's kept state (`crate::persist`) in a ConfigMap, fenced
//! by resourceVersion.

use std::sync::Mutex;

use kube::api::{Api, PostParams};
use kube::Client;

use super::api_status;

/// The agent's persisted state (`crate::persist`) in a ConfigMap of the agent's
/// namespace, key `state.json`. Writes carry the resourceVersion last seen: a replica
/// that lost the leader Lease and wakes up late gets 409 instead of overwriting what
/// the new leader wrote, and from then on writes nothing until it wins the Lease again
/// ([`ConfigMapStore::rearm`]). Its namespace, name and size limit are in the RBAC of
/// `deploy/kubernetes/base/agent/10-rbac.yaml` (get, create, update on this one name).
#[derive(Debug)]
pub struct ConfigMapStore {
    api: Api<k8s_openapi::api::core::v1::ConfigMap>,
    namespace: String,
    name: String,
    version: Mutex<Option<String>>,
    /// Another writer got there first (409): saves are refused until [`ConfigMapStore::rearm`].
    fenced: std::sync::atomic::AtomicBool,
}

/// The key of the state in the ConfigMap.
pub const STATE_KEY: &str = "state.json";

impl ConfigMapStore {
    /// The state in ConfigMap `namespace/name`.
    pub fn new(client: Client, namespace: &str, name: &str) -> ConfigMapStore {
        ConfigMapStore {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
            version: Mutex::new(None),
            fenced: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn err(&self, e: impl std::fmt::Display) -> crate::persist::PersistError {
        crate::persist::PersistError::Store {
            store: crate::persist::StateStore::describe(self),
            why: e.to_string(),
        }
    }

    fn remember(&self, cm: &k8s_openapi::api::core::v1::ConfigMap) {
        *self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = cm.metadata.resource_version.clone();
    }
}

impl crate::persist::StateStore for ConfigMapStore {
    fn load(&self) -> crate::persist::StoreFuture<'_, Option<Vec<u8>>> {
        Box::pin(async move {
            let cm = self.api.get_opt(&self.name).await.map_err(|e| self.err(e))?;
            let Some(cm) = cm else { return Ok(None) };
            self.remember(&cm);
            Ok(cm.data.and_then(|d| d.get(STATE_KEY).map(|s| s.as_bytes().to_vec())))
        })
    }

    fn save(&self, bytes: Vec<u8>) -> crate::persist::StoreFuture<'_, ()> {
        Box::pin(async move {
            if self.fenced.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(self.err("another replica wrote it since this one last did; this replica writes again only once it wins the leader Lease"));
            }
            let text = String::from_utf8(bytes).map_err(|e| self.err(e))?;
            let rv = self
                .version
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            let mut cm = k8s_openapi::api::core::v1::ConfigMap {
                metadata: kube::api::ObjectMeta {
                    name: Some(self.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    labels: Some([("app.kubernetes.io/name".to_string(), "kvota-agent".to_string())].into()),
                    annotations: Some(
                        [(
                            "kvota.dev/state-format".to_string(),
                            crate::persist::FORMAT_VERSION.to_string(),
                        )]
                        .into(),
                    ),
                    resource_version: rv.clone(),
                    ..Default::default()
                },
                data: Some([(STATE_KEY.to_string(), text)].into()),
                ..Default::default()
            };
            let result = match rv {
                Some(_) => self.api.replace(&self.name, &PostParams::default(), &cm).await,
                None => match self.api.create(&PostParams::default(), &cm).await {
                    // It exists (another replica made it): take its version, then replace.
                    Err(e) if matches!(api_status(&e), Some(409)) => {
                        let cur = self.api.get(&self.name).await.map_err(|e| self.err(e))?;
                        cm.metadata.resource_version = cur.metadata.resource_version.clone();
                        self.api.replace(&self.name, &PostParams::default(), &cm).await
                    }
                    other => other,
                },
            };
            match result {
                Ok(saved) => {
                    self.remember(&saved);
                    Ok(())
                }
                Err(e) => {
                    match api_status(&e) {
                        // Someone wrote since we did: the new leader. Stop writing.
                        Some(409) => self.fenced.store(true, std::sync::atomic::Ordering::SeqCst),
                        // Deleted (by a person): the next save makes it again.
                        Some(404) => *self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None,
                        _ => {}
                    }
                    Err(self.err(e))
                }
            }
        })
    }

    fn describe(&self) -> String {
        format!("ConfigMap {}/{}", self.namespace, self.name)
    }

    fn rearm(&self) {
        self.fenced.store(false, std::sync::atomic::Ordering::SeqCst);
        *self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}
