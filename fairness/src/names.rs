//! The one rule for the names kvota uses as keys: tenants, clusters and the namespaces a
//! policy maps to tenants are Kubernetes DNS labels (RFC 1123): 1 to 63 lowercase
//! letters, digits and '-', starting and ending with a letter or digit. The policy, the
//! federation, the wire conversions and the certificate identities all check with
//! [`is_dns_label`], so a name one of them accepts every other accepts too.

/// Longest DNS label, in bytes.
pub const MAX_DNS_LABEL: usize = 63;

/// The rule in words, for error messages.
pub const DNS_LABEL_RULE: &str = "1-63 lowercase letters, digits and '-', starting and ending with a letter or digit";

/// Whether `s` is a DNS label (see the module docs).
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_DNS_LABEL
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A name that is not a DNS label, with what it was to name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} {name:?} is not valid: {rule}")]
pub struct NameError {
    /// What the name was for: "tenant name", "cluster name" or "pod key".
    pub what: &'static str,
    /// The name as given (at most its first 80 characters).
    pub name: String,
    /// The rule it breaks, in words.
    pub rule: &'static str,
}

fn checked(what: &'static str, name: String) -> Result<String, NameError> {
    if is_dns_label(&name) {
        Ok(name)
    } else {
        let shown: String = name.chars().take(80).collect();
        Err(NameError {
            what,
            name: shown,
            rule: DNS_LABEL_RULE,
        })
    }
}

/// Defines a name type: a `String` known to be a DNS label, made only by parsing
/// (`parse`, `FromStr`, `TryFrom`, deserializing), read as a `&str` everywhere
/// (`Deref`, `Borrow<str>` so maps keyed by it are looked up with a `&str`). It
/// serializes as the bare string, so formats that carried the string carry it
/// unchanged, and its `Debug` is the string's.
macro_rules! label_name {
    ($(#[$meta:meta])* $name:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// Parses `name`: an error names the rule it breaks.
            pub fn parse(name: impl Into<String>) -> Result<Self, NameError> {
                checked($what, name.into()).map($name)
            }
        }

        name_traits!($name);
    };
}

/// The traits every name type shares (see [`label_name`]), over its `parse` and its
/// one `String` field.
macro_rules! name_traits {
    ($name:ident) => {
        impl $name {
            /// A name written in the source. Panics if it breaks the rule: for literals
            /// only, never for input.
            #[track_caller]
            pub fn from_static(name: &'static str) -> Self {
                match Self::parse(name) {
                    Ok(n) => n,
                    Err(e) => panic!("{e}"),
                }
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The name as a `String`.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Debug::fmt(&self.0, f)
            }
        }

        impl std::str::FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, NameError> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = NameError;
            fn try_from(s: String) -> Result<Self, NameError> {
                Self::parse(s)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = NameError;
            fn try_from(s: &str) -> Result<Self, NameError> {
                Self::parse(s)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> String {
                n.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::parse(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

label_name!(
    /// A tenant's name: a DNS label (see the module docs), as the policy names it.
    TenantName,
    "tenant name"
);

label_name!(
    /// A member cluster's name: a DNS label (see the module docs), as it registers.
    ClusterName,
    "cluster name"
);

/// Longest pod name (a DNS subdomain), in bytes.
pub const MAX_POD_NAME: usize = 253;

/// Longest uid in a provisional pod key, in bytes (Kubernetes uids are 36).
pub const MAX_UID: usize = 64;

/// The pod-key rule in words, for error messages.
pub const POD_KEY_RULE: &str = "NAMESPACE/NAME: the namespace a DNS label, the name 1-253 lowercase letters, digits, '-' and '.' (or PREFIX*UID for a pod not named yet)";

/// Whether `s` is a pod name as Kubernetes allows it (a DNS subdomain's characters).
fn is_pod_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_POD_NAME
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
}

/// Whether `s` is the `PREFIX*UID` a pod has before the API server names it: the
/// prefix (its `generateName`, possibly empty) with a name's characters, the uid 1-64
/// lowercase letters, digits and '-'.
fn is_provisional_name(s: &str) -> bool {
    let Some((prefix, uid)) = s.split_once('*') else {
        return false;
    };
    (prefix.is_empty() || is_pod_name(prefix))
        && !uid.is_empty()
        && uid.len() <= MAX_UID
        && uid
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// A pod's key, `namespace/name` (see [`POD_KEY_RULE`]): how the agent's admission
/// state, its inventory and reclaim name a pod. A pod created with `generateName` is
/// judged by the mutating webhook before the API server names it: its key is then the
/// provisional `namespace/prefix*uid` ([`PodKey::provisional`]) until the inventory sees
/// it under its name. Made only by parsing; read as a `&str`; serialized as the string.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey(String);

impl PodKey {
    fn checked(key: String) -> Result<PodKey, NameError> {
        let ok = key
            .split_once('/')
            .is_some_and(|(ns, name)| is_dns_label(ns) && (is_pod_name(name) || is_provisional_name(name)));
        if ok {
            Ok(PodKey(key))
        } else {
            Err(NameError {
                what: "pod key",
                name: key.chars().take(80).collect(),
                rule: POD_KEY_RULE,
            })
        }
    }

    /// Parses `namespace/name` (or a provisional `namespace/prefix*uid`).
    pub fn parse(key: impl Into<String>) -> Result<PodKey, NameError> {
        PodKey::checked(key.into())
    }

    /// The key of pod `name` in `namespace`.
    pub fn new(namespace: &str, name: &str) -> Result<PodKey, NameError> {
        if name.contains('*') {
            return Err(NameError {
                what: "pod key",
                name: format!("{namespace}/{name}").chars().take(80).collect(),
                rule: POD_KEY_RULE,
            });
        }
        PodKey::checked(format!("{namespace}/{name}"))
    }

    /// The provisional key of a pod not named yet: its `generateName` prefix and the
    /// review's uid.
    pub fn provisional(namespace: &str, prefix: &str, uid: &str) -> Result<PodKey, NameError> {
        PodKey::checked(format!("{namespace}/{prefix}*{uid}"))
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        self.0.split_once('/').map_or("", |(ns, _)| ns)
    }

    /// The name (or `prefix*uid` for a provisional key).
    pub fn name(&self) -> &str {
        self.0.split_once('/').map_or("", |(_, n)| n)
    }

    /// Whether this is a provisional key (a pod the API server had not named yet).
    pub fn is_provisional(&self) -> bool {
        self.name().contains('*')
    }
}

name_traits!(PodKey);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_rfc_1123() {
        for ok in ["a", "training", "team-7", "0", &"x".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "ü", &"x".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn names_parse_once_read_as_str_and_serialize_as_the_bare_string() {
        let t: TenantName = "training".parse().expect("valid");
        assert_eq!(t, "training");
        assert_eq!(&*t, "training");
        assert_eq!(format!("{t} {t:?}"), "training \"training\"");
        assert_eq!(serde_json::to_string(&t).expect("json"), "\"training\"");
        let map: std::collections::BTreeMap<ClusterName, u32> =
            serde_json::from_str(r#"{"east":1,"west":2}"#).expect("keys");
        assert_eq!(map.get("west"), Some(&2));
        let e = serde_json::from_str::<TenantName>("\"Not_A_Label\"").expect_err("refused");
        assert!(
            e.to_string()
                .contains("tenant name \"Not_A_Label\" is not valid: 1-63 lowercase"),
            "{e}"
        );
        let e =
            serde_json::from_str::<std::collections::BTreeMap<ClusterName, u32>>(r#"{"a.b":1}"#).expect_err("refused");
        assert!(e.to_string().contains("cluster name \"a.b\""), "{e}");
        assert_eq!(ClusterName::parse("x".repeat(64)).map_err(|e| e.name.len()), Err(64));
        assert_eq!(TenantName::parse("y".repeat(500)).map_err(|e| e.name.len()), Err(80));
    }

    #[test]
    fn pod_keys_are_a_namespace_and_a_name_or_a_provisional_prefix_and_uid() {
        let k = PodKey::new("ml", "train-0.worker").expect("valid");
        assert_eq!(
            (k.namespace(), k.name(), k.is_provisional(), k.as_str()),
            ("ml", "train-0.worker", false, "ml/train-0.worker")
        );
        let p = PodKey::provisional("ml", "job-", "4f1c-9a").expect("valid");
        assert_eq!((p.as_str(), p.is_provisional()), ("ml/job-*4f1c-9a", true));
        assert_eq!(
            PodKey::provisional("ml", "", "abc").map(PodKey::into_string),
            Ok("ml/*abc".to_string())
        );
        assert_eq!(PodKey::parse("ml/job-*4f1c-9a"), Ok(p));
        for bad in [
            "",
            "ml",
            "/x",
            "ml/",
            "ML/x",
            "ml/X",
            "ml/a b",
            "ml/a/b",
            "ml/job-*",
            "ml/job-*UID",
            "ml/**a",
            &format!("ml/{}", "x".repeat(254)),
        ] {
            let e = PodKey::parse(bad).expect_err(bad);
            assert_eq!(e.what, "pod key");
            assert!(e.to_string().contains("NAMESPACE/NAME"), "{e}");
        }
        assert!(PodKey::new("ml", "a*b").is_err(), "a name never holds '*'");
        let json = serde_json::to_string(&k).expect("json");
        assert_eq!(json, "\"ml/train-0.worker\"");
        assert_eq!(serde_json::from_str::<PodKey>(&json).expect("back"), k);
        assert!(serde_json::from_str::<PodKey>("\"no-slash\"").is_err());
    }

    proptest::proptest! {
        /// A name type accepts exactly the DNS labels, and what it accepts goes through
        /// JSON unchanged.
        #[test]
        fn a_name_type_accepts_exactly_the_labels(s in "[a-z0-9A-Z._-]{0,70}") {
            let parsed = TenantName::parse(s.clone());
            proptest::prop_assert_eq!(parsed.is_ok(), is_dns_label(&s));
            if let Ok(t) = parsed {
                let back: TenantName = serde_json::from_str(&serde_json::to_string(&t).expect("json")).expect("back");
                proptest::prop_assert_eq!(back, t);
            }
        }

        /// A pod key parses exactly when its parts follow the rule, and goes through
        /// JSON unchanged; its parts read back as they were given.
        #[test]
        fn a_pod_key_parses_by_its_rule(ns in "[a-z0-9A-Z-]{0,8}", name in "[a-z0-9.A-Z*/-]{0,12}") {
            let key = format!("{ns}/{name}");
            let want = is_dns_label(&ns) && (is_pod_name(&name) || is_provisional_name(&name));
            let parsed = PodKey::parse(key.clone());
            proptest::prop_assert_eq!(parsed.is_ok(), want);
            if let Ok(k) = parsed {
                proptest::prop_assert_eq!((k.namespace(), k.name()), (ns.as_str(), name.as_str()));
                let back: PodKey = serde_json::from_str(&serde_json::to_string(&k).expect("json")).expect("back");
                proptest::prop_assert_eq!(back, k);
            }
        }
    }
}
