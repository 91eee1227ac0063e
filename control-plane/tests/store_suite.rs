//! openraft's storage conformance suite against kvota's log store (segments) and state
//! machine store.

use kvota_control_plane::store::{self, LogStore, StateMachineStore};
use kvota_control_plane::types::TypeConfig;
use openraft::testing::{StoreBuilder, Suite};
use openraft::{StorageError, StorageIOError};
use tempfile::TempDir;

/// Every build opens a fresh database in its own temporary directory; the directory is
/// the guard, so it lives exactly as long as the test that uses the stores.
struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError<u64>> {
        let dir = TempDir::new().map_err(|e| StorageIOError::write(&e))?;
        let (log_store, sm_store) = store::open(dir.path()).map_err(|e| StorageIOError::write(&e))?;
        Ok((dir, log_store, sm_store))
    }
}

#[test]
fn openraft_storage_suite() {
    if let Err(e) = Suite::test_all(SledBuilder) {
        panic!("openraft storage suite failed: {e}");
    }
}
