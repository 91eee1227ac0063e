//! PKCS#12 bundles (RFC 7292): a certificate, its chain and its key in one
//! password-protected file, the form browsers and operating systems import client
//! certificates in (`kvota certs p12`).
//!
//! Written as current tools write them: the key as a PKCS#8 shrouded key bag under PBES2
//! (PBKDF2 with HMAC-SHA-256, AES-256-CBC), the certificates in plain certificate bags,
//! and the whole checked by an HMAC-SHA-256 whose key the PKCS#12 key derivation makes
//! from the password. The leaf certificate and the key share a local key id.

use ring::rand::SecureRandom as _;
use yasna::models::ObjectIdentifier;
use yasna::{DERWriter, Tag};

/// PBKDF2 and MAC iterations: what OpenSSL 3 writes by default is 2,048; more costs an
/// attacker who has the file more per password tried.
pub const ITERATIONS: u32 = 100_000;

const DATA: &[u64] = &[1, 2, 840, 113_549, 1, 7, 1];
const CERT_BAG: &[u64] = &[1, 2, 840, 113_549, 1, 12, 10, 1, 3];
const SHROUDED_KEY_BAG: &[u64] = &[1, 2, 840, 113_549, 1, 12, 10, 1, 2];
const X509_CERT: &[u64] = &[1, 2, 840, 113_549, 1, 9, 22, 1];
const FRIENDLY_NAME: &[u64] = &[1, 2, 840, 113_549, 1, 9, 20];
const LOCAL_KEY_ID: &[u64] = &[1, 2, 840, 113_549, 1, 9, 21];
const PBES2: &[u64] = &[1, 2, 840, 113_549, 1, 5, 13];
const PBKDF2: &[u64] = &[1, 2, 840, 113_549, 1, 5, 12];
const HMAC_SHA256: &[u64] = &[1, 2, 840, 113_549, 2, 9];
const AES256_CBC: &[u64] = &[2, 16, 840, 1, 101, 3, 4, 1, 42];
const SHA256: &[u64] = &[2, 16, 840, 1, 101, 3, 4, 2, 1];

/// Why a bundle could not be made.
#[derive(Debug, thiserror::Error)]
pub enum P12Error {
    /// No certificate was given.
    #[error("no certificate to bundle")]
    NoCertificate,
    /// The key is not PKCS#8.
    #[error("the key must be a PKCS#8 key (PEM `BEGIN PRIVATE KEY`, as `kvota certs` writes)")]
    KeyFormat,
    /// An empty password protects nothing.
    #[error("the password is empty; a bundle holding a private key needs one")]
    EmptyPassword,
    /// The system's random source failed.
    #[error("no random bytes from the system")]
    Random,
}

/// The PKCS#8 DER of a PEM private key (`BEGIN PRIVATE KEY`); another form is
/// [`P12Error::KeyFormat`].
pub fn pkcs8_from_pem(pem: &[u8]) -> Result<Vec<u8>, P12Error> {
    use rustls::pki_types::pem::PemObject as _;
    match rustls::pki_types::PrivateKeyDer::from_pem_slice(pem) {
        Ok(rustls::pki_types::PrivateKeyDer::Pkcs8(k)) => Ok(k.secret_pkcs8_der().to_vec()),
        _ => Err(P12Error::KeyFormat),
    }
}

fn oid(parts: &[u64]) -> ObjectIdentifier {
    ObjectIdentifier::from_slice(parts)
}

fn random<const N: usize>() -> Result<[u8; N], P12Error> {
    let mut b = [0u8; N];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| P12Error::Random)?;
    Ok(b)
}

/// A PKCS#12 file holding `chain` (DER certificates, the leaf first) and `key_pkcs8`
/// (the leaf's private key, PKCS#8 DER), under `password`, the leaf named `name`.
pub fn bundle(chain: &[Vec<u8>], key_pkcs8: &[u8], name: &str, password: &str) -> Result<Vec<u8>, P12Error> {
    if chain.is_empty() {
        return Err(P12Error::NoCertificate);
    }
    if password.is_empty() {
        return Err(P12Error::EmptyPassword);
    }
    let key_id = ring::digest::digest(&ring::digest::SHA256, &chain[0]);
    let key_id = key_id.as_ref();
    let shrouded = shroud(key_pkcs8, password)?;
    let certs = yasna::construct_der(|w| {
        w.write_sequence_of(|w| {
            for (i, cert) in chain.iter().enumerate() {
                let attrs = (i == 0).then_some((name, key_id));
                safe_bag(w.next(), CERT_BAG, attrs, |w| {
                    w.write_sequence(|w| {
                        w.next().write_oid(&oid(X509_CERT));
                        w.next().write_tagged(Tag::context(0), |w| w.write_bytes(cert));
                    })
                });
            }
        })
    });
    let keys = yasna::construct_der(|w| {
        w.write_sequence_of(|w| {
            safe_bag(w.next(), SHROUDED_KEY_BAG, Some((name, key_id)), |w| {
                w.write_der(&shrouded)
            });
        })
    });
    let auth_safe = yasna::construct_der(|w| {
        w.write_sequence_of(|w| {
            data_content(w.next(), &certs);
            data_content(w.next(), &keys);
        })
    });
    let salt: [u8; 16] = random()?;
    let mac = mac(&auth_safe, password, &salt, ITERATIONS);
    Ok(yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_u8(3);
            data_content(w.next(), &auth_safe);
            w.next().write_sequence(|w| {
                w.next().write_sequence(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_oid(&oid(SHA256));
                        w.next().write_null();
                    });
                    w.next().write_bytes(&mac);
                });
                w.next().write_bytes(&salt);
                w.next().write_u32(ITERATIONS);
            });
        })
    }))
}

/// `ContentInfo` of type data holding `content`.
fn data_content(w: DERWriter, content: &[u8]) {
    w.write_sequence(|w| {
        w.next().write_oid(&oid(DATA));
        w.next().write_tagged(Tag::context(0), |w| w.write_bytes(content));
    });
}

/// A `SafeBag` of `kind` whose value `value` writes, with a friendly name and local key
/// id when given.
fn safe_bag(w: DERWriter, kind: &[u64], attrs: Option<(&str, &[u8])>, value: impl FnOnce(DERWriter)) {
    w.write_sequence(|w| {
        w.next().write_oid(&oid(kind));
        w.next().write_tagged(Tag::context(0), value);
        if let Some((name, id)) = attrs {
            w.next().write_set_of(|w| {
                w.next().write_sequence(|w| {
                    w.next().write_oid(&oid(FRIENDLY_NAME));
                    w.next().write_set_of(|w| w.next().write_bmp_string(name));
                });
                w.next().write_sequence(|w| {
                    w.next().write_oid(&oid(LOCAL_KEY_ID));
                    w.next().write_set_of(|w| w.next().write_bytes(id));
                });
            });
        }
    });
}

/// The key as an `EncryptedPrivateKeyInfo` under PBES2: PBKDF2-HMAC-SHA-256 of the
/// password (its UTF-8 bytes, as PBES2 takes them), AES-256-CBC with PKCS#7 padding.
fn shroud(key_pkcs8: &[u8], password: &str) -> Result<Vec<u8>, P12Error> {
    use aes::cipher::{BlockEncryptMut, KeyIvInit};
    let salt: [u8; 16] = random()?;
    let iv: [u8; 16] = random()?;
    let mut key = [0u8; 32];
    let iterations = std::num::NonZeroU32::new(ITERATIONS).unwrap_or(std::num::NonZeroU32::MIN);
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        iterations,
        &salt,
        password.as_bytes(),
        &mut key,
    );
    let sealed = cbc::Encryptor::<aes::Aes256>::new(&key.into(), &iv.into())
        .encrypt_padded_vec_mut::<aes::cipher::block_padding::Pkcs7>(key_pkcs8);
    Ok(yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_sequence(|w| {
                w.next().write_oid(&oid(PBES2));
                w.next().write_sequence(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_oid(&oid(PBKDF2));
                        w.next().write_sequence(|w| {
                            w.next().write_bytes(&salt);
                            w.next().write_u32(ITERATIONS);
                            w.next().write_sequence(|w| {
                                w.next().write_oid(&oid(HMAC_SHA256));
                                w.next().write_null();
                            });
                        });
                    });
                    w.next().write_sequence(|w| {
                        w.next().write_oid(&oid(AES256_CBC));
                        w.next().write_bytes(&iv);
                    });
                });
            });
            w.next().write_bytes(&sealed);
        })
    }))
}

/// The MAC over the authenticated safe: HMAC-SHA-256 keyed by the PKCS#12 key derivation
/// (RFC 7292, appendix B.2; purpose 3, MAC) of the password as a BMPString.
fn mac(content: &[u8], password: &str, salt: &[u8], iterations: u32) -> Vec<u8> {
    let key = pkcs12_kdf(password, salt, iterations, 3);
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
    ring::hmac::sign(&k, content).as_ref().to_vec()
}

/// The PKCS#12 key derivation with SHA-256 (block 64 bytes), for one hash's worth of
/// key (32 bytes): `H^iterations(D || I)`, `D` the purpose byte repeated over a block,
/// `I` the salt and the password (UTF-16BE, two zero bytes after) each repeated to a
/// whole number of blocks.
fn pkcs12_kdf(password: &str, salt: &[u8], iterations: u32, purpose: u8) -> [u8; 32] {
    const V: usize = 64;
    let mut pass: Vec<u8> = password.encode_utf16().flat_map(u16::to_be_bytes).collect();
    pass.extend([0, 0]);
    let fill = |s: &[u8]| -> Vec<u8> {
        if s.is_empty() {
            return Vec::new();
        }
        let n = s.len().div_ceil(V) * V;
        s.iter().copied().cycle().take(n).collect()
    };
    let mut input = vec![purpose; V];
    input.extend(fill(salt));
    input.extend(fill(&pass));
    let mut a = ring::digest::digest(&ring::digest::SHA256, &input);
    for _ in 1..iterations {
        a = ring::digest::digest(&ring::digest::SHA256, a.as_ref());
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(a.as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The derivation against a vector computed independently: `openssl kdf -keylen 32
    /// -kdfopt digest:SHA256 -kdfopt hexpass:006b0076006f007400610000 -kdfopt
    /// hexsalt:0102030405060708 -kdfopt iter:2048 -kdfopt id:3 PKCS12KDF` (password
    /// "kvota" as the BMPString PKCS#12 derives from).
    #[test]
    fn the_pkcs12_derivation_matches_an_independent_computation() {
        let salt = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let key = pkcs12_kdf("kvota", &salt, 2_048, 3);
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, include_str!("p12_kdf_vector.txt").trim());
    }

    #[test]
    fn refusals_are_named() {
        assert!(matches!(bundle(&[], b"k", "n", "p"), Err(P12Error::NoCertificate)));
        assert!(matches!(
            bundle(&[vec![1]], b"k", "n", ""),
            Err(P12Error::EmptyPassword)
        ));
    }
}
