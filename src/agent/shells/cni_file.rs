//! The CNI configuration file kg keeps on the node's pod CIDRs and MTU (Kilo's `--cni`): read
//! and written whole, behind [`CniFile`], so the agent's decision about its content is pure
//! (`control::cni::update_conflist`) and its twin holds the text in memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use parking_lot::Mutex;

/// The CNI conflist kg manages.
pub trait CniFile: Send + Sync {
    /// Where it is, for messages.
    fn path(&self) -> &Path;
    /// Its text.
    fn read(&self) -> std::io::Result<String>;
    /// Replaces its text (atomically on a host: a temporary file renamed over it, mode 0644).
    fn write(&self, text: &str) -> Result<()>;
}

/// The conflist on the host's file system (`--cni-path`).
#[derive(Debug, Clone)]
pub struct HostCniFile {
    path: PathBuf,
}

impl HostCniFile {
    /// The file at `path`.
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }
}

impl CniFile for HostCniFile {
    fn path(&self) -> &Path {
        &self.path
    }
    fn read(&self) -> std::io::Result<String> {
        std::fs::read_to_string(&self.path)
    }
    fn write(&self, text: &str) -> Result<()> {
        super::write_file(&self.path, text, 0o644)
    }
}

/// An in-memory conflist: its text (`None`: no file) and how often it was written.
#[derive(Debug, Clone, Default)]
pub struct MemCniFile {
    path: PathBuf,
    state: Arc<Mutex<(Option<String>, usize)>>,
}

impl MemCniFile {
    /// A conflist at `path` holding `text` (`None`: missing).
    pub fn holding(path: impl Into<PathBuf>, text: Option<&str>) -> Self {
        Self {
            path: path.into(),
            state: Arc::new(Mutex::new((text.map(str::to_string), 0))),
        }
    }

    /// Replaces its text, as another program would.
    pub fn put(&self, text: &str) {
        self.state.lock().0 = Some(text.to_string());
    }

    /// Its text now.
    pub fn text(&self) -> Option<String> {
        self.state.lock().0.clone()
    }

    /// How many times it was written.
    pub fn writes(&self) -> usize {
        self.state.lock().1
    }
}

impl CniFile for MemCniFile {
    fn path(&self) -> &Path {
        &self.path
    }
    fn read(&self) -> std::io::Result<String> {
        self.state
            .lock()
            .0
            .clone()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }
    fn write(&self, text: &str) -> Result<()> {
        let mut s = self.state.lock();
        s.0 = Some(text.to_string());
        s.1 += 1;
        Ok(())
    }
}
