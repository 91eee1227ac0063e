//! An agent's disk under the real journal ([`kvota_member_agent::journal::Journal`]):
//! writes land in the file at once; a sync makes what is there durable only after the
//! disk's delay; a crash keeps what was durable, plus (drawn by the seed) a prefix of
//! what was written since, as a torn write leaves it; a full disk refuses writes;
//! a flaky disk fails some writes and syncs.
//!
//! Time is the agent host's clock, set by the world before each journal call
//! ([`SimDisk::set_now`]). A journal call returns at once here; the world holds its
//! outcome back until [`SimDisk::durable_at`], as an `fdatasync` would keep the real
//! agent waiting.

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use kvota_fairness::Millis;
use kvota_member_agent::journal::Disk;

use crate::rng::Rng;

#[derive(Debug, Default)]
struct State {
    /// What reads see.
    bytes: Vec<u8>,
    /// What survives a crash now.
    durable: Vec<u8>,
    /// Syncs on their way: at this time, this becomes durable.
    syncing: Vec<(Millis, Vec<u8>)>,
    now_ms: Millis,
    delay_ms: Millis,
    full: bool,
    /// Per mille of writes and syncs that fail.
    flaky_per_mille: u64,
    rng: Option<Rng>,
    /// Writes refused (full or flaky), for the run summary.
    refused: u64,
    /// Crashes that left a torn tail.
    torn: u64,
}

/// A simulated disk holding one journal file; clones share it.
#[derive(Clone, Debug, Default)]
pub struct SimDisk(Arc<Mutex<State>>);

impl SimDisk {
    /// An empty disk whose random draws (torn writes, flaky failures) come from `rng`.
    pub fn new(rng: Rng) -> SimDisk {
        SimDisk(Arc::new(Mutex::new(State {
            rng: Some(rng),
            ..State::default()
        })))
    }

    fn s(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The host clock now; syncs due by then become durable.
    pub fn set_now(&self, now_ms: Millis) {
        let mut s = self.s();
        s.now_ms = now_ms;
        settle(&mut s);
    }

    /// How long a sync takes from now on.
    pub fn set_delay(&self, delay_ms: Millis) {
        self.s().delay_ms = delay_ms;
    }

    /// The disk is full (`true`): every write fails with "no space left on device".
    pub fn set_full(&self, full: bool) {
        self.s().full = full;
    }

    /// From now on, this per mille of writes and syncs fail.
    pub fn set_flaky(&self, per_mille: u64) {
        self.s().flaky_per_mille = per_mille;
    }

    /// When everything written so far is durable (the outcome of the last journal call
    /// may be delivered then).
    pub fn durable_at(&self) -> Millis {
        let s = self.s();
        s.syncing
            .iter()
            .map(|(at, _)| *at)
            .max()
            .unwrap_or(s.now_ms)
            .max(s.now_ms)
    }

    /// The file as a process starting now would read it.
    pub fn bytes(&self) -> Vec<u8> {
        self.s().bytes.clone()
    }

    /// Writes refused so far, and crashes that tore a write.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.s();
        (s.refused, s.torn)
    }

    /// The host crashes at `now_ms`: what was not durable is lost, except a prefix of
    /// what was appended since the last durable point (a torn write), drawn by the seed.
    pub fn crash(&self, now_ms: Millis) {
        let mut s = self.s();
        s.now_ms = now_ms;
        settle(&mut s);
        s.syncing.clear();
        let durable = s.durable.clone();
        let mut after = durable.clone();
        if s.bytes.len() > durable.len() && s.bytes.starts_with(&durable) {
            let extra = s.bytes.len() - durable.len();
            // Half the crashes tear the write: a prefix of it reached the device.
            let (tear, len) = s
                .rng
                .as_mut()
                .map_or((false, 0), |rng| (rng.chance(50), rng.range(0, extra as u64)));
            let keep = if tear { usize::try_from(len).unwrap_or(0) } else { 0 };
            if keep > 0 {
                s.torn += 1;
            }
            after.extend_from_slice(&s.bytes[durable.len()..durable.len() + keep]);
        }
        s.bytes = after;
    }

    fn refuse(&self) -> io::Result<()> {
        let mut s = self.s();
        if s.full {
            s.refused += 1;
            return Err(io::Error::other("no space left on device"));
        }
        let p = s.flaky_per_mille;
        if p > 0 && s.rng.as_mut().is_some_and(|r| r.chance_per_mille(p)) {
            s.refused += 1;
            return Err(io::Error::other("input/output error"));
        }
        Ok(())
    }
}

/// Syncs due by now become durable.
fn settle(s: &mut State) {
    let now = s.now_ms;
    let mut due: Vec<(Millis, Vec<u8>)> = Vec::new();
    s.syncing.retain(|(at, bytes)| {
        if *at <= now {
            due.push((*at, bytes.clone()));
            false
        } else {
            true
        }
    });
    if let Some((_, bytes)) = due.into_iter().max_by_key(|(at, _)| *at) {
        s.durable = bytes;
    }
}

impl Disk for SimDisk {
    fn describe(&self) -> String {
        "journal.kvj (simulated disk)".to_string()
    }

    fn open(&mut self) -> io::Result<Vec<u8>> {
        Ok(self.s().bytes.clone())
    }

    fn write_at(&mut self, at: u64, bytes: &[u8]) -> io::Result<()> {
        self.refuse()?;
        let at = usize::try_from(at).map_err(io::Error::other)?;
        let mut s = self.s();
        if s.bytes.len() < at {
            s.bytes.resize(at, 0);
        }
        s.bytes.truncate(at);
        s.bytes.extend_from_slice(bytes);
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.refuse()?;
        let mut s = self.s();
        let at = s.now_ms + s.delay_ms;
        let copy = s.bytes.clone();
        s.syncing.push((at, copy));
        settle(&mut s);
        Ok(())
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        self.s().bytes.resize(len, 0);
        Ok(())
    }

    fn read_at(&mut self, at: u64, len: usize) -> io::Result<Vec<u8>> {
        let at = usize::try_from(at).map_err(io::Error::other)?;
        let s = self.s();
        s.bytes
            .get(at..at.saturating_add(len))
            .map(<[u8]>::to_vec)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))
    }

    /// The new contents replace the old atomically once durable (a renamed file): a
    /// crash before then finds the old durable contents.
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.refuse()?;
        let mut s = self.s();
        s.bytes = bytes.to_vec();
        let at = s.now_ms + s.delay_ms;
        s.syncing.push((at, bytes.to_vec()));
        settle(&mut s);
        Ok(())
    }

    fn sync_dir(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_was_synced_and_is_due_survives_a_crash_plus_maybe_a_torn_prefix() {
        let mut d = SimDisk::new(Rng::new(7));
        d.set_delay(100);
        d.set_now(0);
        d.write_at(0, b"head").expect("write");
        d.sync().expect("sync");
        assert_eq!(d.durable_at(), 100);
        d.write_at(4, b"-more").expect("write");
        d.crash(50);
        assert!(d.open().expect("open").is_empty(), "the first sync was not due yet");
        d.write_at(0, b"head").expect("write");
        d.sync().expect("sync");
        d.set_now(200);
        d.write_at(4, b"-tail-tail").expect("write");
        d.crash(200);
        let after = d.open().expect("open");
        assert!(
            after.starts_with(b"head") && b"head-tail-tail".starts_with(&after[..]),
            "{after:?}"
        );
        d.set_full(true);
        assert!(d.write_at(0, b"x").is_err());
    }
}
