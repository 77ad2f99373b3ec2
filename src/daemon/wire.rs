//! The composition root: the one place the daemon's real parts are made
//! and wired together (the store, the backend and its network through
//! [`super::recover`], the image cache, the engine, the source and
//! its exchange thread, the signal thread), then handed to the main loop.
//! Tests wire fakes instead, through [`Daemon::new`](super::Daemon::new).

use std::path::PathBuf;
use std::sync::Arc;

use super::{
    Daemon, DaemonError, Exchange, Link, Parts, Readiness, Recovered, Signals, SystemClock,
    XorShift, discover, metrics, recover,
};
use crate::config::{Config, DesiredSource};
use crate::pb;
use crate::reconcile::seams::{HostFacts, SystemHost};
use crate::reconcile::{Engine, Seams};
use crate::seed::NoCloudSeed;
use crate::source::{FileSource, HttpSource, Source};

/// The host's self-description, sent with every request.
pub fn host_info(config: &Config, host_id: String, boot_id: String) -> pb::HostInfo {
    pb::HostInfo {
        host_id,
        agent_version: crate::version::AGENT_VERSION.to_owned(),
        boot_id,
        max_vcpus: config.reconcile.engine.caps.max_vcpus as i64,
        max_mem_mb: config.reconcile.engine.caps.max_mem_mb as i64,
        max_disk_gb: config.reconcile.engine.caps.max_disk_gb as i64,
    }
}

/// systemd's notify socket, when the agent runs under `Type=notify`; one
/// that cannot be used is said, and the agent runs on (systemd then says
/// why it never became ready).
fn systemd_readiness() -> Option<Readiness> {
    let path = std::env::var_os("NOTIFY_SOCKET").filter(|p| !p.is_empty())?;
    #[cfg(target_os = "linux")]
    match Readiness::systemd(&path) {
        Ok(readiness) => return Some(readiness),
        Err(e) => log::warn!(
            "NOTIFY_SOCKET={}: {e}; readiness cannot be said",
            path.display()
        ),
    }
    #[cfg(not(target_os = "linux"))]
    log::warn!(
        "NOTIFY_SOCKET={} is systemd's, and this is not Linux",
        path.display()
    );
    None
}

/// Runs the daemon with the host's real parts until SIGTERM or SIGINT.
/// `signals` were installed first thing in `main`, so a signal that came
/// while the agent was starting is acted on, not fatal.
pub fn run(mut config: Config, signals: Signals) -> Result<(), DaemonError> {
    crate::events::keep_in(crate::state::Layout::new(&config.state.dir));
    config.reconcile.engine.caps.fds = open_file_budget();
    let readiness = before_anything_runs(&config)?;
    let (events, rx) = crossbeam_channel::unbounded();
    let signal_thread = signals
        .spawn(events.clone())
        .map_err(DaemonError::Signals)?;
    let host = Arc::new(SystemHost::new().map_err(DaemonError::BootId)?);
    let boot_id = host.boot_id();
    let guest_dns = config
        .guest
        .guest_dns
        .clone()
        .unwrap_or_else(discover::resolvers);
    let Recovered {
        store,
        images,
        provisioner,
        mut notes,
    } = recover::recover(&config, guest_dns)?;
    notes.extend(what_the_operator_should_know(&config));
    notes.extend(host_checks(&config));
    let seams = Seams {
        provisioner,
        images: Arc::clone(&images) as Arc<dyn crate::reconcile::seams::Images>,
        seed: Arc::new(seed_maker(&config, &mut notes)),
        host_keys: Arc::new(crate::hostkey::LocalHostKeys),
        host,
    };
    let usage = config
        .reporting
        .usage_interval
        .and_then(|every| crate::usage::Sampler::start(Arc::clone(&seams.provisioner), every));
    let engine = Arc::new(Engine::new(
        Arc::clone(&store),
        seams,
        config.reconcile.engine.clone(),
    ));
    let source = source_of(&config);
    let (remote, described) = (source.is_remote(), source.describe());
    let host_id = config
        .source
        .host_id
        .clone()
        .unwrap_or_else(discover::host_id);
    log::info!(
        "eitri-agent {} starting: host {host_id}, state dir {}, {described}",
        crate::version::AGENT_VERSION,
        config.state.dir.display(),
    );
    let link = Link::new(events);
    let info = host_info(&config, host_id, boot_id);
    let mut rng = XorShift::seeded();
    let exchange = Exchange::new(
        source,
        info.clone(),
        config.reconcile.tick,
        config.source.backoff_max,
        Box::new(SystemClock::new()),
        Box::new(move || rng.next_unit()),
        Arc::clone(&link),
    )
    .spawn()
    .map_err(|source| DaemonError::Thread {
        name: "source",
        source,
    })?;
    let daemon = Daemon::new(
        config.reconcile.tick,
        Parts {
            store,
            engine,
            link,
            host: info,
            source: described,
            remote,
            readiness,
            notes,
            image_cache_max: image_cache_bytes(&config),
            agents_dir: Some(config.state.agents_dir.clone()),
            max_epoch_step: config.source.max_epoch_step,
            usage,
            metrics: config
                .reporting
                .metrics_file
                .clone()
                .map(|path| metrics::MetricsFile::new(path, Arc::clone(&images))),
        },
    );
    daemon.run(&rx, Some(exchange), config.reconcile.shutdown_grace);
    signal_thread.stop();
    log::info!("stopped");
    Ok(())
}

/// What is settled before the agent runs anything: the readiness fd taken
/// (first, so no child can inherit it), the control plane's token file's
/// mode checked, and every program the agent will run found once by
/// absolute path (and logged).
fn before_anything_runs(config: &Config) -> Result<Option<Readiness>, DaemonError> {
    let readiness = config
        .reporting
        .notify_fd
        .map(|fd| Readiness::adopt(fd).map_err(|source| DaemonError::Notify { fd, source }))
        .transpose()?
        .or_else(systemd_readiness);
    if let DesiredSource::ControlPlane(cp) = &config.source.desired
        && let Some(token) = &cp.token_file
    {
        crate::source::check_token_mode(token).map_err(DaemonError::Token)?;
    }
    if config.guest.underlay.is_some() {
        for program in ["ip", "nft", "iptables"] {
            crate::programs::resolved(program);
        }
    }
    Ok(readiness)
}

/// The agent's open-file limit raised to what the host lets it have (its
/// hard limit), logged, and the budget its VMs are held to under it (see
/// [`crate::reconcile::FdBudget`]): each published port holds a socket, so
/// a tenant with many could otherwise spend the descriptors another VM's
/// create needs.
fn open_file_budget() -> crate::reconcile::FdBudget {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        log::warn!("cannot read the open-file limit: VMs are not held to a descriptor budget");
        return crate::reconcile::FdBudget::default();
    };
    // macOS refuses a soft limit past OPEN_MAX however high the hard one.
    let want = if cfg!(target_os = "macos") {
        hard.min(10_240)
    } else {
        hard
    };
    let limit = if want > soft && setrlimit(Resource::RLIMIT_NOFILE, want, hard).is_ok() {
        log::info!("open-file limit raised from {soft} to {want} (the hard limit)");
        want
    } else {
        soft
    };
    let budget = crate::reconcile::FdBudget::under(limit);
    log::info!(
        "open files: VMs and their published ports may hold {} of {limit} ({} kept for creates, probes and downloads in flight)",
        limit.saturating_sub(budget.reserve),
        budget.reserve
    );
    budget
}

/// `--image-cache-max` in bytes: a share is of the state dir's filesystem,
/// measured now, and said.
fn image_cache_bytes(config: &Config) -> Option<u64> {
    let cap = config.images.cache_max?;
    let total = crate::state::Room::at(&config.state.dir).map_or(0, |room| room.size);
    let bytes = cap.bytes(total);
    if let crate::config::CacheCap::Percent(p) = cap {
        log::info!(
            "the image cache is held to {} ({p}% of the state dir's filesystem)",
            crate::human::bytes(bytes)
        );
    }
    Some(bytes)
}

/// Every host requirement, checked once at start (`eitri-agent check`
/// runs the same): what is not ok is logged, all of it, and noted for
/// `status` as found at start (the agent runs on: it must report).
fn host_checks(config: &Config) -> Vec<String> {
    use crate::provision::checklist::{self, Verdict};
    let items = checklist::check(&config.host());
    let mut notes = Vec::new();
    for item in &items {
        let line = format!("host check: {}: {}", item.what, item.detail);
        match item.verdict {
            Verdict::Ok => log::debug!("{line}"),
            Verdict::Warn => log::warn!("{line}"),
            Verdict::Fail => log::error!("{line}; no VM can be created until it is fixed"),
        }
        if item.verdict != Verdict::Ok {
            notes.push(format!(
                "at start, {line} (`eitri-agent check` looks again)"
            ));
        }
    }
    let bad = items.iter().filter(|i| i.verdict != Verdict::Ok).count();
    log::info!(
        "host checks: {} of {} ok{}",
        items.len() - bad,
        items.len(),
        if bad > 0 { " (the others above)" } else { "" }
    );
    notes
}

/// What the operator should know of this agent's settings from the start
/// (in `status`, and logged): caps not set, desired state not signed.
fn what_the_operator_should_know(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let caps = config.reconcile.engine.caps;
    let unlimited: Vec<&str> = [
        (caps.max_vcpus, "--max-vcpus"),
        (caps.max_mem_mb, "--max-mem-mb"),
        (caps.max_disk_gb, "--max-disk-gb"),
    ]
    .into_iter()
    .filter(|(cap, _)| *cap == 0)
    .map(|(_, flag)| flag)
    .collect();
    if !unlimited.is_empty() {
        let note = format!(
            "no cap on {}: every VM desired state names is admitted however much the host has",
            unlimited.join(", ")
        );
        log::warn!("{note}");
        out.push(note);
    }
    // The images' deny list is --guest-deny as given (see config::run).
    if config.guest.underlay.is_some() && config.images.fetch.reach.deny.is_empty() {
        let note = "--guest-deny is empty: guests may reach every private network this host routes to (its management LAN included) but its own addresses, link-local and the control plane; list what they must not reach";
        log::warn!("{note}");
        out.push(note.into());
    }
    match &config.source.trust {
        None => out.push(
            "desired state is unauthenticated: whoever can answer for the control plane (or write the desired file) decides what this host runs; pin the signer's keys with --trusted-keys".into(),
        ),
        Some(keys) => log::info!(
            "desired state is taken only signed by a pinned key: {}",
            keys.ids().collect::<Vec<_>>().join(", ")
        ),
    }
    out
}

/// Where desired state comes from: the desired file, or the control plane.
fn source_of(config: &Config) -> Box<dyn Source> {
    match &config.source.desired {
        DesiredSource::File(path) => Box::new(FileSource::new(
            PathBuf::from(path),
            config.source.limits,
            config.source.trust.clone(),
        )),
        DesiredSource::ControlPlane(cp) => {
            let source = HttpSource::new(
                cp.clone(),
                config.source.limits,
                config.source.proxy.as_deref(),
                config.source.trust.clone(),
            );
            // A control plane that signs what it sends hears reports it can
            // tell are this host's.
            if config.source.trust.is_none() {
                return Box::new(source);
            }
            let path = crate::state::Layout::new(&config.state.dir).host_signing_key();
            match crate::trust::SecretKey::host_key(&path) {
                Ok(key) => {
                    log::info!("reports are signed by this host's key {}", key.id());
                    Box::new(source.signing_reports(key))
                }
                Err(e) => {
                    log::error!(
                        "reports go unsigned, and a control plane that pinned this host's key refuses them: {e}"
                    );
                    Box::new(source)
                }
            }
        }
    }
}

/// The seeds of new VMs: carrying the guest agent `--guest-agent` names
/// (or finds beside the agent), else none; one that cannot be read is a
/// note for the operator, and seeds go without it.
fn seed_maker(config: &Config, notes: &mut Vec<String>) -> NoCloudSeed {
    let Some(path) = &config.guest.guest_agent else {
        log::info!(
            "no guest agent is delivered to new VMs (--guest-agent off, or no eitri-guest beside this agent)"
        );
        return NoCloudSeed::default();
    };
    match NoCloudSeed::delivering(path) {
        Ok(seed) => {
            log::info!(
                "new VMs' seeds carry the guest agent {} (cloud-init installs and starts it)",
                crate::quote::path(path)
            );
            seed
        }
        Err(e) => {
            let why = format!(
                "the guest agent {} cannot be delivered ({e}): new VMs get none; fix --guest-agent or set it off",
                crate::quote::path(path)
            );
            log::warn!("{why}");
            notes.push(why);
            NoCloudSeed::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Config {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        match crate::config::parse(&args, &Default::default()) {
            Ok(crate::config::Command::Run(c)) => *c,
            _ => panic!("not a run: {args:?}"),
        }
    }

    #[test]
    fn networked_guests_without_a_guest_deny_list_are_named() {
        let open = config(&["run", "--desired", "/d"]);
        let listed = config(&["run", "--desired", "/d", "--guest-deny", "10.0.0.0/8"]);

        let said = what_the_operator_should_know(&open).join("\n");
        let quiet = what_the_operator_should_know(&listed).join("\n");

        assert!(said.contains("--guest-deny is empty"), "{said}");
        assert!(!quiet.contains("--guest-deny"), "{quiet}");
    }
}
