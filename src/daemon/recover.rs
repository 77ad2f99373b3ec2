//! Start-up recovery: what the previous agent (killed at any point) or the
//! host (rebooted) left, repaired in one place, in an order that matters.
//! Each step repairs one kind of leftover and must come before the next:
//!
//! 1. **Lock the state dir** (`Store::open_within`). First of all: two
//!    agents recovering one state dir would each undo the other's work. A
//!    lock held by another process is waited for, [`LOCK_PATIENCE`] at
//!    most, saying who holds it: an agent restarted the moment its
//!    predecessor died may find the lock not yet let go, and one that
//!    exited then would leave the host unreported until restarted. The
//!    records are read here; stray temp files are never read as records.
//!    Then **claim** this state dir's VMM ids and cgroup root against the
//!    host's other agents (`state::claim`), before anything uses either:
//!    step 4 removes the cgroups of no VM under the root it is given.
//! 2. **Sweep** every directory the agent writes (the root, each VM's,
//!    `net/`, `volumes/`, `images/`): temp files of interrupted atomic
//!    writes, VM directories caught mid-delete, partial image downloads.
//!    Before any writer starts, since a writer's own temp file would look
//!    the same; and before the network loads its address map from `net/`.
//! 3. **Bring the host network up** (bridge, forwarding, the NAT table,
//!    the address map). Before any tap is plugged into it, the adopted
//!    VMMs' included.
//! 4. **Remove leaked taps** with this agent's prefix that no live VMM
//!    holds. Before adoption re-plugs the live ones and before any boot
//!    opens a tap of the same name.
//! 5. **Adopt the VMMs that outlived the last agent**, found by their
//!    command lines whatever their pidfiles say: those a record or the last
//!    desired state explains are watched and their networks served again;
//!    the rest are stopped, and `status` says so. Before the engine's first
//!    step, so a VMM that is alive is seen as running, never started twice.
//! 6. (In `Engine::new`, after this:) the compute ledger is rebuilt from
//!    the records, so the first step's admissions count every VM.
//!
//! Steps 4 and 5 are the backend's (`Lifecycle::recover`), since only it
//! knows what it leaves on a host.

use std::sync::Arc;

use super::DaemonError;
use crate::config::Config;
#[cfg(target_os = "linux")]
use crate::error::chain;
use crate::image::ImageCache;
#[cfg(target_os = "linux")]
use crate::net::host::HostNetwork;
use crate::provision::Lifecycle;
use crate::state::Store;

/// How long a new agent waits for a state dir another process holds
/// before it refuses to start (step 1).
pub const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// What recovery hands the daemon: the locked, swept store, and the parts
/// that now reflect the host as it is.
pub struct Recovered {
    pub store: Arc<Store>,
    pub images: Arc<ImageCache>,
    pub provisioner: Arc<dyn Lifecycle>,
    /// Lasting facts for `status` (e.g. networking is off, and why).
    pub notes: Vec<String>,
}

/// The underlay with the control plane's and the proxy's addresses added
/// to what guests may not reach: a guest has no business with either, and
/// a control plane that trusts its network would hear a guest as a host.
#[cfg(target_os = "linux")]
fn keep_from_guests(
    mut underlay: crate::net::underlay::UnderlayConfig,
    config: &Config,
) -> crate::net::underlay::UnderlayConfig {
    use crate::model::Cidr;
    let mut urls: Vec<&str> = Vec::new();
    if let crate::config::DesiredSource::ControlPlane(cp) = &config.source.desired {
        urls.push(&cp.base_url);
    }
    urls.extend(config.source.proxy.as_deref());
    for url in urls {
        let found = crate::source::url_addresses(url);
        if found.is_empty() {
            log::warn!("cannot resolve {url} now: guests are not kept from its address");
        }
        underlay
            .egress
            .deny
            .extend(found.into_iter().map(Cidr::host));
    }
    underlay
}

/// Step 3 on Linux: the underlay and the host networks, or why not (in
/// `notes`).
#[cfg(target_os = "linux")]
fn host_network(
    config: &Config,
    guest: &crate::provision::GuestBoot,
    store: &Store,
    guest_dns: Vec<std::net::Ipv4Addr>,
    notes: &mut Vec<String>,
) -> Option<Arc<HostNetwork>> {
    match guest.underlay.clone() {
        None => {
            notes.push("guest networking is off (--underlay-bridge is empty or none)".to_owned());
            None
        }
        Some(underlay) => match HostNetwork::setup(
            keep_from_guests(underlay, config),
            store.layout(),
            guest_dns,
            guest.host_networks.clone(),
        ) {
            Ok(n) => {
                if n.turned_on_forwarding() {
                    note_forwarding(config, notes);
                }
                if n.nat() == crate::net::underlay::Nat::HostOnly {
                    notes.push(
                        "guest networking is host-only: neither nft nor iptables is installed"
                            .to_owned(),
                    );
                }
                if !n.nat().guards() {
                    notes.push(crate::net::underlay::UNGUARDED.to_owned());
                }
                Some(Arc::new(n))
            }
            // Without its network a VM still boots; the log, `status` and
            // the VM's missing address say why it is unreachable.
            Err(e) => {
                let why = chain(&*e as &dyn std::error::Error);
                log::error!("guest networking is off: {why}");
                notes.push(format!("guest networking is off: {why}"));
                None
            }
        },
    }
}

/// Notes in the agents' registry that this agent turned the host's IPv4
/// forwarding on, so the last `release` turns it off again; a note that
/// cannot be written is said (forwarding then stays on after release).
#[cfg(target_os = "linux")]
fn note_forwarding(config: &Config, notes: &mut Vec<String>) {
    let files = crate::state::claim::Files {
        state_dir: &config.state.dir,
        registry: &config.state.agents_dir,
    };
    if let Err(e) = crate::state::claim::note_forwarding_turned_on(files) {
        let note = format!(
            "this agent turned IPv4 forwarding on but cannot note it in the agents' registry ({e}): release will leave it on"
        );
        log::warn!("{note}");
        notes.push(note);
    }
}

/// How guests boot, with the VMM ids and cgroup root this state dir holds
/// (step 1).
fn claimed(config: &Config) -> Result<crate::provision::GuestBoot, DaemonError> {
    use crate::state::claim;
    let files = claim::Files {
        state_dir: &config.state.dir,
        registry: &config.state.agents_dir,
    };
    let claim = claim::settle(
        files,
        &config.wish,
        &crate::provision::reclaimer(&config.guest.confinement.devices()),
    )
    .map_err(DaemonError::Claim)?;
    claim::check_host_accounts(claim.first_id, claim.id_count).map_err(DaemonError::Claim)?;
    log::info!(
        "VMM ids {}:{} and cgroup root {:?} are this agent's",
        claim.first_id,
        claim.id_count,
        claim.cgroup_root
    );
    let mut guest = config.guest.clone();
    // The claim settles what the flags left to it: one new section, which
    // the backend then shares.
    guest.confinement = std::sync::Arc::new(crate::provision::Confinement {
        first_id: claim.first_id,
        id_count: claim.id_count,
        cgroup_root: claim.cgroup_root,
        ..(*config.guest.confinement).clone()
    });
    if let (Some(underlay), Some(network)) = (guest.underlay.as_mut(), claim.network) {
        log::info!(
            "bridge {}, firewall tables {:?} and taps {}… are this agent's",
            network.bridge,
            network.table,
            network.tap_prefix
        );
        underlay.table = network.table;
    }
    Ok(guest)
}

/// Runs the steps of the module, in order. `guest_dns` is what guests are
/// told (the flag's list, or the host's own resolvers).
pub fn recover(
    config: &Config,
    guest_dns: Vec<std::net::Ipv4Addr>,
) -> Result<Recovered, DaemonError> {
    // 1.
    let store =
        Arc::new(Store::open_within(&config.state.dir, LOCK_PATIENCE).map_err(DaemonError::Store)?);
    let guest = claimed(config)?;
    // 2.
    let images = Arc::new(ImageCache::with(
        store.layout().images(),
        &config.images.fetch,
    ));
    let swept = store.sweep();
    let partials = images.sweep_partials();
    if swept.temp_files + swept.half_deleted_vms + partials > 0 {
        log::info!(
            "recovered: {} stray temp file(s), {} half-deleted VM dir(s), {partials} partial download(s) removed",
            swept.temp_files,
            swept.half_deleted_vms
        );
    }
    // 3.
    let mut notes = Vec::new();
    #[cfg(target_os = "linux")]
    let network = host_network(config, &guest, &store, guest_dns, &mut notes);
    #[cfg(not(target_os = "linux"))]
    {
        let _ = guest_dns;
        notes.push(
            "guest networking is the hypervisor's own NAT on this platform (--underlay-bridge and --host-network are Linux's)"
                .to_owned(),
        );
    }
    // 4. and 5.
    #[cfg(target_os = "linux")]
    let provisioner = crate::provision::for_host(Arc::clone(&store), &guest, network);
    #[cfg(not(target_os = "linux"))]
    let provisioner = crate::provision::for_host(Arc::clone(&store), &guest);
    let mut known: Vec<crate::model::Id> = store.load_all().keys().cloned().collect();
    if let Ok(Some(last)) = super::last::load(&store.layout().last_snapshot()) {
        known.extend(
            crate::pb::convert::snapshot_from_wire(&last)
                .vms
                .iter()
                .map(|w| w.id().clone()),
        );
    }
    notes.extend(provisioner.recover(&known));
    Ok(Recovered {
        store,
        images,
        provisioner,
        notes,
    })
}
