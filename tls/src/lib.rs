//! Who may talk to kvota, and how much: the identities in certificates
//! ([`identity`]), the PEM files that hold them and their reloading ([`material`]),
//! verification by identity ([`verify`]), listeners with connection limits
//! ([`listen`]), HTTP limits ([`http`]), the client connector ([`connect`]) and
//! issuing certificates ([`issue`]). The control plane and the agent share all of it;
//! `docs/security.md` has the threat model and every limit.

pub mod connect;
pub mod http;
pub mod identity;
pub mod issue;
pub mod listen;
pub mod material;
pub mod p12;
pub mod verify;

pub use identity::{Identity, Role};
pub use listen::{Conn, Limits, Listener, PeerInfo, Refusal, ServerTls};
pub use material::{TlsError, TlsPaths, TlsSource};
pub use verify::{Expect, TrustGroup};

use std::sync::{Arc, OnceLock};

/// The one crypto provider kvota uses (ring), shared by every configuration.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    static P: OnceLock<Arc<rustls::crypto::CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}
