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
}
