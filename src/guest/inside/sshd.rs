//! The host key a clone's sshd presents: written where sshd reads its
//! ed25519 key, the template's other keys removed, and sshd reloaded only
//! where a new connection would not get the new key without it.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::files::write_whole;

const HOST_KEY: &str = "/etc/ssh/ssh_host_ed25519_key";
const HOST_CERTIFICATE: &str = "/etc/ssh/ssh_host_ed25519_key-cert.pub";
const SSHD_CONFIG: &str = "/etc/ssh/sshd_config";
const SSHD_DROP_IN: &str = "/etc/ssh/sshd_config.d/10-eitri.conf";

/// The host key files of the other types: a clone's are its template's,
/// the same in every sibling, so they are removed (the guest presents the
/// one key the host made for it).
const OTHER_HOST_KEYS: &[&str] = &[
    "/etc/ssh/ssh_host_rsa_key",
    "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_dsa_key",
];

/// Where OpenSSH 9.8 and later keep `sshd-session`. Their listener loads
/// the host keys and hands them to each connection's session, so a key
/// changed on disk is served only after a reload; before 9.8 each
/// connection's re-executed sshd loads them from their files itself.
const SSHD_SESSION: &[&str] = &[
    "/usr/lib/openssh/sshd-session",
    "/usr/libexec/openssh/sshd-session",
    "/usr/libexec/sshd-session",
    "/usr/lib/ssh/sshd-session",
    "/usr/local/libexec/sshd-session",
];

/// Installs a host key (and its certificate) where sshd reads its ed25519
/// key, removes the other types' keys, and has sshd's configuration serve
/// it: its fingerprint, and whether sshd must be reloaded for a new
/// connection to get it ([`reload_sshd`], the caller's to do).
///
/// A reload (sshd executing itself anew) is the slowest thing a clone's
/// identity did, most of it the restored guest faulting its pages in one
/// by one, so it is done only where a new connection would not otherwise
/// get the new key: sshd's configuration does not name the key or the
/// certificate (a drop-in is written that does), or the sshd is one that
/// hands its connections the keys it loaded at start.
pub(super) fn host_key(pem: &str, certificate: &str) -> Result<(String, bool), String> {
    let key = crate::hostkey::parse(pem)
        .ok_or_else(|| "the host key is not an unencrypted OpenSSH ed25519 key".to_owned())?;
    let certificate = certificate.trim();
    if certificate.contains('\n') {
        return Err("the host certificate is more than one line".into());
    }
    let fingerprint = crate::hostkey::fingerprint(&key.public_line)
        .ok_or_else(|| "the host key's public half does not parse".to_owned())?;
    write_whole(Path::new(HOST_KEY), pem, 0o600)?;
    write_whole(
        Path::new(&format!("{HOST_KEY}.pub")),
        &format!("{}\n", key.public_line),
        0o644,
    )?;
    if certificate.is_empty() {
        remove(HOST_CERTIFICATE)?;
    } else {
        write_whole(
            Path::new(HOST_CERTIFICATE),
            &format!("{certificate}\n"),
            0o644,
        )?;
    }
    for other in OTHER_HOST_KEYS {
        for suffix in ["", ".pub", "-cert.pub"] {
            remove(&format!("{other}{suffix}"))?;
        }
    }
    let mut reload = SSHD_SESSION.iter().any(|p| Path::new(p).exists());
    if !sshd_names(SSHD_CONFIG).serve(!certificate.is_empty()) {
        let mut conf = format!("HostKey {HOST_KEY}\n");
        if !certificate.is_empty() {
            conf.push_str(&format!("HostCertificate {HOST_CERTIFICATE}\n"));
        }
        write_whole(Path::new(SSHD_DROP_IN), &conf, 0o644)?;
        reload = true;
    }
    Ok((fingerprint, reload))
}

/// `path` removed, if it is there.
fn remove(path: &str) -> Result<(), String> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot remove {path}: {e}")),
    }
}

/// The host keys and certificates an sshd configuration names.
#[derive(Debug, Default, PartialEq)]
struct SshdNames {
    host_keys: Vec<String>,
    certificates: Vec<String>,
}

impl SshdNames {
    /// Whether an sshd so configured serves the ed25519 key at its usual
    /// path (and its certificate, where there is one).
    fn serve(&self, certificate: bool) -> bool {
        let key = self.host_keys.is_empty() || self.host_keys.iter().any(|k| k == HOST_KEY);
        key && (!certificate || self.certificates.iter().any(|c| c == HOST_CERTIFICATE))
    }
}

/// What the configuration `path` and the files it includes name as host
/// keys and certificates (each may be given more than once; no key named
/// means sshd's defaults, the ed25519 key among them). An `Include` is
/// followed where its pattern is a file, or a directory's `*` or `*.conf`;
/// a `Match` ends the global part, where neither may appear.
fn sshd_names(path: &str) -> SshdNames {
    let mut names = SshdNames::default();
    sshd_names_into(Path::new(path), &mut names, 0);
    names
}

/// Adds what `path` names to `names`: false once a `Match` was met.
fn sshd_names_into(path: &Path, names: &mut SshdNames, depth: u32) -> bool {
    let Ok(text) = fs::read_to_string(path) else {
        return true;
    };
    for line in text.lines().map(str::trim) {
        let (word, rest) = line
            .split_once(|c: char| c.is_whitespace() || c == '=')
            .unwrap_or((line, ""));
        let value = rest
            .trim_start_matches(|c: char| c.is_whitespace() || c == '=')
            .trim();
        match word.to_ascii_lowercase().as_str() {
            "hostkey" => names.host_keys.push(value.to_owned()),
            "hostcertificate" => names.certificates.push(value.to_owned()),
            "match" => return false,
            "include" if depth < 8 => {
                for pattern in value.split_whitespace() {
                    for file in included(pattern) {
                        if !sshd_names_into(&file, names, depth + 1) {
                            return false;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    true
}

/// The files an `Include` pattern names, in sshd's (lexical) order: a
/// relative pattern is under /etc/ssh.
fn included(pattern: &str) -> Vec<PathBuf> {
    let pattern = Path::new("/etc/ssh").join(pattern);
    let (Some(dir), Some(name)) = (
        pattern.parent(),
        pattern.file_name().and_then(|n| n.to_str()),
    ) else {
        return Vec::new();
    };
    let suffix = match name {
        "*" => "",
        "*.conf" => ".conf",
        _ if !name.contains(['*', '?', '[']) => return vec![pattern.clone()],
        _ => return Vec::new(),
    };
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| !n.starts_with('.') && n.ends_with(suffix))
                .map(|n| dir.join(n))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// How long a reloaded sshd is given to listen again.
const SSHD_RELOAD: Duration = Duration::from_secs(5);

/// Asks sshd to read its configuration and keys again (SIGHUP to the
/// listener: new connections get the new key, open ones stay), and waits
/// until it listens again: sshd execs itself anew, closing its listening
/// sockets for a moment, and a client the host told "applied" was refused
/// in that moment on a real guest. Whether it listens again in time.
pub(super) fn reload_sshd() -> bool {
    let pid = ["/run/sshd.pid", "/var/run/sshd.pid"]
        .iter()
        .find_map(|p| fs::read_to_string(p).ok()?.trim().parse::<i32>().ok());
    let Some(pid) = pid.filter(|pid| *pid > 1) else {
        return false;
    };
    let before = listening_sockets(22);
    let signalled = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGHUP,
    )
    .is_ok();
    if !signalled || before.is_empty() {
        return signalled;
    }
    // Listening again: on sockets of its own, none of the old ones.
    let until = Instant::now() + SSHD_RELOAD;
    while Instant::now() < until {
        let now = listening_sockets(22);
        if !now.is_empty() && now.is_disjoint(&before) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The inodes of the sockets listening on TCP `port` (IPv4 and IPv6), as
/// the kernel lists them.
fn listening_sockets(port: u16) -> std::collections::HashSet<u64> {
    let port = format!("{port:04X}");
    let mut found = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl, local address:port, remote, state, queues, …, inode (10th).
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            if local.rsplit(':').next() == Some(port.as_str())
                && *state == "0A"
                && let Ok(inode) = inode.parse()
            {
                found.insert(inode);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_found_by_its_port_and_gone_once_closed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();

        let open = listening_sockets(port);
        drop(listener);

        assert_eq!(open.len(), 1, "{open:?}");
        assert!(listening_sockets(port).is_empty());
    }

    #[test]
    fn sshd_with_no_host_key_named_serves_its_default_ed25519_key() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("sshd_config");
        fs::write(&config, "#HostKey /etc/ssh/ssh_host_rsa_key\nPort 22\n").unwrap();

        let named = sshd_names(config.to_str().unwrap());

        assert!(named.serve(false));
        assert!(!named.serve(true), "no HostCertificate is named");
    }

    #[test]
    fn sshd_naming_only_other_host_keys_does_not_serve_the_ed25519_one() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("sshd_config");
        fs::write(&config, "HostKey /etc/ssh/ssh_host_rsa_key\n").unwrap();

        assert!(!sshd_names(config.to_str().unwrap()).serve(false));
    }

    #[test]
    fn sshd_names_are_read_through_includes_until_a_match() {
        let dir = tempfile::tempdir().unwrap();
        let drop_ins = dir.path().join("d");
        fs::create_dir(&drop_ins).unwrap();
        fs::write(
            drop_ins.join("50-cert.conf"),
            format!("HostCertificate = {HOST_CERTIFICATE}\n"),
        )
        .unwrap();
        fs::write(drop_ins.join("README"), "HostKey /not/a/conf\n").unwrap();
        let config = dir.path().join("sshd_config");
        fs::write(
            &config,
            format!(
                "Include {}/*.conf\nhostkey {HOST_KEY}\nMatch User x\nHostKey /after/match\n",
                drop_ins.display()
            ),
        )
        .unwrap();

        let named = sshd_names(config.to_str().unwrap());

        assert_eq!(
            named,
            SshdNames {
                host_keys: vec![HOST_KEY.to_owned()],
                certificates: vec![HOST_CERTIFICATE.to_owned()],
            }
        );
        assert!(named.serve(true));
    }
}
