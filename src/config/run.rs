//! `run`'s settings: each raw value (flag, else environment, else default)
//! is looked up by [`Key`], then checked and built into one part of the
//! [`Config`] by the function that owns that part: where desired state
//! comes from, how guests boot and the networks they join, how the engine
//! behaves, and the daemon's own timing. Nothing here reads the host; what
//! must be discovered there is left `None` for the daemon.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use super::settings::Key;
use super::{Config, ConfigError, DesiredSource, err, flag_values, parse_duration};
use crate::image::{ImageOptions, Reach};
use crate::model::Cidr;
use crate::net::addresses::Subnet;
use crate::net::underlay::{Egress, UnderlayConfig};
use crate::provision::{Confinement, GuestBoot, Piece};
use crate::reconcile::{EngineConfig, HostCaps};
use crate::source::{ControlPlane, SnapshotLimits};

/// Parses `run`'s arguments, with `env` for fallbacks.
pub(super) fn parse(args: &[String], env: &HashMap<String, String>) -> Result<Config, ConfigError> {
    let known: Vec<&str> = Key::ALL.iter().map(|k| k.setting().flag).collect();
    let raw = Raw {
        flags: flag_values(args, &known, &[])?,
        env,
    };
    let source = source(&raw)?;
    let trust = trust(&raw, &source)?;
    Ok(Config {
        state_dir: state_dir(&raw)?,
        source,
        trust,
        host_id: raw.optional(Key::HostId).map(|h| h.trim().to_owned()),
        tick: tick(&raw)?,
        backoff_max: raw.duration(Key::BackoffMax)?,
        shutdown_grace: raw.duration(Key::ShutdownGrace)?,
        notify_fd: notify_fd(&raw)?,
        limits: snapshot_limits(&raw)?,
        proxy: proxy(&raw)?,
        images: images(&raw)?,
        guest: guest_boot(&raw)?,
        engine: engine(&raw)?,
        metrics_file: raw.optional(Key::MetricsFile).map(PathBuf::from),
        image_cache_max: image_cache_max(&raw)?,
        agents_dir: PathBuf::from(raw.get(Key::AgentsDir)),
        wish: wish(&raw)?,
    })
}

fn image_cache_max(raw: &Raw<'_>) -> Result<Option<u64>, ConfigError> {
    let text = raw.get(Key::ImageCacheMax);
    match super::parse_size(&text) {
        Some(0) => Ok(None),
        Some(n) => Ok(Some(n)),
        None => Err(err(format!(
            "--image-cache-max: {text:?} is not a size; write 200G, 500M or 0 for no cap"
        ))),
    }
}

/// The ids and cgroup root the operator gave, if any (the defaults are the
/// claim's to choose, see `state::claim`), and the guest network.
fn wish(raw: &Raw<'_>) -> Result<crate::state::claim::Wish, ConfigError> {
    let confinement = confinement(raw)?;
    Ok(crate::state::claim::Wish {
        ids: raw
            .given(Key::VmmIds)
            .then_some((confinement.first_id, confinement.id_count)),
        cgroup_root: raw
            .given(Key::CgroupRoot)
            .then_some(confinement.cgroup_root),
        default_state_dir: raw.get(Key::StateDir) == Key::StateDir.setting().default,
        network: underlay(raw)?.map(|u| crate::state::claim::Network {
            subnet: u.subnet.cidr(),
            bridge: u.bridge,
            tap_prefix: u.tap_prefix,
            table: u.table,
        }),
    })
}

/// Raw values: flag, else environment, else default.
struct Raw<'a> {
    flags: HashMap<String, &'a str>,
    env: &'a HashMap<String, String>,
}

impl Raw<'_> {
    fn get(&self, key: Key) -> String {
        let setting = key.setting();
        match self.flags.get(setting.flag) {
            Some(v) => (*v).to_owned(),
            None => self
                .env
                .get(setting.env)
                .cloned()
                .unwrap_or_else(|| setting.default.to_owned()),
        }
    }

    /// Whether the operator set `key`, by flag or environment.
    fn given(&self, key: Key) -> bool {
        let setting = key.setting();
        self.flags.contains_key(setting.flag) || self.env.contains_key(setting.env)
    }

    /// The value, `None` when it is empty or blank.
    fn optional(&self, key: Key) -> Option<String> {
        Some(self.get(key)).filter(|v| !v.trim().is_empty())
    }

    fn duration(&self, key: Key) -> Result<Duration, ConfigError> {
        let raw = self.get(key);
        parse_duration(&raw).ok_or_else(|| {
            err(format!(
                "--{}: {raw:?} is not a duration; write a number with a unit, e.g. 500ms, 30s, 15m, 24h",
                key.setting().flag
            ))
        })
    }

    fn number(&self, key: Key) -> Result<u64, ConfigError> {
        let raw = self.get(key);
        raw.trim().parse().map_err(|_| {
            err(format!(
                "--{}: {raw:?} is not a whole number",
                key.setting().flag
            ))
        })
    }
}

/// A directory the VMM is told about as `path=…` in an option list, which
/// cloud-hypervisor splits on commas.
fn no_comma(key: Key, path: &str) -> Result<(), ConfigError> {
    if path.contains(',') {
        return Err(err(format!(
            "--{}: {path:?} has a comma, which cloud-hypervisor reads as the end of a path; choose a directory without one",
            key.setting().flag
        )));
    }
    Ok(())
}

fn state_dir(raw: &Raw<'_>) -> Result<PathBuf, ConfigError> {
    let dir = raw.get(Key::StateDir);
    if dir.is_empty() {
        return Err(err(
            "--state-dir is empty; give the directory the agent keeps its state in",
        ));
    }
    no_comma(Key::StateDir, &dir)?;
    Ok(PathBuf::from(dir))
}

fn tick(raw: &Raw<'_>) -> Result<Duration, ConfigError> {
    let tick = raw.duration(Key::Tick)?;
    if tick.is_zero() {
        return Err(err("--tick must be longer than 0"));
    }
    Ok(tick)
}

fn notify_fd(raw: &Raw<'_>) -> Result<Option<i32>, ConfigError> {
    let Some(v) = raw.optional(Key::NotifyFd) else {
        return Ok(None);
    };
    match v.trim().parse::<i32>() {
        Ok(fd) if fd >= 3 => Ok(Some(fd)),
        _ => Err(err(format!(
            "--notify-fd: {v:?} is not a file descriptor of 3 or more"
        ))),
    }
}

// ── where desired state comes from ──────────────────────────────────────

fn source(raw: &Raw<'_>) -> Result<DesiredSource, ConfigError> {
    match (raw.optional(Key::Desired), raw.optional(Key::ControlPlane)) {
        (Some(file), None) => Ok(DesiredSource::File(PathBuf::from(file))),
        (None, Some(url)) => control_plane(raw, &url).map(DesiredSource::ControlPlane),
        (Some(_), Some(_)) => Err(err(
            "--desired and --control-plane are both set; choose one",
        )),
        (None, None) => Err(err(
            "no desired state: give --desired FILE (standalone) or --control-plane URL",
        )),
    }
}

/// `--trusted-keys`, read and checked at start; with them, a token is not
/// sent in clear unless `--token-in-clear yes` says so: signing proves the
/// control plane to the agent, and a token an eavesdropper copies would
/// let it speak for the agent.
fn trust(
    raw: &Raw<'_>,
    source: &DesiredSource,
) -> Result<Option<crate::trust::TrustedKeys>, ConfigError> {
    let in_clear = match raw.get(Key::TokenInClear).trim() {
        "yes" | "true" => true,
        "no" | "false" => false,
        other => {
            return Err(err(format!(
                "--token-in-clear: {other:?} is neither yes nor no"
            )));
        }
    };
    let Some(path) = raw.optional(Key::TrustedKeys) else {
        return Ok(None);
    };
    let keys = crate::trust::TrustedKeys::load(std::path::Path::new(&path))
        .map_err(|e| err(format!("--trusted-keys: {e}")))?;
    if let DesiredSource::ControlPlane(cp) = source
        && cp.token_file.is_some()
        && cp.base_url.starts_with("http://")
        && !in_clear
    {
        return Err(err(
            "--trusted-keys with an http:// control plane and --token-file: the token would travel in clear, where anyone on the path can copy it and speak as this agent. Use https:// (a build with --features tls), drop --token-file, or accept it with --token-in-clear yes",
        ));
    }
    Ok(Some(keys))
}

fn control_plane(raw: &Raw<'_>, url: &str) -> Result<ControlPlane, ConfigError> {
    let url = url.trim().trim_end_matches('/');
    let tls = cfg!(feature = "tls");
    let scheme_ok = url.starts_with("http://") || (tls && url.starts_with("https://"));
    if !scheme_ok {
        return Err(err(if url.starts_with("https://") {
            format!(
                "--control-plane: {url:?} needs TLS, and this build has none; rebuild with --features tls or use http://"
            )
        } else {
            format!("--control-plane: {url:?} is not an http:// URL")
        }));
    }
    Ok(ControlPlane {
        base_url: url.to_owned(),
        token_file: raw.optional(Key::TokenFile).map(PathBuf::from),
        connect_timeout: raw.duration(Key::ConnectTimeout)?,
        request_timeout: raw.duration(Key::RequestTimeout)?,
    })
}

fn proxy(raw: &Raw<'_>) -> Result<Option<String>, ConfigError> {
    let proxy = raw.optional(Key::Proxy);
    if let Some(p) = &proxy {
        ureq::Proxy::new(p).map_err(|e| {
            err(format!(
                "--proxy: {p:?} is not a proxy URL ({e}); write http://HOST:PORT"
            ))
        })?;
    }
    Ok(proxy)
}

fn images(raw: &Raw<'_>) -> Result<ImageOptions, ConfigError> {
    let file_root = raw.optional(Key::ImageRoot).map(PathBuf::from);
    if let Some(root) = &file_root
        && !root.is_absolute()
    {
        return Err(err(format!(
            "--image-root: {} is not an absolute path",
            crate::quote::path(root)
        )));
    }
    let stall = raw.duration(Key::ImageStallTimeout)?;
    if stall.is_zero() {
        return Err(err(
            "--image-stall-timeout: 0 would fail every download; give a duration such as 60s",
        ));
    }
    let deadline = raw.duration(Key::ImageDownloadTimeout)?;
    if deadline < stall {
        return Err(err(
            "--image-download-timeout is shorter than --image-stall-timeout: every slow download would fail; give it hours (1h)",
        ));
    }
    let min_rate = raw.number(Key::ImageMinRate)?.saturating_mul(1024);
    let ranges = |key: Key| {
        Cidr::parse_list(&raw.get(key)).map_err(|e| err(format!("--{}: {e}", key.setting().flag)))
    };
    Ok(ImageOptions {
        proxy: proxy(raw)?,
        file_root,
        stall,
        deadline,
        min_rate,
        reach: Reach {
            deny: ranges(Key::GuestDeny)?,
            allow: ranges(Key::ImageAllow)?,
        },
    })
}

fn snapshot_limits(raw: &Raw<'_>) -> Result<SnapshotLimits, ConfigError> {
    let max_bytes = raw.number(Key::MaxResponseBytes)?;
    if max_bytes < 1024 {
        return Err(err("--max-response-bytes must be at least 1024"));
    }
    let count = |key: Key| -> Result<usize, ConfigError> {
        let flag = key.setting().flag;
        match raw.number(key)? {
            0 => Err(err(format!("--{flag} must be at least 1"))),
            n => usize::try_from(n).map_err(|_| err(format!("--{flag} is too large"))),
        }
    };
    Ok(SnapshotLimits {
        max_bytes,
        max_vms: count(Key::MaxVms)?,
        max_volumes: count(Key::MaxVolumes)?,
    })
}

// ── how guests boot, and their networks ─────────────────────────────────

fn tap_prefix(raw: &Raw<'_>) -> Result<String, ConfigError> {
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

fn guest_boot(raw: &Raw<'_>) -> Result<GuestBoot, ConfigError> {
    let tap_prefix = tap_prefix(raw)?;
    let run_dir = raw.get(Key::RunDir);
    no_comma(Key::RunDir, &run_dir)?;
    let kernel = raw.optional(Key::Kernel).map(PathBuf::from);
    let firmware = raw.optional(Key::Firmware).map(PathBuf::from);
    if kernel.is_some() && firmware.is_some() {
        return Err(err(
            "--kernel and --firmware are both set; a guest boots one or the other",
        ));
    }
    Ok(GuestBoot {
        underlay: underlay(raw)?,
        guest_dns: guest_dns(raw)?,
        host_networks: host_networks(raw)?,
        hypervisor: PathBuf::from(raw.get(Key::Hypervisor)),
        run_dir: PathBuf::from(run_dir),
        tap_prefix,
        kernel,
        firmware,
        cmdline: raw.get(Key::Cmdline),
        stop_grace: raw.duration(Key::StopGrace)?,
        confinement: confinement(raw)?,
    })
}

fn confinement(raw: &Raw<'_>) -> Result<Confinement, ConfigError> {
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
    let serial_mb = raw.number(Key::SerialLogMaxMb)?;
    if serial_mb == 0 {
        return Err(err(
            "--serial-log-max-mb: 0 would keep no serial output at all; give at least 1",
        ));
    }
    Ok(Confinement {
        first_id: first,
        id_count: count,
        kvm: PathBuf::from(raw.get(Key::KvmDevice)),
        userfaultfd: raw.optional(Key::UserfaultfdDevice).map(PathBuf::from),
        cgroup_root,
        allow_without,
        serial_log_bytes: serial_mb.saturating_mul(1 << 20),
        limits: limit_defaults(raw)?,
    })
}

/// The `--vm-…` limits, each bounded as a spec's own is.
fn limit_defaults(raw: &Raw<'_>) -> Result<crate::model::LimitDefaults, ConfigError> {
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
    Ok(crate::model::LimitDefaults {
        cpu_max_millis_per_vcpu: within(Key::VmCpuMaxPerVcpu, 1000)?,
        cpu_burst_ms: within(Key::VmCpuBurst, 100 * u64::from(Limits::MAX_VCPUS))?,
        disk_mbps: within(Key::VmDiskMbps, Limits::MAX_DISK_MBPS)?,
        disk_iops: within(Key::VmDiskIops, Limits::MAX_DISK_IOPS)?,
        net_mbps: within(Key::VmNetMbps, Limits::MAX_NET_MBPS)?,
    })
}

fn underlay(raw: &Raw<'_>) -> Result<Option<UnderlayConfig>, ConfigError> {
    let Some(bridge) = raw.optional(Key::UnderlayBridge) else {
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
    let ranges = |key: Key| {
        Cidr::parse_list(&raw.get(key)).map_err(|e| err(format!("--{}: {e}", key.setting().flag)))
    };
    Ok(Some(UnderlayConfig {
        bridge,
        subnet,
        table: "eitri".into(),
        tap_prefix: tap_prefix(raw)?,
        egress: Egress {
            deny: ranges(Key::GuestDeny)?,
            allow: ranges(Key::GuestAllow)?,
            dns: Vec::new(),
        },
    }))
}

/// `--guest-dns`; `None` when not given: the daemon then tells guests the
/// host's own resolvers.
fn guest_dns(raw: &Raw<'_>) -> Result<Option<Vec<Ipv4Addr>>, ConfigError> {
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

fn host_networks(raw: &Raw<'_>) -> Result<HashMap<String, String>, ConfigError> {
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

// ── how the engine behaves ───────────────────────────────────────────────

fn engine(raw: &Raw<'_>) -> Result<EngineConfig, ConfigError> {
    let vm_timeout = raw.duration(Key::VmTimeout)?;
    let max_create_attempts = raw.number(Key::MaxCreateAttempts)?;
    if !(1..=1000).contains(&max_create_attempts) {
        return Err(err("--max-create-attempts must be between 1 and 1000"));
    }
    Ok(EngineConfig {
        vm_timeout: (!vm_timeout.is_zero()).then_some(vm_timeout),
        tombstone_grace: raw.duration(Key::TombstoneGrace)?,
        vanish_grace: raw.duration(Key::VanishGrace)?,
        max_create_attempts: max_create_attempts as u32,
        create_rearm: raw.duration(Key::CreateRearm)?,
        max_concurrent_creates: raw.number(Key::MaxConcurrentCreates)? as usize,
        caps: HostCaps {
            max_vcpus: raw.number(Key::MaxVcpus)?,
            max_mem_mb: raw.number(Key::MaxMemMb)?,
            max_disk_gb: raw.number(Key::MaxDiskGb)?,
        },
        ..EngineConfig::default()
    })
}
