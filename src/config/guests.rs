//! The guests' sections of `run`'s settings: their network (the
//! underlay, its DNS, the host networks), the hypervisor that boots them,
//! its jail, and the limits and caps they are held to.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;

use super::read::{Part, absolute, no_comma, program};
use super::settings::Key;
use super::{ConfigError, err};
use crate::model::{Cidr, IpRange};
use crate::net::addresses::Subnet;
use crate::net::underlay::{Egress, UnderlayConfig};
use crate::provision::hugepages;
use crate::provision::supervise::StopTimeouts;
use crate::provision::{Confinement, GuestBoot, GuestLimits, HypervisorSettings, Piece};
use crate::reconcile::HostCaps;

/// The network section as built.
pub(super) struct Network {
    /// `None` when guest networking is off.
    pub(super) underlay: Option<UnderlayConfig>,
    pub(super) tap_prefix: String,
    pub(super) guest_dns: Option<Vec<Ipv4Addr>>,
    pub(super) host_networks: HashMap<String, String>,
    /// `--guest-deny`, which image downloads obey too (its IPv6 ranges
    /// are theirs alone: the guests' network is IPv4).
    pub(super) deny: Vec<IpRange>,
}

pub(super) fn network(raw: &Part<'_>) -> Result<Network, ConfigError> {
    let tap_prefix = tap_prefix(raw)?;
    let deny = raw.ip_ranges(Key::GuestDeny)?;
    let guest_deny: Vec<Cidr> = deny.iter().filter_map(IpRange::v4).collect();
    Ok(Network {
        underlay: underlay(raw, &tap_prefix, &guest_deny)?,
        guest_dns: guest_dns(raw)?,
        host_networks: host_networks(raw)?,
        tap_prefix,
        deny,
    })
}

pub(super) fn tap_prefix(raw: &Part<'_>) -> Result<String, ConfigError> {
    let tap_prefix = raw.get(Key::TapPrefix);
    if tap_prefix.is_empty()
        || tap_prefix.len() > 8
        || !tap_prefix.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Err(err(format!(
            "--tap-prefix: {tap_prefix:?} must be 1-8 letters or digits (tap names are at most 15 bytes)"
        )));
    }
    Ok(tap_prefix)
}

/// The `--underlay-bridge` that turns guest networking off, like empty.
pub(super) const NO_BRIDGE: &str = "none";

pub(super) fn underlay(
    raw: &Part<'_>,
    tap_prefix: &str,
    deny: &[Cidr],
) -> Result<Option<UnderlayConfig>, ConfigError> {
    // `none` says it where an empty value cannot be given: an empty
    // env-dir file unsets its variable under s6-envdir and chpst (and the
    // systemd unit), which gives the default.
    let Some(bridge) = raw.optional(Key::UnderlayBridge).filter(|b| b != NO_BRIDGE) else {
        return Ok(None);
    };
    if bridge.len() > 15
        || !bridge
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(err(format!(
            "--underlay-bridge: {bridge:?} is not a link name (1-15 letters, digits, - or _)"
        )));
    }
    let subnet = Subnet::parse(&raw.get(Key::UnderlaySubnet))
        .map_err(|e| err(format!("--underlay-subnet: {e}")))?;
    Ok(Some(UnderlayConfig {
        bridge,
        subnet,
        table: "eitri".into(),
        tap_prefix: tap_prefix.to_owned(),
        egress: Egress {
            deny: deny.to_vec(),
            allow: raw.ranges(Key::GuestAllow)?,
            dns: Vec::new(),
        },
        publish: crate::model::PortRange::parse(&raw.get(Key::PublishPorts))
            .map_err(|e| err(format!("--publish-ports: {e}")))?,
    }))
}

/// `--guest-dns`; `None` when not given: the daemon then tells guests the
/// host's own resolvers.
pub(super) fn guest_dns(raw: &Part<'_>) -> Result<Option<Vec<Ipv4Addr>>, ConfigError> {
    let Some(list) = raw.optional(Key::GuestDns) else {
        return Ok(None);
    };
    list.split(',')
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|_| err(format!("--guest-dns: {s:?} is not an IPv4 address")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

pub(super) fn host_networks(raw: &Part<'_>) -> Result<HashMap<String, String>, ConfigError> {
    let mut networks = HashMap::new();
    for pair in raw
        .optional(Key::HostNetwork)
        .iter()
        .flat_map(|v| v.split(','))
    {
        let Some((name, bridge)) = pair.trim().split_once('=') else {
            return Err(err(format!("--host-network: {pair:?} is not NAME=BRIDGE")));
        };
        crate::model::Id::parse(name)
            .map_err(|e| err(format!("--host-network: network name {e}")))?;
        if bridge.is_empty() || bridge.len() > 15 {
            return Err(err(format!(
                "--host-network: {bridge:?} is not a link name"
            )));
        }
        networks.insert(name.to_owned(), bridge.to_owned());
    }
    Ok(networks)
}

// ── the hypervisor, its jail, and what a guest may use ──────────────────

/// How guests boot: the network, hypervisor, jail and limits sections,
/// each as built, shared with the backend that uses them.
pub(super) fn guest_boot(
    hypervisor: (HypervisorSettings, Option<PathBuf>),
    network: Network,
    confinement: Confinement,
    limits: &Part<'_>,
) -> Result<GuestBoot, ConfigError> {
    let (hypervisor, guest_agent) = hypervisor;
    Ok(GuestBoot {
        guest_agent,
        underlay: network.underlay,
        guest_dns: network.guest_dns,
        host_networks: network.host_networks,
        tap_prefix: network.tap_prefix,
        hypervisor: Arc::new(hypervisor),
        confinement: Arc::new(confinement),
        limits: Arc::new(guest_limits(limits)?),
    })
}

/// `--guest-agent`: off, a path, or (empty) `eitri-guest` beside this
/// agent's own binary when it is there.
pub(super) fn guest_agent(raw: &Part<'_>) -> Option<PathBuf> {
    match raw.get(Key::GuestAgent).trim() {
        "off" => None,
        "" => std::env::current_exe()
            .ok()
            .and_then(|me| Some(me.parent()?.join("eitri-guest")))
            .filter(|beside| beside.is_file()),
        path => Some(absolute(path.to_owned())),
    }
}

pub(super) fn hypervisor(raw: &Part<'_>) -> Result<HypervisorSettings, ConfigError> {
    let run_dir = raw.get(Key::RunDir);
    no_comma(Key::RunDir, &run_dir)?;
    let kernel = raw.optional_path(Key::Kernel);
    let firmware = raw.optional_path(Key::Firmware);
    if kernel.is_some() && firmware.is_some() {
        return Err(err(
            "--kernel and --firmware are both set; a guest boots one or the other",
        ));
    }
    Ok(HypervisorSettings {
        binary: program(raw.get(Key::Hypervisor)),
        run_dir: absolute(run_dir),
        kernel,
        firmware,
        cmdline: raw.get(Key::Cmdline),
        stop: StopTimeouts {
            power_button: raw.duration(Key::StopGrace)?,
            ..StopTimeouts::default()
        },
        hugepages: guest_hugepages(raw)?,
    })
}

/// `--guest-hugepages`: refused where no guest can have them (vfkit), and
/// where the host sets none aside, since every boot would then fail.
pub(super) fn guest_hugepages(raw: &Part<'_>) -> Result<bool, ConfigError> {
    if !raw.yes_no(Key::GuestHugepages)? {
        return Ok(false);
    }
    if cfg!(target_os = "macos") {
        return Err(err(
            "--guest-hugepages: vfkit has no huge pages to back a guest with; leave it at no",
        ));
    }
    match hugepages::Pool::of_host() {
        Ok(pool) if pool.total > 0 => Ok(true),
        Ok(_) => Err(err(
            "--guest-hugepages: this host sets no 2 MiB huge pages aside (nr_hugepages is 0); reserve the guests' memory first, e.g. sysctl vm.nr_hugepages=2048 for 4 GiB, or leave it at no",
        )),
        Err(e) => Err(err(format!(
            "--guest-hugepages: cannot read this host's 2 MiB huge page pool ({e}); the kernel needs CONFIG_HUGETLBFS, or leave it at no"
        ))),
    }
}

/// What the operator asked of the host's shared ids and cgroups, when
/// they asked: the defaults are the claim's to choose (`state::claim`).
pub(super) struct JailWish {
    pub(super) ids: Option<(u32, u32)>,
    pub(super) cgroup_root: Option<String>,
}

pub(super) fn confinement(raw: &Part<'_>) -> Result<(Confinement, JailWish), ConfigError> {
    let ids = raw.get(Key::VmmIds);
    let (first, count) = ids
        .split_once(':')
        .and_then(|(f, c)| Some((f.trim().parse::<u32>().ok()?, c.trim().parse::<u32>().ok()?)))
        .filter(|(f, c)| *f >= 65_536 && *c >= 2 && f.checked_add(*c).is_some())
        .ok_or_else(|| {
            err(format!(
                "--vmm-ids: {ids:?} is not FIRST:COUNT (FIRST at least 65536, clear of the host's users; COUNT at least 2: a group for /dev/kvm and one id per VM)"
            ))
        })?;
    let mut allow_without = Vec::new();
    for name in raw
        .get(Key::AllowWithout)
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let piece = Piece::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            err(format!(
                "--allow-without: {name:?} is not a piece of confinement (jail, cgroups, landlock)"
            ))
        })?;
        allow_without.push(piece);
    }
    let cgroup_root = raw.get(Key::CgroupRoot);
    if cgroup_root.is_empty()
        || cgroup_root
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(err(format!(
            "--cgroup-root: {cgroup_root:?} is not a relative cgroup path such as eitri or machine/eitri"
        )));
    }
    let wish = JailWish {
        ids: raw.given(Key::VmmIds).then_some((first, count)),
        cgroup_root: raw.given(Key::CgroupRoot).then(|| cgroup_root.clone()),
    };
    let confinement = Confinement {
        first_id: first,
        id_count: count,
        kvm: raw.path(Key::KvmDevice),
        userfaultfd: raw.optional_path(Key::UserfaultfdDevice),
        cgroup_root,
        allow_without,
    };
    Ok((confinement, wish))
}

/// The host's caps on what it commits to VMs.
pub(super) fn host_caps(
    raw: &Part<'_>,
    hypervisor: &HypervisorSettings,
) -> Result<HostCaps, ConfigError> {
    let pool_mb = match hypervisor.hugepages {
        true => hugepages::Pool::of_host().map(|p| p.total_mb()).ok(),
        false => None,
    };
    let max_mem_mb = match raw.get(Key::MaxMemMb).trim() {
        "auto" => None,
        _ => Some(raw.number(Key::MaxMemMb)?),
    };
    let meminfo = || std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    Ok(HostCaps {
        max_vcpus: raw.number(Key::MaxVcpus)?,
        max_mem_mb: memory_cap_mb(max_mem_mb, pool_mb, meminfo)?,
        max_disk_gb: raw.number(Key::MaxDiskGb)?,
        // Set at start, from the limit the agent runs under (see
        // `daemon::wire::open_file_budget`).
        fds: crate::reconcile::FdBudget::default(),
    })
}

/// `--max-mem-mb`: `asked`, or `None` for auto. With guests on huge
/// pages (a pool of `pool_mb`), memory is what the pool holds: auto is the
/// pool, and a cap past it is refused, since the guests it would admit
/// past the pool could not boot.
pub(super) fn memory_cap_mb(
    asked: Option<u64>,
    pool_mb: Option<u64>,
    meminfo: impl FnOnce() -> String,
) -> Result<u64, ConfigError> {
    match (asked, pool_mb) {
        (None, Some(pool_mb)) => Ok(pool_mb),
        (None, None) => Ok(auto_memory_cap_mb(&meminfo())),
        (Some(cap), Some(pool_mb)) if cap == 0 || cap > pool_mb => {
            let asked = match cap {
                0 => "0 (no cap)".to_owned(),
                _ => format!("{cap} MiB"),
            };
            Err(err(format!(
                "--max-mem-mb: {asked} is more than the {pool_mb} MiB of huge pages this host sets aside for guests (--guest-hugepages yes); give at most {pool_mb}, or auto"
            )))
        }
        (Some(cap), _) => Ok(cap),
    }
}

/// `--max-mem-mb auto`: the host's memory (`meminfo`'s MemTotal) less a
/// tenth, and at least 1 GiB, for the host itself (the agent, the page
/// cache, the VMMs' own few MiB each). Memory is what VMs cannot share:
/// admitting more than the host has ends with the kernel killing a VMM,
/// a customer's running VM, to free some. 0 (unlimited) when the host
/// does not say.
pub(super) fn auto_memory_cap_mb(meminfo: &str) -> u64 {
    let total_mb = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024);
    total_mb.saturating_sub((total_mb / 10).max(1024))
}

/// What a VM whose spec sets none may use (each bounded as a spec's own
/// is), and how much of its serial output is kept.
pub(super) fn guest_limits(raw: &Part<'_>) -> Result<GuestLimits, ConfigError> {
    use crate::model::Limits;
    let within = |key: Key, max: u64| -> Result<u32, ConfigError> {
        let n = raw.number(key)?;
        if n > max {
            return Err(err(format!(
                "--{}: {n} is past {max}; 0 means none",
                key.setting().flag
            )));
        }
        Ok(n as u32)
    };
    let serial_mb = raw.number(Key::SerialLogMaxMb)?;
    if serial_mb == 0 {
        return Err(err(
            "--serial-log-max-mb: 0 would keep no serial output at all; give at least 1",
        ));
    }
    Ok(GuestLimits {
        defaults: crate::model::LimitDefaults {
            cpu_max_millis_per_vcpu: within(Key::VmCpuMaxPerVcpu, 1000)?,
            cpu_burst_ms: within(Key::VmCpuBurst, 100 * u64::from(Limits::MAX_VCPUS))?,
            disk_mbps: within(Key::VmDiskMbps, Limits::MAX_DISK_MBPS)?,
            disk_iops: within(Key::VmDiskIops, Limits::MAX_DISK_IOPS)?,
            net_mbps: within(Key::VmNetMbps, Limits::MAX_NET_MBPS)?,
        },
        serial_log_bytes: serial_mb.saturating_mul(1 << 20),
    })
}

// ── how the engine behaves ───────────────────────────────────────────────

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_guests_on_huge_pages_the_automatic_memory_cap_is_the_pool() {
        let cap = memory_cap_mb(None, Some(1200), || unreachable!("the pool is the cap"));

        assert_eq!(cap.expect("cap"), 1200);
    }

    #[test]
    fn with_guests_on_huge_pages_a_cap_past_the_pool_or_none_is_refused() {
        let past = memory_cap_mb(Some(2048), Some(1200), String::new).expect_err("past");
        let none = memory_cap_mb(Some(0), Some(1200), String::new).expect_err("none");

        assert!(
            past.to_string()
                .contains("2048 MiB is more than the 1200 MiB"),
            "{past}"
        );
        assert!(none.to_string().contains("0 (no cap)"), "{none}");
        assert_eq!(
            memory_cap_mb(Some(1000), Some(1200), String::new).expect("within"),
            1000
        );
    }

    #[test]
    fn the_automatic_memory_cap_keeps_a_tenth_and_at_least_1_gib_for_the_host() {
        let meminfo = |mib: u64| format!("MemTotal:       {} kB\nMemFree: 1 kB\n", mib * 1024);

        assert_eq!(auto_memory_cap_mb(&meminfo(24 * 1024)), 24 * 1024 - 2457);
        assert_eq!(auto_memory_cap_mb(&meminfo(4096)), 3072);
        assert_eq!(
            auto_memory_cap_mb(&meminfo(512)),
            0,
            "all of it is the host's"
        );
        assert_eq!(auto_memory_cap_mb(""), 0, "unknown: no cap");
    }
}
