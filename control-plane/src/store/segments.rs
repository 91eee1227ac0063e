//! The Raft log on disk: append-only segment files of checksummed records.
//!
//! # Format (segment format 1)
//!
//! The directory `log/` holds segments named `<first index, 20 digits>.seg`, each
//! holding the records of consecutive log indexes, the segments themselves consecutive:
//!
//! ```text
//! header   "KVRAFTLG" | segment format (u32 LE) = 1 | flags (u32 LE) | first index (u64 LE)
//!          flags: 1 = starts past the end of the segment before it (see SegmentLog::append)
//! record   payload length (u32 LE) | CRC-32 of index and payload (u32 LE) | index (u64 LE) | payload
//! ```
//!
//! The payload is opaque here (the store writes one protobuf `RaftEntry` per record).
//!
//! # Durability
//!
//! [`SegmentLog::append`] writes a whole batch with one `write` at the end of the active
//! segment, and the caller `fdatasync`s that one file before acknowledging: one device
//! flush per batch. A segment is created complete or not at all (header written to a
//! temporary name, synced, renamed, directory synced), so a segment always starts with
//! a whole header. Truncation deletes the later segments from the last one backwards and
//! then cuts the segment holding the truncation point, so a crash half way leaves a
//! shorter log, never one with a hole. Purging deletes whole segments from the first.
//!
//! # Opening
//!
//! Every record of every segment is read and checked. In the last segment, a bad record
//! (cut short, too long for the file, or failing its checksum) with no whole record of a
//! later index anywhere after it is a write torn by a crash: its batch was never
//! acknowledged (the sync had not returned), so it and whatever follows it (zeros a
//! power loss left, say) are cut off and the file truncated there. Anything else that
//! does not check out is damage and opening fails with an error naming the file and
//! offset, changing nothing: a bad record with whole records after it, a bad record in a
//! sealed (not last) segment, indexes that do not follow on, a hole between segments, a
//! header that is not ours, or a segment format newer than this build reads.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The segment format this build writes, and the newest it reads.
pub const SEGMENT_FORMAT: u32 = 1;

/// A new segment is started once the active one holds this much.
pub const SEGMENT_BYTES: u64 = 16 << 20;

/// Largest payload a record may hold. A log entry is one batch of commands, bounded by
/// the gRPC message limit (well under this); a length field above it is damage.
pub const MAX_RECORD_BYTES: u32 = 64 << 20;

const MAGIC: &[u8; 8] = b"KVRAFTLG";
/// Segment header length.
pub const HEADER_LEN: usize = 24;
/// Record head length (length, checksum, index).
pub const RECORD_HEAD: usize = 16;

/// Why the log could not be opened, read or written.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The log on disk does not check out (see the module docs for what is damage).
    #[error("Raft log segment {} is damaged at offset {offset}: {why}", path.display())]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// Where in it.
        offset: u64,
        /// What is wrong.
        why: String,
    },
    /// A segment written by a newer kvota.
    #[error("Raft log segment {} is format {found}, newer than this kvota reads ({SEGMENT_FORMAT}): run the newer kvota on this directory", path.display())]
    Newer {
        /// The segment.
        path: PathBuf,
        /// Its format.
        found: u32,
    },
    /// An append that does not follow on from the last entry (a caller's bug: Raft
    /// truncates before it overwrites).
    #[error("append of index {got} where the log expects {expected}")]
    NotNext {
        /// The index the log would take next.
        expected: u64,
        /// The index offered.
        got: u64,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SegmentError + 'a {
    move |source| SegmentError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn checksum(index: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// The bytes of one record.
pub fn frame(index: u64, payload: &[u8]) -> Result<Vec<u8>, SegmentError> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_RECORD_BYTES)
        .ok_or_else(|| SegmentError::Corrupt {
            path: PathBuf::new(),
            offset: 0,
            why: format!(
                "a log entry of {} bytes is larger than the {MAX_RECORD_BYTES} a record may hold",
                payload.len()
            ),
        })?;
    let mut out = Vec::with_capacity(RECORD_HEAD + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&checksum(index, payload).to_le_bytes());
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// Header flag: the segment starts past the end of the one before it (see
/// [`SegmentLog::append`]); without it, a segment that does so marks a lost one.
pub const FLAG_AFTER_GAP: u32 = 1;

/// The header of a segment whose first record is `first`.
pub fn header(first: u64, after_gap: bool) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_FORMAT.to_le_bytes());
    h[12..16].copy_from_slice(&(if after_gap { FLAG_AFTER_GAP } else { 0 }).to_le_bytes());
    h[16..24].copy_from_slice(&first.to_le_bytes());
    h
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// What reading one segment's bytes gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scanned {
    /// The index its header says its first record has.
    pub first: u64,
    /// Whether its header says it starts past the end of the segment before it.
    pub after_gap: bool,
    /// Each record's offset and payload length, in index order from `first`.
    pub records: Vec<(u64, u32)>,
    /// Length of the good part: the header and the whole, checked records. Shorter than
    /// the file only for a torn tail of the last segment.
    pub good_len: u64,
}

/// Reads a segment's bytes (see the module docs): `last` says whether it is the last
/// segment, the only one whose tail may be torn. Never panics, whatever the bytes.
pub fn scan(bytes: &[u8], last: bool, path: &Path) -> Result<Scanned, SegmentError> {
    let corrupt = |offset: usize, why: String| SegmentError::Corrupt {
        path: path.to_path_buf(),
        offset: offset as u64,
        why,
    };
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(
            0,
            format!("{} bytes, shorter than a segment header", bytes.len()),
        ));
    }
    if &bytes[..8] != MAGIC {
        return Err(corrupt(
            0,
            "not a kvota Raft log segment (its first bytes are not the segment magic)".into(),
        ));
    }
    let format = le_u32(&bytes[8..]);
    if format > SEGMENT_FORMAT {
        return Err(SegmentError::Newer {
            path: path.to_path_buf(),
            found: format,
        });
    }
    if format == 0 {
        return Err(corrupt(8, "segment format 0".into()));
    }
    let flags = le_u32(&bytes[12..]);
    if flags & !FLAG_AFTER_GAP != 0 {
        return Err(corrupt(12, format!("unknown header flags {flags:#x}")));
    }
    let first = le_u64(&bytes[16..]);
    let mut records = Vec::new();
    let mut at = HEADER_LEN;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let due = first.checked_add(records.len() as u64);
        // A bad record is a torn tail only in the last segment, and only if no whole
        // record of a later index follows it: acknowledged records never come after
        // a torn write.
        let torn = |why: &str| {
            if !last {
                Err(corrupt(
                    at,
                    format!("{why}, and later segments follow: a sealed segment is never torn"),
                ))
            } else if due.is_some_and(|d| whole_record_after(bytes, at + 1, d)) {
                Err(corrupt(
                    at,
                    format!("{why}, with whole records after it: damage, not a torn write"),
                ))
            } else {
                Ok(())
            }
        };
        if rest.len() < RECORD_HEAD {
            torn("a record head cut short")?;
            break;
        }
        let len = le_u32(rest);
        let sum = le_u32(&rest[4..]);
        let index = le_u64(&rest[8..]);
        let end = RECORD_HEAD.saturating_add(len as usize);
        if len > MAX_RECORD_BYTES || end > rest.len() {
            // Declares more than the file holds: a write cut short, or a length field
            // torn mid-write.
            torn("a record longer than what follows it")?;
            break;
        }
        let payload = &rest[RECORD_HEAD..end];
        if checksum(index, payload) != sum {
            torn("a record whose checksum fails")?;
            break;
        }
        if due != Some(index) {
            return Err(corrupt(
                at,
                format!(
                    "record of index {index} where index {} was due",
                    due.map_or("past the last".into(), |e| e.to_string())
                ),
            ));
        }
        records.push((at as u64, len));
        at += end;
    }
    Ok(Scanned {
        first,
        after_gap: flags & FLAG_AFTER_GAP != 0,
        records,
        good_len: at as u64,
    })
}

/// Whether a whole, checked record of index `index` or later starts anywhere at or after
/// `from` (only called when opening finds a bad record).
fn whole_record_after(bytes: &[u8], from: usize, index: u64) -> bool {
    (from..bytes.len()).any(|j| {
        let r = &bytes[j..];
        if r.len() < RECORD_HEAD {
            return false;
        }
        let i = le_u64(&r[8..]);
        if i < index || i - index > (r.len() / RECORD_HEAD) as u64 {
            return false;
        }
        let len = le_u32(r);
        let end = RECORD_HEAD.saturating_add(len as usize);
        len <= MAX_RECORD_BYTES && end <= r.len() && checksum(i, &r[RECORD_HEAD..end]) == le_u32(&r[4..])
    })
}

/// One segment file.
#[derive(Debug)]
struct Segment {
    path: PathBuf,
    file: Arc<File>,
    /// Bytes in it (header and records).
    len: u64,
    /// Records in it.
    count: u64,
}

/// Where one record is.
#[derive(Clone, Copy, Debug)]
struct Loc {
    /// The first index of its segment (the segment's key).
    segment: u64,
    offset: u64,
    len: u32,
}

/// What opening found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Opened {
    /// Segments read.
    pub segments: usize,
    /// Records read.
    pub records: u64,
    /// Bytes of a torn tail cut off the last segment (0 when none).
    pub cut: u64,
}

/// The log: its segments and where each record is. Operations block (file I/O); the
/// store runs them on the blocking pool.
///
/// Holds: every record in `locs` is in the segment it names, at its offset; each
/// segment holds consecutive indexes from its start; a segment starts where the one
/// before it ends, or past that end when its header is flagged [`FLAG_AFTER_GAP`];
/// every segment but the last is synced; the last one's records are durable once the
/// file [`SegmentLog::append`] handed back is synced (the caller does that before it
/// acknowledges a follower's append, or has the flusher do it for the leader's: see
/// `super::flush`), and all of it once [`SegmentLog::open`] returns.
#[derive(Debug)]
pub struct SegmentLog {
    dir: PathBuf,
    segments: BTreeMap<u64, Segment>,
    locs: BTreeMap<u64, Loc>,
}

fn sync_dir(dir: &Path) -> Result<(), SegmentError> {
    super::files::sync_dir(dir).map_err(io("sync directory", dir))
}

fn segment_name(first: u64) -> String {
    format!("{first:020}.seg")
}

impl SegmentLog {
    /// Opens (or creates) the log in `dir`, checking every record and cutting a torn
    /// tail off the last segment (see the module docs).
    pub fn open(dir: &Path) -> Result<(SegmentLog, Opened), SegmentError> {
        std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
        let mut starts = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io("read directory", dir))? {
            let entry = entry.map_err(io("read directory", dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".tmp") {
                // A segment whose creation did not finish: never part of the log.
                std::fs::remove_file(entry.path()).map_err(io("remove unfinished segment", &entry.path()))?;
                continue;
            }
            let Some(stem) = name.strip_suffix(".seg") else {
                continue;
            };
            match stem.parse::<u64>() {
                Ok(first) if stem.len() == 20 => starts.push(first),
                _ => {
                    return Err(SegmentError::Corrupt {
                        path: entry.path(),
                        offset: 0,
                        why: "a segment name that is not 20 digits and `.seg`".into(),
                    })
                }
            }
        }
        starts.sort_unstable();
        let mut log = SegmentLog {
            dir: dir.to_path_buf(),
            segments: BTreeMap::new(),
            locs: BTreeMap::new(),
        };
        let mut opened = Opened {
            segments: starts.len(),
            ..Opened::default()
        };
        let n = starts.len();
        for (i, start) in starts.into_iter().enumerate() {
            let path = dir.join(segment_name(start));
            let bytes = std::fs::read(&path).map_err(io("read", &path))?;
            let last = i + 1 == n;
            let s = scan(&bytes, last, &path)?;
            if s.first != start {
                return Err(SegmentError::Corrupt {
                    path,
                    offset: 16,
                    why: format!("its header says it starts at index {}, its name {start}", s.first),
                });
            }
            if let Some(next) = log.next_index() {
                let gap_ok = s.after_gap && start > next;
                if start != next && !gap_ok {
                    return Err(SegmentError::Corrupt { path, offset: 0, why: format!("starts at index {start} where the previous segment ended before {next}: the log has a hole") });
                }
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io("open", &path))?;
            if s.good_len < bytes.len() as u64 {
                // A torn tail of the last segment: never acknowledged, so cut it.
                file.set_len(s.good_len).map_err(io("cut the torn tail of", &path))?;
                opened.cut = bytes.len() as u64 - s.good_len;
            }
            if last {
                // Records a killed process wrote but had not synced are still in the
                // page cache and read back as part of the log: make them durable before
                // this node votes or acknowledges on the strength of them.
                file.sync_data().map_err(io("fdatasync", &path))?;
            }
            for (k, (offset, len)) in s.records.iter().enumerate() {
                log.locs.insert(
                    start + k as u64,
                    Loc {
                        segment: start,
                        offset: *offset,
                        len: *len,
                    },
                );
            }
            opened.records += s.records.len() as u64;
            log.segments.insert(
                start,
                Segment {
                    path,
                    file: Arc::new(file),
                    len: s.good_len,
                    count: s.records.len() as u64,
                },
            );
        }
        Ok((log, opened))
    }

    /// The index of the first record present, `None` when the log is empty.
    pub fn first_index(&self) -> Option<u64> {
        self.locs.first_key_value().map(|(k, _)| *k)
    }

    /// The index of the last record present, `None` when the log is empty.
    pub fn last_index(&self) -> Option<u64> {
        self.locs.last_key_value().map(|(k, _)| *k)
    }

    /// The index the last segment takes next, `None` without segments.
    fn next_index(&self) -> Option<u64> {
        self.segments
            .last_key_value()
            .map(|(start, seg)| start.saturating_add(seg.count))
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Creates an empty segment starting at `first`, complete or not at all.
    fn create_segment(&mut self, first: u64, after_gap: bool) -> Result<(), SegmentError> {
        let path = self.dir.join(segment_name(first));
        let tmp = self.dir.join(format!("{}.tmp", segment_name(first)));
        {
            let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
            f.write_all(&header(first, after_gap)).map_err(io("write", &tmp))?;
            f.sync_all().map_err(io("fsync", &tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io("rename into place", &path))?;
        sync_dir(&self.dir)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io("open", &path))?;
        self.segments.insert(
            first,
            Segment {
                path,
                file: Arc::new(file),
                len: HEADER_LEN as u64,
                count: 0,
            },
        );
        Ok(())
    }

    fn remove_segment(&mut self, start: u64) -> Result<(), SegmentError> {
        if let Some(seg) = self.segments.remove(&start) {
            std::fs::remove_file(&seg.path).map_err(io("remove", &seg.path))?;
        }
        Ok(())
    }

    /// Whether an append at `first` starts a new segment (creating a file, syncing the
    /// directory), rather than writing at the end of the active one.
    pub fn needs_new_segment(&self, first: u64) -> bool {
        match self.segments.last_key_value() {
            None => true,
            Some((&start, seg)) => {
                (seg.count == 0 && start != first)
                    || self.next_index().is_some_and(|n| first > n)
                    || seg.len >= SEGMENT_BYTES
            }
        }
    }

    /// Writes `payloads` as the records of indexes `first..`, in one write at the end of
    /// the active segment (a new one when it is full, or when `first` is past its end:
    /// Raft never appends past the end, but the storage contract allows it, and such a
    /// segment's header says so). Returns the file to `fdatasync` before the append may
    /// be acknowledged. A failed write is cut back, so no half batch stays in front of
    /// the next one.
    pub fn append(&mut self, first: u64, payloads: &[Vec<u8>]) -> Result<Arc<File>, SegmentError> {
        // An empty last segment made for another index (the log was purged past it, or
        // the append goes elsewhere): not part of the log, replace it.
        if let Some((&start, seg)) = self.segments.last_key_value() {
            if seg.count == 0 && start != first {
                self.remove_segment(start)?;
                sync_dir(&self.dir)?;
            }
        }
        let next = self.next_index();
        if let Some(expected) = next {
            if first < expected {
                return Err(SegmentError::NotNext { expected, got: first });
            }
        }
        let mut bytes = Vec::new();
        let mut spans = Vec::with_capacity(payloads.len());
        for (i, p) in payloads.iter().enumerate() {
            let framed = frame(first + i as u64, p)?;
            // `frame` refused anything over MAX_RECORD_BYTES, so the length fits.
            spans.push((
                bytes.len() as u64,
                u32::try_from(framed.len() - RECORD_HEAD).unwrap_or(MAX_RECORD_BYTES),
            ));
            bytes.extend(framed);
        }
        let after_gap = next.is_some_and(|n| first > n);
        let full = self
            .segments
            .last_key_value()
            .is_none_or(|(_, s)| s.len >= SEGMENT_BYTES);
        if after_gap || full {
            // The segment left behind may hold writes acknowledged before their sync (the
            // leader's: see `flush`), and its sync is queued for the file it leaves:
            // sync it now, since later syncs are of the new one.
            if let Some((_, seg)) = self.segments.last_key_value() {
                seg.file.sync_data().map_err(io("fdatasync", &seg.path))?;
            }
            self.create_segment(first, after_gap)?;
        }
        let Some((&start, seg)) = self.segments.iter_mut().next_back() else {
            return Err(SegmentError::NotNext {
                expected: first,
                got: first,
            });
        };
        let at = seg.len;
        if let Err(e) = seg.file.write_all_at(&bytes, at) {
            let _ = seg.file.set_len(at);
            return Err(io("write", &seg.path)(e));
        }
        seg.len = at + bytes.len() as u64;
        seg.count += payloads.len() as u64;
        for (i, (offset, len)) in spans.into_iter().enumerate() {
            self.locs.insert(
                first + i as u64,
                Loc {
                    segment: start,
                    offset: at + offset,
                    len,
                },
            );
        }
        Ok(Arc::clone(&seg.file))
    }

    /// The records of indexes in `from..to` that are present, in order, each checked
    /// against its checksum again.
    pub fn read(&self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, SegmentError> {
        let mut out = Vec::new();
        if from >= to {
            return Ok(out);
        }
        for (&index, loc) in self.locs.range(from..to) {
            let Some(seg) = self.segments.get(&loc.segment) else {
                return Err(SegmentError::Corrupt {
                    path: self.dir.clone(),
                    offset: 0,
                    why: format!("no segment holds index {index}"),
                });
            };
            let mut buf = vec![0u8; RECORD_HEAD + loc.len as usize];
            seg.file
                .read_exact_at(&mut buf, loc.offset)
                .map_err(io("read", &seg.path))?;
            let payload = buf.split_off(RECORD_HEAD);
            if le_u64(&buf[8..]) != index || checksum(index, &payload) != le_u32(&buf[4..]) {
                return Err(SegmentError::Corrupt {
                    path: seg.path.clone(),
                    offset: loc.offset,
                    why: format!("the record of index {index} changed on disk since it was written (checksum or index no longer match)"),
                });
            }
            out.push((index, payload));
        }
        Ok(out)
    }

    /// Removes the records at `index` and after, durably.
    pub fn truncate(&mut self, index: u64) -> Result<(), SegmentError> {
        // Later segments first, last one first: a crash leaves a shorter log, no hole.
        let later: Vec<u64> = self.segments.range(index..).map(|(k, _)| *k).rev().collect();
        let whole = !later.is_empty();
        for start in later {
            self.remove_segment(start)?;
        }
        if whole {
            sync_dir(&self.dir)?;
        }
        // Then the segment holding `index`, cut where its record starts.
        if let Some(loc) = self.locs.range(index..).next().map(|(_, l)| *l) {
            if let Some(seg) = self.segments.get_mut(&loc.segment) {
                seg.file.set_len(loc.offset).map_err(io("truncate", &seg.path))?;
                seg.file.sync_data().map_err(io("fdatasync", &seg.path))?;
                seg.len = loc.offset;
                seg.count = index.saturating_sub(loc.segment);
            }
        }
        self.locs.split_off(&index);
        Ok(())
    }

    /// Forgets the records at `index` and before, deleting the segments that hold only
    /// such records (durably). Records of a partly purged segment stay in its file, out
    /// of sight.
    pub fn purge(&mut self, index: u64) -> Result<(), SegmentError> {
        let mut gone = false;
        while let Some((&start, seg)) = self.segments.first_key_value() {
            // It goes when everything it holds is at or below `index`; an empty one
            // only when it does not start at `index + 1` (the next append's place).
            let end = start.saturating_add(seg.count); // one past its last index
            if end <= index.saturating_add(1) && !(seg.count == 0 && start == index.saturating_add(1)) {
                self.remove_segment(start)?;
                gone = true;
            } else {
                break;
            }
        }
        if gone {
            sync_dir(&self.dir)?;
        }
        self.locs = self.locs.split_off(&index.saturating_add(1));
        if index == u64::MAX {
            self.locs.clear();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]
    use super::*;
    use proptest::prelude::*;

    fn payload(i: u64) -> Vec<u8> {
        format!("entry {i}").repeat((i % 7 + 1) as usize).into_bytes()
    }

    fn append_range(log: &mut SegmentLog, from: u64, to: u64) {
        let ps: Vec<Vec<u8>> = (from..to).map(payload).collect();
        log.append(from, &ps).unwrap().sync_data().unwrap();
    }

    fn indexes(log: &SegmentLog) -> Vec<u64> {
        log.read(0, u64::MAX)
            .unwrap()
            .into_iter()
            .map(|(i, p)| {
                assert_eq!(p, payload(i));
                i
            })
            .collect()
    }

    #[test]
    fn appends_truncates_and_purges_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, opened) = SegmentLog::open(dir.path()).unwrap();
            assert_eq!(opened, Opened::default());
            append_range(&mut log, 0, 10);
            append_range(&mut log, 10, 12);
            log.truncate(8).unwrap();
            append_range(&mut log, 8, 20);
            log.purge(4).unwrap();
            assert_eq!(indexes(&log), (5..20).collect::<Vec<_>>());
            assert!(
                matches!(
                    log.append(15, &[payload(15)]),
                    Err(SegmentError::NotNext { expected: 20, got: 15 })
                ),
                "overwriting needs a truncate first"
            );
        }
        let (log, opened) = SegmentLog::open(dir.path()).unwrap();
        // The purged records of a segment still in use stay in its file: a reopened log
        // shows them until the store's purge point hides them again.
        assert_eq!(opened.cut, 0);
        assert_eq!(indexes(&log), (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn a_log_purged_past_its_end_goes_on_where_the_next_append_starts() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = SegmentLog::open(dir.path()).unwrap();
        append_range(&mut log, 3, 6);
        log.purge(100).unwrap();
        assert_eq!(log.segment_count(), 0);
        assert_eq!(log.first_index(), None);
        append_range(&mut log, 101, 103);
        drop(log);
        let (log, _) = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(indexes(&log), vec![101, 102]);
    }

    /// openraft's storage suite appends past the end (Raft never does): the new segment
    /// says so in its header, so reopening tells it from a lost segment.
    #[test]
    fn an_append_past_the_end_starts_a_flagged_segment() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, _) = SegmentLog::open(dir.path()).unwrap();
            append_range(&mut log, 1, 2);
            append_range(&mut log, 3, 5);
            assert_eq!(log.segment_count(), 2);
            assert_eq!(indexes(&log), vec![1, 3, 4]);
        }
        let (mut log, _) = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(indexes(&log), vec![1, 3, 4]);
        log.truncate(2).unwrap();
        assert_eq!((indexes(&log), log.segment_count()), (vec![1], 1));
        append_range(&mut log, 2, 3);
        drop(log);
        let (log, _) = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(indexes(&log), vec![1, 2]);
    }

    #[test]
    fn a_torn_tail_is_cut_and_damage_in_the_middle_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(segment_name(0));
        {
            let (mut log, _) = SegmentLog::open(dir.path()).unwrap();
            append_range(&mut log, 0, 5);
        }
        let whole = std::fs::read(&path).unwrap();
        // Cut in the last record: cut off cleanly on open.
        std::fs::write(&path, &whole[..whole.len() - 3]).unwrap();
        let (log, opened) = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(indexes(&log), vec![0, 1, 2, 3]);
        assert!(opened.cut > 0);
        drop(log);
        let cut_len = std::fs::metadata(&path).unwrap().len();
        assert_eq!(
            cut_len as usize,
            whole.len() - (RECORD_HEAD + payload(4).len()),
            "the file itself is cut"
        );
        // A flipped byte in the second record, with records after it: an error, and
        // the file is left as it was.
        let mut bad = std::fs::read(&path).unwrap();
        let second = HEADER_LEN + RECORD_HEAD + payload(0).len() + RECORD_HEAD + 1;
        bad[second] ^= 0x40;
        std::fs::write(&path, &bad).unwrap();
        let e = SegmentLog::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("damaged") && e.contains("checksum fails") && e.contains("not a torn write"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), bad, "nothing changed");
    }

    #[test]
    fn sealed_segments_roll_over_and_holes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, _) = SegmentLog::open(dir.path()).unwrap();
            append_range(&mut log, 0, 2);
            // Force a roll: pretend the active segment is full.
            log.segments.values_mut().for_each(|s| s.len = SEGMENT_BYTES);
            append_range(&mut log, 2, 4);
            log.segments
                .values_mut()
                .for_each(|s| s.len = std::fs::metadata(&s.path).unwrap().len());
            assert_eq!(log.segment_count(), 2);
            log.segments.values_mut().next_back().unwrap().len = SEGMENT_BYTES;
            append_range(&mut log, 4, 6);
            assert_eq!(log.segment_count(), 3);
            log.purge(2).unwrap();
            assert_eq!(log.segment_count(), 2, "the first segment (0, 1) is gone");
            log.truncate(4).unwrap();
            assert_eq!(log.segment_count(), 1, "the segment starting at 4 is gone");
            assert_eq!(indexes(&log), vec![3]);
        }
        let (log, _) = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(
            indexes(&log),
            vec![2, 3],
            "2 was purged, but its segment is still in use"
        );
        drop(log);
        // A sealed segment torn, with one after it: damage.
        std::fs::write(dir.path().join(segment_name(9)), header(9, false)).unwrap();
        let e = SegmentLog::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("hole"), "{e}");
        std::fs::remove_file(dir.path().join(segment_name(9))).unwrap();
        std::fs::write(dir.path().join(segment_name(4)), header(4, false)).unwrap();
        let seg2 = dir.path().join(segment_name(2));
        let b = std::fs::read(&seg2).unwrap();
        std::fs::write(&seg2, &b[..b.len() - 1]).unwrap();
        let e = SegmentLog::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("sealed segment is never torn"), "{e}");
    }

    /// A segment whose header claims the last possible index: read, never an overflow.
    #[test]
    fn a_segment_at_the_end_of_the_index_space_does_not_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = header(u64::MAX, false).to_vec();
        b.extend(frame(u64::MAX, b"last").unwrap());
        std::fs::write(dir.path().join(segment_name(u64::MAX)), &b).unwrap();
        let (mut log, _) = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_index(), Some(u64::MAX));
        assert!(log.append(0, &[b"x".to_vec()]).is_err());
        log.purge(u64::MAX).unwrap();
        assert_eq!(log.first_index(), None);
    }

    #[test]
    fn a_newer_or_foreign_segment_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = header(0, false);
        h[8] = 2;
        std::fs::write(dir.path().join(segment_name(0)), h).unwrap();
        let e = SegmentLog::open(dir.path()).unwrap_err();
        assert!(matches!(e, SegmentError::Newer { found: 2, .. }), "{e}");
        std::fs::write(
            dir.path().join(segment_name(0)),
            b"something else entirely, not a segment",
        )
        .unwrap();
        let e = SegmentLog::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a kvota Raft log segment"), "{e}");
    }

    proptest! {
        /// Arbitrary bytes, with or without a header: an answer, never a panic.
        #[test]
        fn scanning_arbitrary_bytes_never_panics(junk in prop::collection::vec(any::<u8>(), 0..512), with_header in any::<bool>(), last in any::<bool>()) {
            let mut b = if with_header { header(7, false).to_vec() } else { Vec::new() };
            b.extend(junk);
            let _ = scan(&b, last, Path::new("x"));
        }

        /// A good segment cut anywhere or with one byte changed: read as the last
        /// segment it gives a prefix of its records or an error, never a wrong record.
        #[test]
        fn a_damaged_segment_yields_a_prefix_or_an_error(n in 1u64..12, at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<bool>()) {
            let mut b = header(5, false).to_vec();
            let mut spans = Vec::new();
            for i in 5..5 + n {
                spans.push((b.len() as u64, payload(i).len() as u32));
                b.extend(frame(i, &payload(i)).unwrap());
            }
            let good = scan(&b, true, Path::new("x")).unwrap();
            prop_assert_eq!(&good.records, &spans);
            let i = HEADER_LEN + at.index(b.len() - HEADER_LEN);
            if cut { b.truncate(i) } else { b[i] ^= byte.max(1) }
            match scan(&b, true, Path::new("x")) {
                Ok(s) => {
                    prop_assert!(s.records.len() <= spans.len());
                    prop_assert_eq!(&s.records[..], &spans[..s.records.len()]);
                    prop_assert!(s.good_len as usize <= b.len());
                    // A changed byte before the last record is always damage.
                    let last_start = spans.last().map_or(0, |l| l.0) as usize;
                    prop_assert!(cut || i >= last_start, "a change at {} (last record at {}) read as a torn tail", i, last_start);
                }
                Err(e) => prop_assert!(!cut, "a cut segment is a torn tail, not {}", e),
            }
        }
    }
}
