//! The cloud-hypervisor backend against the project's stand-in hypervisor:
//! real forks, real sockets, real taps, real signals. Through the engine
//! where the rule is the engine's.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

use eitri_agent::state::lifecycle::{Lifecycle, LifecycleParts};
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::hostkey::LocalHostKeys;
use eitri_agent::image::{ImageCache, ImageOptions, sha256_file};
use eitri_agent::model::{Phase, PowerState, Snapshot};
use eitri_agent::provision::Lifecycle as Backend;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::provision::jail::cgroup::Cgroups;
use eitri_agent::provision::supervise::StopTimeouts;
use eitri_agent::reconcile::{Engine, EngineConfig, Seams};
use eitri_agent::seed::NoCloudSeed;
use eitri_agent::state::Store;
use eitri_agent::testkit::net::{link_exists, nft_ruleset, nft_set_elements};
use eitri_agent::testkit::{Fakes, desired, id, present, snapshot, tombstoned};

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// A bound for a test to fail on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(20);

struct Host {
    dir: tempfile::TempDir,
    store: Arc<Store>,
    cfg: CloudHvConfig,
    backend: Arc<CloudHypervisor>,
    fakes: Arc<Fakes>,
    engine: Option<Engine>,
    base_url: String,
    base_sha: String,
    /// Destroy every VM on drop; off for the old half of a restart.
    cleanup: bool,
    /// What the guest writes on its serial console once it runs: the
    /// stand-in's "booting", or the real guest's marker.
    serial_marker: String,
}

/// A tap prefix of this test process alone: parallel tests never touch
/// each other's links, and no real host names a link like this.
fn tap_prefix() -> String {
    format!("et{:04x}", std::process::id() & 0xffff)
}

/// The tests' underlay, its taps named with this process's prefix.
fn underlay() -> eitri_agent::net::underlay::UnderlayConfig {
    eitri_agent::net::underlay::UnderlayConfig {
        tap_prefix: tap_prefix(),
        ..eitri_agent::testkit::net::underlay_config()
    }
}

/// The VMs start-up recovery knows of: those with a record.
fn known(store: &Store) -> Vec<eitri_agent::model::Id> {
    store.load_all().keys().cloned().collect()
}

/// A copy of the stand-in in `dir`, with knobs set.
fn launcher(dir: &Path, knobs: &[(&str, &str)]) -> PathBuf {
    let path = dir.join(format!("hv-{}", knobs.len()));
    eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &path, knobs);
    path
}

impl Host {
    fn new(knobs: &[(&str, &str)]) -> Host {
        let dir = tempfile::tempdir().expect("tempdir");
        Host::in_dir(dir, knobs)
    }

    /// A host whose hypervisor is a real cloud-hypervisor booting `kernel`.
    /// The root disk is `EITRI_TEST_GUEST_IMAGE` when set, else a blank one.
    fn real(hypervisor: PathBuf, kernel: PathBuf) -> Host {
        let mut h = Host::new(&[]);
        h.cfg.hypervisor = hypervisor;
        h.cfg.kernel = Some(kernel);
        h.cfg.boot_wait = Duration::from_secs(30);
        // Confined as on a host: the real VMM, as its own user, opens the
        // real /dev/kvm (its group is given access by an ACL entry).
        h.cfg.confinement.kvm = PathBuf::from("/dev/kvm");
        // And, resuming, the real userfaultfd device (given the same way).
        h.cfg.confinement.userfaultfd = Some(PathBuf::from("/dev/userfaultfd"));
        if let Some(image) = std::env::var_os("EITRI_TEST_GUEST_IMAGE") {
            h.base_sha = sha256_file(Path::new(&image)).expect("hash the guest image");
            h.base_url = format!("file://{}", PathBuf::from(image).display());
        }
        // The tiny guest (`mkguest.py`) prints its marker first thing.
        h.serial_marker =
            std::env::var("EITRI_TEST_GUEST_MARKER").unwrap_or_else(|_| "TINY-GUEST-UP".into());
        h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
        h.backend.recover(&known(&h.store));
        h.engine = Some(h.make_engine());
        h
    }

    fn in_dir(dir: tempfile::TempDir, knobs: &[(&str, &str)]) -> Host {
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"not really a kernel").expect("kernel");
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![0x5a; 1 << 20]).expect("base image");
        let base_sha = sha256_file(&base).expect("hash");
        let cfg = CloudHvConfig {
            hypervisor: launcher(dir.path(), knobs),
            kernel: Some(kernel),
            firmware: None,
            cmdline: "console=ttyS0".into(),
            run_dir: dir.path().join("run"),
            tap_prefix: tap_prefix(),
            boot_wait: Duration::from_secs(5),
            network: None,
            stop: StopTimeouts {
                power_button: Duration::from_millis(500),
                vmm_shutdown: Duration::from_millis(500),
                terminate: Duration::from_millis(300),
                ..StopTimeouts::default()
            },
            confinement: eitri_agent::testkit::confinement(dir.path()),
        };
        let base_url = format!("file://{}", base.display());
        Host::assemble(dir, cfg, Fakes::new(), base_url, base_sha)
    }

    /// A host over `dir`'s state dir, with a fresh backend and engine.
    fn assemble(
        dir: tempfile::TempDir,
        cfg: CloudHvConfig,
        fakes: Arc<Fakes>,
        base_url: String,
        base_sha: String,
    ) -> Host {
        let store = Arc::new(Store::open(&dir.path().join("state")).expect("store"));
        let backend = Arc::new(CloudHypervisor::new(Arc::clone(&store), cfg.clone()));
        // What the daemon's start-up recovery asks of the backend.
        backend.recover(&known(&store));
        let mut host = Host {
            dir,
            store,
            cfg,
            backend,
            fakes,
            engine: None,
            base_url,
            base_sha,
            cleanup: true,
            serial_marker: "booting".into(),
        };
        host.engine = Some(host.make_engine());
        host
    }

    fn make_engine(&self) -> Engine {
        let seams = Seams {
            provisioner: Arc::clone(&self.backend) as Arc<dyn Backend>,
            // The images these tests boot are wherever the test (or the
            // real-hypervisor env vars) put them: the whole tree is the root.
            images: Arc::new(ImageCache::with(
                self.store.layout().images(),
                &ImageOptions {
                    file_root: Some("/".into()),
                    ..ImageOptions::default()
                },
            )),
            seed: Arc::new(NoCloudSeed),
            host_keys: Arc::new(LocalHostKeys),
            host: self.fakes.seams().host,
        };
        let config = EngineConfig {
            agent_version: "1.0.0".into(),
            vm_timeout: Some(Duration::from_secs(30)),
            tombstone_grace: Duration::ZERO,
            ..EngineConfig::default()
        };
        Engine::new(Arc::clone(&self.store), seams, config)
    }

    /// A new agent over the same state dir and host: the old engine,
    /// backend and store are dropped (releasing the lock), the VMMs live on.
    fn restart(mut self) -> Host {
        drop(self.engine.take());
        self.cleanup = false;
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
        let (cfg, fakes, base_url, base_sha) = (
            self.cfg.clone(),
            Arc::clone(&self.fakes),
            self.base_url.clone(),
            self.base_sha.clone(),
        );
        let serial_marker = std::mem::take(&mut self.serial_marker);
        drop(self);
        let mut host = Host::assemble(dir, cfg, fakes, base_url, base_sha);
        host.serial_marker = serial_marker;
        host
    }

    /// Gives the backend a host network (call in a private namespace).
    fn connect(&mut self) {
        let network = eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            self.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network");
        self.cfg.network = Some(Arc::new(network));
        self.backend = Arc::new(CloudHypervisor::new(
            Arc::clone(&self.store),
            self.cfg.clone(),
        ));
        self.backend.recover(&known(&self.store));
        self.engine = Some(self.make_engine());
    }

    fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("engine")
    }

    /// `vm` as desired state, its image this host's base.
    fn desired(&self, vm: &str) -> eitri_agent::model::DesiredVm {
        let mut d = desired(vm);
        d.spec.image_url = self.base_url.clone();
        d.spec.image_sha256 = self.base_sha.clone();
        d
    }

    fn vm(&self, vm: &str) -> Snapshot {
        snapshot(1, vec![present(self.desired(vm))])
    }

    /// Ticks, a second of the engine's clock apart and 50 ms of the
    /// host's, until `done` holds for the VM's row (at most 200 ticks).
    fn tick_until_row(
        &self,
        snap: &Snapshot,
        vm: &str,
        done: impl Fn(&eitri_agent::model::VmStatus) -> bool,
    ) -> eitri_agent::model::VmStatus {
        for _ in 0..200 {
            self.tick(snap);
            let row = self.row(vm);
            if done(&row) {
                return row;
            }
            self.fakes.advance_clock(Duration::from_secs(1));
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{vm} never got there: {:?}", self.row(vm));
    }

    fn tick(&self, snap: &Snapshot) -> eitri_agent::model::Report {
        let report = self.engine().step(snap);
        assert!(
            self.engine().wait_idle(Deadline::after(PATIENCE)),
            "engine did not go idle"
        );
        report
    }

    fn row(&self, vm: &str) -> eitri_agent::model::VmStatus {
        self.engine()
            .published()
            .vms
            .into_iter()
            .find(|r| r.vm_id == vm)
            .map(std::sync::Arc::unwrap_or_clone)
            .unwrap_or_else(|| panic!("no row for {vm}"))
    }

    fn pid(&self, vm: &str) -> Option<i32> {
        let text = std::fs::read_to_string(self.store.layout().pidfile(&id(vm))).ok()?;
        text.split_whitespace().next()?.parse().ok()
    }

    fn spec(&self, vm: &str) -> eitri_agent::model::VmSpec {
        let mut spec = desired(vm).spec;
        spec.image_url = self.base_url.clone();
        spec
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if !self.cleanup {
            return;
        }
        // The engine first: its workers would boot a VM destroyed below
        // again, on the exit of its VMM.
        drop(self.engine.take());
        // Leave no stand-in running behind a failed test.
        for link in std::fs::read_dir(self.store.root().join("vms"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(vm) = eitri_agent::model::Id::parse(&link.file_name().to_string_lossy()) {
                let _ = self
                    .backend
                    .destroy(&vm, Deadline::after(Duration::from_secs(5)));
            }
        }
        eitri_agent::testkit::remove_cgroup_root(&self.cfg.confinement.cgroup_root);
    }
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        let state = s
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        state != Some("Z")
    })
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stand-in processes serving this socket.
/// Live processes whose command line names `disk` as a VM's root disk:
/// that VM's hypervisors.
fn processes_on(disk: &Path) -> usize {
    let needle = format!("path={}", disk.display());
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
                c.split(|b| *b == 0).any(|a| {
                    a.strip_prefix(needle.as_bytes())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with(b","))
                })
            })
        })
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|p| p.parse().ok())
                .is_some_and(alive)
        })
        .count()
}

fn a_created_vm_boots_and_runs_on(h: Host) {
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready)),
        "{row:?}"
    );
    assert!(h.pid("vm-1").is_some_and(alive));
    let serial = std::fs::read_to_string(h.store.layout().serial_log(&id("vm-1"))).expect("serial");
    assert!(serial.contains(&h.serial_marker), "{serial}");
}

/// `vm` wanted with a readiness probe on `check` (period 1 s, grace 60 s).
fn probed(h: &Host, vm: &str, check: eitri_agent::model::Check) -> Snapshot {
    let mut d = h.desired(vm);
    d.readiness = Some(eitri_agent::model::Readiness {
        check,
        period: Duration::from_secs(1),
        timeout: Duration::from_millis(500),
        grace: Duration::from_secs(60),
        restart_after: None,
    });
    snapshot(1, vec![present(d)])
}

fn a_serial_probe_makes_the_vm_ready_once_its_guest_prints_the_line_on(h: Host) {
    let snap = probed(
        &h,
        "vm-1",
        eitri_agent::model::Check::Serial(h.serial_marker.clone()),
    );

    let row = h.tick_until_row(&snap, "vm-1", |r| r.phase == Some(Phase::Ready));

    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(row.last_error.is_empty(), "{row:?}");
}

fn a_serial_probe_for_a_line_the_guest_never_prints_holds_ready_back_on(h: Host) {
    let snap = probed(
        &h,
        "vm-1",
        eitri_agent::model::Check::Serial("NEVER-SAID-BY-ANY-GUEST".into()),
    );

    h.tick(&snap);
    h.tick(&snap);

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.status_detail
            .starts_with("waiting for the guest: console line \"NEVER-SAID-BY-ANY-GUEST\""),
        "{row:?}"
    );
}

// ── suspend and resume ───────────────────────────────────────────────────

/// `vm` wanted at `power`.
fn wanting(h: &Host, vm: &str, power: PowerState) -> Snapshot {
    let mut d = h.desired(vm);
    d.power = power;
    snapshot(1, vec![present(d)])
}

/// The VM's console as `eitri-agent logs` prints it: what its resumes
/// moved aside, then what its VMM writes now.
fn console(h: &Host, vm: &str) -> Vec<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_eitri-agent"))
        .args(["logs", vm, "--lines", "100000", "--state-dir"])
        .arg(h.store.root())
        .output()
        .expect("eitri-agent logs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// What the VM's VMM's API says its state is.
fn vm_state(h: &Host, vm: &str) -> Option<String> {
    let (status, body) = eitri_agent::provision::unix_http::request(
        &h.backend.socket_path(&id(vm)),
        "GET",
        "/api/v1/vm.info",
        None,
        Duration::from_secs(2),
    )
    .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    (status == 200).then(|| v.get("state")?.as_str().map(str::to_owned))?
}

/// Live processes whose command line names `vm` as theirs: its root disk
/// (a boot) or its snapshot (a restore).
fn vmms_of(h: &Host, vm: &str) -> usize {
    let layout = h.store.layout();
    let disk = format!("path={}", layout.root_disk(&id(vm)).display());
    let snapshot = format!("source_url=file://{}", layout.snapshot(&id(vm)).display());
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| alive(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.split(|b| *b == 0).any(|a| {
                    [disk.as_bytes(), snapshot.as_bytes()].iter().any(|n| {
                        a.strip_prefix(*n)
                            .is_some_and(|rest| rest.is_empty() || rest.starts_with(b","))
                    })
                })
            })
        })
        .count()
}

fn suspend_and_resume_twice_keep_the_guest_and_its_console_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    wait_until("the guest's marker", || {
        console(&h, "vm-1")
            .iter()
            .any(|l| l.contains(&h.serial_marker))
    });
    let booted = h.pid("vm-1").expect("pid");

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    let asleep = (
        h.row("vm-1").power,
        vmms_of(&h, "vm-1"),
        h.store.layout().snapshot_manifest(&id("vm-1")).is_file(),
    );
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let resumed = (h.row("vm-1").power, vmms_of(&h, "vm-1"));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(asleep, (Some(PowerState::Suspended), 0, true));
    assert!(!alive(booted), "the suspended VM's VMM is gone");
    assert_eq!(resumed, (Some(PowerState::Running), 1));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(vmms_of(&h, "vm-1"), 1);
    assert!(h.backend.running(&id("vm-1")));
    assert!(
        !h.store.layout().snapshot(&id("vm-1")).exists(),
        "a snapshot is spent once its guest runs"
    );
    let lines = console(&h, "vm-1");
    let markers = lines
        .iter()
        .filter(|l| l.contains(&h.serial_marker))
        .count();
    assert_eq!(markers, 1, "resumed, never booted again: {lines:?}");
}

fn a_suspended_vm_resumes_after_an_agent_restart_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let h = h.restart();
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    let still = (h.row("vm-1").power, vmms_of(&h, "vm-1"));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(still, (Some(PowerState::Suspended), 0));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(vmms_of(&h, "vm-1"), 1);
    assert_eq!(h.engine().counts().cold_boots.get("interrupted"), 0);
}

fn a_restored_hypervisor_is_jailed_in_namespaces_of_its_own_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid").to_string();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");

    assert_ne!(namespace(&pid, "net"), namespace("thread-self", "net"));
    assert_ne!(namespace(&pid, "mnt"), namespace("thread-self", "mnt"));
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse::<u32>().ok())
        .expect("uid");
    assert!(uid >= 1_900_000_000, "runs as its VM's own user: {uid}");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
}

fn a_disk_changed_while_suspended_boots_the_vm_from_its_disks_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    {
        use std::io::Write;
        let mut disk = std::fs::OpenOptions::new()
            .write(true)
            .open(h.store.layout().root_disk(&id("vm-1")))
            .expect("the root disk");
        disk.write_all(b"written while it slept").expect("write");
    }

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().cold_boots.get("unusable"), 1);
    assert!(
        !h.store.layout().snapshot(&id("vm-1")).exists(),
        "discarded"
    );
    let pid = h.pid("vm-1").expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let cmdline = String::from_utf8_lossy(&cmdline);
    assert!(
        cmdline.contains("--kernel") && !cmdline.contains("--restore"),
        "booted, not restored: {cmdline}"
    );
}

fn stopping_a_suspended_vm_discards_its_snapshot_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Stopped));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 0);
}

fn destroying_a_suspended_vm_leaves_nothing_of_it_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 0);
}

#[test]
fn a_snapshot_holding_a_file_cloud_hypervisor_never_writes_is_refused_and_the_vm_runs_on() {
    let h = Host::new(&[("STANDIN_SNAPSHOT_EXTRA", "planted.json")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(row.last_error.contains("planted.json"), "{row:?}");
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(
        vm_state(&h, "vm-1").as_deref(),
        Some("Running"),
        "the paused guest was resumed"
    );
}

/// A host whose VMMs cannot be given a userfaultfd device.
fn without_userfaultfd() -> Host {
    let mut h = Host::new(&[]);
    h.cfg.confinement.userfaultfd = None;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.engine = Some(h.make_engine());
    h
}

#[test]
fn a_host_without_a_userfaultfd_device_says_a_resume_reads_the_whole_snapshot() {
    let h = without_userfaultfd();

    let notes = h.backend.recover(&[]);

    assert!(
        notes
            .iter()
            .any(|n| n.contains("whole snapshot") && n.contains("--userfaultfd-device is empty")),
        "{notes:?}"
    );
}

#[test]
fn a_host_without_a_userfaultfd_device_resumes_by_reading_the_snapshot_first() {
    let h = without_userfaultfd();
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    let pid = h.pid("vm-1").expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let cmdline = String::from_utf8_lossy(&cmdline);
    assert!(cmdline.contains("memory_restore_mode=copy"), "{cmdline}");
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
}

#[test]
fn a_snapshot_whose_memory_is_larger_than_its_guests_is_refused_and_the_vm_runs_on() {
    let h = Host::new(&[("STANDIN_SNAPSHOT_BIG", "1")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(
        row.last_error.contains("more than its guest's could be"),
        "{row:?}"
    );
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
}

#[test]
fn a_restore_that_fails_boots_the_vm_from_its_disks_and_never_restores_again() {
    let h = Host::new(&[("STANDIN_RESTORE_FAIL", "1")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().cold_boots.get("failed"), 1);
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 1);
}

fn booting_twice_starts_one_process_on(h: Host) {
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("first boot");
    let first = h.pid("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("second boot");

    assert_eq!(h.pid("vm-1"), first);
    assert_eq!(processes_on(&h.store.layout().root_disk(&id("vm-1"))), 1);
}

fn an_agent_restart_adopts_the_running_hypervisor_on(h: Host) {
    h.tick(&h.vm("vm-1"));
    let before = h.pid("vm-1").expect("pid");

    let h = h.restart();
    h.tick(&h.vm("vm-1"));

    assert_eq!(h.pid("vm-1"), Some(before), "no new process");
    assert!(alive(before));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(processes_on(&h.store.layout().root_disk(&id("vm-1"))), 1);
}

/// Kills the VM's hypervisor with SIGKILL, and waits, with no step, for
/// another one to be running in its place.
fn kill_and_see_it_booted_again(h: &Host) -> (i32, i32) {
    let before = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(before),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until("a new hypervisor, with no step", || {
        h.pid("vm-1")
            .is_some_and(|p| p != before && alive(p) && h.backend.running(&id("vm-1")))
    });

    (before, h.pid("vm-1").expect("pid"))
}

fn a_killed_hypervisor_is_booted_again_without_a_tick_on(h: Host) {
    h.tick(&h.vm("vm-1"));

    let (before, after) = kill_and_see_it_booted_again(&h);

    assert!(!alive(before));
    assert!(alive(after));
    assert!(h.engine().wait_idle(Deadline::after(PATIENCE)));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
}

fn an_adopted_hypervisor_killed_is_booted_again_without_a_tick_on(h: Host) {
    h.tick(&h.vm("vm-1"));
    // The VMM outlives this agent: the next one's backend did not fork it,
    // so no reaper waits for it; the exit watch must.
    let h = h.restart();
    h.tick(&h.vm("vm-1"));

    let (before, after) = kill_and_see_it_booted_again(&h);

    assert!(!alive(before));
    assert!(alive(after));
}

#[test]
fn a_crashed_hypervisors_last_words_reach_the_row() {
    let h = Host::new(&[("STANDIN_CRASH_AFTER_MS", "300")]);
    h.tick(&h.vm("vm-1"));
    // From now on it cannot even start: when it crashes, the boot that
    // repairs it at once fails, and the row says why the last one died.
    // (Renamed over it: the running one holds its binary busy.)
    let broken = h.dir.path().join("broken-hv");
    std::fs::write(&broken, "#!/bin/sh\nexit 1\n").expect("a broken hypervisor");
    std::fs::set_permissions(&broken, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&broken, &h.cfg.hypervisor).expect("break the hypervisor");

    wait_until("the repair to fail", || {
        h.engine()
            .published()
            .vms
            .iter()
            .any(|r| r.vm_id == "vm-1" && r.phase == Some(Phase::Failed))
    });

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(
        row.last_error.contains("KVM internal error"),
        "{}",
        row.last_error
    );
}

/// The pid of the process the stand-in started (`STANDIN_FORK_CHILD`).
fn vmm_child(h: &Host, vm: &str) -> i32 {
    standin_said(h, vm, "standin-child pid=")
        .split("standin-child pid=")
        .nth(1)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("the stand-in named no child"))
}

/// The line the stand-in logged for `tag` (`standin-look`, …), once it has.
fn standin_said(h: &Host, vm: &str, tag: &str) -> String {
    let log = h.store.layout().hypervisor_log(&id(vm));
    let mut said = String::new();
    wait_until(&format!("the VMM to log {tag}"), || {
        said = std::fs::read_to_string(&log).unwrap_or_default();
        said.contains(tag)
    });
    said.lines()
        .filter(|l| l.contains(tag))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_vmm_sees_its_own_files_and_nothing_else_of_the_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"the host's").expect("secret");
    let other_disk = dir.path().join("state/vms/vm-2/disk.raw");
    let own_disk = dir.path().join("state/vms/vm-1/disk.raw");
    let look = format!(
        "{},{},{},/etc/passwd,/proc/1",
        secret.display(),
        other_disk.display(),
        own_disk.display()
    );
    let h = Host::in_dir(dir, &[("STANDIN_LOOK", look.as_str())]);
    h.backend
        .boot(&h.spec("vm-2"), Deadline::NONE)
        .expect("boot vm-2");

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot vm-1");

    let said = standin_said(&h, "vm-1", "standin-look");
    assert!(
        said.contains(&format!("{} there", own_disk.display())),
        "{said}"
    );
    for hidden in [
        secret.display().to_string(),
        other_disk.display().to_string(),
    ] {
        assert!(said.contains(&format!("{hidden} absent")), "{said}");
    }
    assert!(said.contains("/etc/passwd absent"), "{said}");
    assert!(said.contains("/proc/1 absent"), "{said}");
}

#[test]
fn a_vmm_cannot_grow_its_seed() {
    // The seed is the VMM's to read, not to write: grown to 1 TiB, it
    // would fill the state dir's filesystem for every tenant.
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = dir.path().join("state/vms/vm-1/seed.iso");
    let grow = seed.display().to_string();
    let h = Host::in_dir(dir, &[("STANDIN_GROW", grow.as_str())]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let said = standin_said(&h, "vm-1", "standin-grow");
    assert!(said.contains("refused: Read-only file system"), "{said}");
    assert!(std::fs::metadata(&seed).expect("seed").len() < 1 << 30);
}

#[test]
fn a_vmm_cannot_grow_a_disk_past_the_largest_of_its_disks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("state/vms/vm-1/disk.raw");
    let grow = disk.display().to_string();
    let h = Host::in_dir(dir, &[("STANDIN_GROW", grow.as_str())]);
    let spec = h.spec("vm-1");
    let size = spec.disk_gb << 30;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let said = standin_said(&h, "vm-1", "standin-grow");
    assert!(said.contains("refused: File too large"), "{said}");
    assert!(std::fs::metadata(&disk).expect("disk").len() <= size);
    assert!(h.backend.running(&id("vm-1")), "the VMM lives on");
}

#[test]
fn a_vmm_reaches_what_it_is_given_under_the_agents_umask() {
    // `main` sets 077; the view's directories must still be the VMM's to
    // pass (a daemon's VMMs could not exec their binary before).
    let h = Host::new(&[]);
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_vmm_cannot_reach_a_service_on_the_hosts_loopback() {
    // The jailed uid reached a service on the host's 127.0.0.1 before.
    let service = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback service");
    let at = service.local_addr().expect("its address").to_string();
    let h = Host::new(&[("STANDIN_CONNECT", at.as_str())]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let line = standin_said(&h, "vm-1", "standin-connect");
    assert!(line.contains("refused:"), "{line}");
}

#[test]
fn what_a_vmm_forked_is_gone_after_its_stop() {
    let h = Host::new(&[("STANDIN_FORK_CHILD", "1")]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let child = vmm_child(&h, "vm-1");
    assert!(alive(child), "the VMM's child runs");

    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stopped");

    assert!(!alive(child), "the VMM's child {child} outlived its stop");
}

#[test]
fn what_a_vmm_forked_is_gone_after_destroy_and_its_cgroups_with_it() {
    let h = Host::new(&[("STANDIN_FORK_CHILD", "1")]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let child = vmm_child(&h, "vm-1");
    let cgroups = Cgroups::probe(&h.cfg.confinement.cgroup_root).expect("cgroups");

    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroyed");

    assert!(
        !alive(child),
        "the VMM's child {child} outlived the destroy"
    );
    assert!(cgroups.dirs(&id("vm-1")).iter().all(|d| !d.exists()));
}

/// This process's resident memory, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb << 10
}

#[test]
fn a_vmm_flooding_its_answers_costs_no_memory_and_frees_the_worker_at_its_deadline() {
    // A VMM its guest took over answers every API call with a status line
    // that never ends. Read line by line it took the agent to 1.5 GB.
    let h = Host::new(&[("STANDIN_FLOOD_ANSWERS", "1")]);
    let spec = h.spec("vm-1");
    let before = rss();
    let started = Instant::now();

    let booted = h
        .backend
        .boot(&spec, Deadline::after(Duration::from_secs(3)));

    let (took, grew) = (started.elapsed(), rss().saturating_sub(before));
    assert!(
        booted.is_err(),
        "a VMM that never says Running did not boot"
    );
    assert!(grew < 10 << 20, "the agent grew by {grew} bytes");
    // Free at its deadline (3 s), not when the VMM stops sending.
    assert!(
        took < Duration::from_secs(8),
        "the boot held on for {took:?}"
    );
}

#[test]
fn a_hypervisor_that_ignores_shutdown_is_gone_within_the_bound() {
    let h = Host::new(&[("STANDIN_IGNORE_SHUTDOWN", "1")]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stopped");

    assert!(!alive(pid));
    assert!(!h.backend.running(&id("vm-1")));
}

#[test]
fn a_long_stop_is_narrated_stage_by_stage() {
    let h = Host::new(&[("STANDIN_IGNORE_SHUTDOWN", "1")]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let said = parking_lot::Mutex::new(Vec::new());

    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|what| {
            said.lock().push(what.to_owned())
        })
        .expect("stopped");

    let said = said.into_inner();
    assert_eq!(
        said[..2],
        [
            "stopping: pressing the power button",
            "stopping: waiting for the guest to power off, 0 s of 1"
        ],
        "{said:?}"
    );
    assert!(
        said.iter().any(|s| s == "stopping: killing the hypervisor"),
        "{said:?}"
    );
}

fn destroy_leaves_no_process_socket_pidfile_tap_or_directory_on(h: Host) {
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("pid");
    let socket = h.backend.socket_path(&id("vm-1"));
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    assert!(link_exists(&tap), "the tap exists while the VMM runs");

    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!alive(pid));
    assert!(!socket.exists());
    assert!(!PathBuf::from(format!("{}.lock", socket.display())).exists());
    assert!(!link_exists(&tap));
    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
}

fn the_tap_dies_with_a_killed_hypervisor_on(h: Host) {
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    let pid = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");

    wait_until("the tap to go", || !link_exists(&tap));
}

/// Which namespace of `kind` (`net`, `mnt`) process `pid` is in.
fn namespace(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .map(|t| t.display().to_string())
        .unwrap_or_else(|e| panic!("/proc/{pid}/ns/{kind}: {e}"))
}

fn the_hypervisor_runs_in_network_and_mount_namespaces_of_its_own_on(h: Host) {
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid").to_string();

    let theirs = (namespace(&pid, "net"), namespace(&pid, "mnt"));
    let ours = (
        namespace("thread-self", "net"),
        namespace("thread-self", "mnt"),
    );
    assert!(h.backend.running(&id("vm-1")), "it runs in it");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stopped in it");
    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroyed");

    assert_ne!(
        theirs.0, ours.0,
        "the VMM's network namespace is the agent's"
    );
    assert_ne!(theirs.1, ours.1, "the VMM's mount namespace is the agent's");
}

fn the_hypervisor_holds_only_its_own_fds_on(h: Host) {
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    // An fd closed between the listing and its link (a VMM's own API
    // connection, say) is not held: left out.
    let fds: Vec<(String, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .flatten()
        .filter_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?;
            Some((
                e.file_name().to_string_lossy().into_owned(),
                target.display().to_string(),
            ))
        })
        .collect();

    let target = |fd: &str| fds.iter().find(|(n, _)| n == fd).map(|(_, t)| t.as_str());
    let log = h
        .store
        .layout()
        .hypervisor_log(&id("vm-1"))
        .display()
        .to_string();
    assert_eq!(target("0"), Some("/dev/null"));
    assert_eq!(target("1"), Some(log.as_str()));
    assert_eq!(target("2"), Some(log.as_str()));
    assert!(
        target("3").is_some_and(|t| t.starts_with("socket:")),
        "the API socket: {fds:?}"
    );
    assert_eq!(target("4"), Some("/dev/net/tun"), "its tap: {fds:?}");
    // Anything else it opened itself: its own files, API connections, and
    // what a real VMM opens for its guest (the KVM device and its VM and
    // vCPU fds, event fds and epolls, a second tun queue, entropy).
    let own_dir = h.store.layout().vm_dir(&id("vm-1")).display().to_string();
    let a_vmms_own = |t: &str| {
        t.starts_with(&own_dir)
            || t.starts_with("socket:")
            || t.starts_with("anon_inode:kvm-")
            // Its guest's memory (shared, so it snapshots sparse).
            || t.starts_with("/memfd:ch_ram")
            || [
                "anon_inode:[eventfd]",
                "anon_inode:[eventpoll]",
                "/dev/kvm",
                "/dev/net/tun",
                "/dev/urandom",
            ]
            .contains(&t)
    };
    let others: Vec<&(String, String)> = fds
        .iter()
        .filter(|(n, _)| n.parse::<u32>().is_ok_and(|n| n > 4))
        .filter(|(_, t)| !a_vmms_own(t))
        .collect();
    assert!(others.is_empty(), "fds that are not its own: {others:?}");
}

fn a_hundred_boot_destroy_cycles_leave_no_zombie_and_no_fd_on(h: Host) {
    let spec = h.spec("vm-1");
    let fds_before = std::fs::read_dir("/proc/self/fd").expect("fds").count();

    for _ in 0..100 {
        h.backend.boot(&spec, Deadline::NONE).expect("boot");
        h.backend
            .destroy(&id("vm-1"), Deadline::NONE)
            .expect("destroy");
    }

    let me = std::process::id().to_string();
    let zombies = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|s| {
            let rest: Vec<&str> = s
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            rest.first() == Some(&"Z") && rest.get(1) == Some(&me.as_str())
        })
        .count();
    wait_until("fds to settle", || {
        std::fs::read_dir("/proc/self/fd").expect("fds").count() <= fds_before
    });
    assert_eq!(zombies, 0);
}

#[test]
fn a_pidfile_naming_an_unrelated_process_reads_not_running() {
    let h = Host::new(&[]);
    let mut sleeper = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    let pid = sleeper.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let start = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().nth(19))
        .expect("start time");
    std::fs::create_dir_all(h.store.layout().vm_dir(&id("vm-1"))).expect("dir");
    std::fs::write(
        h.store.layout().pidfile(&id("vm-1")),
        format!("{pid} {start}\n"),
    )
    .expect("pidfile");

    let running = h.backend.running(&id("vm-1"));

    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(!running);
}

#[test]
fn a_hypervisor_that_never_opens_its_socket_is_killed_and_explained() {
    let mut h = Host::new(&[("STANDIN_NO_SOCKET", "1")]);
    h.cfg.boot_wait = Duration::from_millis(500);
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let spec = h.spec("vm-1");

    let err = h
        .backend
        .boot(&spec, Deadline::NONE)
        .expect_err("never came up");

    assert!(err.to_string().contains("did not say Running"), "{err}");
    let pid = h.pid("vm-1").expect("pid");
    assert!(!alive(pid));
}

#[test]
fn a_hypervisor_that_fails_at_start_says_why() {
    let h = Host::new(&[("STANDIN_FAIL_START", "cannot open /dev/kvm: busy")]);
    let spec = h.spec("vm-1");

    let err = h.backend.boot(&spec, Deadline::NONE).expect_err("failed");

    assert!(
        err.to_string().contains("cannot open /dev/kvm: busy"),
        "{err}"
    );
}

#[test]
fn a_hypervisors_log_cannot_put_a_terminal_escape_in_the_error() {
    let h = Host::new(&[("STANDIN_FAIL_START", "bad \u{1b}[2J guest \r")]);
    let spec = h.spec("vm-1");

    let err = h.backend.boot(&spec, Deadline::NONE).expect_err("failed");

    let text = err.to_string();
    assert!(!text.chars().any(char::is_control), "{text:?}");
    assert!(text.contains("bad \\u{1b}[2J guest"), "{text}");
}

#[test]
fn a_long_state_dir_still_gets_a_short_socket() {
    let outer = tempfile::tempdir().expect("tempdir");
    let deep = outer.path().join("d".repeat(100)).join("e".repeat(100));
    std::fs::create_dir_all(&deep).expect("deep dir");
    let dir = tempfile::tempdir_in(&deep).expect("deep tempdir");
    let mut h = Host::in_dir(dir, &[]);
    // Sockets live apart from the state dir (/run/eitri in production).
    let run = tempfile::tempdir().expect("run dir");
    h.cfg.run_dir = run.path().to_path_buf();
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    assert!(
        h.store.layout().vm_dir(&id("vm-1")).as_os_str().len() > 200,
        "the state dir is long"
    );
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    assert!(h.backend.socket_path(&id("vm-1")).as_os_str().len() < 108);
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_gone_runs_cgroup_root_is_ended_with_its_processes_by_the_next_run() {
    // This process's own once-per-process sweep is done first, so only the
    // call below can see the root this test leaves.
    let scratch = tempfile::tempdir().expect("tempdir");
    eitri_agent::testkit::confinement(scratch.path());
    // No process has a pid past the kernel's largest pid_max (2^22).
    let root = format!("eitri-test-{}", (1u32 << 22) + 7);
    let cgroups = eitri_agent::provision::jail::cgroup::Cgroups::probe(&root).expect("cgroups");
    let dirs: Vec<PathBuf> = cgroups.roots().iter().map(|r| r.join("vm-1")).collect();
    for dir in &dirs {
        std::fs::create_dir_all(dir).expect("cgroup");
    }
    let mut left = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("sleep");
    std::fs::write(dirs[0].join("cgroup.procs"), left.id().to_string()).expect("move");

    eitri_agent::testkit::sweep_stale_test_roots();

    let ended = left.wait().expect("wait");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&ended),
        Some(9)
    );
    assert!(
        cgroups.roots().iter().all(|r| !r.exists()),
        "{:?}",
        cgroups.roots()
    );
}

/// Set in the environment of the process the interrupt test starts.
const INTERRUPTED_CHILD: &str = "EITRI_TEST_INTERRUPTED_CHILD";

#[test]
#[ignore = "run by a_test_interrupted_with_ctrl_c_leaves_no_hypervisor_and_no_cgroups"]
fn a_test_process_that_waits_for_its_interrupt() {
    if std::env::var_os(INTERRUPTED_CHILD).is_none() {
        return;
    }
    let h = Host::new(&[]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    println!("vmm {}", h.pid("vm-1").expect("pid"));
    // Nothing past here: this process ends by the signal.
    std::thread::sleep(PATIENCE * 3);
}

#[test]
fn a_test_interrupted_with_ctrl_c_leaves_no_hypervisor_and_no_cgroups() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "a_test_process_that_waits_for_its_interrupt",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(INTERRUPTED_CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("child test");
    let out = child.stdout.take().expect("stdout");
    let vmm: i32 = std::io::BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        // libtest prints the test's name on the same line first.
        .find_map(|l| {
            l.rsplit_once("vmm ")
                .and_then(|(_, p)| p.trim().parse().ok())
        })
        .expect("the child booted a VMM");
    let root = format!("eitri-test-{}", child.id());
    let roots = Cgroups::probe(&root).expect("cgroups").roots();
    assert!(alive(vmm) && roots.iter().all(|r| r.exists()));

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let ended = child.wait().expect("wait");

    assert_eq!(ended.code(), Some(130));
    let until = Instant::now() + PATIENCE;
    while (alive(vmm) || roots.iter().any(|r| r.exists())) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(vmm), "the VMM {vmm} outlived its test");
    assert!(roots.iter().all(|r| !r.exists()), "{roots:?}");
}

/// The host over `h`'s state dir again, its hypervisor and kernel in
/// `elsewhere` (searchable by anyone), so only the state dir's parent can
/// stand in the VMM's way.
fn booting_from(h: &mut Host, elsewhere: &Path) {
    let kernel = elsewhere.join("vmlinux");
    std::fs::write(&kernel, b"not really a kernel").expect("kernel");
    h.cfg.hypervisor = launcher(elsewhere, &[]);
    h.cfg.kernel = Some(kernel);
    drop(h.engine.take());
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.engine = Some(h.make_engine());
}

#[test]
fn a_state_dir_under_a_0700_directory_is_refused_naming_it_and_spends_no_attempt() {
    let mut h = Host::new(&[]);
    let elsewhere = tempfile::tempdir().expect("tempdir");
    booting_from(&mut h, elsewhere.path());
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");

    h.tick(&h.vm("vm-1"));
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    let rec = h.store.get(&id("vm-1")).expect("readable").expect("record");
    let closed = h.dir.path().display().to_string();
    assert!(
        row.last_error.contains(&format!("{closed} is 0700 0:0"))
            && row.last_error.contains(&format!("chmod o+x {closed}"))
            && row.last_error.contains("--state-dir"),
        "{row:?}"
    );
    assert_eq!(row.phase, Some(Phase::Creating));
    assert_eq!(rec.lifecycle.create_attempts(), 0);
    assert!(!h.backend.running(&id("vm-1")));
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod back");
}

#[test]
fn a_state_dir_opened_to_0711_converges_at_the_next_tick_with_no_spec_change() {
    let mut h = Host::new(&[]);
    let elsewhere = tempfile::tempdir().expect("tempdir");
    booting_from(&mut h, elsewhere.path());
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    h.tick(&h.vm("vm-1"));

    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_hypervisor_installed_after_start_is_found_at_the_next_tick() {
    let mut h = Host::new(&[]);
    let later = h.dir.path().join("installed-later");
    h.cfg.hypervisor = later.clone();
    drop(h.engine.take());
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.engine = Some(h.make_engine());
    h.tick(&h.vm("vm-1"));
    let missing = h.row("vm-1");

    std::fs::rename(launcher(h.dir.path(), &[]), &later).expect("install");
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert!(
        missing.last_error.contains("is not an executable file"),
        "{missing:?}"
    );
    assert_eq!(missing.phase, Some(Phase::Creating));
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn preflight_names_a_missing_hypervisor() {
    let mut h = Host::new(&[]);
    h.cfg.hypervisor = h.dir.path().join("no-such-hypervisor");
    let backend = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());

    let err = backend.preflight(Deadline::NONE).expect_err("missing");

    assert!(err.is_host_condition() && !err.is_permanent());
    assert!(err.to_string().contains("no-such-hypervisor"), "{err}");
}

#[test]
fn a_hypervisor_named_without_a_path_is_found_once_and_run_by_its_absolute_path() {
    // First thing, while this test's process has no other thread: the
    // stand-in's directory on PATH.
    let bin = Path::new(STANDIN).parent().expect("bin dir").to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: no other thread of this process reads the environment now.
    unsafe { std::env::set_var("PATH", path) };
    let h = Host::new(&[]);
    let backend = CloudHypervisor::new(
        Arc::clone(&h.store),
        CloudHvConfig {
            hypervisor: "eitri-standin-hypervisor".into(),
            ..h.cfg.clone()
        },
    );
    let spec = h.spec("vm-1");

    backend.boot(&spec, Deadline::NONE).expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    let _ = backend.destroy(&id("vm-1"), Deadline::NONE);
    assert_eq!(
        std::fs::canonicalize(exe).expect("exe"),
        std::fs::canonicalize(STANDIN).expect("standin")
    );
}

#[test]
fn preflight_refuses_a_hypervisor_older_than_v51_that_would_probe_disk_formats() {
    let h = Host::new(&[]);
    let old = h.dir.path().join("old-hv");
    std::fs::write(&old, "#!/bin/sh\necho 'cloud-hypervisor v50.0'\n").expect("old");
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let backend = CloudHypervisor::new(
        Arc::clone(&h.store),
        CloudHvConfig {
            hypervisor: old,
            ..h.cfg.clone()
        },
    );

    let err = backend.preflight(Deadline::NONE).expect_err("too old");

    assert!(err.is_host_condition() && !err.is_permanent());
    assert!(err.to_string().contains("v51 or later"), "{err}");
    assert!(err.to_string().contains("backing_files=off"), "{err}");
}

#[test]
fn a_hypervisor_replaced_by_an_older_one_is_refused_at_the_next_preflight() {
    let h = Host::new(&[]);
    let hv = h.dir.path().join("hv");
    eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &hv, &[]);
    let backend = CloudHypervisor::new(
        Arc::clone(&h.store),
        CloudHvConfig {
            hypervisor: hv.clone(),
            ..h.cfg.clone()
        },
    );
    backend.preflight(Deadline::NONE).expect("v53 passes");
    // Replaced as a package upgrade does: a new file renamed over it.
    let staged = h.dir.path().join("hv.new");
    std::fs::write(&staged, "#!/bin/sh\necho 'cloud-hypervisor v50.0'\n").expect("old");
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&staged, &hv).expect("replace");

    let err = backend.preflight(Deadline::NONE).expect_err("too old now");

    assert!(err.to_string().contains("v51 or later"), "{err}");
}

fn preflight_passes_on(h: Host) {
    let ok = h.backend.preflight(Deadline::NONE);

    assert!(ok.is_ok(), "{:?}", ok.err().map(|e| e.to_string()));
}

// ── the same scenarios, against the stand-in and a real hypervisor ──────

/// A host driving a real cloud-hypervisor, when the environment names one
/// and a guest kernel it can boot; else the reason the scenario is skipped.
fn real_host() -> Result<Host, String> {
    let hv = std::env::var_os("EITRI_TEST_CLOUD_HYPERVISOR");
    let kernel = std::env::var_os("EITRI_TEST_GUEST_KERNEL");
    match (hv, kernel) {
        (Some(hv), Some(kernel)) => Ok(Host::real(PathBuf::from(hv), PathBuf::from(kernel))),
        _ => Err("set EITRI_TEST_CLOUD_HYPERVISOR (a cloud-hypervisor binary) and EITRI_TEST_GUEST_KERNEL (a PVH kernel it boots) to run this against a real hypervisor".into()),
    }
}

macro_rules! both {
    ($($scenario:ident),* $(,)?) => {
        mod with_stand_in {
            $(#[test] fn $scenario() {
                eitri_agent::testkit::net::private_network();
                let mut h = super::Host::new(&[]);
                h.connect();
                super::$scenario(h);
            })*
        }
        mod with_real_hypervisor {
            $(#[test] fn $scenario() {
                eitri_agent::testkit::net::private_network();
                match super::real_host() {
                    Ok(mut h) => {
                        h.connect();
                        super::$scenario(h)
                    }
                    Err(why) => println!("SKIPPED {}: {why}", stringify!($scenario)),
                }
            })*
        }
    };
}

both!(
    a_created_vm_boots_and_runs_on,
    booting_twice_starts_one_process_on,
    an_agent_restart_adopts_the_running_hypervisor_on,
    a_killed_hypervisor_is_booted_again_without_a_tick_on,
    an_adopted_hypervisor_killed_is_booted_again_without_a_tick_on,
    destroy_leaves_no_process_socket_pidfile_tap_or_directory_on,
    the_tap_dies_with_a_killed_hypervisor_on,
    the_hypervisor_holds_only_its_own_fds_on,
    the_hypervisor_runs_in_network_and_mount_namespaces_of_its_own_on,
    a_hundred_boot_destroy_cycles_leave_no_zombie_and_no_fd_on,
    preflight_passes_on,
    suspend_and_resume_twice_keep_the_guest_and_its_console_on,
    a_suspended_vm_resumes_after_an_agent_restart_on,
    a_restored_hypervisor_is_jailed_in_namespaces_of_its_own_on,
    a_disk_changed_while_suspended_boots_the_vm_from_its_disks_on,
    stopping_a_suspended_vm_discards_its_snapshot_on,
    destroying_a_suspended_vm_leaves_nothing_of_it_on,
    a_serial_probe_makes_the_vm_ready_once_its_guest_prints_the_line_on,
    a_serial_probe_for_a_line_the_guest_never_prints_holds_ready_back_on,
);

/// What the VM's VMM's API says its configuration is.
fn vm_config(h: &Host, vm: &str) -> serde_json::Value {
    let (_, body) = eitri_agent::provision::unix_http::request(
        &h.backend.socket_path(&id(vm)),
        "GET",
        "/api/v1/vm.info",
        None,
        Duration::from_secs(2),
    )
    .expect("vm.info");
    let info: serde_json::Value = serde_json::from_slice(&body).expect("json");
    info["config"].clone()
}

/// A real cloud-hypervisor takes the limits' command line and holds them:
/// its own account of its configuration has the disks' group and bucket
/// and the NIC's. (That it paces a guest's I/O to them is measured by
/// `make bench-limits`, on a guest that does I/O.)
#[test]
fn a_real_vmm_holds_the_disk_and_nic_limits_it_was_given() {
    eitri_agent::testkit::net::private_network();
    let mut h = match real_host() {
        Ok(h) => h,
        Err(why) => return println!("SKIPPED: {why}"),
    };
    h.connect();
    let mut spec = h.spec("vm-1");
    spec.limits.disk_mbps = 50;
    spec.limits.disk_iops = 800;
    spec.limits.net_mbps = 80;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let config = vm_config(&h, "vm-1");
    assert_eq!(vm_state(&h, "vm-1").as_deref(), Some("Running"));
    let group = &config["rate_limit_groups"][0];
    assert_eq!(group["id"], "disks", "{config}");
    assert_eq!(
        group["rate_limiter_config"]["bandwidth"]["size"], 50_000_000,
        "{config}"
    );
    assert_eq!(group["rate_limiter_config"]["ops"]["size"], 800, "{config}");
    assert_eq!(config["disks"][0]["rate_limit_group"], "disks", "{config}");
    assert_eq!(
        config["net"][0]["rate_limiter_config"]["bandwidth"]["size"], 10_000_000,
        "{config}"
    );
}

/// Deletes a test link on the way out, whatever happened.
struct Link(String);

impl Drop for Link {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .output();
    }
}

#[test]
fn a_leaked_tap_with_the_agents_prefix_is_removed_at_start() {
    let h = Host::new(&[]);
    // A persistent tap, as `ip tuntap add` (or another agent's bug) leaves.
    let leaked = Link(format!("{}leak", tap_prefix()));
    let made = std::process::Command::new("ip")
        .args(["tuntap", "add", "dev", &leaked.0, "mode", "tap"])
        .status()
        .expect("ip");
    assert!(made.success());
    assert!(link_exists(&leaked.0));

    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted.recover(&known(&h.store));

    assert!(!link_exists(&leaked.0), "{} was not removed", leaked.0);
}

#[test]
fn a_tap_a_live_vmm_holds_survives_a_restart() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;

    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    // vm-1 has no record; the last desired state names it.
    restarted.recover(&[id("vm-1")]);

    assert!(link_exists(&tap));
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn an_orphan_hypervisor_is_stopped_at_start_and_said() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    // No record and no desired state names vm-1: nothing explains it.
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    let notes = restarted.recover(&[]);

    wait_until("the orphan to be gone", || !alive(pid));
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].contains("orphan") && notes[0].contains(&pid.to_string()),
        "{notes:?}"
    );
}

#[test]
fn every_disk_the_hypervisor_is_given_is_raw_with_backing_files_off() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let log = std::fs::read_to_string(h.store.layout().hypervisor_log(&id("vm-1"))).expect("log");

    let start = args.iter().position(|a| a == "--disk").expect("--disk") + 1;
    let disks: Vec<&String> = args[start..]
        .iter()
        .take_while(|a| !a.starts_with("--"))
        .collect();
    assert_eq!(disks.len(), 2, "root disk and seed: {args:?}");
    assert!(
        disks
            .iter()
            .all(|d| d.ends_with(",image_type=raw,backing_files=off")),
        "{disks:?}"
    );
    assert!(
        !log.contains("DEPRECATION"),
        "the format is never probed: {log}"
    );
}

/// A line of `/proc/<pid>/status`, after its key.
fn status_of(pid: i32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
        .unwrap_or_default()
}

#[test]
fn the_hypervisor_runs_as_the_vms_own_user_with_no_capabilities_and_no_new_privileges() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let uid: u32 = status_of(pid, "Uid:")
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .expect("uid");
    let first = h.cfg.confinement.first_id;
    assert!(
        uid > first && uid < first + h.cfg.confinement.id_count,
        "uid {uid}"
    );
    assert_eq!(
        status_of(pid, "Uid:"),
        format!("{uid}\t{uid}\t{uid}\t{uid}")
    );
    assert_eq!(
        status_of(pid, "Gid:"),
        format!("{uid}\t{uid}\t{uid}\t{uid}")
    );
    assert_eq!(status_of(pid, "Groups:"), first.to_string());
    assert_eq!(status_of(pid, "CapEff:"), "0000000000000000");
    assert_eq!(status_of(pid, "CapBnd:"), "0000000000000000");
    assert_eq!(status_of(pid, "NoNewPrivs:"), "1");
    let owner =
        |p: &Path| std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(p).expect("stat"));
    assert_eq!(owner(&h.store.layout().root_disk(&id("vm-1"))), uid);
    assert_eq!(owner(&h.store.layout().seed(&id("vm-1"))), uid);
    assert_eq!(
        owner(&h.store.layout().vm_dir(&id("vm-1"))),
        0,
        "its directory stays root's"
    );
    assert_eq!(
        owner(&h.store.layout().pidfile(&id("vm-1"))),
        0,
        "and its pidfile"
    );
}

#[test]
fn the_hypervisor_is_in_the_vms_own_cgroups_with_its_limits_until_destroyed() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");
    let cgroups = Cgroups::probe(&h.cfg.confinement.cgroup_root).expect("cgroups");
    let dirs = cgroups.dirs(&id("vm-1"));

    let listed = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let suffix = format!("/{}/vm-1", h.cfg.confinement.cgroup_root);
    let read = |name: &str| {
        dirs.iter()
            .find_map(|d| std::fs::read_to_string(d.join(name)).ok())
            .map(|v| v.trim().to_owned())
    };
    let memory = read("memory.max").or_else(|| read("memory.limit_in_bytes"));
    let pids = read("pids.max");
    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    for controller in ["memory", "pids", "cpu"] {
        assert!(
            listed.lines().any(|l| {
                let mut f = l.splitn(3, ':');
                let (_, names, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
                (names.split(',').any(|n| n == controller) || names.is_empty())
                    && path.ends_with(&suffix)
            }),
            "{controller}: {listed}"
        );
    }
    let want = (spec.mem_mb << 20) + eitri_agent::provision::jail::VMM_OVERHEAD_BYTES;
    assert_eq!(memory, Some(want.to_string()));
    assert_eq!(
        pids,
        Some(eitri_agent::provision::jail::max_threads(spec.vcpus).to_string())
    );
    assert!(
        dirs.iter().all(|d| !d.exists()),
        "removed at destroy: {dirs:?}"
    );
}

#[test]
fn the_hypervisor_inherits_none_of_the_agents_environment() {
    // Something the agent's environment has, as a secret might be.
    // SAFETY: first thing in this test's own process, no other thread yet.
    unsafe { std::env::set_var("EITRI_TEST_SECRET", "hunter2") };
    let h = Host::new(&[]);
    // The stand-in itself, not the launcher script (a shell sets PWD).
    let backend = CloudHypervisor::new(
        Arc::clone(&h.store),
        CloudHvConfig {
            hypervisor: STANDIN.into(),
            ..h.cfg.clone()
        },
    );
    let spec = h.spec("vm-1");

    backend.boot(&spec, Deadline::NONE).expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).expect("cwd");
    let _ = backend.destroy(&id("vm-1"), Deadline::NONE);
    assert!(environ.is_empty(), "{}", String::from_utf8_lossy(&environ));
    assert_eq!(cwd, Path::new("/"), "not the agent's working directory");
}

/// A VM whose VMM writes `rate` bytes a second for 4 s (by `knob`)
/// against a 512 KiB cap; the length and the bytes held of the file `of`
/// names.
fn flooded(knob: &str, rate: u64, of: fn(&Host) -> PathBuf) -> (Host, PathBuf, u64, u64) {
    let mut h = Host::new(&[(knob, &rate.to_string())]);
    h.cfg.confinement.serial_log_bytes = 512 << 10;
    let h = h.restart();
    h.tick(&h.vm("vm-1"));
    let path = of(&h);
    std::thread::sleep(Duration::from_secs(4));
    let meta = std::fs::metadata(&path).expect("the flooded file");
    let held = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
    (h, path, meta.len(), held)
}

#[test]
fn a_guest_printing_to_serial_forever_holds_no_more_disk_than_the_cap() {
    // 2 MiB a second against a 512 KiB cap.
    let rate: u64 = 2 << 20;

    let (_h, serial, len, held) = flooded("STANDIN_SERIAL_FLOOD", rate, |h| {
        h.store.layout().serial_log(&id("vm-1"))
    });

    let text = std::fs::read(&serial).expect("read");
    let last = text.rsplit(|b| *b == b'\n').nth(1).unwrap_or_default();
    assert!(len > 4 << 20, "the guest wrote {len} bytes");
    // The cap, and at most what the guest writes in a check's second.
    assert!(held <= (512 << 10) + rate * 5 / 4, "{held} bytes held");
    assert!(
        last.starts_with(b"serial line "),
        "the newest output is kept: {:?}",
        String::from_utf8_lossy(last)
    );
}

#[test]
fn a_vmm_writing_its_log_forever_holds_no_more_disk_than_the_cap() {
    let rate: u64 = 2 << 20;

    let (_h, _log, len, held) = flooded("STANDIN_LOG_FLOOD", rate, |h| {
        h.store.layout().hypervisor_log(&id("vm-1"))
    });

    assert!(len > 4 << 20, "the VMM wrote {len} bytes");
    assert!(held <= (512 << 10) + rate * 5 / 4, "{held} bytes held");
}

#[test]
fn the_hypervisor_keeps_its_cgroups_across_an_agent_restart() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("pid");
    let before = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");

    let h = h.restart();

    let after = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let dirs = Cgroups::probe(&h.cfg.confinement.cgroup_root)
        .expect("cgroups")
        .dirs(&id("vm-1"));
    assert_eq!(h.pid("vm-1"), Some(pid), "the same VMM, adopted");
    assert_eq!(after, before);
    assert!(dirs.iter().all(|d| d.exists()), "{dirs:?}");
}

#[test]
fn a_vms_hypervisor_user_is_the_same_after_an_agent_restart() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let first = status_of(h.pid("vm-1").expect("pid"), "Uid:");
    let h = h.restart();
    let spec = h.spec("vm-1");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stop");

    h.backend.boot(&spec, Deadline::NONE).expect("boot again");

    assert_eq!(status_of(h.pid("vm-1").expect("pid"), "Uid:"), first);
}

#[test]
fn a_local_users_process_naming_a_vms_disk_is_not_taken_for_its_hypervisor() {
    use std::os::unix::process::CommandExt;
    let h = Host::new(&[]);
    let disk = format!("path={}", h.store.layout().root_disk(&id("vm-1")).display());
    // A process of nobody's with the VM's disk on its command line, as any
    // local user could start.
    // (A shell waiting on its stdin: it keeps the argument and runs
    // until killed.)
    let mut impostor = std::process::Command::new("sh")
        .args(["-c", "read line", "impostor", &disk])
        .stdin(std::process::Stdio::piped())
        .uid(65534)
        .gid(65534)
        .spawn()
        .expect("sh");
    // Its socket file too, so the backend looks hard (it scans).
    std::fs::create_dir_all(h.cfg.run_dir.clone()).expect("run dir");
    std::fs::write(h.backend.socket_path(&id("vm-1")), b"").expect("socket file");

    let taken = h.backend.adopt(&id("vm-1"));
    let still_there = alive(impostor.id() as i32);
    let _ = impostor.kill();
    let _ = impostor.wait();

    assert!(
        !taken,
        "a local user's process passed for the VM's hypervisor"
    );
    assert!(still_there, "and it was not ours to stop");
}

#[test]
fn a_garbled_pidfile_does_not_hide_a_running_hypervisor() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");
    std::fs::write(h.store.layout().pidfile(&id("vm-1")), b"\x00garbage").expect("garble");

    let running = h.backend.running(&id("vm-1"));

    assert!(running);
    assert_eq!(h.pid("vm-1"), Some(pid), "the pidfile names it again");
}

#[test]
fn a_pidfile_naming_an_unrelated_process_does_not_hide_the_hypervisor() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");
    // This test process: alive, and no hypervisor of vm-1.
    let me = std::process::id();
    let start = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| s.rsplit(')').next().map(str::to_owned))
        .and_then(|r| r.split_whitespace().nth(19).map(str::to_owned))
        .expect("start time");
    std::fs::write(
        h.store.layout().pidfile(&id("vm-1")),
        format!("{me} {start}\n"),
    )
    .expect("wrong pid");

    let running = h.backend.running(&id("vm-1"));

    assert!(running);
    assert_eq!(h.pid("vm-1"), Some(pid));
}

#[test]
fn a_vmm_whose_record_never_said_booted_is_adopted_not_started_again() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("pid");
    let disk = h.store.layout().root_disk(&id("vm-1"));
    let inode =
        |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("disk"));
    let disk_before = inode(&disk);
    // The crash: the VMM runs, the record never said the create finished.
    let mut rec = (*h.store.get(&id("vm-1")).expect("readable").expect("record")).clone();
    rec.lifecycle = Lifecycle::from_parts(LifecycleParts {
        boot_id: String::new(),
        ..rec.lifecycle.parts()
    });
    h.store.save(&rec).expect("save");
    let h = h.restart();

    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready))
    );
    assert_eq!(h.pid("vm-1"), Some(pid), "the same VMM, no second one");
    assert_eq!(processes_on(&h.store.layout().root_disk(&id("vm-1"))), 1);
    assert_eq!(inode(&disk), disk_before, "its disk was not replaced");
    assert_eq!(
        h.store
            .get(&id("vm-1"))
            .expect("r")
            .expect("r")
            .lifecycle
            .create_attempts(),
        1
    );
}

#[test]
fn a_booted_vm_has_its_address_and_its_tap_on_the_bridge_until_destroyed() {
    // A network namespace of this test's own: the bridge and NAT table
    // never touch the host's.
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let subnet = eitri_agent::testkit::net::underlay_config().subnet;
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let address = h.backend.address(&id("vm-1"));
    let port = std::process::Command::new("ip")
        .args([
            "-d",
            "link",
            "show",
            &h.backend.taps(&id("vm-1")).expect("taps").underlay,
        ])
        .output()
        .expect("ip");
    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    let ip: Ipv4Addr = address.expect("an address right after boot");
    assert!(subnet.contains(ip) && ip != subnet.gateway(), "{ip}");
    let port = String::from_utf8_lossy(&port.stdout);
    assert!(
        port.contains("master etbr0") && port.contains("isolated on"),
        "{port}"
    );
    assert_eq!(h.backend.address(&id("vm-1")), None, "released at destroy");
}

#[test]
fn after_a_vmm_crash_an_agent_crash_and_a_destroy_no_link_with_the_prefix_remains() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot vm-1");
    h.backend
        .boot(&h.spec("vm-2"), Deadline::NONE)
        .expect("boot vm-2");
    let crashed = h.pid("vm-1").expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(crashed),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until("the VMM to die", || !alive(crashed));

    // The agent "crashes": a new backend over the same state, then the
    // control plane deletes what is left.
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy vm-1");
    restarted
        .destroy(&id("vm-2"), Deadline::NONE)
        .expect("destroy vm-2");

    let links = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["-o", "link", "show"])
            .output()
            .expect("ip")
            .stdout,
    )
    .into_owned();
    let ours: Vec<&str> = links
        .lines()
        .filter(|l| l.contains(&format!(": {}", tap_prefix())))
        .collect();
    assert!(ours.is_empty(), "{ours:?}");
}

#[test]
fn an_agent_restart_serves_the_adopted_vms_network_again() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&h.vm("vm-1"));
    let address = h.backend.address(&id("vm-1"));
    assert!(address.is_some());

    // The agent restarts: its responders died with it; the VMM did not.
    h.cfg.network = None;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let network = Arc::new(
        eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            h.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network"),
    );
    h.cfg.network = Some(Arc::clone(&network));
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted.recover(&known(&h.store));

    assert!(network.serves_dhcp(&id("vm-1")));
    assert_eq!(restarted.address(&id("vm-1")), address);
    assert!(restarted.running(&id("vm-1")));
}

#[test]
fn a_vm_whose_tap_cannot_join_its_network_fails_and_leaves_no_hypervisor() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    // A named network whose bridge is gone: the second tap's join fails,
    // on the plug's own thread, while the VMM starts.
    let network = eitri_agent::net::host::HostNetwork::setup(
        underlay(),
        h.store.layout(),
        vec![],
        std::collections::HashMap::from([("site".to_owned(), "etnobridge".to_owned())]),
    )
    .expect("network");
    h.cfg.network = Some(Arc::new(network));
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let mut spec = h.spec("vm-1");
    spec.network = "site".into();

    let err = h
        .backend
        .boot(&spec, Deadline::NONE)
        .expect_err("no bridge");

    assert!(err.to_string().contains("etnobridge"), "{err}");
    let pid = h.pid("vm-1").expect("a VMM was started");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the VMM of a failed plug still runs"
    );
    assert!(!h.backend.running(&id("vm-1")));
}

#[test]
fn with_networking_off_a_vm_gets_no_nic() {
    let h = Host::new(&[]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert!(!args.iter().any(|a| a == "--net"), "{args:?}");
    assert_eq!(h.backend.taps(&id("vm-1")), None);
}

#[test]
fn a_destroyed_vm_leaves_no_rule_naming_its_tap() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    assert!(
        nft_ruleset().contains(&format!("\"{tap}\" . ")),
        "guarded while it runs"
    );

    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    let rules = nft_ruleset();
    assert!(!rules.contains(&tap), "{rules}");
}

#[test]
fn an_adopted_vm_is_guarded_again_before_its_first_tick() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&h.vm("vm-1"));
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    let mac = eitri_agent::model::Mac::underlay(&id("vm-1")).to_string();
    let element = format!("\"{tap}\" . {mac}");

    // The agent restarts: setting the network up again replaces its tables
    // (the adopted tap is dropped whole meanwhile), and recovery guards it.
    let mut cfg = h.cfg.clone();
    cfg.network = Some(Arc::new(
        eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            h.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network"),
    ));
    let between = nft_ruleset();
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), cfg);
    restarted.recover(&known(&h.store));

    let after = nft_ruleset();
    assert!(!between.contains(&element), "{between}");
    assert!(
        between.contains(&format!("iifname != \"{}*\" accept", tap_prefix()))
            && between.contains("iifname . ether saddr != @macs"),
        "an unguarded tap of the agent's is dropped: {between}"
    );
    assert!(after.contains(&element), "{after}");
}

/// `vm`'s desired state with its own egress rules.
fn with_egress(h: &Host, vm: &str, epoch: u64, deny: &str, allow: &str) -> Snapshot {
    let mut d = h.desired(vm);
    d.egress = eitri_agent::model::Egress {
        deny: eitri_agent::model::Cidr::parse_list(deny).expect("deny"),
        allow: eitri_agent::model::Cidr::parse_list(allow).expect("allow"),
    };
    snapshot(epoch, vec![present(d)])
}

#[test]
fn a_running_vms_egress_change_is_held_within_a_tick_with_its_vmm_untouched() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&with_egress(&h, "vm-1", 1, "203.0.113.10", ""));
    let (pid, ip) = (h.pid("vm-1"), h.backend.address(&id("vm-1")).expect("ip"));
    let before = nft_set_elements("vm_deny");

    h.tick(&with_egress(&h, "vm-1", 2, "203.0.113.20", ""));

    let after = nft_set_elements("vm_deny");
    assert!(before.contains(&format!("{ip} . 203.0.113.10")), "{before}");
    assert!(
        after.contains(&format!("{ip} . 203.0.113.20")) && !after.contains("203.0.113.10"),
        "{after}"
    );
    assert_eq!(h.pid("vm-1"), pid);
    assert!(pid.is_some_and(alive));
    assert_eq!(h.row("vm-1").egress, "deny 203.0.113.20/32");
}

#[test]
fn an_adopted_vm_is_held_to_its_recorded_egress_rules_before_its_first_tick() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&with_egress(&h, "vm-1", 1, "0.0.0.0/0", "192.0.2.0/24"));
    let ip = h.backend.address(&id("vm-1")).expect("ip");

    // The agent restarts: its tables are made afresh, then recovery.
    let mut cfg = h.cfg.clone();
    cfg.network = Some(Arc::new(
        eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            h.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network"),
    ));
    let between = nft_set_elements("vm_deny");
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), cfg);
    restarted.recover(&known(&h.store));

    assert!(!between.contains(&ip.to_string()), "{between}");
    assert!(
        nft_set_elements("vm_deny").contains(&format!("{ip} . 0.0.0.0/0")),
        "{}",
        nft_ruleset()
    );
    assert!(nft_set_elements("vm_allow").contains(&format!("{ip} . 192.0.2.0/24")));
}

#[test]
fn a_destroyed_vm_leaves_no_egress_rule_of_its_own() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&with_egress(&h, "vm-1", 1, "0.0.0.0/0", "192.0.2.0/24"));
    let ip = h.backend.address(&id("vm-1")).expect("ip").to_string();
    let held = nft_set_elements("vm_deny");

    // Through the engine, as a deleted VM goes: a destroy behind its back
    // would race its worker booting the VM it still wants.
    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(held.contains(&ip), "{held}");
    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
    assert!(!nft_set_elements("vm_deny").contains(&ip));
    assert!(!nft_set_elements("vm_allow").contains(&ip));
}

/// The VMM's arguments, as its /proc cmdline has them.
fn vmm_args(h: &Host, vm: &str) -> Vec<String> {
    let pid = h.pid(vm).expect("pid");
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .expect("cmdline")
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The VM's cgroup file `name`, from whichever hierarchy has it.
fn cgroup_file(h: &Host, vm: &str, name: &str) -> Option<String> {
    eitri_agent::testkit::cgroup_file(&h.cfg.confinement.cgroup_root, &id(vm), name)
}

#[test]
fn a_vms_cpu_cap_is_its_cgroups_quota_and_its_burst_too() {
    let h = Host::new(&[]);
    let mut spec = h.spec("vm-1");
    spec.limits.cpu_max_millis = 250;
    spec.limits.cpu_burst_ms = 10;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let quota =
        cgroup_file(&h, "vm-1", "cpu.cfs_quota_us").or_else(|| cgroup_file(&h, "vm-1", "cpu.max"));
    assert!(
        quota.as_deref() == Some("25000") || quota.as_deref() == Some("25000 100000"),
        "{quota:?}"
    );
    let burst = cgroup_file(&h, "vm-1", "cpu.cfs_burst_us")
        .or_else(|| cgroup_file(&h, "vm-1", "cpu.max.burst"));
    assert_eq!(burst.as_deref(), Some("10000"));
}

#[test]
fn a_stopped_vm_boots_again_with_a_cap_below_its_old_burst() {
    let h = Host::new(&[]);
    let mut spec = h.spec("vm-1");
    spec.limits.cpu_max_millis = 500;
    spec.limits.cpu_burst_ms = 40;
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stop");
    spec.limits.cpu_max_millis = 200;
    spec.limits.cpu_burst_ms = 0;

    h.backend
        .boot(&spec, Deadline::NONE)
        .expect("boot with the lower cap");

    let quota =
        cgroup_file(&h, "vm-1", "cpu.cfs_quota_us").or_else(|| cgroup_file(&h, "vm-1", "cpu.max"));
    assert!(
        quota.as_deref() == Some("20000") || quota.as_deref() == Some("20000 100000"),
        "{quota:?}"
    );
}

#[test]
fn a_vm_with_no_cap_of_its_own_takes_the_hosts_per_vcpu() {
    let mut h = Host::new(&[]);
    h.cfg.confinement.limits.cpu_max_millis_per_vcpu = 500;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let mut spec = h.spec("vm-1");
    spec.vcpus = 2;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let quota =
        cgroup_file(&h, "vm-1", "cpu.cfs_quota_us").or_else(|| cgroup_file(&h, "vm-1", "cpu.max"));
    assert!(
        quota.as_deref() == Some("100000") || quota.as_deref() == Some("100000 100000"),
        "{quota:?}"
    );
}

#[test]
fn a_vms_disk_and_nic_limits_are_on_its_vmms_command_line() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let mut spec = h.spec("vm-1");
    spec.limits.disk_mbps = 50;
    spec.limits.disk_iops = 800;
    spec.limits.net_mbps = 80;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let args = vmm_args(&h, "vm-1");
    assert!(
        args.iter().any(|a| a
            == "id=disks,bw_size=50000000,bw_refill_time=1000,ops_size=800,ops_refill_time=1000"),
        "{args:?}"
    );
    assert!(
        args.iter()
            .any(|a| a.starts_with("fd=") && a.ends_with(",bw_size=10000000,bw_refill_time=1000")),
        "{args:?}"
    );
}

#[test]
fn a_killed_vmm_raises_its_lost_counter_by_one() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let metrics = eitri_agent::daemon::metrics::MetricsFile::new(
        h.dir.path().join("eitri.prom"),
        Arc::new(ImageCache::new(h.dir.path().join("images"))),
    );
    let lost = || {
        let text = metrics.render(
            &eitri_agent::pb::HostInfo::default(),
            h.engine(),
            &h.engine().published(),
            1,
            &eitri_agent::metrics::CounterVec::default(),
        );
        text.lines()
            .find_map(|l| l.strip_prefix("eitri_vm_lost_total{vm_id=\"vm-1\"} "))
            .map(str::to_owned)
    };
    assert_eq!(lost().as_deref(), Some("0"));
    let pid = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until("a new VMM", || {
        h.pid("vm-1").is_some_and(|p| p != pid && alive(p))
    });
    assert!(h.engine().wait_idle(Deadline::after(PATIENCE)));

    assert_eq!(lost().as_deref(), Some("1"));
}

const AGENT: &str = env!("CARGO_BIN_EXE_eitri-agent");

/// The number of a stand-in flood line (`serial line N …`).
fn line_number(line: &str) -> Option<u64> {
    line.strip_prefix("serial line ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn logs_of_a_guest_that_printed_10_mib_shows_its_newest_lines_within_the_cap() {
    // 4 MiB a second against a 1 MiB cap.
    let rate: u64 = 4 << 20;
    let mut h = Host::new(&[("STANDIN_SERIAL_FLOOD", &rate.to_string())]);
    h.cfg.confinement.serial_log_bytes = 1 << 20;
    let h = h.restart();
    h.tick(&h.vm("vm-1"));
    let serial = h.store.layout().serial_log(&id("vm-1"));
    wait_until("10 MiB of console", || {
        std::fs::metadata(&serial).is_ok_and(|m| m.len() > 10 << 20)
    });
    let written_before = std::fs::metadata(&serial).expect("serial").len();

    let out = std::process::Command::new(AGENT)
        .args(["logs", "vm-1", "--lines", "3", "--state-dir"])
        .arg(h.store.root())
        .output()
        .expect("eitri-agent logs");

    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Vec<u64> = text.lines().filter_map(line_number).collect();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(numbers.len(), 3, "{text}");
    assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
    // Newer than anything the first 10 MiB held (lines are ~40 bytes).
    assert!(numbers[0] * 40 > written_before / 2, "{numbers:?}");
    let meta = std::fs::metadata(&serial).expect("serial");
    let held = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
    assert!(held <= (1 << 20) + rate * 5 / 4, "{held} bytes held");
}

#[test]
fn logs_follow_prints_a_new_line_within_a_tick() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let serial = h.store.layout().serial_log(&id("vm-1"));
    let mut child = std::process::Command::new(AGENT)
        .args(["logs", "vm-1", "--follow", "--lines", "1", "--state-dir"])
        .arg(h.store.root())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("eitri-agent logs --follow");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    std::thread::sleep(Duration::from_millis(300));

    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&serial)
        .expect("serial");
    std::io::Write::write_all(&mut file, b"a guest says hello\n").expect("write");
    // The agent's default tick.
    let until = Instant::now() + Duration::from_secs(5);
    let mut seen = false;
    while let Ok(line) = rx.recv_deadline(until) {
        if line == "a guest says hello" {
            seen = true;
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();

    assert!(seen, "no new line within a tick");
}
