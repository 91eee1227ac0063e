//! What the leader agent keeps in its member cluster, so that whichever agent process
//! runs next (the same replica restarted, or the standby taking over, possibly while the
//! control plane is unreachable) goes on enforcing at once: the policy, the lease with
//! how long its budgets may still be enforced, and how far the cluster's usage is
//! counted.
//!
//! Where: in the cluster itself, a ConfigMap (`--state-configmap`, default
//! `kvota-agent-state` in the agent's namespace; [`crate::kube::ConfigMapStore`]), which
//! both replicas can read wherever they run; without Kubernetes, a file in the data
//! directory ([`FileStore`]). Only the holder of the leader Lease writes it, with the
//! object's resourceVersion as a precondition, so a replica that lost the Lease cannot
//! overwrite what the new leader wrote. Why not a PersistentVolume: a volume is mounted
//! on one node at a time, so the standby could not read it when it takes over from a
//! leader whose node is gone; and why not the usage journal itself: the journal holds
//! every unacknowledged report (it can outgrow an API object during a long partition),
//! while what enforcement needs is small. Usage the dead leader had not delivered is
//! recovered from the pods themselves ([`crate::agent::Agent::settle_takeover`]).
//!
//! # Format (version 1)
//!
//! JSON of [`MemberState`], whose `format` field is the version. A newer version than
//! this agent knows, a state of another cluster, or one that does not decode is not
//! used (the agent says why and falls back to the safe budgets of whatever lease its
//! own journal holds: docs/guarantees.md G11).
//!
//! # Lease timing across processes
//!
//! A monotonic clock does not survive its process, so the writer records until when the
//! lease may be enforced on its wall clock (`lease_usable_until_unix_ms`: the request
//! send time plus duration minus margin, as it measured). A reader takes off the
//! lease's margin once more, for the difference between the two processes' wall clocks
//! (the replicas' nodes must agree within it, as they must with the control plane), and
//! measures what is left on its own monotonic clock: it never enforces the lease longer
//! than the writer could have.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use kvota_fairness::lease::Lease;
use kvota_fairness::policy::Policy;
use serde::{Deserialize, Serialize};

/// The format this code writes, and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// Largest state accepted or written: a ConfigMap holds at most 1 MiB.
pub const MAX_STATE_BYTES: usize = 900 << 10;

/// The state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberState {
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// The member cluster.
    pub cluster: kvota_fairness::names::ClusterName,
    /// The replica that wrote it.
    pub writer: String,
    /// When (writer's wall clock, Unix ms).
    pub written_unix_ms: u64,
    /// The policy in force.
    pub policy: Option<Policy>,
    /// The lease held.
    pub lease: Option<Lease>,
    /// Until when the lease's budgets may be enforced (writer's wall clock, Unix ms; 0:
    /// already expired, or unknown).
    pub lease_usable_until_unix_ms: u64,
    /// Highest report sequence the control plane acknowledged.
    pub acked_seq: u64,
    /// Usage of the cluster counted through this instant (Unix ms, the agents' wall
    /// clock): the end of the last acknowledged report's window.
    pub counted_through_unix_ms: u64,
}

/// Why a stored state is not used.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The store could not be read or written.
    #[error("agent state in {store}: {why}")]
    Store {
        /// Which store.
        store: String,
        /// Why.
        why: String,
    },
    /// It does not decode.
    #[error("agent state in {store} is corrupt: {why}")]
    Corrupt {
        /// Which store.
        store: String,
        /// Why.
        why: String,
    },
    /// Written by a newer agent.
    #[error("agent state in {store} is format version {found}, newer than this agent reads ({FORMAT_VERSION})")]
    Newer {
        /// Which store.
        store: String,
        /// Its version.
        found: u32,
    },
    /// Written for another cluster.
    #[error("agent state in {store} belongs to cluster `{found}`, not `{cluster}`")]
    OtherCluster {
        /// Which store.
        store: String,
        /// The cluster it names.
        found: String,
        /// This agent's cluster.
        cluster: String,
    },
}

/// Encodes a state ([`MAX_STATE_BYTES`] at most).
pub fn encode(s: &MemberState) -> Result<Vec<u8>, PersistError> {
    let bytes = serde_json::to_vec(s).map_err(|e| PersistError::Corrupt {
        store: "memory".into(),
        why: e.to_string(),
    })?;
    if bytes.len() > MAX_STATE_BYTES {
        return Err(PersistError::Store {
            store: "memory".into(),
            why: format!(
                "{} bytes; at most {MAX_STATE_BYTES} fit (a policy of thousands of tenants?)",
                bytes.len()
            ),
        });
    }
    Ok(bytes)
}

/// Decodes a state read from `store` for `cluster`: the version first (so a newer
/// format is refused, not misread), then the rest.
pub fn decode(bytes: &[u8], store: &str, cluster: &str) -> Result<MemberState, PersistError> {
    if bytes.len() > MAX_STATE_BYTES {
        return Err(PersistError::Corrupt {
            store: store.into(),
            why: format!("{} bytes is more than a state holds", bytes.len()),
        });
    }
    #[derive(Deserialize)]
    struct Version {
        format: u32,
    }
    let v: Version = serde_json::from_slice(bytes).map_err(|e| PersistError::Corrupt {
        store: store.into(),
        why: e.to_string(),
    })?;
    if v.format > FORMAT_VERSION {
        return Err(PersistError::Newer {
            store: store.into(),
            found: v.format,
        });
    }
    if v.format == 0 {
        return Err(PersistError::Corrupt {
            store: store.into(),
            why: "format version 0".into(),
        });
    }
    let s: MemberState = serde_json::from_slice(bytes).map_err(|e| PersistError::Corrupt {
        store: store.into(),
        why: e.to_string(),
    })?;
    if s.cluster != cluster {
        return Err(PersistError::OtherCluster {
            store: store.into(),
            found: s.cluster.into_string(),
            cluster: cluster.into(),
        });
    }
    if let Some(l) = &s.lease {
        if l.cluster != cluster {
            return Err(PersistError::Corrupt {
                store: store.into(),
                why: "its lease is another cluster's".into(),
            });
        }
        // The checks a lease from the control plane passes (epoch, margin against
        // duration, budgets), so an edited one is refused as a received one would be.
        l.validate().map_err(|e| PersistError::Corrupt {
            store: store.into(),
            why: format!("its lease: {e}"),
        })?;
    }
    Ok(s)
}

/// A future returned by a store.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, PersistError>> + Send + 'a>>;

/// Where the state is kept: bytes in, bytes out.
pub trait StateStore: Send + Sync + fmt::Debug {
    /// The bytes last saved (`None`: nothing saved yet).
    fn load(&self) -> StoreFuture<'_, Option<Vec<u8>>>;
    /// Saves `bytes`, durably, replacing what was there (fenced: see the module docs).
    fn save(&self, bytes: Vec<u8>) -> StoreFuture<'_, ()>;
    /// Where, for logs and errors.
    fn describe(&self) -> String;
    /// This replica (again) holds the leader Lease: a store that stopped writing after
    /// another writer got there first may write again.
    fn rearm(&self) {}
}

/// The state in a file (no Kubernetes: a simulated cluster, or tests): written to a
/// temporary file, synced, renamed over the old one, the directory synced (and made
/// first if it does not exist).
#[derive(Debug)]
pub struct FileStore {
    path: PathBuf,
}

impl FileStore {
    /// The file `state.json` in `dir`.
    pub fn in_dir(dir: &Path) -> FileStore {
        FileStore {
            path: dir.join("state.json"),
        }
    }
}

impl StateStore for FileStore {
    fn load(&self) -> StoreFuture<'_, Option<Vec<u8>>> {
        Box::pin(async move {
            match std::fs::read(&self.path) {
                Ok(b) => Ok(Some(b)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(PersistError::Store {
                    store: self.describe(),
                    why: e.to_string(),
                }),
            }
        })
    }

    fn save(&self, bytes: Vec<u8>) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            use std::io::Write as _;
            let err = |e: std::io::Error| PersistError::Store {
                store: self.describe(),
                why: e.to_string(),
            };
            let tmp = self.path.with_extension("json.tmp");
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir).map_err(err)?;
            }
            let mut f = std::fs::File::create(&tmp).map_err(err)?;
            f.write_all(&bytes).map_err(err)?;
            f.sync_all().map_err(err)?;
            std::fs::rename(&tmp, &self.path).map_err(err)?;
            if let Some(dir) = self.path.parent() {
                std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
            }
            Ok(())
        })
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::names::ClusterName;
    use proptest::prelude::*;

    fn sample() -> MemberState {
        MemberState {
            format: FORMAT_VERSION,
            cluster: ClusterName::from_static("east"),
            writer: "agent-0".into(),
            written_unix_ms: 1_000,
            policy: Some(Policy::from_yaml(Policy::article_example_yaml()).expect("policy")),
            lease: Some(Lease {
                cluster: ClusterName::from_static("east"),
                epoch: 3,
                duration_ms: 30_000,
                margin_ms: 3_000,
                issued_at_ms: 10,
                budgets: Default::default(),
            }),
            lease_usable_until_unix_ms: 28_000,
            acked_seq: 9,
            counted_through_unix_ms: 900,
        }
    }

    #[test]
    fn states_round_trip_and_the_wrong_ones_are_refused_with_the_reason() {
        let s = sample();
        assert_eq!(decode(&encode(&s).expect("enc"), "cm", "east").expect("dec"), s);
        let e = decode(&encode(&s).expect("enc"), "cm", "west").expect_err("other cluster");
        assert!(matches!(e, PersistError::OtherCluster { .. }), "{e}");
        let mut newer = serde_json::to_value(&s).expect("json");
        newer["format"] = serde_json::json!(FORMAT_VERSION + 1);
        newer["something_new"] = serde_json::json!(true);
        let e = decode(&serde_json::to_vec(&newer).expect("json"), "cm", "east").expect_err("newer");
        assert!(matches!(e, PersistError::Newer { found: 2, .. }), "{e}");
        assert!(matches!(
            decode(b"{\"format\": 1}", "cm", "east"),
            Err(PersistError::Corrupt { .. })
        ));
        assert!(matches!(
            decode(b"not json", "cm", "east"),
            Err(PersistError::Corrupt { .. })
        ));
    }

    #[tokio::test]
    async fn a_file_store_keeps_what_was_saved() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = FileStore::in_dir(dir.path());
        assert_eq!(store.load().await.expect("load"), None);
        store.save(encode(&sample()).expect("enc")).await.expect("save");
        let back = store.load().await.expect("load").expect("some");
        assert_eq!(decode(&back, "f", "east").expect("dec"), sample());
    }

    proptest! {
        /// Any bytes: decoding answers, never panics.
        #[test]
        fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..400), edit in any::<prop::sample::Index>(), b in any::<u8>()) {
            let _ = decode(&bytes, "fuzz", "east");
            let mut good = encode(&sample()).expect("enc");
            let i = edit.index(good.len());
            good[i] = b;
            if let Ok(s) = decode(&good, "fuzz", "east") {
                prop_assert_eq!(s.cluster, "east");
            }
        }
    }
}
