//! The stand-in's guest agent, on the stand-in's vsock socket: the VMM's
//! side of the `CONNECT` handshake as cloud-hypervisor does it, then a
//! scripted guest that answers through the agent's own
//! [`serve_one`], or misbehaves as
//! `STANDIN_GUEST_AGENT` says:
//!
//! - `none`: no guest agent; every `CONNECT` is closed unanswered, as the
//!   VMM closes a host connection the guest refused.
//! - `stall`: reads the request, never answers.
//! - `flood`: answers bytes without end, as fast as it can.
//! - `oversize`: a frame that says it is 4 GiB long.
//! - `old-version`: answers in protocol version 2.
//! - `wrong-id`: answers another request's id.
//! - `garbage`: a frame of bytes that are no answer.
//! - `close`: half a frame, then closes.
//!
//! `STANDIN_GUEST_UP_AFTER_MS=n`: the guest's system says `starting` for
//! its first n ms, then `running`. `STANDIN_GUEST_STATUS_AFTER_MS=n`: a
//! status request is answered n ms after it came (a guest whose
//! `systemctl` is slow). Each request served is logged
//! (`standin-guest <what>`), a reseed with the digest of its entropy.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use eitri_agent::deadline::Deadline;
use eitri_agent::guest::serve::{Inside, serve_one};
use eitri_agent::pb::guest::{
    Answer, Identity, IdentityApplied, Quieted, Reseeded, Resumed, Status, SystemState, answer,
};

/// A scripted guest: its boot (kept across a snapshot), when this VMM
/// started it, what it was told.
pub struct Scripted {
    pub boot_id: String,
    pub started: Instant,
    pub up_after: Duration,
    /// How long a status request waits before it is answered.
    pub status_after: Duration,
    pub say: Arc<dyn Fn(&str) + Send + Sync>,
    frozen: Mutex<bool>,
}

impl Scripted {
    /// Its status as `eitri-guest` takes it, said in no log line: up once
    /// its `up_after` has passed.
    fn state(&self) -> Status {
        let up = self.started.elapsed() >= self.up_after;
        Status {
            boot_id: self.boot_id.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            system: if up {
                SystemState::SystemUp
            } else {
                SystemState::SystemStarting
            } as i32,
            system_detail: format!("systemd: {}", if up { "running" } else { "starting" }),
            memory_total_kib: 512 << 10,
            memory_available_kib: 400 << 10,
            load_milli: 10,
            root_total_bytes: 1 << 30,
            root_free_bytes: 1 << 29,
            agent_version: "standin".into(),
        }
    }

    pub fn new(
        boot_id: String,
        (up_after, status_after): (Duration, Duration),
        say: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Scripted {
        Scripted {
            boot_id,
            started: Instant::now(),
            up_after,
            status_after,
            say,
            frozen: Mutex::new(false),
        }
    }
}

impl Inside for Scripted {
    fn status(&self) -> Status {
        std::thread::sleep(self.status_after);
        let status = self.state();
        let up = status.system == SystemState::SystemUp as i32;
        (self.say)(&format!("standin-guest status up={up}"));
        status
    }

    fn resumed(&self, r: &Resumed, received: SystemTime) -> Result<Reseeded, String> {
        use sha2::{Digest, Sha256};
        let host = i128::from(r.host_unix_ns);
        let here = received
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let digest = Sha256::digest(&r.entropy);
        (self.say)(&format!(
            "standin-guest reseeded bytes={} sha256={}",
            r.entropy.len(),
            eitri_agent::hex::encode(&digest[..8])
        ));
        Ok(Reseeded {
            credited_bytes: r.entropy.len() as u32,
            crng_reseeded: true,
            clock_offset_ms: ((here - host) / 1_000_000) as i64,
            clock_set: false,
            lease_renewed: false,
        })
    }

    fn identity(&self, i: &Identity) -> Result<IdentityApplied, String> {
        let macs: Vec<String> = i.nics.iter().map(|n| n.to.clone()).collect();
        (self.say)(&format!(
            "standin-guest identity hostname={} macs={}",
            i.hostname,
            macs.join(",")
        ));
        // The key sshd would present, as `eitri-guest` reports it.
        let ssh_host_key_fingerprint = match i.ssh_host_key.as_str() {
            "" => String::new(),
            pem => eitri_agent::hostkey::parse(pem)
                .and_then(|key| eitri_agent::hostkey::fingerprint(&key.public_line))
                .ok_or("the host key is not an unencrypted OpenSSH ed25519 key")?,
        };
        Ok(IdentityApplied {
            hostname: i.hostname.clone(),
            authorized_keys: i.authorized_keys.len() as u32,
            ssh_host_key_fingerprint,
            sshd_reloaded: !i.ssh_host_key.is_empty(),
            // No interfaces here: each MAC asked for is taken, and with it
            // a lease, as a guest's DHCP client takes one.
            readdressed: !macs.is_empty(),
            macs,
            steps: Vec::new(),
            status: Some(self.state()),
        })
    }

    fn freeze(&self, thaw_after: Duration) -> Result<Vec<String>, String> {
        *self.frozen.lock().map_err(|e| e.to_string())? = true;
        (self.say)(&format!(
            "standin-guest frozen thaw_after_ms={}",
            thaw_after.as_millis()
        ));
        Ok(vec!["/".into()])
    }

    fn thaw(&self) -> Result<Vec<String>, String> {
        *self.frozen.lock().map_err(|e| e.to_string())? = false;
        (self.say)("standin-guest thawed");
        Ok(vec!["/".into()])
    }

    fn saving(&self) -> Result<Quieted, String> {
        (self.say)("standin-guest saving");
        Ok(Quieted {
            stall_check_quiet: true,
            was_quiet: false,
        })
    }

    fn power_off(&self) {
        (self.say)("standin-guest power off");
        // The guest is gone; its VMM exits, as cloud-hypervisor does when
        // its guest powers off.
        std::thread::sleep(Duration::from_millis(20));
        std::process::exit(0);
    }
}

/// Binds `socket` (a stale one replaced, as the VMM's bind would fail on
/// one and the agent removes it first) and serves every connection.
pub fn listen(socket: &Path, guest: Arc<Scripted>, how: Option<String>) {
    let listener = match UnixListener::bind(socket) {
        Ok(l) => l,
        Err(e) => {
            (guest.say)(&format!(
                "Error: cannot bind the vsock socket {}: {e}",
                socket.display()
            ));
            std::process::exit(1);
        }
    };
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let guest = Arc::clone(&guest);
            let how = how.clone();
            std::thread::spawn(move || connection(stream, &guest, how.as_deref()));
        }
    });
}

/// The VMM's side of `CONNECT <port>\n`: the port read, `OK <local>\n`
/// answered when the guest listens there.
fn handshake(stream: &UnixStream) -> Option<u32> {
    let mut line = String::new();
    let mut reader = BufReader::new(stream.try_clone().ok()?).take(32);
    reader.read_line(&mut line).ok()?;
    line.strip_prefix("CONNECT ")?
        .trim_end_matches('\n')
        .parse()
        .ok()
}

fn connection(mut stream: UnixStream, guest: &Scripted, how: Option<&str>) {
    let Some(port) = handshake(&stream) else {
        return;
    };
    if port != eitri_agent::guest::PORT || how == Some("none") {
        return;
    }
    if stream.write_all(b"OK 1073741824\n").is_err() {
        return;
    }
    let deadline = Deadline::after(Duration::from_secs(10));
    if matches!(how, None | Some("ok")) {
        if let Err(e) = serve_one(&mut stream, guest, deadline) {
            (guest.say)(&format!("standin-guest exchange failed: {e}"));
        }
        return;
    }
    // A hostile agent reads the request as any does, then misbehaves.
    let Ok(request) = eitri_agent::guest::frame::read(&mut stream, 1 << 16, deadline) else {
        return;
    };
    let mut misbehave = |bytes: &[u8]| {
        let _ = stream.write_all(bytes);
    };
    match how {
        Some("stall") => std::thread::sleep(Duration::from_secs(3600)),
        Some("flood") => {
            let chunk = [0x41u8; 64 << 10];
            while stream.write_all(&chunk).is_ok() {}
        }
        Some("oversize") => misbehave(&u32::MAX.to_be_bytes()),
        Some("close") => misbehave(&[0, 0, 0, 40, 1, 2, 3]),
        Some("garbage") => misbehave(&[0, 0, 0, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
        Some(other) => {
            use prost::Message;
            let id =
                eitri_agent::pb::guest::Request::decode(request.as_slice()).map_or(0, |r| r.id);
            let (version, id) = match other {
                "old-version" => (2, id),
                "wrong-id" => (eitri_agent::guest::VERSION, id.wrapping_add(1)),
                _ => return,
            };
            let answer = Answer {
                version,
                id,
                said: Some(answer::Said::Status(guest.status())),
            };
            let _ =
                eitri_agent::guest::frame::write(&mut stream, &answer.encode_to_vec(), deadline);
        }
        None => {}
    }
}
