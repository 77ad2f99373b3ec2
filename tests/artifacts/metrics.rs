//! The metrics file (`--metrics-file`) read back by a real Prometheus
//! parser (Debian's python3-prometheus-client): it parses, its counters
//! only rise, and a destroyed VM's series are gone the tick after.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::daemon::metrics::MetricsFile;
use eitri_agent::deadline::Deadline;
use eitri_agent::image::ImageCache;
use eitri_agent::metrics::CounterVec;
use eitri_agent::model::Snapshot;
use eitri_agent::pb;
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::state::Store;
use eitri_agent::testkit::{Fakes, Op, desired, id, present, snapshot, tombstoned};

/// Debian's python, which the package is installed for (a `python3`
/// earlier on PATH may be another).
const PYTHON: &str = "/usr/bin/python3";

/// Every sample the parser read: `name{k=v,…}` → value.
fn parse(text: &str) -> BTreeMap<String, f64> {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("eitri.prom");
    std::fs::write(&file, text).expect("write");
    let out = Command::new(PYTHON)
        .arg("-c")
        .arg(
            "import sys\n\
             from prometheus_client.parser import text_string_to_metric_families\n\
             for fam in text_string_to_metric_families(open(sys.argv[1]).read()):\n\
             \x20   for s in fam.samples:\n\
             \x20       labels = ','.join(k + '=' + v for k, v in sorted(s.labels.items()))\n\
             \x20       print(s.name + '{' + labels + '} ' + repr(float(s.value)))\n",
        )
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("{PYTHON} (apt install python3-prometheus-client): {e}"));
    assert!(
        out.status.success(),
        "the parser refused the file: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

struct Host {
    _dir: tempfile::TempDir,
    fakes: Arc<Fakes>,
    engine: Engine,
    metrics: MetricsFile,
    /// The usage samples the file is written with.
    usage: std::collections::HashMap<String, eitri_agent::usage::Usage>,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Store::open(&dir.path().join("state")).expect("store"));
        let fakes = Fakes::new();
        let engine = Engine::new(
            Arc::clone(&store),
            fakes.seams(),
            EngineConfig {
                tombstone_grace: Duration::ZERO,
                ..EngineConfig::default()
            },
        );
        let images = Arc::new(ImageCache::new(dir.path().join("images")));
        let metrics = MetricsFile::new(dir.path().join("eitri.prom"), images);
        Host {
            _dir: dir,
            fakes,
            engine,
            metrics,
            usage: Default::default(),
        }
    }

    /// One tick, and the metrics file as it would be written after it.
    fn tick(&self, snap: &Snapshot) -> String {
        self.engine.step(snap);
        assert!(
            self.engine
                .wait_idle(Deadline::after(Duration::from_secs(20)))
        );
        let host = pb::HostInfo {
            host_id: "host-\"a\"".into(),
            agent_version: "1.0.0".into(),
            ..Default::default()
        };
        let failures = CounterVec::default();
        failures.inc("unreachable");
        self.metrics.render(
            &host,
            &self.engine,
            &self.engine.published(),
            snap.epoch,
            &eitri_agent::daemon::metrics::Kept {
                contact_failures: &failures,
                epoch_refusals: &CounterVec::default(),
                usage: &self.usage,
            },
        )
    }
}

#[test]
fn the_metrics_file_parses_with_a_prometheus_parser() {
    let h = Host::new();
    h.fakes
        .fail_permanently(Op::PrepareRootDisk, "vm-2", "no such image format");

    let text = h.tick(&snapshot(
        1,
        vec![present(desired("vm-1")), present(desired("vm-2"))],
    ));

    let samples = parse(&text);
    assert_eq!(
        samples.get("eitri_agent_info{host_id=host-\"a\",version=1.0.0}"),
        Some(&1.0),
        "{samples:#?}"
    );
    assert_eq!(
        samples.get("eitri_vms{phase=ready,power=running}"),
        Some(&1.0)
    );
    assert_eq!(
        samples.get("eitri_vms{phase=failed,power=stopped}"),
        Some(&1.0)
    );
    assert_eq!(
        samples.get("eitri_create_failures_total{permanence=permanent}"),
        Some(&1.0)
    );
    assert_eq!(samples.get("eitri_vm_lost_total{vm_id=vm-1}"), Some(&0.0));
    assert!(samples.contains_key("eitri_step_duration_seconds_count{}"));
    assert!(samples.contains_key("eitri_boot_duration_seconds_bucket{le=+Inf}"));
    // Both were admitted; a failed create keeps its place for its retry.
    assert_eq!(
        samples.get("eitri_quota_committed{resource=vcpus}"),
        Some(&2.0)
    );
}

#[test]
fn a_sampled_vm_has_its_usage_series_and_an_unsampled_one_none() {
    let mut h = Host::new();
    h.usage.insert(
        "vm-1".into(),
        eitri_agent::usage::Usage {
            resident_bytes: Some(512 << 20),
            totals: eitri_agent::usage::Totals {
                cpu_ns: Some(2_500_000_000),
                disk_write_bytes: Some(4096),
                net_rx_bytes: Some(100),
                ..Default::default()
            },
            ..Default::default()
        },
    );

    let samples = parse(&h.tick(&snapshot(
        1,
        vec![present(desired("vm-1")), present(desired("vm-2"))],
    )));

    assert_eq!(
        samples.get("eitri_vm_cpu_seconds_total{vm_id=vm-1}"),
        Some(&2.5)
    );
    assert_eq!(
        samples.get("eitri_vm_memory_resident_bytes{vm_id=vm-1}"),
        Some(&f64::from(512u32 << 20))
    );
    assert_eq!(
        samples.get("eitri_vm_disk_written_bytes_total{vm_id=vm-1}"),
        Some(&4096.0)
    );
    assert_eq!(
        samples.get("eitri_vm_network_received_bytes_total{vm_id=vm-1}"),
        Some(&100.0)
    );
    // A total the VMM did not give is no series, not a 0.
    assert_eq!(
        samples.get("eitri_vm_disk_read_bytes_total{vm_id=vm-1}"),
        None
    );
    assert!(
        !samples
            .keys()
            .any(|k| k.contains("vm_id=vm-2") && k.starts_with("eitri_vm_cpu"))
    );
}

#[test]
fn a_suspend_and_a_resume_are_counted_and_timed_and_the_vm_counted_by_its_power() {
    let h = Host::new();
    let mut asleep = desired("vm-1");
    asleep.power = eitri_agent::model::PowerState::Suspended;
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    let suspended = parse(&h.tick(&snapshot(2, vec![present(asleep)])));

    let resumed = parse(&h.tick(&snapshot(3, vec![present(desired("vm-1"))])));

    assert_eq!(
        suspended.get("eitri_vms{phase=ready,power=suspended}"),
        Some(&1.0)
    );
    assert_eq!(
        suspended.get("eitri_suspend_duration_seconds_count{}"),
        Some(&1.0)
    );
    assert_eq!(
        resumed.get("eitri_resume_duration_seconds_count{}"),
        Some(&1.0)
    );
    assert_eq!(
        resumed.get("eitri_resume_cold_boots_total{why=unusable}"),
        Some(&0.0)
    );
}

#[test]
fn counters_only_rise_across_ticks() {
    let h = Host::new();
    h.fakes.fail(Op::Boot, "vm-3", "a moment's trouble");
    let ticks = [
        snapshot(1, vec![present(desired("vm-1"))]),
        snapshot(2, vec![present(desired("vm-1")), present(desired("vm-2"))]),
        snapshot(3, vec![present(desired("vm-2")), present(desired("vm-3"))]),
        snapshot(4, vec![tombstoned("vm-2"), present(desired("vm-3"))]),
        snapshot(5, vec![present(desired("vm-3"))]),
    ];
    let mut before: BTreeMap<String, f64> = BTreeMap::new();

    for (n, snap) in ticks.iter().enumerate() {
        if n == 2 {
            h.fakes.kill(&id("vm-2"));
        }
        let now = parse(&h.tick(snap));
        for (name, value) in &now {
            let counter = name.contains("_total{")
                || name.contains("_bucket{")
                || name.ends_with("_count{}")
                || name.ends_with("_sum{}");
            if let Some(old) = before.get(name).filter(|_| counter) {
                assert!(value >= old, "tick {n}: {name} fell from {old} to {value}");
            }
        }
        before = now;
    }

    assert!(before["eitri_create_attempts_total{}"] >= 3.0);
    assert!(before["eitri_destroys_total{}"] >= 1.0);
}

#[test]
fn a_destroyed_vms_series_are_gone_the_tick_after() {
    let h = Host::new();
    let with = parse(&h.tick(&snapshot(1, vec![present(desired("vm-1"))])));
    assert!(with.contains_key("eitri_vm_lost_total{vm_id=vm-1}"));

    let after = h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!after.contains("vm-1"), "{after}");
    assert_eq!(parse(&after).get("eitri_destroys_total{}"), Some(&1.0));
}

#[test]
fn a_vm_lost_is_counted_once() {
    let h = Host::new();
    let snap = snapshot(1, vec![present(desired("vm-1"))]);
    h.tick(&snap);

    h.fakes.kill(&id("vm-1"));
    let text = h.tick(&snap);

    assert_eq!(
        parse(&text).get("eitri_vm_lost_total{vm_id=vm-1}"),
        Some(&1.0)
    );
}

#[test]
fn a_vms_limits_egress_ranges_and_probe_are_series_of_their_own() {
    let h = Host::new();
    h.fakes.set_addresses(&id("vm-1"), "127.0.0.1", "");
    let guest = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let mut d = desired("vm-1");
    d.spec.limits.cpu_max_millis = 500;
    d.spec.limits.net_mbps = 100;
    d.egress.deny = eitri_agent::model::Cidr::parse_list("0.0.0.0/0").expect("deny");
    d.egress.allow = eitri_agent::model::Cidr::parse_list("10.0.0.0/8, 192.0.2.7").expect("allow");
    d.readiness = Some(tcp_probe(&guest));

    let samples = parse(&h.tick(&snapshot(1, vec![present(d)])));

    let at = |key: &str| samples.get(key).copied();
    assert_eq!(
        at("eitri_vm_limit{limit=cpu_max_millis,vm_id=vm-1}"),
        Some(500.0),
        "{samples:#?}"
    );
    assert_eq!(at("eitri_vm_limit{limit=net_mbps,vm_id=vm-1}"), Some(100.0));
    assert_eq!(at("eitri_vm_limit{limit=disk_mbps,vm_id=vm-1}"), Some(0.0));
    assert_eq!(
        at("eitri_vm_egress_ranges{list=deny,vm_id=vm-1}"),
        Some(1.0)
    );
    assert_eq!(
        at("eitri_vm_egress_ranges{list=allow,vm_id=vm-1}"),
        Some(2.0)
    );
    assert_eq!(at("eitri_vm_probe_answering{vm_id=vm-1}"), Some(1.0));
}

#[test]
fn a_vm_failing_its_probe_after_it_answered_is_counted_unhealthy() {
    let h = Host::new();
    h.fakes.set_addresses(&id("vm-1"), "127.0.0.1", "");
    let guest = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let mut d = desired("vm-1");
    d.readiness = Some(tcp_probe(&guest));
    let snap = snapshot(1, vec![present(d)]);
    let answering = parse(&h.tick(&snap));
    drop(guest);
    h.fakes.advance_clock(Duration::from_secs(2));

    let failing = parse(&h.tick(&snap));

    assert_eq!(answering.get("eitri_vms_unhealthy{}").copied(), Some(0.0));
    assert_eq!(failing.get("eitri_vms_unhealthy{}").copied(), Some(1.0));
}

/// A TCP probe of `guest`'s port every 2 s, with a grace of 60 s.
fn tcp_probe(guest: &std::net::TcpListener) -> eitri_agent::model::Readiness {
    eitri_agent::model::Readiness {
        check: eitri_agent::model::Check::Tcp(guest.local_addr().expect("addr").port()),
        period: Duration::from_secs(2),
        timeout: Duration::from_millis(500),
        grace: Duration::from_secs(60),
        restart_after: None,
    }
}
