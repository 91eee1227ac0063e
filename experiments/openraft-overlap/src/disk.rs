//! The log file both openraft versions write to: one append-only file per node, one
//! `fdatasync` before an append is reported flushed. Entries are also kept in memory for
//! reads; truncation and purge act on memory only (this is a benchmark of the append
//! path, not a store: nothing is read back after a restart).

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;

/// When the `fdatasync` of an append runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flush {
    /// Inside `append`, before it returns (kvota's store today): openraft's core waits for
    /// the flush whichever version it is.
    Inline,
    /// On a flusher thread after `append` returned; the callback fires after the
    /// `fdatasync`. Appends queued while one flush runs share the next (group commit).
    Background,
}

/// Records appended and `fdatasync`s of the log, all nodes of all runs together; the
/// caller takes differences around a phase.
pub static RECORDS: AtomicU64 = AtomicU64::new(0);
pub static SYNCS: AtomicU64 = AtomicU64::new(0);

type Done = Box<dyn FnOnce(io::Result<()>) + Send>;

/// One node's log file.
pub struct LogFile {
    file: Arc<File>,
    flush: Flush,
    flusher: Option<mpsc::Sender<Done>>,
}

impl LogFile {
    pub fn create(path: &Path, flush: Flush) -> io::Result<Self> {
        let file = Arc::new(File::options().create(true).append(true).open(path)?);
        let flusher = match flush {
            Flush::Inline => None,
            Flush::Background => {
                let (tx, rx) = mpsc::channel::<Done>();
                let file = Arc::clone(&file);
                thread::Builder::new()
                    .name("log-flusher".into())
                    .spawn(move || flusher(&file, &rx))?;
                Some(tx)
            }
        };
        Ok(LogFile {
            file,
            flush,
            flusher,
        })
    }

    /// Node `id`'s directory under `dir` (created) and its log file.
    pub fn for_node(
        dir: &Path,
        id: u64,
        flush: Flush,
    ) -> Result<(std::path::PathBuf, LogFile), String> {
        let d = dir.join(format!("n{id}"));
        std::fs::create_dir_all(&d).map_err(|e| format!("create {}: {e}", d.display()))?;
        let file = LogFile::create(&d.join("log"), flush)
            .map_err(|e| format!("open the log in {}: {e}", d.display()))?;
        Ok((d, file))
    }

    /// Writes `bytes` (`records` log entries), then makes them durable and calls `done`: before returning
    /// ([`Flush::Inline`], on a blocking thread) or later ([`Flush::Background`]).
    pub async fn append(&self, records: u64, bytes: Vec<u8>, done: Done) -> io::Result<()> {
        RECORDS.fetch_add(records, Ordering::Relaxed);
        match self.flush {
            Flush::Inline => {
                let file = Arc::clone(&self.file);
                let r = tokio::task::spawn_blocking(move || {
                    (&*file).write_all(&bytes)?;
                    SYNCS.fetch_add(1, Ordering::Relaxed);
                    file.sync_data()
                })
                .await
                .map_err(io::Error::other)?;
                let copy = r
                    .as_ref()
                    .map(|_| ())
                    .map_err(|e| io::Error::new(e.kind(), e.to_string()));
                done(r);
                copy
            }
            Flush::Background => {
                // A write to the page cache: short enough to run inline.
                (&*self.file).write_all(&bytes)?;
                let tx = self
                    .flusher
                    .as_ref()
                    .ok_or_else(|| io::Error::other("no flusher"))?;
                tx.send(done)
                    .map_err(|_| io::Error::other("the flusher stopped"))
            }
        }
    }

    /// Returns once every append queued before it is durable and its callback has run.
    ///
    /// openraft 0.10.0-alpha.37 marks a new leader's whole log as flushed when it takes
    /// office (upstream issue #2118), which is only true if no append is still in
    /// flight. A node saves its vote before it can lead, and accepts no entries of an
    /// older term after that, so waiting here in `save_vote` makes that mark true.
    pub async fn barrier(&self) -> io::Result<()> {
        let Some(tx) = &self.flusher else {
            return Ok(());
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        tx.send(Box::new(move |r| {
            let _ = done_tx.send(r);
        }))
        .map_err(|_| io::Error::other("the flusher stopped"))?;
        done_rx
            .await
            .map_err(|_| io::Error::other("the flusher stopped"))?
    }

    /// A small durable write (the vote); rare, so inline.
    pub fn put_durably(path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut f = File::create(path)?;
        f.write_all(bytes)?;
        f.sync_data()
    }
}

fn flusher(file: &File, rx: &mpsc::Receiver<Done>) {
    while let Ok(first) = rx.recv() {
        // Every append whose callback is queued has written already: one fdatasync
        // covers them all.
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        SYNCS.fetch_add(1, Ordering::Relaxed);
        let r = file.sync_data();
        for done in batch {
            done(
                r.as_ref()
                    .map(|_| ())
                    .map_err(|e| io::Error::new(e.kind(), e.to_string())),
            );
        }
    }
}
