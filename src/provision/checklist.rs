//! Every host requirement checked at once, each on its own line: what
//! `eitri-agent check` prints, and what the agent logs and reports at
//! start. A problem found at start does not stop the agent (it must go on
//! reporting), but it is said then, all of it, not one piece per failed
//! create.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::GuestBoot;

/// How one requirement stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// The agent works, with less (said in the detail).
    Warn,
    /// No VM can be created until it is fixed.
    Fail,
}

impl Verdict {
    fn word(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One requirement: what, how it stands, and what was found or what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub what: &'static str,
    pub verdict: Verdict,
    pub detail: String,
}

impl Item {
    fn new(what: &'static str, verdict: Verdict, detail: impl Into<String>) -> Item {
        Item {
            what,
            verdict,
            detail: detail.into(),
        }
    }
}

/// What the checks look at: the settings `run` would use.
pub struct Host<'a> {
    pub guest: &'a GuestBoot,
    pub state_dir: &'a Path,
    pub image_root: Option<&'a Path>,
    /// The registry of the host's agents (`--agents-dir`) and what this
    /// one would claim there; `None`: not checked.
    pub claim: Option<(&'a Path, &'a crate::state::claim::Wish)>,
}

/// Every check, in the order an operator fixes them.
pub fn check(host: &Host<'_>) -> Vec<Item> {
    let mut items = vec![
        hypervisor(&host.guest.hypervisor.binary),
        boot_file(host.guest),
    ];
    items.extend(devices(host.guest));
    #[cfg(target_os = "linux")]
    items.push(guest_memory(host.guest, Path::new(SHMEM_HUGE_PAGES)));
    #[cfg(target_os = "linux")]
    items.push(host_memory(host.guest, Path::new("/sys")));
    items.extend(confinement(host.guest));
    items.push(network_tools(host.guest));
    items.extend(routing(host.guest));
    items.push(image_root(host.image_root));
    items.push(state_dir(host.state_dir));
    if let Some((registry, wish)) = host.claim {
        items.push(claim(host.state_dir, registry, wish));
    }
    items
}

/// Whether the ids, cgroup root and guest network this agent would claim
/// are clear of every other agent's on the host, as `run` will find them
/// (`state::claim`), each setting to change named.
fn claim(state_dir: &Path, registry: &Path, wish: &crate::state::claim::Wish) -> Item {
    const WHAT: &str = "claim";
    let files = crate::state::claim::Files {
        state_dir,
        registry,
    };
    match crate::state::claim::refusal(files, wish) {
        Ok(None) => Item::new(
            WHAT,
            Verdict::Ok,
            format!("clear of every other agent's in {}", registry.display()),
        ),
        Ok(Some(why)) => Item::new(WHAT, Verdict::Fail, why),
        Err(e) => Item::new(WHAT, Verdict::Fail, e.to_string()),
    }
}

/// The checks as a table, one line each.
pub fn render(items: &[Item]) -> String {
    let width = items.iter().map(|i| i.what.len()).max().unwrap_or(0);
    let mut out = String::new();
    for item in items {
        let _ = writeln!(
            out,
            "{:<4}  {:<width$}  {}",
            item.verdict.word(),
            item.what,
            crate::quote::inline(&item.detail)
        );
    }
    out
}

/// Whether any check failed: no VM can be created here as things stand.
pub fn failed(items: &[Item]) -> bool {
    items.iter().any(|i| i.verdict == Verdict::Fail)
}

fn hypervisor(binary: &Path) -> Item {
    const WHAT: &str = "hypervisor";
    let Some(found) = crate::programs::find(&binary.to_string_lossy()) else {
        return Item::new(
            WHAT,
            Verdict::Fail,
            format!(
                "{} not found: install cloud-hypervisor v{MIN} or later (a static release binary from github.com/cloud-hypervisor/cloud-hypervisor/releases), or name it with --hypervisor",
                binary.display(),
                MIN = min_version()
            ),
        );
    };
    version_item(WHAT, &found)
}

#[cfg(target_os = "linux")]
fn min_version() -> u32 {
    super::cloudhv::MIN_VERSION
}

#[cfg(not(target_os = "linux"))]
fn min_version() -> u32 {
    0
}

#[cfg(target_os = "linux")]
fn version_item(what: &'static str, found: &Path) -> Item {
    use super::cloudhv::{FLOOR_NEED, MIN_VERSION, major_version, version_of};
    match version_of(found) {
        Ok(banner) => match major_version(&banner) {
            Some(major) if major >= MIN_VERSION => {
                Item::new(what, Verdict::Ok, format!("{} ({banner})", found.display()))
            }
            _ => Item::new(
                what,
                Verdict::Fail,
                format!(
                    "{} says {banner:?}: cloud-hypervisor v{MIN_VERSION} or later is needed ({FLOOR_NEED})",
                    found.display()
                ),
            ),
        },
        Err(why) => Item::new(
            what,
            Verdict::Fail,
            format!("{} --version: {why}", found.display()),
        ),
    }
}

#[cfg(not(target_os = "linux"))]
fn version_item(what: &'static str, found: &Path) -> Item {
    Item::new(what, Verdict::Ok, found.display().to_string())
}

fn boot_file(guest: &GuestBoot) -> Item {
    const WHAT: &str = "boot file";
    let hv = &guest.hypervisor;
    let (path, flag): (&PathBuf, &str) = match (&hv.kernel, &hv.firmware) {
        (Some(kernel), _) => (kernel, "--kernel"),
        (None, Some(firmware)) => (firmware, "--firmware"),
        (None, None) => {
            return Item::new(
                WHAT,
                Verdict::Fail,
                "neither --kernel nor --firmware is set: name a PVH kernel (vmlinux) or a firmware (hypervisor-fw, CLOUDHV.fd)",
            );
        }
    };
    match std::fs::File::open(path) {
        Ok(_) if path.is_file() => {
            Item::new(WHAT, Verdict::Ok, format!("{flag} {}", path.display()))
        }
        Ok(_) => Item::new(
            WHAT,
            Verdict::Fail,
            format!("{flag} {} is not a regular file", path.display()),
        ),
        Err(e) => Item::new(
            WHAT,
            Verdict::Fail,
            format!("{flag} {}: {e}", path.display()),
        ),
    }
}

/// The devices every VM needs, and the one a fast resume needs.
fn devices(guest: &GuestBoot) -> Vec<Item> {
    let kvm = &guest.confinement.kvm;
    let kvm = match std::fs::OpenOptions::new().read(true).write(true).open(kvm) {
        Ok(_) => Item::new("kvm", Verdict::Ok, kvm.display().to_string()),
        Err(e) => Item::new(
            "kvm",
            Verdict::Fail,
            format!(
                "{}: {e}: load kvm_intel or kvm_amd (or name the device with --kvm-device)",
                kvm.display()
            ),
        ),
    };
    let tun = if Path::new("/dev/net/tun").exists() {
        Item::new("tun", Verdict::Ok, "/dev/net/tun")
    } else {
        Item::new(
            "tun",
            Verdict::Fail,
            "/dev/net/tun is missing: load the tun module",
        )
    };
    let userfaultfd = match &guest.confinement.userfaultfd {
        Some(device) if device.exists() => {
            Item::new("userfaultfd", Verdict::Ok, device.display().to_string())
        }
        Some(device) => Item::new(
            "userfaultfd",
            Verdict::Warn,
            format!(
                "{} is missing (Linux 6.1 or later has it): a resume reads the whole snapshot before its guest runs",
                device.display()
            ),
        ),
        None => Item::new(
            "userfaultfd",
            Verdict::Warn,
            "--userfaultfd-device is empty: a resume reads the whole snapshot before its guest runs",
        ),
    };
    vec![kvm, tun, userfaultfd]
}

/// Where the kernel says whether shared memory may take transparent huge
/// pages.
#[cfg(target_os = "linux")]
const SHMEM_HUGE_PAGES: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// How a VM's memory (shared, a memfd: see `cloudhv::argv`) is faulted
/// in: in 2 MiB pages where the host lets a hypervisor ask for them (it
/// does), else 4 KiB at a time, which a restore pays at every page it
/// fills; `setting`: the kernel's shmem huge page setting.
#[cfg(target_os = "linux")]
fn guest_memory(guest: &GuestBoot, setting: &Path) -> Item {
    const WHAT: &str = "guest memory";
    if guest.hypervisor.hugepages {
        return Item::new(
            WHAT,
            Verdict::Ok,
            "2 MiB huge pages set aside (--guest-hugepages)",
        );
    }
    let chosen = std::fs::read_to_string(setting)
        .ok()
        .and_then(|text| chosen(&text).map(str::to_owned));
    match chosen.as_deref() {
        Some(word @ ("advise" | "always" | "within_size" | "force")) => Item::new(
            WHAT,
            Verdict::Ok,
            format!(
                "in 2 MiB pages where it can be ({}: {word})",
                setting.display()
            ),
        ),
        other => Item::new(
            WHAT,
            Verdict::Warn,
            format!(
                "faulted in 4 KiB at a time ({}: {}): a clone's restore fills its memory page by page, about 100 ms more for a 512 MiB guest (README, Templates and clones); echo advise > {} lets hypervisors ask for 2 MiB pages, or set guests' memory aside with --guest-hugepages",
                setting.display(),
                other.unwrap_or("unreadable"),
                setting.display()
            ),
        ),
    }
}

/// The choice a kernel setting that lists its choices has made: the
/// bracketed word (`always [advise] never` says `advise`).
pub fn chosen(text: &str) -> Option<&str> {
    let (_, rest) = text.split_once('[')?;
    Some(rest.split_once(']')?.0)
}

/// virtio-balloon's feature bit for free page reporting.
#[cfg(target_os = "linux")]
const VIRTIO_BALLOON_F_REPORTING: usize = 5;

/// Whether the host's memory is its own: a host that is itself a VM may
/// hand the blocks it frees back to the hypervisor under it (a
/// virtio-balloon that reports free pages), and memory a restore then
/// fills from such a block that hypervisor faults in again, 2 MiB blocks
/// costing the most (512 MiB in 0.9 s against 0.09 s on the host the
/// README measured). Huge pages set aside stay in their pool, never
/// freed, so they are not handed back. `sys`: where sysfs is.
#[cfg(target_os = "linux")]
fn host_memory(guest: &GuestBoot, sys: &Path) -> Item {
    const WHAT: &str = "host memory";
    let balloons = sys.join("bus/virtio/drivers/virtio_balloon");
    let reporting = std::fs::read_dir(&balloons).ok().is_some_and(|devices| {
        devices.flatten().any(|device| {
            std::fs::read_to_string(device.path().join("features"))
                .is_ok_and(|bits| bits.as_bytes().get(VIRTIO_BALLOON_F_REPORTING) == Some(&b'1'))
        })
    });
    let order_file = sys.join("module/page_reporting/parameters/page_reporting_order");
    let order = std::fs::read_to_string(&order_file)
        .ok()
        .and_then(|o| o.trim().parse::<u32>().ok());
    let reported = match order {
        // Above x86-64's largest block (order 10): nothing is reported.
        Some(order) if reporting && order <= 10 => order,
        // A kernel that does not say reports from its pageblock order, a
        // huge page's (2 MiB, order 9, on x86-64).
        None if reporting => 9,
        _ => {
            return Item::new(
                WHAT,
                Verdict::Ok,
                "its own: it hands no free memory back to a hypervisor under it",
            );
        }
    };
    if guest.hypervisor.hugepages {
        return Item::new(
            WHAT,
            Verdict::Ok,
            "handed back to the hypervisor under this host where freed (free page reporting), but guests' huge pages stay in their pool",
        );
    }
    let block_kib = 4u64 << reported;
    let (setting, or_stop) = match order {
        Some(_) => (
            format!("{}: {reported}", order_file.display()),
            format!(
                ", or echo 11 > {} stops the reporting (the host then keeps what it frees)",
                order_file.display()
            ),
        ),
        None => ("this kernel names no order".to_owned(), String::new()),
    };
    Item::new(
        WHAT,
        Verdict::Warn,
        format!(
            "handed back to the hypervisor under this host where it frees a block of {} or more (virtio-balloon free page reporting, {setting}): a restore that fills guest memory from such a block waits for that hypervisor to fault it in again, each clone's restore slower and unevenly so (README, Templates and clones); guests on huge pages set aside keep them (--guest-hugepages){or_stop}",
            crate::human::bytes(block_kib * 1024),
        ),
    )
}

/// What confines each hypervisor: root for its own user, cgroups for its
/// limits, Landlock. A piece the operator allowed running without warns.
#[cfg(target_os = "linux")]
fn confinement(guest: &GuestBoot) -> Vec<Item> {
    use super::Piece;
    let allowed = |piece: Piece| guest.confinement.allow_without.contains(&piece);
    let lacking = |what: &'static str, piece: Piece, why: String| {
        let (verdict, then) = if allowed(piece) {
            (
                Verdict::Warn,
                "hypervisors run without it (--allow-without)",
            )
        } else {
            (
                Verdict::Fail,
                "or allow running without it: --allow-without",
            )
        };
        Item::new(what, verdict, format!("{why}; {then} {}", piece.name()))
    };
    let root = if nix::unistd::geteuid().is_root() {
        Item::new(
            "root",
            Verdict::Ok,
            "each hypervisor gets a user of its own",
        )
    } else {
        lacking(
            "root",
            Piece::Jail,
            format!(
                "the agent runs as uid {}, and only root gives each hypervisor a user of its own",
                nix::unistd::geteuid()
            ),
        )
    };
    let cgroups = match super::jail::cgroup::Cgroups::probe(&guest.confinement.cgroup_root) {
        Ok(found) => Item::new(
            "cgroups",
            Verdict::Ok,
            format!(
                "{} hierarchies for memory, pids and cpu",
                found.roots().len()
            ),
        ),
        Err(lack) => lacking("cgroups", Piece::Cgroups, lack.to_string()),
    };
    let landlock = match super::jail::landlock_abi() {
        Ok(abi) => Item::new("landlock", Verdict::Ok, format!("ABI {abi}")),
        Err(lack) => lacking("landlock", Piece::Landlock, lack.to_string()),
    };
    vec![root, cgroups, landlock]
}

#[cfg(not(target_os = "linux"))]
fn confinement(_: &GuestBoot) -> Vec<Item> {
    Vec::new()
}

/// `ip`, and `nft` or `iptables`, when guests have a network.
fn network_tools(guest: &GuestBoot) -> Item {
    const WHAT: &str = "network tools";
    if guest.underlay.is_none() {
        return Item::new(WHAT, Verdict::Ok, "guest networking is off: none needed");
    }
    let ip = crate::programs::find("ip");
    let firewall = crate::programs::find("nft").or_else(|| crate::programs::find("iptables"));
    match (ip, firewall) {
        (Some(ip), Some(fw)) => Item::new(
            WHAT,
            Verdict::Ok,
            format!("{}, {}", ip.display(), fw.display()),
        ),
        (ip, fw) => {
            let missing: Vec<&str> = [
                ip.is_none().then_some("ip (iproute2)"),
                fw.is_none().then_some("nft (nftables) or iptables"),
            ]
            .into_iter()
            .flatten()
            .collect();
            Item::new(
                WHAT,
                Verdict::Fail,
                format!(
                    "not found on PATH: {}; install them, or turn guest networking off with --underlay-bridge=\"\"",
                    missing.join(", ")
                ),
            )
        }
    }
}

/// What the host's kernel does with guests' traffic: whether it forwards
/// IPv4 (the agent turns it on: the host becomes its guests' router), and
/// whether bridged frames also pass the ip and arp tables
/// (`br_netfilter`'s `bridge-nf-call-*`). Neither is a failure; both are
/// said, since an operator's other firewall rules see guest traffic by
/// them.
fn routing(guest: &GuestBoot) -> Vec<Item> {
    if guest.underlay.is_none() {
        return Vec::new();
    }
    let read = |path: &str| std::fs::read_to_string(path).ok().map(|v| v.trim() == "1");
    let forwarding = match read("/proc/sys/net/ipv4/ip_forward") {
        Some(true) => "on: this host routes its guests' traffic to the outside".to_owned(),
        Some(false) => {
            "off: the agent turns it on at its start, and this host becomes a router for its guests (the release of the last agent with guests turns it off again)"
                .to_owned()
        }
        None => "cannot read /proc/sys/net/ipv4/ip_forward".to_owned(),
    };
    let bridged = match (
        read("/proc/sys/net/bridge/bridge-nf-call-iptables"),
        read("/proc/sys/net/bridge/bridge-nf-call-arptables"),
    ) {
        (None, None) => "br_netfilter is not loaded: bridged frames pass the agent's bridge table only, which holds guests apart alone".to_owned(),
        (ip, arp) => format!(
            "bridge-nf-call-iptables={}, bridge-nf-call-arptables={}: bridged frames {}also pass the ip and arp tables; guests are held apart by the agent's bridge table either way",
            u8::from(ip == Some(true)),
            u8::from(arp == Some(true)),
            if ip == Some(true) || arp == Some(true) { "" } else { "do not " }
        ),
    };
    vec![
        Item::new("ip forwarding", Verdict::Ok, forwarding),
        Item::new("bridged netfilter", Verdict::Ok, bridged),
        guest_subnet(guest),
    ]
}

/// Whether another link holds the guests' subnet (see `net::rivals`): not
/// a failure (VMs are created), but their traffic may go astray. (macOS:
/// vfkit's guests share the host's network, and no underlay is built.)
#[cfg(target_os = "linux")]
fn guest_subnet(guest: &GuestBoot) -> Item {
    const WHAT: &str = "guest subnet";
    let Some(underlay) = &guest.underlay else {
        return Item::new(WHAT, Verdict::Ok, "no guest networking");
    };
    let subnet = underlay.subnet.cidr();
    match crate::net::rivals::rivals(subnet, &underlay.bridge) {
        Ok(rivals) if rivals.is_empty() => Item::new(
            WHAT,
            Verdict::Ok,
            format!(
                "{subnet}: no link but {} holds or is routed any of it",
                underlay.bridge
            ),
        ),
        Ok(rivals) => Item::new(WHAT, Verdict::Warn, rivals.join("; ")),
        Err(e) => Item::new(
            WHAT,
            Verdict::Warn,
            format!("cannot ask which links hold {subnet}: {e}"),
        ),
    }
}

#[cfg(not(target_os = "linux"))]
fn guest_subnet(_: &GuestBoot) -> Item {
    Item::new("guest subnet", Verdict::Ok, "no underlay on this platform")
}

fn image_root(root: Option<&Path>) -> Item {
    const WHAT: &str = "image root";
    match root {
        None => Item::new(
            WHAT,
            Verdict::Ok,
            "not set: file:// images are refused, http(s) ones fetched",
        ),
        Some(root) if root.is_dir() => Item::new(WHAT, Verdict::Ok, root.display().to_string()),
        Some(root) => Item::new(
            WHAT,
            Verdict::Fail,
            format!(
                "{} is not a directory: create it, or fix --image-root",
                root.display()
            ),
        ),
    }
}

/// How much room the state dir's filesystem has: under a GiB warns (a
/// root disk alone is a GiB or more).
fn state_dir(dir: &Path) -> Item {
    const WHAT: &str = "state dir";
    const LOW: u64 = 1 << 30;
    // The nearest directory there is: the agent makes the rest.
    let there = dir
        .ancestors()
        .find(|d| d.is_dir())
        .unwrap_or(Path::new("/"));
    match crate::state::Room::at(there) {
        Some(room) if room.free < LOW => Item::new(
            WHAT,
            Verdict::Warn,
            format!("{}: {room}: make room for VMs' disks", dir.display()),
        ),
        Some(room) => Item::new(WHAT, Verdict::Ok, format!("{}: {room}", dir.display())),
        None => Item::new(
            WHAT,
            Verdict::Fail,
            format!("{}: its filesystem cannot be asked", dir.display()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_hypervisor_fails_naming_where_to_get_one() {
        let item = hypervisor(Path::new("/nonexistent/cloud-hypervisor"));

        assert_eq!(item.verdict, Verdict::Fail);
        assert!(item.detail.contains("install cloud-hypervisor"), "{item:?}");
    }

    /// The settings `run` would use with `flags` and no environment.
    fn guest(flags: &[&str]) -> GuestBoot {
        let args: Vec<String> = ["run", "--desired", "/d"]
            .iter()
            .chain(flags)
            .map(|s| s.to_string())
            .collect();
        match crate::config::parse(&args, &Default::default()) {
            Ok(crate::config::Command::Run(c)) => c.guest,
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn no_boot_file_fails_naming_both_flags() {
        let guest = guest(&[]);

        let item = boot_file(&guest);

        assert_eq!(item.verdict, Verdict::Fail);
        assert!(item.detail.contains("--kernel nor --firmware"), "{item:?}");
    }

    #[cfg(target_os = "linux")]
    fn shmem_setting(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("shmem_enabled");
        std::fs::write(&path, text).expect("setting");
        (dir, path)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn guest_memory_without_shared_huge_pages_warns_saying_how_to_allow_them() {
        let (_dir, setting) = shmem_setting("always within_size advise [never] deny force\n");

        let item = guest_memory(&guest(&[]), &setting);

        assert_eq!(item.verdict, Verdict::Warn);
        assert!(item.detail.contains("shmem_enabled: never)"), "{item:?}");
        assert!(item.detail.contains("echo advise >"), "{item:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn guest_memory_that_may_ask_for_huge_pages_is_ok() {
        let (_dir, setting) = shmem_setting("always within_size [advise] never deny force\n");

        let item = guest_memory(&guest(&[]), &setting);

        assert_eq!(item.verdict, Verdict::Ok, "{item:?}");
    }

    /// A sysfs with one virtio-balloon of `features` and the kernel's
    /// page reporting `order`.
    #[cfg(target_os = "linux")]
    fn balloon_sys(features: &str, order: &str) -> tempfile::TempDir {
        let sys = tempfile::tempdir().expect("tempdir");
        let device = sys.path().join("bus/virtio/drivers/virtio_balloon/virtio0");
        std::fs::create_dir_all(&device).expect("device");
        std::fs::write(device.join("features"), format!("{features}\n")).expect("features");
        let parameters = sys.path().join("module/page_reporting/parameters");
        std::fs::create_dir_all(&parameters).expect("parameters");
        std::fs::write(
            parameters.join("page_reporting_order"),
            format!("{order}\n"),
        )
        .expect("order");
        sys
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn host_memory_handed_back_to_the_hypervisor_under_it_warns_saying_how_to_keep_it() {
        let sys = balloon_sys("0110010100000000", "9");

        let item = host_memory(&guest(&[]), sys.path());

        assert_eq!(item.verdict, Verdict::Warn, "{item:?}");
        assert!(
            item.detail.contains("a block of 2.0 MiB or more"),
            "{item:?}"
        );
        assert!(item.detail.contains("echo 11 >"), "{item:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn host_memory_is_its_own_where_its_balloon_reports_nothing() {
        let sys = balloon_sys("0110000100000000", "9");

        let item = host_memory(&guest(&[]), sys.path());

        assert_eq!(item.verdict, Verdict::Ok, "{item:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn host_memory_reported_by_a_kernel_that_names_no_order_warns() {
        let sys = balloon_sys("0110010100000000", "9");
        std::fs::remove_dir_all(sys.path().join("module")).expect("no order");

        let item = host_memory(&guest(&[]), sys.path());

        assert_eq!(item.verdict, Verdict::Warn, "{item:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn host_memory_reporting_above_the_largest_block_is_its_own() {
        let sys = balloon_sys("0110010100000000", "11");

        let item = host_memory(&guest(&[]), sys.path());

        assert_eq!(item.verdict, Verdict::Ok, "{item:?}");
    }

    #[test]
    fn the_table_has_a_line_per_check_and_fails_if_one_does() {
        let items = vec![
            Item::new("kvm", Verdict::Ok, "/dev/kvm"),
            Item::new("boot file", Verdict::Fail, "neither"),
        ];

        let table = render(&items);

        assert_eq!(
            table,
            "ok    kvm        /dev/kvm\nFAIL  boot file  neither\n"
        );
        assert!(failed(&items));
    }
}
