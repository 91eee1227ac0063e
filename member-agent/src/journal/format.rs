//! The journal file's bytes: the header, framed and checksummed records, and reading a
//! file back (see the format in the module docs of [`crate::journal`]). Pure: bytes in,
//! records out; never panics, whatever the bytes.

use kvota_fairness::federation::UsageReport;
use kvota_fairness::lease::Lease;
use kvota_proto::v1;
use prost::Message as _;

use super::JournalError;

/// The format this code writes, and the newest it reads.
pub const FORMAT_VERSION: u32 = 2;

/// Largest record accepted (a report for 10,000 tenants is about 400 KiB of protobuf).
pub const MAX_RECORD_BYTES: u32 = 16 << 20;

pub(super) const MAGIC: &[u8; 4] = b"KVJ\0";
pub(super) const HEADER_LEN: usize = 8;
pub(super) const RECORD_HEAD: usize = 9;

/// Format 1 only: a report as JSON.
const KIND_REPORT_JSON: u8 = 1;
pub(super) const KIND_ACK: u8 = 2;
/// Format 1 only: a lease as JSON.
const KIND_LEASE_JSON: u8 = 3;
pub(super) const KIND_LAST_SEQ: u8 = 4;
/// From format 2: a report as the protobuf the agent sends (`kvota.v1.ReportRequest`).
pub(super) const KIND_REPORT: u8 = 5;
/// From format 2: a lease as the protobuf it arrived in (`kvota.v1.Lease`).
pub(super) const KIND_LEASE: u8 = 6;

pub(super) fn corrupt(what: &'static str, why: String) -> JournalError {
    JournalError::Corrupt { what, why }
}

fn crc(kind: u8, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    h.finalize()
}

/// One record, framed.
pub(super) fn frame(kind: u8, payload: &[u8]) -> Result<Vec<u8>, JournalError> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_RECORD_BYTES)
        .ok_or_else(|| {
            corrupt(
                "record",
                format!(
                    "{} bytes is larger than the {MAX_RECORD_BYTES} a record may hold",
                    payload.len()
                ),
            )
        })?;
    let mut out = Vec::with_capacity(RECORD_HEAD + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc(kind, payload).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(payload);
    Ok(out)
}

/// The header of a file of format `version`.
pub(super) fn header_of(version: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(MAGIC);
    h[4..].copy_from_slice(&version.to_le_bytes());
    h
}

/// The header this code writes.
pub(super) fn header() -> [u8; HEADER_LEN] {
    header_of(FORMAT_VERSION)
}

/// A report record's payload (format 2).
pub(super) fn report_payload(r: &UsageReport) -> Vec<u8> {
    v1::ReportRequest::from(r).encode_to_vec()
}

/// A lease record's payload (format 2).
pub(super) fn lease_payload(l: &Lease) -> Vec<u8> {
    v1::Lease::from(l).encode_to_vec()
}

/// Decodes a report record's payload of `kind`, checked as a report from the network
/// is (a journal is input too: a record that passes its checksum may still have been
/// written by a bug).
pub(super) fn decode_report(kind: u8, payload: &[u8]) -> Result<UsageReport, String> {
    match kind {
        KIND_REPORT => {
            let wire = v1::ReportRequest::decode(payload).map_err(|e| e.to_string())?;
            UsageReport::try_from(wire).map_err(|e| e.to_string())
        }
        KIND_REPORT_JSON => serde_json::from_slice(payload).map_err(|e| e.to_string()),
        other => Err(format!("record kind {other} is not a report")),
    }
}

fn decode_lease(kind: u8, payload: &[u8]) -> Result<Lease, String> {
    let lease: Lease = if kind == KIND_LEASE {
        let wire = v1::Lease::decode(payload).map_err(|e| e.to_string())?;
        Lease::try_from(wire).map_err(|e| e.to_string())?
    } else {
        serde_json::from_slice(payload).map_err(|e| e.to_string())?
    };
    lease.validate().map_err(|e| e.to_string())?;
    Ok(lease)
}

/// A decoded record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A report written (its payload is at `offset`, `len` bytes, of record `kind`).
    Report {
        /// Its sequence number.
        seq: u64,
        /// Where its payload starts in the file.
        offset: u64,
        /// Payload length.
        len: u32,
        /// The record's kind (how the payload is encoded).
        kind: u8,
    },
    /// Every report up to `seq` is acknowledged.
    Ack(u64),
    /// The lease last received.
    Lease(Box<Lease>),
    /// Numbering goes on after this.
    LastSeq(u64),
}

/// What reading a journal's bytes gives: its format, the records, and where the good
/// part ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scan {
    /// The file's format version (0: no complete header, a new file).
    pub version: u32,
    /// The records, in order.
    pub records: Vec<Record>,
    /// Length of the good part (header and whole, checked records).
    pub good_len: u64,
}

/// Reads a journal file's bytes (see the module docs): the header, then records up to
/// the end or to a torn last record. `file` names it in errors. Never panics.
pub fn scan(bytes: &[u8], file: &str) -> Result<Scan, JournalError> {
    if bytes.len() < HEADER_LEN {
        // A file cut before its header was complete: nothing in it was acknowledged.
        return Ok(Scan {
            version: 0,
            records: Vec::new(),
            good_len: 0,
        });
    }
    if &bytes[..4] != MAGIC {
        return Err(corrupt(
            "header",
            format!("{file} is not a kvota usage journal (magic {:?})", &bytes[..4]),
        ));
    }
    let version = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if version > FORMAT_VERSION {
        return Err(JournalError::Newer {
            file: file.to_string(),
            found: version,
        });
    }
    if version == 0 {
        return Err(corrupt("header", "format version 0".into()));
    }
    let mut records = Vec::new();
    let mut at = HEADER_LEN;
    while at < bytes.len() {
        let Some((rec, end)) = next_record(bytes, at, version, file)? else {
            break;
        };
        records.push(rec);
        at = end;
    }
    Ok(Scan {
        version,
        records,
        good_len: at as u64,
    })
}

/// The record at `at` and where it ends; `None` where the file is torn (a record cut
/// short, or the last record failing its checksum).
fn next_record(bytes: &[u8], at: usize, version: u32, file: &str) -> Result<Option<(Record, usize)>, JournalError> {
    let rest = &bytes[at..];
    if rest.len() < RECORD_HEAD {
        return Ok(None); // torn: the head itself is cut
    }
    let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let sum = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
    let kind = rest[8];
    let end = RECORD_HEAD.saturating_add(len as usize);
    if len > MAX_RECORD_BYTES || end > rest.len() {
        // Declares more than the file holds: a write cut short (or a length field torn
        // mid-write). Nothing after it can be read.
        return Ok(None);
    }
    let payload = &rest[RECORD_HEAD..end];
    if crc(kind, payload) != sum {
        if at + end == bytes.len() {
            return Ok(None); // the last record, torn: cut it
        }
        return Err(corrupt(
            "record",
            format!(
                "checksum mismatch at offset {at} of {file} with {} more bytes after it: the file is damaged",
                bytes.len() - at - end
            ),
        ));
    }
    let bad = |what: &str, e: String| corrupt("record", format!("{what} at offset {at}: {e}"));
    let known = match version {
        1 => [KIND_REPORT_JSON, KIND_ACK, KIND_LEASE_JSON, KIND_LAST_SEQ].contains(&kind),
        _ => [KIND_REPORT, KIND_ACK, KIND_LEASE, KIND_LAST_SEQ].contains(&kind),
    };
    if !known {
        return Err(bad(
            "record",
            format!("unknown kind {kind} in a format-{version} file (written by a newer agent?)"),
        ));
    }
    let rec = match kind {
        KIND_REPORT | KIND_REPORT_JSON => {
            let r = decode_report(kind, payload).map_err(|e| bad("report", e))?;
            Record::Report {
                seq: r.seq,
                offset: (at + RECORD_HEAD) as u64,
                len,
                kind,
            }
        }
        KIND_ACK | KIND_LAST_SEQ => {
            let b: [u8; 8] = payload
                .try_into()
                .map_err(|_| bad("sequence number", format!("{len} bytes")))?;
            let n = u64::from_le_bytes(b);
            if kind == KIND_ACK {
                Record::Ack(n)
            } else {
                Record::LastSeq(n)
            }
        }
        _ => Record::Lease(Box::new(decode_lease(kind, payload).map_err(|e| bad("lease", e))?)),
    };
    Ok(Some((rec, at + end)))
}

/// Frames of a whole format-1 file, as an agent of that format wrote them (for golden
/// files and the migration tests).
#[cfg(test)]
pub(super) fn v1_file(reports: &[UsageReport], acked: u64, lease: Option<&Lease>) -> Vec<u8> {
    let mut bytes = header_of(1).to_vec();
    for r in reports {
        let payload = serde_json::to_vec(r).unwrap_or_default();
        bytes.extend(frame(KIND_REPORT_JSON, &payload).unwrap_or_default());
    }
    if acked > 0 {
        bytes.extend(frame(KIND_ACK, &acked.to_le_bytes()).unwrap_or_default());
    }
    if let Some(l) = lease {
        let payload = serde_json::to_vec(l).unwrap_or_default();
        bytes.extend(frame(KIND_LEASE_JSON, &payload).unwrap_or_default());
    }
    bytes
}
