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
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}


/// A name that is not a DNS label, with what it was to name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} name {name:?} is not valid: {rule}")]
pub struct NameError {
    /// What the name was for ("tenant", "cluster", "pod").
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
        Err(NameError { what, name: shown, rule: DNS_LABEL_RULE })
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

            /// A name written in the source. Panics if it is not a DNS label: for
            /// literals only, never for input.
            #[track_caller]
            pub fn from_static(name: &'static str) -> Self {
                match Self::parse(name) {
                    Ok(n) => n,
                    Err(e) => panic!("{e}"),
                }
            }

            /// The name.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The name as a `String`.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        name_traits!($name);
    };
}

/// The traits every name type shares (see [`label_name`]), over its `parse` and its
/// one `String` field.
macro_rules! name_traits {
    ($name:ident) => {
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
    "tenant"
);

label_name!(
    /// A member cluster's name: a DNS label (see the module docs), as it registers.
    ClusterName,
    "cluster"
);

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
        let map: std::collections::BTreeMap<ClusterName, u32> = serde_json::from_str(r#"{"east":1,"west":2}"#).expect("keys");
        assert_eq!(map.get("west"), Some(&2));
        let e = serde_json::from_str::<TenantName>("\"Not_A_Label\"").expect_err("refused");
        assert!(e.to_string().contains("tenant name \"Not_A_Label\" is not valid: 1-63 lowercase"), "{e}");
        let e = serde_json::from_str::<std::collections::BTreeMap<ClusterName, u32>>(r#"{"a.b":1}"#).expect_err("refused");
        assert!(e.to_string().contains("cluster name \"a.b\""), "{e}");
        assert_eq!(ClusterName::parse("x".repeat(64)).map_err(|e| e.name.len()), Err(64));
        assert_eq!(TenantName::parse("y".repeat(500)).map_err(|e| e.name.len()), Err(80));
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
    }
}
