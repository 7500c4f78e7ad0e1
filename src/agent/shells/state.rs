//! The WireGuard peers kg applied last, saved next to the key file (`<key-file>.state`, mode
//! 0600, in UAPI `get` form without the private key) so a restarted kg restores them before it
//! has heard from the backend; and the routes and rules it installed (`<key-file>.routes`), so
//! a restarted kg knows what of the kernel's is its own even when its settings changed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use dataplane::{DeviceConfig, SecretKey};

/// Where the state of the kg using `key_file` lives.
pub fn path(key_file: &Path) -> PathBuf {
    super::keyfile::beside(key_file, ".state")
}

/// Saves `config`'s peers and port (never the private key).
pub fn save(key_file: &Path, config: &DeviceConfig) -> Result<()> {
    let mut public = config.clone();
    public.interface.private_key = None;
    let text = dataplane::uapi::format_get(&public, public.interface.listen_port, &[]);
    super::write_file(&path(key_file), &text, 0o600)
}

/// The saved configuration, if there is one, on this run's `key` and `port`: the peers are the
/// last run's, the port is the one kg listens on now (a `--port` changed across the restart
/// must not be taken back to the old one, which another socket may hold).
pub fn load(key_file: &Path, key: &SecretKey, port: u16) -> Result<Option<DeviceConfig>> {
    let path = path(key_file);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let (mut config, _) = dataplane::uapi::parse_get(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    config.interface.private_key = Some(key.clone());
    config.interface.listen_port = port;
    Ok(Some(config))
}

mod routes;

pub use routes::{load_routes, save_routes};

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::{InterfaceConfig, PeerConfig};
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn peers_round_trip_without_the_private_key() {
        let dir = std::env::temp_dir().join(format!("kilotun-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key_file = dir.join("key");
        let key = SecretKey::generate();
        let mut peer = PeerConfig::new(SecretKey::generate().public_key());
        peer.endpoint = Some("192.0.2.7:51820".parse().unwrap());
        peer.persistent_keepalive = 25;
        peer.add_allowed_ip("10.42.3.0/24".parse().unwrap());
        let config = DeviceConfig {
            interface: InterfaceConfig {
                private_key: Some(key.clone()),
                listen_port: 51821,
                fwmark: 0,
            },
            peers: vec![peer],
        };
        assert!(load(&key_file, &key, 51821).unwrap().is_none());
        save(&key_file, &config).unwrap();
        let text = std::fs::read_to_string(path(&key_file)).unwrap();
        assert!(
            !text.contains(key.expose_hex().as_str()),
            "the private key is never saved"
        );
        let mode = std::fs::metadata(path(&key_file))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(load(&key_file, &key, 51821).unwrap(), Some(config.clone()));
        // A port changed since (--port): the peers are restored on the port of this run.
        let moved = load(&key_file, &key, 51830).unwrap().unwrap();
        assert_eq!(moved.interface.listen_port, 51830);
        assert_eq!(moved.peers, config.peers);
        std::fs::write(path(&key_file), "listen_port=banana\n").unwrap();
        assert!(load(&key_file, &key, 51821).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
