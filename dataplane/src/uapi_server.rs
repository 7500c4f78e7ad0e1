//! The UAPI socket, `/var/run/wireguard/IFACE.sock`, that `wg` connects to.
//!
//! The socket is mode 0600 in a 0755 directory, so only root reaches it. A socket left by a
//! crashed run (nobody accepts on it) is replaced; a live one is an error. Each connection is
//! served on its own thread and may carry several requests; a malformed request is answered
//! with `errno=-N` and never disturbs the device. A stopped server removes its socket file
//! before it stops listening, and only while the file is still its own, so a device started
//! again under the same name meanwhile keeps its socket.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::eventfd::{poll, readable, StopSignal};
use crate::uapi::{UapiError, EINVAL, EPROTO, MAX_REQUEST_BYTES};

/// The directory `wg` looks in.
pub const SOCKET_DIR: &str = "/var/run/wireguard";

/// What the server calls for each request.
pub trait UapiHandler: Send + Sync + 'static {
    /// The body of a `get=1` answer (without `errno=0`).
    fn get(&self) -> String;
    /// Applies the body of a `set=1` request.
    ///
    /// # Errors
    /// The errno and message to answer with.
    fn set(&self, body: &str) -> Result<(), UapiError>;
}

/// Why the socket could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UapiBindError {
    /// Another live process serves this interface.
    #[error("UAPI socket {path} is in use by another running process")]
    InUse {
        /// The socket path.
        path: PathBuf,
    },
    /// Creating the directory or the socket failed.
    #[error("creating UAPI socket {path}: {source}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// The socket path for `interface` under `dir`.
pub fn socket_path(dir: &Path, interface: &str) -> PathBuf {
    dir.join(format!("{interface}.sock"))
}

/// Creates the listening socket at `path`, replacing a stale one.
///
/// # Errors
/// [`UapiBindError::InUse`] when a live server answers there.
pub fn bind(path: &Path) -> Result<UnixListener, UapiBindError> {
    let io_err = |source| UapiBindError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err)?;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(UapiBindError::InUse {
                path: path.to_owned(),
            });
        }
        std::fs::remove_file(path).map_err(io_err)?;
    }
    bind_private(path).map_err(io_err)
}

/// Binds a socket that no one but its owner can connect to at any moment, whatever the umask:
/// it is bound inside a new 0700 directory beside `path` (connecting needs search permission on
/// every directory of the path), made 0600 there, then renamed to `path`. wireguard-go narrows
/// the process's umask around its listen instead, which other threads would see.
fn bind_private(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::DirBuilderExt as _;
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a socket path needs a file name",
        )
    })?;
    let private = path.with_file_name(format!(".{name}.{}.bind", std::process::id()));
    // A directory a crash left behind.
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let inner = private.join("s");
    let bound = (|| {
        let listener = UnixListener::bind(&inner)?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&inner, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// Removes the socket file [`bind`] made when dropped, unless [`SocketGuard::keep`] was
/// called: a start that fails after binding leaves no socket behind.
#[derive(Debug)]
#[must_use = "dropping the guard removes the socket file"]
pub struct SocketGuard(Option<PathBuf>);

impl SocketGuard {
    /// Guards the socket file at `path`.
    pub fn new(path: &Path) -> Self {
        Self(Some(path.to_owned()))
    }

    /// Leaves the file in place (a [`UapiServer`] now owns it).
    pub fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A running UAPI server; dropping it removes the socket file and stops accepting.
#[derive(Debug)]
pub struct UapiServer {
    path: PathBuf,
    /// Device and inode of the socket file when the server started: the file is removed only
    /// while it is still this one.
    file: Option<(u64, u64)>,
    stop: Arc<StopSignal>,
    thread: Option<JoinHandle<()>>,
}

/// The device and inode of the file at `path`.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

impl UapiServer {
    /// Serves `listener` (bound at `path`) with `handler` until dropped.
    ///
    /// # Errors
    /// Failure to create the stop eventfd or to spawn the accept thread.
    pub fn start(
        listener: UnixListener,
        path: PathBuf,
        handler: Arc<dyn UapiHandler>,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let file = file_id(&path);
        let stop = Arc::new(StopSignal::new()?);
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kilotun-uapi".into())
            .spawn(move || accept_loop(&listener, &handler, &thread_stop))?;
        Ok(Self {
            path,
            file,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for UapiServer {
    fn drop(&mut self) {
        // While still listening: once the listener closes, another device may take the path
        // as stale and bind its own socket there.
        if self.file.is_some() && file_id(&self.path) == self.file {
            let _ = std::fs::remove_file(&self.path);
        }
        self.stop.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts connections until told to stop, each served on its own thread. It sleeps in `poll`
/// until a client connects or [`UapiServer`] is dropped: no periodic wake-up.
fn accept_loop(listener: &UnixListener, handler: &Arc<dyn UapiHandler>, stop: &StopSignal) {
    while !stop.is_stopped() {
        let mut fds = [readable(listener.as_raw_fd()), readable(stop.fd())];
        poll(&mut fds, None);
        match listener.accept() {
            Ok((stream, _)) => {
                let handler = Arc::clone(handler);
                let _ = std::thread::Builder::new()
                    .name("kilotun-uapi-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve_connection(stream, &*handler) {
                            tracing::debug!(error = %e, "UAPI connection ended");
                        }
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::warn!(error = %e, "accepting a UAPI connection failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Serves every request on one connection until the client closes it.
///
/// # Errors
/// I/O errors of the connection; protocol errors are answered, not returned.
pub fn serve_connection(stream: UnixStream, handler: &dyn UapiHandler) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        if read_bounded_line(&mut reader, &mut line, 4096)? == 0 {
            return Ok(());
        }
        match line.as_str() {
            "get=1\n" => {
                line.clear();
                read_bounded_line(&mut reader, &mut line, 4096)?;
                if line != "\n" {
                    answer(
                        &mut writer,
                        Err(&UapiError::invalid("trailing data after get=1")),
                    )?;
                    return close_after_error(&writer, reader);
                }
                let body = handler.get();
                writer.write_all(body.as_bytes())?;
                answer(&mut writer, Ok(()))?;
            }
            "set=1\n" => {
                let mut body = String::new();
                let mut too_long = false;
                loop {
                    line.clear();
                    let n = read_bounded_line(&mut reader, &mut line, 4096)?;
                    if n == 0 || line == "\n" {
                        break;
                    }
                    if body.len() + line.len() > MAX_REQUEST_BYTES || !line.ends_with('\n') {
                        too_long = true;
                        break;
                    }
                    body.push_str(&line);
                }
                if too_long {
                    let err = UapiError::invalid("request too long");
                    answer(&mut writer, Err(&err))?;
                    return close_after_error(&writer, reader);
                }
                let result = handler.set(&body);
                if let Err(e) = &result {
                    tracing::warn!(errno = e.errno, error = %e.message, "UAPI set refused");
                }
                answer(&mut writer, result.as_ref().map(|_| ()))?;
            }
            _ => {
                let err = UapiError {
                    errno: EPROTO,
                    message: "unknown operation".into(),
                };
                answer(&mut writer, Err(&err))?;
                return close_after_error(&writer, reader);
            }
        }
    }
}

/// Closes a connection whose client sent something unusable, reading (and discarding) what it
/// still sends for a moment so the close does not reset the connection before the client has
/// read our answer.
fn close_after_error(writer: &UnixStream, mut reader: BufReader<UnixStream>) -> io::Result<()> {
    writer.shutdown(std::net::Shutdown::Write)?;
    writer.set_read_timeout(Some(Duration::from_millis(200)))?;
    let _ = io::copy(&mut (&mut reader).take(1 << 20), &mut io::sink());
    Ok(())
}

fn answer(writer: &mut UnixStream, result: Result<(), &UapiError>) -> io::Result<()> {
    let errno = match result {
        Ok(()) => 0,
        Err(e) if e.errno == 0 => -EINVAL,
        Err(e) => -e.errno.abs(),
    };
    writer.write_all(format!("errno={errno}\n\n").as_bytes())?;
    writer.flush()
}

/// Reads one line of at most `max` bytes (a longer line is returned cut, without its newline).
/// Bytes that are not UTF-8 are replaced, so they fail validation instead of the connection.
fn read_bounded_line(
    reader: &mut BufReader<UnixStream>,
    line: &mut String,
    max: usize,
) -> io::Result<usize> {
    let mut bytes = Vec::new();
    let n = reader
        .by_ref()
        .take(max as u64)
        .read_until(b'\n', &mut bytes)?;
    line.push_str(&String::from_utf8_lossy(&bytes));
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Recorder(Mutex<Vec<String>>);

    impl UapiHandler for Recorder {
        fn get(&self) -> String {
            "listen_port=1\n".into()
        }
        fn set(&self, body: &str) -> Result<(), UapiError> {
            self.0.lock().unwrap().push(body.into());
            if body.contains("bad") {
                Err(UapiError::invalid("bad line"))
            } else {
                Ok(())
            }
        }
    }

    fn exchange(request: &[u8]) -> (String, Vec<String>) {
        let (client, server) = UnixStream::pair().unwrap();
        let handler = Recorder(Mutex::new(Vec::new()));
        let mut c = client.try_clone().unwrap();
        c.write_all(request).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        serve_connection(server, &handler).unwrap();
        let mut reply = String::new();
        let mut client = client;
        client.read_to_string(&mut reply).unwrap();
        let sets = handler.0.into_inner().unwrap();
        (reply, sets)
    }

    #[test]
    fn get_and_set_on_one_connection() {
        let (reply, sets) = exchange(b"get=1\n\nset=1\nlisten_port=2\n\nset=1\nbad=1\n\n");
        assert_eq!(reply, "listen_port=1\nerrno=0\n\nerrno=0\n\nerrno=-22\n\n");
        assert_eq!(
            sets,
            vec!["listen_port=2\n".to_string(), "bad=1\n".to_string()]
        );
    }

    #[test]
    fn unknown_operation_is_answered_then_closed() {
        let (reply, sets) = exchange(b"hello\nset=1\n\n");
        assert_eq!(reply, "errno=-71\n\n");
        assert!(sets.is_empty());
    }

    #[test]
    fn binary_garbage_and_overlong_lines_do_not_panic() {
        let mut request = b"set=1\n".to_vec();
        request.extend(std::iter::repeat_n(0xffu8, 10_000));
        request.extend(b"\n\n");
        let (reply, _) = exchange(&request);
        assert_eq!(reply, "errno=-22\n\n");
        let (reply, _) = exchange(&[0u8, 1, 2, 3, b'\n']);
        assert_eq!(reply, "errno=-71\n\n");
    }

    #[test]
    fn the_socket_is_private_from_its_bind_whatever_the_umask() {
        let dir = std::env::temp_dir().join(format!("kilotun-uapi-umask-{}", std::process::id()));
        let path = socket_path(&dir, "t1");
        // SAFETY: umask has no preconditions; the old mask is put back below.
        let old = unsafe { libc::umask(0) };
        let bound = bind(&path);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let listener = bound.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the socket's mode under umask 0");
        // Only the socket is left: the private directory it was bound in is gone.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["t1.sock"]);
        // And it answers at its final path.
        assert!(UnixStream::connect(&path).is_ok());
        drop(listener);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn stale_socket_is_replaced_and_live_one_refused() {
        let dir = std::env::temp_dir().join(format!("kilotun-uapi-{}", std::process::id()));
        let path = socket_path(&dir, "t0");
        let first = bind(&path).unwrap();
        assert!(matches!(bind(&path), Err(UapiBindError::InUse { .. })));
        drop(first);
        let second = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        drop(second);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_server_removes_its_own_socket_and_never_a_successors() {
        let dir = std::env::temp_dir().join(format!("kilotun-uapi-own-{}", std::process::id()));
        let path = socket_path(&dir, "t1");
        let handler: Arc<dyn UapiHandler> = Arc::new(Recorder(Mutex::new(Vec::new())));
        let server =
            UapiServer::start(bind(&path).unwrap(), path.clone(), handler.clone()).unwrap();
        drop(server);
        assert!(!path.exists(), "the server's own socket is removed");

        let server = UapiServer::start(bind(&path).unwrap(), path.clone(), handler).unwrap();
        // Another device's socket where this one's was (as after a stale replacement).
        std::fs::remove_file(&path).unwrap();
        let successor = UnixListener::bind(&path).unwrap();
        drop(server);
        assert!(path.exists(), "a successor's socket stays");
        drop(successor);

        let guard = SocketGuard::new(&path);
        drop(guard);
        assert!(!path.exists(), "a guard removes the file");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
