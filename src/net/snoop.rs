//! Learning the address of a VM's second NIC, which the site's own DHCP
//! server grants (the agent hands out nothing there).
//!
//! The guest owns its NIC and may send anything, and other hosts on the
//! site may too; the reported address must be neither's choice. A snooper
//! on the NIC's tap tells the two directions apart (a frame the tap sends
//! goes to the guest, so it came from the site; one it receives came from
//! the guest) and believes only what each side is entitled to say:
//! - **From the site**: a DHCP ACK (a BOOTREPLY, from port 67) to the VM's
//!   MAC, answering the guest's own last REQUEST (its xid) and from the
//!   server that REQUEST was addressed to, teaches the address until its
//!   lease ends, capped at [`MAX_LEASE_SECS`]. A NAK forgets it, when it
//!   answers the guest's REQUEST and comes from the server that granted the
//!   lease. Nothing else from the site (ARP above all) teaches anything.
//! - **From the guest**, with the VM's MAC as the frame's source: its
//!   REQUEST (whose xid and server the ACK must answer), and a RELEASE or
//!   DECLINE of its own, which forgets the address. Nothing the guest
//!   sends teaches an address: its ARP and IPv4 would let it pick one (a
//!   RELEASE, then traffic from the site gateway's address), and what is
//!   learned here is what the site guard lets it send from. A guest with a
//!   static address on a site network has no IPv4 there.
//!
//! The snooper keeps the site guard in step with what is learned (see
//! [`crate::net::rules::nft_ruleset`]): the address a lease grants is
//! the one the tap may send from, until the lease ends, a NAK or the
//! guest's RELEASE forgets it, or the VM is destroyed.
//!
//! What is learned is persisted: a guest asks again only at renewal, so an
//! agent restart must not forget an address it cannot learn again for
//! hours. A guest changing its address a thousand times a second must not
//! make the agent write a thousand times: the map is written by its own
//! thread, at most once a second, from a copy taken under the lock.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::dhcp::codec::{CLIENT_PORT, Frame, Kind, Message, SERVER_PORT, option};
use super::packet::PacketSocket;
use crate::model::Mac;
use crate::state::atomic::write_atomic;
use crate::threads::{OwnedThread, StopFlag};

/// The longest lease believed: a server's (or a forger's) "forever" is a
/// day, and a guest still using the address is learned again from its
/// traffic.
pub const MAX_LEASE_SECS: u64 = 24 * 3600;

/// The shortest time between two writes of the learned map.
const WRITE_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    ip: Ipv4Addr,
    /// Unix seconds. `None` only in a map an older agent wrote, for an
    /// address it learned from the guest's own traffic: not believed.
    expires: Option<u64>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Learned second-NIC addresses by MAC, persisted by a [`Writer`].
pub struct Learned {
    path: PathBuf,
    map: Mutex<BTreeMap<String, Entry>>,
    /// Changed since the last write.
    dirty: AtomicBool,
    changed: Sender<()>,
    changes: Receiver<()>,
    writes: AtomicU64,
}

impl Learned {
    /// Loads what was learned before (absent or unreadable = nothing: a
    /// learned address is an observation, and will be observed again).
    pub fn open(path: &Path) -> Learned {
        let map = std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let (changed, changes) = crossbeam_channel::bounded(1);
        Learned {
            path: path.to_path_buf(),
            map: Mutex::new(map),
            dirty: AtomicBool::new(false),
            changed,
            changes,
            writes: AtomicU64::new(0),
        }
    }

    /// The address, unless its lease has run out.
    pub fn get(&self, mac: &str) -> Option<Ipv4Addr> {
        let map = self.map.lock();
        let entry = map.get(mac)?;
        match entry.expires {
            Some(at) if at > now_unix() => Some(entry.ip),
            _ => None,
        }
    }

    /// How many times the map has been written since it was opened.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Learns `entry` for `mac`.
    fn set(&self, mac: &str, entry: Entry) {
        let mut map = self.map.lock();
        if map.get(mac) == Some(&entry) {
            return;
        }
        map.insert(mac.to_owned(), entry);
        drop(map);
        self.changed_now();
    }

    /// Forgets the address of `mac` (a NAK, RELEASE, DECLINE, or destroy).
    pub fn forget(&self, mac: &str) {
        if self.map.lock().remove(mac).is_some() {
            self.changed_now();
        }
    }

    fn changed_now(&self) {
        self.dirty.store(true, Ordering::Release);
        match self.changed.try_send(()) {
            // Full: a write is already due, and will take this change.
            Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
        }
    }

    /// Writes the map if it changed since the last write: a copy taken
    /// under the lock, written (temp, fsync, rename) outside it.
    fn write(&self) {
        if !self.dirty.swap(false, Ordering::AcqRel) {
            return;
        }
        let copy = self.map.lock().clone();
        let result = self
            .path
            .parent()
            .map_or(Ok(()), crate::state::perms::make_dir_in)
            .and_then(|()| {
                write_atomic(
                    &self.path,
                    &serde_json::to_vec_pretty(&copy).map_err(std::io::Error::other)?,
                )
            });
        self.writes.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = result {
            // Kept dirty: the next change or the stop tries again.
            self.dirty.store(true, Ordering::Release);
            log::warn!(
                "cannot save learned addresses to {}: {e}",
                self.path.display()
            );
        }
    }
}

/// The `learned-writer` thread: writes the learned map after a change, at
/// most once a [`WRITE_EVERY`], and once more when stopped.
pub struct Writer {
    _thread: OwnedThread,
}

impl Writer {
    pub fn start(learned: Arc<Learned>) -> std::io::Result<Writer> {
        let thread = OwnedThread::spawn("learned-writer".into(), 64 * 1024, None, move |stop| {
            write_changes(&learned, &stop);
            learned.write();
        })?;
        Ok(Writer { _thread: thread })
    }
}

fn write_changes(learned: &Learned, stop: &StopFlag) {
    let tick = Duration::from_millis(100);
    while !stop.stopped() {
        match learned.changes.recv_timeout(tick) {
            Ok(()) => {}
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        learned.write();
        let wrote = std::time::Instant::now();
        while wrote.elapsed() < WRITE_EVERY {
            if stop.stopped() {
                return;
            }
            std::thread::sleep(tick);
        }
    }
}

/// What one frame teaches about `mac`'s address.
#[derive(Debug, PartialEq, Eq)]
enum Lesson {
    /// The address, until the unix second given.
    Learn(Ipv4Addr, u64),
    Forget,
}

/// What the snooper remembers of the DHCP conversation, to tell a
/// server's answer from anyone else's.
#[derive(Debug, Default)]
struct Conversation {
    /// The xid of the guest's last REQUEST, and the server it addressed
    /// (its server-id option, or the address it was unicast to; `None`
    /// when it asked any server, as a rebooting client does).
    request: Option<(u32, Option<Ipv4Addr>)>,
    /// The server that granted the lease now learned.
    granted_by: Option<Ipv4Addr>,
}

/// A unicast address a host could use (not 0.0.0.0, broadcast,
/// multicast, loopback or link-local).
fn usable(ip: Ipv4Addr) -> bool {
    !(ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_loopback()
        || ip.is_link_local())
}

fn server_id(m: &Message) -> Option<Ipv4Addr> {
    m.option(option::SERVER_ID)
        .filter(|d| d.len() == 4)
        .map(|d| Ipv4Addr::new(d[0], d[1], d[2], d[3]))
}

/// What `frame` teaches about `mac`'s address; `to_guest` says the tap
/// sent it (it came from the site) rather than received it (from the
/// guest). See the module's rules.
fn lesson(
    frame: &[u8],
    to_guest: bool,
    mac: [u8; 6],
    talk: &mut Conversation,
    now: u64,
) -> Option<Lesson> {
    let ethertype = frame.get(12..14)?;
    if to_guest {
        return from_site(frame, mac, talk, now);
    }
    if frame.get(6..12)? != mac {
        return None;
    }
    if ethertype != [0x08, 0x00] {
        return None;
    }
    if let Ok(f) = Frame::parse(frame)
        && f.src_port == CLIENT_PORT
        && f.dst_port == SERVER_PORT
    {
        let m = Message::parse(f.payload)
            .ok()
            .filter(|m| m.op == 1 && m.chaddr == mac)?;
        return match m.kind()? {
            Kind::Request => {
                let server = server_id(&m).or((!f.dst_ip.is_broadcast()).then_some(f.dst_ip));
                talk.request = Some((m.xid, server));
                None
            }
            Kind::Release | Kind::Decline => Some(Lesson::Forget),
            _ => None,
        };
    }
    None
}

/// A frame from the site side: only the server's answer to the guest's
/// own REQUEST counts.
fn from_site(frame: &[u8], mac: [u8; 6], talk: &mut Conversation, now: u64) -> Option<Lesson> {
    let f = Frame::parse(frame).ok()?;
    if f.src_port != SERVER_PORT || f.dst_port != CLIENT_PORT {
        return None;
    }
    let m = Message::parse(f.payload)
        .ok()
        .filter(|m| m.op == 2 && m.chaddr == mac)?;
    let (xid, asked) = talk.request?;
    let server = server_id(&m)?;
    if m.xid != xid || asked.is_some_and(|a| a != server) {
        return None;
    }
    match m.kind()? {
        Kind::Ack if usable(m.yiaddr) => {
            let secs = m
                .option(option::LEASE_TIME)
                .filter(|d| d.len() == 4)
                .map_or(MAX_LEASE_SECS, |d| {
                    u64::from(u32::from_be_bytes([d[0], d[1], d[2], d[3]]))
                })
                .min(MAX_LEASE_SECS);
            talk.granted_by = Some(server);
            Some(Lesson::Learn(m.yiaddr, now + secs))
        }
        Kind::Nak if talk.granted_by.is_none_or(|g| g == server) => {
            talk.granted_by = None;
            Some(Lesson::Forget)
        }
        _ => None,
    }
}

/// How the guard is told the tap's address changed: `(old, new)`.
pub type Rebind = Box<dyn Fn(Option<Ipv4Addr>, Option<Ipv4Addr>) + Send>;

/// How often a lease's end is looked for when no frame comes.
const EXPIRY_CHECK: Duration = Duration::from_secs(1);

/// The `snoop-<tap>` thread; stopped and joined on drop.
pub struct Snooper {
    /// The address the guard lets the tap send from now.
    bound: Arc<Mutex<Option<Ipv4Addr>>>,
    _thread: OwnedThread,
}

impl Snooper {
    /// Snoops `iface`, the tap of the second NIC `mac`, and calls `rebind`
    /// each time the address it may send from changes (at once, for a
    /// lease learned before a restart).
    pub fn start(
        iface: &str,
        mac: Mac,
        learned: Arc<Learned>,
        rebind: Rebind,
    ) -> std::io::Result<Snooper> {
        let (key, mac) = (mac.to_string(), mac.octets());
        let socket = PacketSocket::open_dhcp(iface, Some(Duration::from_millis(200)))?;
        let bound: Arc<Mutex<Option<Ipv4Addr>>> = Arc::default();
        let follow = {
            let (bound, learned, key) = (Arc::clone(&bound), Arc::clone(&learned), key.clone());
            move || {
                let now = learned.get(&key);
                let mut bound = bound.lock();
                if *bound != now {
                    rebind(*bound, now);
                    *bound = now;
                }
            }
        };
        follow();
        let thread = OwnedThread::spawn(format!("snoop-{iface}"), 128 * 1024, None, move |stop| {
            let mut buf = vec![0u8; 2048];
            let mut talk = Conversation::default();
            let mut checked = std::time::Instant::now();
            while !stop.stopped() {
                if checked.elapsed() >= EXPIRY_CHECK {
                    follow();
                    checked = std::time::Instant::now();
                }
                let (n, to_guest) = match socket.recv_with_direction(&mut buf) {
                    Ok(got) => got,
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                        ) =>
                    {
                        continue;
                    }
                    Err(_) => return, // the tap is gone
                };
                match lesson(&buf[..n], to_guest, mac, &mut talk, now_unix()) {
                    Some(Lesson::Learn(ip, until)) => learned.set(
                        &key,
                        Entry {
                            ip,
                            expires: Some(until),
                        },
                    ),
                    Some(Lesson::Forget) => learned.forget(&key),
                    None => continue,
                }
                follow();
            }
        })?;
        Ok(Snooper {
            bound,
            _thread: thread,
        })
    }

    /// Stops the thread; the address the guard lets the tap send from,
    /// which nothing changes any more.
    pub fn end(self) -> Option<Ipv4Addr> {
        let Snooper { bound, _thread } = self;
        drop(_thread);
        *bound.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::dhcp::codec::build_frame;

    /// What `frame`, on its way to the guest, teaches.
    fn to_guest(frame: &[u8], talk: &mut Conversation) -> Option<Lesson> {
        lesson(frame, true, MAC, talk, NOW)
    }

    /// What `frame`, from the guest, teaches.
    fn from_guest(frame: &[u8], talk: &mut Conversation) -> Option<Lesson> {
        lesson(frame, false, MAC, talk, NOW)
    }

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 5];
    const SERVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
    const GRANTED: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 7);
    const NOW: u64 = 1_000_000;

    /// A server's answer of `kind`, from `server`, to transaction `xid`.
    fn reply(kind: Kind, xid: u32, server: Ipv4Addr, lease: u32) -> Vec<u8> {
        let m = Message {
            yiaddr: GRANTED,
            options: vec![
                (option::MESSAGE_TYPE, vec![kind.byte()]),
                (option::SERVER_ID, server.octets().to_vec()),
                (option::LEASE_TIME, lease.to_be_bytes().to_vec()),
            ],
            ..Message::new(2, xid, MAC)
        };
        build_frame(
            [2, 9, 9, 9, 9, 9],
            MAC,
            (server, 67),
            (GRANTED, 68),
            &m.encode(),
        )
    }

    /// The guest's REQUEST of transaction `xid` to `server`.
    fn request(xid: u32, server: Ipv4Addr) -> Vec<u8> {
        let m = Message {
            options: vec![
                (option::MESSAGE_TYPE, vec![Kind::Request.byte()]),
                (option::SERVER_ID, server.octets().to_vec()),
            ],
            ..Message::new(1, xid, MAC)
        };
        build_frame(
            MAC,
            [0xff; 6],
            (Ipv4Addr::UNSPECIFIED, 68),
            (Ipv4Addr::BROADCAST, 67),
            &m.encode(),
        )
    }

    /// A conversation in which the guest asked `SERVER` in transaction 7.
    fn asked() -> Conversation {
        let mut talk = Conversation::default();
        assert_eq!(from_guest(&request(7, SERVER), &mut talk), None);
        talk
    }

    fn arp(ether_src: [u8; 6], sender: Ipv4Addr) -> Vec<u8> {
        crate::net::packet::arp_frame(
            2,
            Some(ether_src),
            (MAC, sender),
            ([0xff; 6], Ipv4Addr::new(192, 0, 2, 254)),
        )
    }

    #[test]
    fn the_servers_ack_to_the_guests_request_teaches_the_address_and_lease() {
        let mut talk = asked();

        let got = to_guest(&reply(Kind::Ack, 7, SERVER, 600), &mut talk);

        assert_eq!(got, Some(Lesson::Learn(GRANTED, NOW + 600)));
    }

    #[test]
    fn an_ack_the_guest_sends_teaches_nothing() {
        let mut talk = asked();

        let got = from_guest(&reply(Kind::Ack, 7, SERVER, 600), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn an_ack_to_no_request_of_the_guests_teaches_nothing() {
        let mut talk = asked();

        let got = to_guest(&reply(Kind::Ack, 8, SERVER, 600), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn an_ack_from_a_server_the_guest_did_not_ask_teaches_nothing() {
        let mut talk = asked();
        let other = Ipv4Addr::new(192, 0, 2, 66);

        let got = to_guest(&reply(Kind::Ack, 7, other, 600), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn a_lease_of_forever_is_believed_for_a_day() {
        let mut talk = asked();

        let got = to_guest(&reply(Kind::Ack, 7, SERVER, u32::MAX), &mut talk);

        assert_eq!(got, Some(Lesson::Learn(GRANTED, NOW + MAX_LEASE_SECS)));
    }

    #[test]
    fn a_nak_from_the_granting_server_forgets() {
        let mut talk = asked();
        to_guest(&reply(Kind::Ack, 7, SERVER, 600), &mut talk);
        from_guest(&request(9, SERVER), &mut talk);

        let got = to_guest(&reply(Kind::Nak, 9, SERVER, 0), &mut talk);

        assert_eq!(got, Some(Lesson::Forget));
    }

    #[test]
    fn a_nak_from_a_third_party_changes_nothing() {
        let mut talk = asked();
        to_guest(&reply(Kind::Ack, 7, SERVER, 600), &mut talk);
        let rogue = Ipv4Addr::new(192, 0, 2, 66);
        // Even one that names the guest's current transaction.
        from_guest(&request(9, rogue), &mut talk);

        let got = to_guest(&reply(Kind::Nak, 9, rogue, 0), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn arp_from_the_site_claiming_the_vms_mac_teaches_nothing() {
        let mut talk = Conversation::default();

        let got = to_guest(&arp(MAC, GRANTED), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn arp_from_the_guest_with_its_own_mac_teaches_nothing() {
        // Else a guest picks the address the site guard lets it send from.
        let mut talk = Conversation::default();

        let got = from_guest(&arp(MAC, GRANTED), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn ipv4_from_the_guest_teaches_nothing() {
        let mut talk = Conversation::default();
        let frame = build_frame(MAC, [0xff; 6], (SERVER, 5000), (GRANTED, 5000), b"x");

        let got = from_guest(&frame, &mut talk);

        assert_eq!(got, None);
    }

    /// The address granted until `expires` (unix seconds), learned for
    /// MAC "m", read back.
    fn learned_and_read_back(expires: Option<u64>) -> Option<Ipv4Addr> {
        let dir = tempfile::tempdir().expect("tempdir");
        let learned = Learned::open(&dir.path().join("l.json"));
        learned.set(
            "m",
            Entry {
                ip: GRANTED,
                expires,
            },
        );
        learned.get("m")
    }

    #[test]
    fn an_entry_without_a_lease_end_is_not_believed() {
        // What an older agent learned from traffic.
        let read = learned_and_read_back(None);

        assert_eq!(read, None);
    }

    #[test]
    fn arp_whose_frame_and_sender_macs_differ_teaches_nothing() {
        let mut talk = Conversation::default();

        let got = from_guest(&arp([2, 0, 0, 0, 0, 6], GRANTED), &mut talk);

        assert_eq!(got, None);
    }

    #[test]
    fn an_expired_lease_reads_as_nothing() {
        let read = learned_and_read_back(Some(1));

        assert_eq!(read, None);
    }

    #[test]
    fn a_thousand_changes_are_written_a_few_times_and_the_last_one_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("l.json");
        let learned = Arc::new(Learned::open(&path));
        let writer = Writer::start(Arc::clone(&learned)).expect("writer");

        for n in 0..1000u32 {
            let ip = Ipv4Addr::from(0x0a00_0000 + n);
            learned.set(
                "m",
                Entry {
                    ip,
                    expires: Some(u64::MAX),
                },
            );
        }
        drop(writer);

        assert!(learned.writes() <= 3, "{} writes", learned.writes());
        assert_eq!(
            Learned::open(&path).get("m"),
            Some(Ipv4Addr::from(0x0a00_0000 + 999))
        );
    }
}
