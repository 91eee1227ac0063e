//! Where the journal's bytes live. The journal's logic (framing, torn tails, the backlog,
//! compaction, renumbering) runs over this trait; [`FileDisk`] is the agent's file with
//! its `fdatasync`s, and the deterministic chaos world supplies a simulated disk with
//! delays, failures, torn writes and crashes that lose what was not synced.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// One journal file's storage. Every method may fail as a real device can; the journal
/// decides what a failure means.
pub trait Disk: Send + 'static {
    /// Names the file in errors and logs.
    fn describe(&self) -> String;
    /// Opens the file, creating it empty if it does not exist, and reads it whole.
    fn open(&mut self) -> io::Result<Vec<u8>>;
    /// Writes `bytes` at offset `at` (the file grows as needed). Not durable until
    /// [`Disk::sync`] returns.
    fn write_at(&mut self, at: u64, bytes: &[u8]) -> io::Result<()>;
    /// Makes everything written so far durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;
    /// Cuts the file (or extends it with zeros) to `len` bytes. Not durable until synced.
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    /// Reads `len` bytes at `at`.
    fn read_at(&mut self, at: u64, len: usize) -> io::Result<Vec<u8>>;
    /// Replaces the whole file with `bytes`, durably and atomically: after a crash the
    /// file holds its old contents or the new ones, never a mix.
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Makes the file's existence durable (syncs its directory), after it was created.
    fn sync_dir(&mut self) -> io::Result<()>;
}

/// The journal's file in a directory of the agent's.
#[derive(Debug)]
pub struct FileDisk {
    path: PathBuf,
    file: Option<File>,
}

impl FileDisk {
    /// The file `name` in directory `dir` (created when opened).
    pub fn new(dir: &Path, name: &str) -> FileDisk {
        FileDisk {
            path: dir.join(name),
            file: None,
        }
    }

    fn file(&mut self) -> io::Result<&mut File> {
        self.file
            .as_mut()
            .ok_or_else(|| io::Error::other("the journal file is not open"))
    }

    fn dir(&self) -> PathBuf {
        self.path.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}

impl Disk for FileDisk {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn open(&mut self) -> io::Result<Vec<u8>> {
        std::fs::create_dir_all(self.dir())?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        self.file = Some(file);
        Ok(bytes)
    }

    fn write_at(&mut self, at: u64, bytes: &[u8]) -> io::Result<()> {
        let f = self.file()?;
        f.seek(SeekFrom::Start(at))?;
        f.write_all(bytes)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file()?.sync_data()
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.file()?.set_len(len)
    }

    fn read_at(&mut self, at: u64, len: usize) -> io::Result<Vec<u8>> {
        let f = self.file()?;
        let mut buf = vec![0u8; len];
        f.seek(SeekFrom::Start(at))?;
        f.read_exact(&mut buf)?;
        Ok(buf)
    }

    /// A temporary file beside it, synced, renamed over it, the directory synced.
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        let tmp = self.path.with_extension("kvj.tmp");
        {
            let mut f = File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        self.sync_dir()?;
        self.file = Some(OpenOptions::new().read(true).write(true).open(&self.path)?);
        Ok(())
    }

    fn sync_dir(&mut self) -> io::Result<()> {
        File::open(self.dir())?.sync_all()
    }
}

/// A journal file in memory, for tests of what the journal and the agent do when the
/// device misbehaves: writes that fail (a full device), syncs that stall until released
/// (a slow device). A [`MemDisk`] is a handle: clones share one file.
#[cfg(any(test, feature = "fault-injection"))]
#[derive(Clone, Debug, Default)]
pub struct MemDisk {
    state: std::sync::Arc<std::sync::Mutex<MemState>>,
    stall: std::sync::Arc<std::sync::Mutex<()>>,
}

#[cfg(any(test, feature = "fault-injection"))]
#[derive(Debug, Default)]
struct MemState {
    bytes: Vec<u8>,
    fail_writes: bool,
}

#[cfg(any(test, feature = "fault-injection"))]
impl MemDisk {
    /// An empty file.
    pub fn new() -> MemDisk {
        MemDisk::default()
    }

    /// A file holding `bytes`.
    pub fn with_bytes(bytes: Vec<u8>) -> MemDisk {
        let disk = MemDisk::default();
        disk.state().bytes = bytes;
        disk
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MemState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// From now on every write fails with "no space left on device" (`true`), or works.
    pub fn fail_writes(&self, fail: bool) {
        self.state().fail_writes = fail;
    }

    /// Holds every sync until the guard is dropped (a device slow to flush).
    pub fn stall(&self) -> std::sync::MutexGuard<'_, ()> {
        self.stall.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The file's bytes now.
    pub fn bytes(&self) -> Vec<u8> {
        self.state().bytes.clone()
    }

    fn refuse(&self) -> io::Result<()> {
        if self.state().fail_writes {
            return Err(io::Error::other("no space left on device"));
        }
        Ok(())
    }
}

#[cfg(any(test, feature = "fault-injection"))]
impl Disk for MemDisk {
    fn describe(&self) -> String {
        "journal.kvj (in memory)".to_string()
    }

    fn open(&mut self) -> io::Result<Vec<u8>> {
        Ok(self.bytes())
    }

    fn write_at(&mut self, at: u64, bytes: &[u8]) -> io::Result<()> {
        self.refuse()?;
        let at = usize::try_from(at).map_err(io::Error::other)?;
        let mut s = self.state();
        if s.bytes.len() < at {
            s.bytes.resize(at, 0);
        }
        let end = at + bytes.len();
        if s.bytes.len() < end {
            s.bytes.resize(end, 0);
        }
        s.bytes[at..end].copy_from_slice(bytes);
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        drop(self.stall());
        Ok(())
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        self.state().bytes.resize(len, 0);
        Ok(())
    }

    fn read_at(&mut self, at: u64, len: usize) -> io::Result<Vec<u8>> {
        let at = usize::try_from(at).map_err(io::Error::other)?;
        let s = self.state();
        s.bytes
            .get(at..at + len)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.refuse()?;
        self.state().bytes = bytes.to_vec();
        Ok(())
    }

    fn sync_dir(&mut self) -> io::Result<()> {
        Ok(())
    }
}
