//! What an agent takes of the host's shared namespaces: its range of VMM
//! user and group ids, its cgroup root and, with guest networking on, its
//! bridge, underlay subnet, tap prefix and firewall tables. Two agents on
//! one host (two state dirs) that shared any of them would hand one uid to
//! VMMs of different tenants, remove each other's cgroups at start, or
//! replace each other's firewall tables (and with them every guard on the
//! other's guests); so each state dir claims its own, recorded host-wide.
//!
//! 1. The state dir's own claim (`jail/claim.json`) is its choice for good:
//!    its VMMs' ids are leased from that range and its cgroups live under
//!    that root, however the host's other agents come and go.
//! 2. Without one: a state dir an older agent already used (it has VMM id
//!    leases) or the default state dir takes the historic defaults
//!    (`1900000000:65536`, `eitri`); any other takes a slot derived from its
//!    path, probing to the next slot while another agent holds it.
//! 3. `--vmm-ids` and `--cgroup-root`, when given, win over both. The
//!    network is the flags' (`--underlay-bridge`, `--underlay-subnet`,
//!    `--tap-prefix`) at every start; its firewall tables are named after
//!    the cgroup root (`eitri` for the historic one), so they are as much
//!    this agent's alone as its cgroups.
//! 4. Under a lock on the host-wide registry (`--agents-dir`, one record per
//!    state dir), the result is checked against every other agent's record
//!    (records of state dirs that no longer exist are dropped): an overlap
//!    of id ranges, one cgroup root inside another or, in one network
//!    namespace, one bridge, overlapping subnets or one tap prefix starting
//!    another stops the start naming the other state dir and every flag to
//!    change (see `clash`). [`refusal`] asks the same without the lock and
//!    writes nothing, for `check`.
//! 5. The claim is written to the state dir, then to the registry.
//!
//! A claim ends when its state dir is gone (the next agent to settle finds
//! its record and takes back what it left: see [`Reclaim`]) or when the
//! operator releases it ([`release`], `eitri-agent release`). Until then
//! its device ACL entries and cgroup root stay: an agent that is only
//! stopped keeps them for its next start, and its VMMs may still run.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::atomic::write_atomic;
use crate::model::Cidr;

mod accounts;
mod clash;
mod forwarding;
mod registry;

pub use accounts::{Accounts, accounts_overlap, check_host_accounts};
pub use clash::this_netns;
pub use forwarding::{note_turned_on as note_forwarding_turned_on, noted as forwarding_noted};
pub use registry::{Holding, Listed, list};
use registry::{end, lock_registry, read_own, record_name, records, slot_of};

/// The historic defaults, slot 0: the default state dir's, and any state
/// dir an agent used before claims existed.
pub const LEGACY_FIRST_ID: u32 = 1_900_000_000;
pub const LEGACY_ID_COUNT: u32 = 65_536;
pub const LEGACY_CGROUP_ROOT: &str = "eitri";

/// Slots after the legacy one: each a range of [`LEGACY_ID_COUNT`] ids
/// after [`LEGACY_FIRST_ID`], all below 2^31: `ps` and other tools print
/// an id past it as `2849903+`, and some take it for a negative number.
/// (A claim already recorded past it, by an agent before this bound, is
/// kept as recorded.)
const SLOTS: u32 = 3_775;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The state dir, canonical.
    pub state_dir: PathBuf,
    pub first_id: u32,
    pub id_count: u32,
    pub cgroup_root: String,
    /// Its guest network; `None` with networking off (and in records of
    /// agents older than it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

/// An agent's guest network, as far as other agents must keep clear of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Network {
    pub bridge: String,
    /// The underlay subnet, kept on disk as `[first address, prefix
    /// length]`, as every agent's record has it.
    #[serde(with = "as_pair")]
    pub subnet: Cidr,
    pub tap_prefix: String,
    /// Its nft tables' name (ip and bridge), and its iptables chains': the
    /// claim's to name ([`table_of`]), whatever a [`Wish`] says.
    pub table: String,
    /// The network namespace the agent runs in (`net:[inode]`): bridges,
    /// taps, tables and routes are each namespace's own, so two agents in
    /// different ones never meet there. Empty in records of agents older
    /// than it, which are taken to share every namespace.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub netns: String,
}

/// What the operator asked for, and what the state dir is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wish {
    /// `--vmm-ids`, when given.
    pub ids: Option<(u32, u32)>,
    /// `--cgroup-root`, when given.
    pub cgroup_root: Option<String>,
    /// The state dir is the default one.
    pub default_state_dir: bool,
    /// The guest network the flags name, when it is on.
    pub network: Option<Network>,
}

/// The firewall tables' name of the agent whose cgroup root is `root`: the
/// historic `eitri` for the historic root, `eitri_N` for slot N's, and a
/// digest of any other (nft names take letters, digits and `_`, and an
/// iptables chain named after it must stay under 29 bytes).
pub fn table_of(root: &str) -> String {
    if root == LEGACY_CGROUP_ROOT {
        return LEGACY_CGROUP_ROOT.to_owned();
    }
    match root
        .strip_prefix(LEGACY_CGROUP_ROOT)
        .and_then(|rest| rest.strip_prefix('-'))
        .filter(|n| n.parse::<u32>().is_ok_and(|n| n > 0 && n <= SLOTS))
    {
        Some(n) => format!("{LEGACY_CGROUP_ROOT}_{n}"),
        None => {
            let d = Sha256::digest(root.as_bytes());
            format!("{LEGACY_CGROUP_ROOT}_{}", crate::hex::encode(&d[..4]))
        }
    }
}

impl Claim {
    fn slot(state_dir: &Path, n: u32) -> Claim {
        Claim {
            state_dir: state_dir.to_path_buf(),
            first_id: LEGACY_FIRST_ID + n * LEGACY_ID_COUNT,
            id_count: LEGACY_ID_COUNT,
            cgroup_root: if n == 0 {
                LEGACY_CGROUP_ROOT.into()
            } else {
                format!("{LEGACY_CGROUP_ROOT}-{n}")
            },
            network: None,
        }
    }
}

/// A subnet as a record holds it: `["10.0.0.0", 16]`.
mod as_pair {
    use std::net::Ipv4Addr;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::model::Cidr;

    pub fn serialize<S: Serializer>(cidr: &Cidr, s: S) -> Result<S::Ok, S::Error> {
        (cidr.network, cidr.prefix).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Cidr, D::Error> {
        let (network, prefix) = <(Ipv4Addr, u8)>::deserialize(d)?;
        if prefix > 32 {
            return Err(serde::de::Error::custom(format!(
                "prefix /{prefix} is longer than 32"
            )));
        }
        Ok(Cidr { network, prefix })
    }
}

/// Takes back from the host what an ended claim left there (its VMM
/// group's device ACL entries, its cgroup root). The state dir knows when a
/// claim ends; the jail knows what it put where. Called under the
/// registry's lock, so no agent settles the same ids or root meanwhile.
pub trait Reclaim {
    fn take_back(&self, ended: &Claim) -> Reclaimed;

    /// Turns the host's IPv4 forwarding off (the last agent with guests is
    /// released, and an agent had turned it on); `None`: this reclaimer
    /// leaves the host's network as it is.
    fn stop_forwarding(&self) -> Option<Result<(), String>> {
        None
    }
}

/// What [`Reclaim::take_back`] took, and what it had to leave (each with
/// why): a claim with something left keeps its record, to be tried again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    pub taken: Vec<String>,
    pub left: Vec<String>,
}

/// Why a claim could not be settled or released.
#[derive(Debug)]
pub enum ClaimError {
    Conflict(String),
    Registry {
        path: PathBuf,
        source: io::Error,
    },
    Own {
        path: PathBuf,
        problem: String,
    },
    /// The claim file in the state dir could not be written (or removed):
    /// the state dir's filesystem, not the registry's, is the one to see.
    Write {
        path: PathBuf,
        source: io::Error,
    },
    /// `release` of a state dir no claim names.
    NotClaimed {
        state_dir: PathBuf,
    },
    /// The VMM ids `first:count` hold an account of the host (`what`, a
    /// line of `path`): a VMM would run as it.
    Accounts {
        first: u32,
        count: u32,
        what: String,
        path: &'static str,
    },
    /// `release` could not take everything back.
    Left {
        state_dir: PathBuf,
        left: Vec<String>,
    },
}

impl std::fmt::Display for ClaimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClaimError::Conflict(why) => f.write_str(why),
            ClaimError::Registry { path, source } => write!(
                f,
                "cannot use the agents' registry {}: {source} (--agents-dir)",
                path.display()
            ),
            ClaimError::Own { path, problem } => write!(
                f,
                "{} is not a claim ({problem}); move it away to have the claim made again",
                path.display()
            ),
            ClaimError::Write { path, source } => {
                write!(f, "cannot write {}: {source}", path.display())
            }
            ClaimError::NotClaimed { state_dir } => write!(
                f,
                "{} holds no claim (no jail/claim.json, no record in the registry): nothing to release; is --agents-dir the agent's?",
                state_dir.display()
            ),
            ClaimError::Accounts {
                first,
                count,
                what,
                path,
            } => write!(
                f,
                "--vmm-ids {first}:{count} holds {what} of {path}: a VMM would run as that account; give --vmm-ids a range clear of the host's users and subordinate ids"
            ),
            ClaimError::Left { state_dir, left } => write!(
                f,
                "the claim of {} is kept: {} (take these away and release it again)",
                state_dir.display(),
                left.join("; ")
            ),
        }
    }
}

impl std::error::Error for ClaimError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClaimError::Registry { source, .. } | ClaimError::Write { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Where a state dir's claim is kept: in the state dir (its claim file,
/// and the VMM id leases an older agent may have left there), and in the
/// host-wide registry.
#[derive(Clone, Copy, Debug)]
pub struct Files<'a> {
    pub state_dir: &'a Path,
    pub registry: &'a Path,
}

impl Files<'_> {
    /// The state dir's own claim file.
    fn own(&self) -> PathBuf {
        super::Layout::new(self.state_dir).claim()
    }

    /// The state dir's VMM id leases.
    fn leases(&self) -> PathBuf {
        super::Layout::new(self.state_dir).vmm_ids()
    }

    /// A failure of the registry's.
    fn registry_error(&self, source: io::Error) -> ClaimError {
        ClaimError::Registry {
            path: self.registry.to_path_buf(),
            source,
        }
    }

    /// The state dir as its claim names it, and the registry's lock, held
    /// until dropped.
    fn locked(&self) -> Result<(PathBuf, fs::File), ClaimError> {
        let reg_err = |e| self.registry_error(e);
        let state_dir = fs::canonicalize(self.state_dir).map_err(reg_err)?;
        let lock = lock_registry(self.registry).map_err(reg_err)?;
        Ok((state_dir, lock))
    }
}

/// Settles this state dir's claim (see the module steps), after taking
/// back what the claims of state dirs that are gone left.
pub fn settle(files: Files<'_>, wish: &Wish, reclaim: &dyn Reclaim) -> Result<Claim, ClaimError> {
    let (own, registry) = (files.own(), files.registry);
    let reg_err = |e| files.registry_error(e);
    let recorded = read_own(&own)?;
    let (state_dir, _lock) = files.locked()?;
    let (live, ended) = records(registry).map_err(reg_err)?;
    for (record, claim) in ended {
        end(&record, &claim, reclaim);
    }
    let others = others_than(&state_dir, live);
    let claim = chosen(&files, wish, &state_dir, recorded, &others)?;
    let text = serde_json::to_vec_pretty(&claim).map_err(|e| reg_err(io::Error::other(e)))?;
    let own_err = |source| ClaimError::Write {
        path: own.clone(),
        source,
    };
    if let Some(dir) = own.parent() {
        super::perms::make_dir(dir).map_err(own_err)?;
    }
    write_atomic(&own, &text).map_err(own_err)?;
    write_atomic(&registry.join(record_name(&state_dir)), &text).map_err(reg_err)?;
    Ok(claim)
}

/// Why a start on the state dir with `wish` would be refused by the
/// claims the host's live agents hold now; `None` when it would not be.
/// Read without any lock, and nothing written: for `check`, beside a
/// running agent or not.
pub fn refusal(files: Files<'_>, wish: &Wish) -> Result<Option<String>, ClaimError> {
    let recorded = read_own(&files.own())?;
    let state_dir = fs::canonicalize(files.state_dir).unwrap_or_else(|_| files.state_dir.into());
    let live = match records(files.registry) {
        Ok((live, _)) => live,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(files.registry_error(e)),
    };
    let others = others_than(&state_dir, live);
    match chosen(&files, wish, &state_dir, recorded, &others) {
        Ok(_) => Ok(None),
        Err(ClaimError::Conflict(why)) => Ok(Some(why)),
        Err(e) => Err(e),
    }
}

/// The live agents' claims but `state_dir`'s own.
fn others_than(state_dir: &Path, live: registry::Records) -> Vec<Claim> {
    live.into_iter()
        .map(|(_, claim)| claim)
        .filter(|c| c.state_dir != state_dir)
        .collect()
}

/// The claim a start takes beside `others`: its recorded one as `wish`
/// reshapes it, else its slot; refused when it meets another's.
fn chosen(
    files: &Files<'_>,
    wish: &Wish,
    state_dir: &Path,
    recorded: Option<Claim>,
    others: &[Claim],
) -> Result<Claim, ClaimError> {
    let netns = this_netns();
    let shaped = |mut claim: Claim| {
        claim.state_dir = state_dir.to_path_buf();
        if let Some((first, count)) = wish.ids {
            claim.first_id = first;
            claim.id_count = count;
        }
        if let Some(root) = &wish.cgroup_root {
            claim.cgroup_root.clone_from(root);
        }
        claim.network = wish.network.clone().map(|n| Network {
            table: table_of(&claim.cgroup_root),
            netns: netns.clone(),
            ..n
        });
        claim
    };
    let first_conflict = |claim: &Claim| others.iter().find_map(|o| claim.conflict(o));
    let claim = match recorded {
        Some(claim) => shaped(claim),
        None if wish.default_state_dir || files.leases().exists() => {
            shaped(Claim::slot(state_dir, 0))
        }
        None => {
            // A new state dir: its path's slot, or the next one free.
            let start = slot_of(state_dir);
            (0..SLOTS)
                .map(|i| shaped(Claim::slot(state_dir, 1 + (start + i) % SLOTS)))
                .find(|c| first_conflict(c).is_none())
                .unwrap_or_else(|| shaped(Claim::slot(state_dir, 1 + start)))
        }
    };
    match first_conflict(&claim) {
        Some(why) => Err(ClaimError::Conflict(why)),
        None => Ok(claim),
    }
}

/// What a start on `state_dir` would claim of ids and cgroup root, as far
/// as it can be told without taking the registry's lock, and why: its
/// recorded claim; else the historic slot (the default state dir, or one
/// an older agent used); else its path's slot, which a start moves past
/// while another agent holds it. For `eitri-agent config`.
pub fn foreseen(state_dir: &Path, default_state_dir: bool) -> (Claim, &'static str) {
    let layout = super::Layout::new(state_dir);
    let canonical = fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    if let Ok(Some(claim)) = read_own(&layout.claim()) {
        return (claim, "claim");
    }
    if default_state_dir || layout.vmm_ids().exists() {
        return (Claim::slot(&canonical, 0), "default");
    }
    (
        Claim::slot(&canonical, 1 + slot_of(&canonical)),
        "derived (the state dir's slot; the next free one if another agent holds it)",
    )
}

/// Ends the claim of `state_dir`: takes back what it left on the host,
/// then removes its record, its claim file and its VMM id leases (the ids
/// are free for other agents now), so a later start there claims anew.
/// The caller makes sure its agent is not running and says what VMs it
/// leaves. Kept whole when anything could not be taken back.
pub fn release(files: Files<'_>, reclaim: &dyn Reclaim) -> Result<Reclaimed, ClaimError> {
    let (own, leases) = (files.own(), files.leases());
    let reg_err = |e| files.registry_error(e);
    let (state_dir, _lock) = files.locked()?;
    let record = files.registry.join(record_name(&state_dir));
    let claim = match read_own(&own)? {
        Some(claim) => claim,
        None => match fs::read(&record) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| ClaimError::Own {
                path: record.clone(),
                problem: e.to_string(),
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ClaimError::NotClaimed { state_dir });
            }
            Err(e) => return Err(reg_err(e)),
        },
    };
    let mut reclaimed = reclaim.take_back(&claim);
    if reclaimed.left.is_empty() {
        forwarding::after_release(files.registry, &claim, reclaim, &mut reclaimed)
            .map_err(reg_err)?;
    }
    if !reclaimed.left.is_empty() {
        return Err(ClaimError::Left {
            state_dir,
            left: reclaimed.left,
        });
    }
    for path in [&record, &own, &leases] {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) if *path == record => return Err(reg_err(e)),
            Err(source) => {
                return Err(ClaimError::Write {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
    Ok(reclaimed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_slots_ids_are_below_2_pow_31() {
        let last = super::Claim::slot(std::path::Path::new("/x"), super::SLOTS);

        let end = u64::from(last.first_id) + u64::from(last.id_count);

        assert!(end <= 1 << 31, "{end}");
    }

    use std::net::Ipv4Addr;

    use super::*;

    struct Host {
        dir: tempfile::TempDir,
        reclaim: Taking,
    }

    /// Takes back nothing of the host: notes whose claims it was asked to,
    /// and leaves what it is told to.
    #[derive(Default)]
    struct Taking {
        asked: std::sync::Mutex<Vec<Claim>>,
        leave: Vec<String>,
        /// How often it was told to turn forwarding off.
        stopped: std::sync::atomic::AtomicUsize,
    }

    impl Reclaim for Taking {
        fn take_back(&self, ended: &Claim) -> Reclaimed {
            self.asked.lock().expect("not poisoned").push(ended.clone());
            Reclaimed {
                taken: vec![format!("group {}", ended.first_id)],
                left: self.leave.clone(),
            }
        }

        fn stop_forwarding(&self) -> Option<Result<(), String>> {
            self.stopped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Some(Ok(()))
        }
    }

    impl Host {
        /// A host whose state dirs "a" and "b" take slots of their own:
        /// one time in 3,775 their paths' slots are one, and a test of
        /// another clash would meet their ids' overlap first.
        fn new() -> Host {
            loop {
                let dir = tempfile::tempdir().expect("tempdir");
                let base = fs::canonicalize(dir.path()).expect("canonical");
                if slot_of(&base.join("a")) != slot_of(&base.join("b")) {
                    return Host {
                        dir,
                        reclaim: Taking::default(),
                    };
                }
            }
        }

        fn asked(&self) -> Vec<u32> {
            let asked = self.reclaim.asked.lock().expect("not poisoned");
            asked.iter().map(|c| c.first_id).collect()
        }

        fn records(&self) -> usize {
            fs::read_dir(self.registry())
                .expect("registry")
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
                .count()
        }

        fn release(&self, name: &str) -> Result<Reclaimed, ClaimError> {
            let state = self.dir.path().join(name);
            let registry = self.registry();
            let files = Files {
                state_dir: &state,
                registry: &registry,
            };
            release(files, &self.reclaim)
        }

        fn registry(&self) -> PathBuf {
            self.dir.path().join("agents")
        }

        fn note_forwarding(&self, name: &str) {
            let state = self.dir.path().join(name);
            let registry = self.registry();
            let files = Files {
                state_dir: &state,
                registry: &registry,
            };
            note_forwarding_turned_on(files).expect("noted");
        }

        fn stopped(&self) -> usize {
            self.reclaim
                .stopped
                .load(std::sync::atomic::Ordering::SeqCst)
        }

        fn settle(&self, name: &str, wish: &Wish) -> Result<Claim, ClaimError> {
            let state = self.dir.path().join(name);
            fs::create_dir_all(&state).expect("state dir");
            let registry = self.registry();
            let files = Files {
                state_dir: &state,
                registry: &registry,
            };
            settle(files, wish, &self.reclaim)
        }
    }

    fn derived() -> Wish {
        Wish {
            ids: None,
            cgroup_root: None,
            default_state_dir: false,
            network: None,
        }
    }

    /// A wish with a guest network on `bridge`, `subnet` and taps `prefix…`.
    fn networked(bridge: &str, subnet: [u8; 4], prefix: &str) -> Wish {
        Wish {
            network: Some(Network {
                bridge: bridge.into(),
                subnet: Cidr {
                    network: Ipv4Addr::from(subnet),
                    prefix: 16,
                },
                tap_prefix: prefix.into(),
                table: String::new(),
                netns: String::new(),
            }),
            ..derived()
        }
    }

    #[test]
    fn a_network_that_meets_anothers_is_refused_naming_every_setting_to_change() {
        let host = Host::new();
        let wish = networked("eitri0", [100, 77, 0, 0], "eitri");
        host.settle("a", &wish).expect("a");

        let err = host.settle("b", &wish).expect_err("refused");

        let said = err.to_string();
        for flag in ["--underlay-bridge", "--underlay-subnet", "--tap-prefix"] {
            assert!(said.contains(flag), "{flag} not named: {said}");
        }
    }

    #[test]
    fn an_agent_in_another_network_namespace_may_take_the_same_network() {
        let host = Host::new();
        let wish = networked("eitri0", [100, 77, 0, 0], "eitri");
        host.settle("a", &wish).expect("a");
        // As if the agent of a ran in a namespace of its own.
        for entry in fs::read_dir(host.registry()).expect("registry").flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|x| x == "json") {
                let text = fs::read_to_string(&path).expect("record");
                let moved = text.replace(&this_netns(), "net:[1]");
                assert_ne!(moved, text, "the record names its namespace");
                fs::write(&path, moved).expect("record");
            }
        }

        let b = host.settle("b", &wish).expect("b");

        assert_eq!(b.network.map(|n| n.bridge).as_deref(), Some("eitri0"));
    }

    #[test]
    fn the_refusal_check_tells_what_a_start_would_meet_and_writes_nothing() {
        let host = Host::new();
        let wish = networked("eitri0", [100, 77, 0, 0], "eitri");
        host.settle("a", &wish).expect("a");
        let state = host.dir.path().join("b");
        let registry = host.registry();
        let files = || Files {
            state_dir: &state,
            registry: &registry,
        };

        let said = refusal(files(), &wish).expect("read");
        let clear = refusal(files(), &networked("eitri1", [100, 78, 0, 0], "tenb")).expect("read");

        assert!(
            said.as_ref()
                .is_some_and(|why| why.contains("--underlay-bridge")),
            "{said:?}"
        );
        assert_eq!(clear, None);
        assert_eq!(host.records(), 1);
        assert!(!state.exists());
    }

    #[test]
    fn a_registry_others_can_write_is_refused_naming_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let host = Host::new();
        fs::create_dir_all(host.registry()).expect("registry");
        fs::set_permissions(host.registry(), fs::Permissions::from_mode(0o777)).expect("chmod");

        let err = host.settle("a", &derived()).expect_err("refused");

        let said = err.to_string();
        assert!(
            said.contains("mode 777") && said.contains("chmod go-w"),
            "{said}"
        );
        assert_eq!(host.records(), 0);
    }

    #[test]
    fn a_registry_lock_that_is_a_symlink_is_not_followed() {
        let host = Host::new();
        fs::create_dir_all(host.registry()).expect("registry");
        let target = host.dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, host.registry().join(".lock")).expect("symlink");

        let err = host.settle("a", &derived()).expect_err("refused");

        assert!(!target.exists(), "root created the file a symlink named");
        assert!(err.to_string().contains("registry"), "{err}");
    }

    #[test]
    fn a_claim_file_that_cannot_be_written_is_blamed_on_the_state_dir_not_the_registry() {
        let host = Host::new();
        let state = host.dir.path().join("a");
        fs::create_dir_all(&state).expect("state dir");
        // Where the claim's directory should be, a file: its write fails.
        fs::write(state.join("jail"), b"not a directory").expect("file");

        let err = host.settle("a", &derived()).expect_err("cannot write");

        let said = err.to_string();
        assert!(said.contains("a/jail/claim.json"), "{said}");
        assert!(!said.contains("--agents-dir"), "{said}");
    }

    #[test]
    fn two_agents_networks_get_tables_of_their_own() {
        let host = Host::new();

        let a = host
            .settle("a", &networked("eitri0", [100, 77, 0, 0], "eitri"))
            .expect("a");
        let b = host
            .settle("b", &networked("eitri1", [100, 78, 0, 0], "tenb"))
            .expect("b");

        let table = |c: &Claim| c.network.as_ref().map(|n| n.table.clone());
        assert_ne!(table(&a), table(&b));
        assert_eq!(table(&a), Some(table_of(&a.cgroup_root)));
    }

    #[test]
    fn the_historic_cgroup_root_keeps_the_historic_tables() {
        assert_eq!(table_of("eitri"), "eitri");
        assert_eq!(table_of("eitri-7"), "eitri_7");
        let other = table_of("tenants/blue");
        assert!(other.starts_with("eitri_") && other.len() == 14, "{other}");
    }

    #[test]
    fn a_second_agent_on_the_same_bridge_is_refused_naming_the_flag() {
        let host = Host::new();
        host.settle("a", &networked("eitri0", [100, 77, 0, 0], "eitri"))
            .expect("a");

        let err = host
            .settle("b", &networked("eitri0", [100, 78, 0, 0], "tenb"))
            .expect_err("one bridge");

        let text = err.to_string();
        assert!(
            text.contains("bridge eitri0")
                && text.contains("--underlay-bridge")
                && text.contains("/a"),
            "{text}"
        );
    }

    #[test]
    fn a_second_agent_on_an_overlapping_subnet_is_refused_naming_the_flag() {
        let host = Host::new();
        host.settle("a", &networked("eitri0", [100, 77, 0, 0], "eitri"))
            .expect("a");
        let mut wish = networked("eitri1", [100, 77, 128, 0], "tenb");
        if let Some(n) = wish.network.as_mut() {
            n.subnet.prefix = 17;
        }

        let err = host.settle("b", &wish).expect_err("overlap");

        assert!(err.to_string().contains("--underlay-subnet"), "{err}");
    }

    #[test]
    fn a_tap_prefix_starting_another_agents_is_refused_naming_the_flag() {
        let host = Host::new();
        host.settle("a", &networked("eitri0", [100, 77, 0, 0], "eitri"))
            .expect("a");

        let err = host
            .settle("b", &networked("eitri1", [100, 78, 0, 0], "eitri2"))
            .expect_err("prefix");

        assert!(err.to_string().contains("--tap-prefix"), "{err}");
    }

    #[test]
    fn an_agent_with_networking_off_shares_nothing_of_the_network() {
        let host = Host::new();
        host.settle("a", &networked("eitri0", [100, 77, 0, 0], "eitri"))
            .expect("a");

        let b = host.settle("b", &derived()).expect("b");

        assert_eq!(b.network, None);
    }

    #[test]
    fn two_new_state_dirs_get_disjoint_ids_and_cgroup_roots() {
        let host = Host::new();

        let a = host.settle("a", &derived()).expect("a");
        let b = host.settle("b", &derived()).expect("b");

        assert!(!a.ids_overlap(&b), "{a:?} {b:?}");
        assert!(!a.cgroups_nest(&b), "{a:?} {b:?}");
    }

    #[test]
    fn a_state_dir_keeps_its_claim_across_starts() {
        let host = Host::new();
        let first = host.settle("a", &derived()).expect("first");

        let again = host.settle("a", &derived()).expect("again");

        assert_eq!(first, again);
    }

    #[test]
    fn the_default_state_dir_keeps_the_historic_defaults() {
        let host = Host::new();

        let claim = host
            .settle(
                "var-lib-eitri",
                &Wish {
                    default_state_dir: true,
                    ..derived()
                },
            )
            .expect("claim");

        assert_eq!(
            (claim.first_id, claim.id_count, claim.cgroup_root.as_str()),
            (LEGACY_FIRST_ID, LEGACY_ID_COUNT, LEGACY_CGROUP_ROOT)
        );
    }

    #[test]
    fn a_state_dir_with_leases_from_an_older_agent_keeps_the_historic_range() {
        let host = Host::new();
        let state = host.dir.path().join("old");
        fs::create_dir_all(state.join("jail")).expect("jail");
        fs::write(state.join("jail/ids.json"), "{}").expect("leases");

        let claim = host.settle("old", &derived()).expect("claim");

        assert_eq!(claim.first_id, LEGACY_FIRST_ID);
    }

    #[test]
    fn an_explicit_range_overlapping_another_agents_is_refused_naming_it() {
        let host = Host::new();
        let a = host.settle("a", &derived()).expect("a");

        let err = host
            .settle(
                "b",
                &Wish {
                    ids: Some((a.first_id + 10, 100)),
                    ..derived()
                },
            )
            .expect_err("overlap");

        let text = err.to_string();
        assert!(text.contains("--vmm-ids") && text.contains("/a"), "{text}");
    }

    #[test]
    fn an_explicit_cgroup_root_inside_another_agents_is_refused() {
        let host = Host::new();
        let a = host.settle("a", &derived()).expect("a");

        let err = host
            .settle(
                "b",
                &Wish {
                    cgroup_root: Some(format!("{}/inner", a.cgroup_root)),
                    ..derived()
                },
            )
            .expect_err("nested");

        assert!(err.to_string().contains("--cgroup-root"), "{err}");
    }

    #[test]
    fn a_claim_whose_state_dir_is_gone_is_taken_back_by_the_next_settle() {
        let host = Host::new();
        let a = host.settle("a", &derived()).expect("a");
        fs::remove_dir_all(host.dir.path().join("a")).expect("remove a");

        host.settle("b", &derived()).expect("b");

        assert_eq!(host.asked(), [a.first_id]);
        assert_eq!(host.records(), 1, "a's record is still there");
    }

    #[test]
    fn a_gone_claim_with_something_left_keeps_its_record_to_be_tried_again() {
        let mut host = Host::new();
        let a = host.settle("a", &derived()).expect("a");
        fs::remove_dir_all(host.dir.path().join("a")).expect("remove a");
        host.reclaim.leave = vec!["a cgroup with processes in it".into()];

        host.settle("b", &derived()).expect("b");
        host.settle("b", &derived()).expect("b again");

        assert_eq!(host.asked(), [a.first_id, a.first_id]);
        assert_eq!(host.records(), 2);
    }

    #[test]
    fn a_released_claim_is_taken_back_and_forgotten() {
        let host = Host::new();
        let a = host.settle("a", &derived()).expect("a");
        let jail = host.dir.path().join("a/jail");
        fs::write(jail.join("ids.json"), b"{}").expect("leases");

        let released = host.release("a").expect("released");

        assert_eq!(released.taken, [format!("group {}", a.first_id)]);
        assert_eq!(host.records(), 0);
        assert!(!jail.join("claim.json").exists(), "its claim file is left");
        assert!(!jail.join("ids.json").exists(), "its id leases are left");
    }

    #[test]
    fn the_last_networked_claim_released_turns_off_the_forwarding_an_agent_turned_on() {
        let host = Host::new();
        host.settle("a", &networked("etf0", [100, 77, 0, 0], "etfa"))
            .expect("a");
        host.note_forwarding("a");

        let released = host.release("a").expect("released");

        assert_eq!(host.stopped(), 1);
        assert!(!forwarding_noted(&host.registry()), "the note is left");
        assert!(
            released.taken.iter().any(|t| t.contains("IPv4 forwarding")),
            "{:?}",
            released.taken
        );
    }

    #[test]
    fn forwarding_stays_on_while_another_agent_has_guests() {
        let host = Host::new();
        host.settle("a", &networked("etf0", [100, 77, 0, 0], "etfa"))
            .expect("a");
        host.settle("b", &networked("etf1", [100, 78, 0, 0], "etfb"))
            .expect("b");
        host.note_forwarding("a");

        host.release("a").expect("released");

        assert_eq!(host.stopped(), 0);
        assert!(forwarding_noted(&host.registry()), "the note is gone");
        host.release("b").expect("released");
        assert_eq!(host.stopped(), 1);
    }

    #[test]
    fn forwarding_no_agent_turned_on_is_left_on() {
        let host = Host::new();
        host.settle("a", &networked("etf0", [100, 77, 0, 0], "etfa"))
            .expect("a");

        host.release("a").expect("released");

        assert_eq!(host.stopped(), 0);
    }

    #[test]
    fn a_state_dir_released_and_started_again_claims_anew() {
        let host = Host::new();
        host.settle("a", &derived()).expect("a");
        host.release("a").expect("released");

        let again = host.settle("a", &derived());

        assert!(again.is_ok(), "{again:?}");
        assert_eq!(host.records(), 1);
    }

    #[test]
    fn a_release_that_leaves_something_keeps_the_claim() {
        let mut host = Host::new();
        host.settle("a", &derived()).expect("a");
        host.reclaim.leave = vec!["a cgroup with processes in it".into()];

        let refused = host.release("a").expect_err("kept");

        assert!(refused.to_string().contains("processes in it"), "{refused}");
        assert_eq!(host.records(), 1);
        assert!(host.dir.path().join("a/jail/claim.json").exists());
    }

    #[test]
    fn releasing_a_state_dir_never_claimed_says_so() {
        let host = Host::new();
        fs::create_dir_all(host.dir.path().join("a")).expect("state dir");

        let refused = host.release("a").expect_err("nothing to release");

        assert!(
            matches!(refused, ClaimError::NotClaimed { .. }),
            "{refused}"
        );
    }

    #[test]
    fn a_record_whose_state_dir_is_gone_is_dropped() {
        let host = Host::new();
        let a = host.settle("a", &derived()).expect("a");
        fs::remove_dir_all(host.dir.path().join("a")).expect("remove a");

        let b = host
            .settle(
                "b",
                &Wish {
                    ids: Some((a.first_id, a.id_count)),
                    ..derived()
                },
            )
            .expect("a's range is free again");

        assert_eq!(b.first_id, a.first_id);
    }

    #[test]
    fn a_network_keeps_its_subnet_on_disk_as_the_pair_older_agents_wrote() {
        let older =
            r#"{"bridge":"eitri0","subnet":["10.64.0.0",16],"tap_prefix":"etr","table":"eitri"}"#;

        let network: Network = serde_json::from_str(older).expect("an older record reads");

        assert_eq!(network.subnet.to_string(), "10.64.0.0/16");
        assert_eq!(
            serde_json::to_string(&network).expect("written"),
            older,
            "written back as it was read"
        );
    }

    #[test]
    fn a_record_with_a_prefix_past_32_is_refused() {
        let garbled =
            r#"{"bridge":"eitri0","subnet":["10.64.0.0",33],"tap_prefix":"etr","table":"eitri"}"#;

        let refused = serde_json::from_str::<Network>(garbled).expect_err("refused");

        assert!(refused.to_string().contains("/33"), "{refused}");
    }
}
