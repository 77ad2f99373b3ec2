//! The vfkit backend against the project's stand-in vfkit, through the
//! engine: real forks, real sockets, real signals, real files. Portable:
//! CI runs it on Linux, `make mac-check` on a Mac; what only a real vfkit
//! can show is the README's macOS checklist.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::hostkey::LocalHostKeys;
use eitri_agent::image::{ImageCache, ImageOptions, sha256_file};
use eitri_agent::model::{Phase, PowerState, Snapshot, VmStatus};
use eitri_agent::provision::supervise::StopTimeouts;
use eitri_agent::provision::vfkit::{Vfkit, VfkitConfig};
use eitri_agent::provision::{HypervisorSettings, Lifecycle};
use eitri_agent::reconcile::{Engine, EngineConfig, Seams};
use eitri_agent::seed::NoCloudSeed;
use eitri_agent::state::Store;
use eitri_agent::testkit::{Fakes, desired, id, present, snapshot, tombstoned};

const VFKIT: &str = env!("CARGO_BIN_EXE_eitri-standin-vfkit");
/// A bound for a test to fail on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(20);

struct Host {
    dir: tempfile::TempDir,
    store: Arc<Store>,
    backend: Arc<Vfkit>,
    engine: Option<Engine>,
    base_url: String,
    base_sha: String,
}

impl Host {
    /// A host whose base image starts with `head`.
    fn with_base(head: &[u8]) -> Host {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.raw");
        let mut bytes = head.to_vec();
        bytes.resize(1 << 20, 0x5a);
        std::fs::write(&base, bytes).expect("base image");
        let base_sha = sha256_file(&base).expect("hash");
        let store = Arc::new(Store::open(&dir.path().join("state")).expect("store"));
        let backend = Arc::new(Vfkit::new(Arc::clone(&store), config(dir.path())));
        backend.recover(&[]);
        let mut host = Host {
            base_url: format!("file://{}", base.display()),
            dir,
            store,
            backend,
            engine: None,
            base_sha,
        };
        host.engine = Some(host.make_engine());
        host
    }

    fn new() -> Host {
        Host::with_base(b"")
    }

    fn make_engine(&self) -> Engine {
        let seams = Seams {
            provisioner: Arc::clone(&self.backend) as Arc<dyn Lifecycle>,
            images: Arc::new(ImageCache::with(
                self.store.layout().images(),
                &ImageOptions {
                    file_root: Some("/".into()),
                    ..ImageOptions::default()
                },
            )),
            seed: Arc::new(NoCloudSeed::default()),
            host_keys: Arc::new(LocalHostKeys),
            host: Fakes::new().seams().host,
        };
        let config = EngineConfig {
            agent_version: "1.0.0".into(),
            vm_timeout: Some(Duration::from_secs(30)),
            tombstone_grace: Duration::ZERO,
            ..EngineConfig::default()
        };
        Engine::new(Arc::clone(&self.store), seams, config)
    }

    fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("engine")
    }

    fn vm(&self, vm: &str, power: PowerState) -> Snapshot {
        let mut d = desired(vm);
        d.spec.image_url = self.base_url.clone();
        d.spec.image_sha256 = self.base_sha.clone();
        d.power = power;
        snapshot(1, vec![present(d)])
    }

    fn tick(&self, snap: &Snapshot) {
        self.engine().step(snap);
        assert!(
            self.engine().wait_idle(Deadline::after(PATIENCE)),
            "engine did not go idle"
        );
    }

    fn row(&self, vm: &str) -> VmStatus {
        self.engine()
            .published()
            .vms
            .into_iter()
            .find(|r| r.vm_id == vm)
            .map(std::sync::Arc::unwrap_or_clone)
            .unwrap_or_else(|| panic!("no row for {vm}"))
    }

    fn pid(&self, vm: &str) -> Option<u32> {
        std::fs::read_to_string(self.backend.pidfile_path(&id(vm)))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        drop(self.engine.take());
        let _ = self
            .backend
            .destroy(&id("vm-1"), Deadline::after(Duration::from_secs(5)));
    }
}

fn config(dir: &Path) -> VfkitConfig {
    VfkitConfig {
        hypervisor: Arc::new(HypervisorSettings {
            stop: StopTimeouts {
                power_button: Duration::from_millis(500),
                vmm_shutdown: Duration::from_millis(500),
                terminate: Duration::from_millis(500),
                kill: Duration::from_millis(500),
            },
            ..HypervisorSettings::new(PathBuf::from(VFKIT), None, dir.join("run"))
        }),
        boot_wait: Duration::from_secs(5),
        leases: dir.join("dhcpd_leases"),
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            != Some("Z")
    })
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_created_vm_boots_and_runs() {
    let h = Host::new();

    h.tick(&h.vm("vm-1", PowerState::Running));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready)),
        "{row:?}"
    );
    assert!(h.pid("vm-1").is_some_and(alive));
    assert!(
        h.store
            .layout()
            .vm_dir(&id("vm-1"))
            .join("efi-vars")
            .exists()
    );
}

#[test]
fn a_vm_with_egress_rules_of_its_own_is_not_started_saying_vfkit_cannot_hold_them() {
    let h = Host::new();
    let Snapshot { mut vms, .. } = h.vm("vm-1", PowerState::Running);
    let Some(eitri_agent::model::WantedVm::Present(d)) = vms.pop() else {
        panic!("a present VM");
    };
    let mut d = (*d).clone();
    d.egress.deny = vec![eitri_agent::model::Cidr::parse("0.0.0.0/0").expect("any")];

    h.tick(&snapshot(1, vec![present(d)]));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Stopped));
    assert!(h.pid("vm-1").is_none());
    assert!(
        row.last_error
            .contains("cannot hold a VM's own egress rules"),
        "{row:?}"
    );
}

#[test]
fn a_killed_vfkit_is_booted_again_without_a_tick() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let first = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");

    wait_until("a new vfkit", || {
        h.pid("vm-1").is_some_and(|p| p != first && alive(p))
    });
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_guest_ignoring_the_power_button_is_hard_stopped() {
    // SAFETY: set before this test's process starts a thread.
    unsafe { std::env::set_var("STANDIN_VFKIT_IGNORE_STOP", "1") };
    let mut h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");
    // No engine to boot it again when it exits.
    drop(h.engine.take());
    let said = std::sync::Mutex::new(Vec::<String>::new());

    h.backend
        .shutdown(&id("vm-1"), Deadline::after(PATIENCE), &|s| {
            said.lock().expect("lock").push(s.to_owned());
        })
        .expect("stopped");

    let said = said.into_inner().expect("lock");
    assert!(!alive(pid));
    assert!(
        said.iter()
            .any(|s| s == "stopping: pressing the power button"),
        "{said:?}"
    );
    assert!(
        said.iter()
            .any(|s| s == "stopping: asking vfkit to shut down"),
        "{said:?}"
    );
    assert!(
        !said.iter().any(|s| s == "stopping: killing vfkit"),
        "{said:?}"
    );
}

#[test]
fn the_engine_stops_a_guest_ignoring_the_power_button_with_a_hard_stop() {
    // SAFETY: set before this test's process starts a thread.
    unsafe { std::env::set_var("STANDIN_VFKIT_IGNORE_STOP", "1") };
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");

    h.tick(&h.vm("vm-1", PowerState::Stopped));

    let log = std::fs::read_to_string(h.store.layout().hypervisor_log(&id("vm-1"))).expect("log");
    assert!(!alive(pid));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
    let asked: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("received state change request"))
        .collect();
    assert_eq!(asked.len(), 2, "{log}");
    assert!(
        asked[0].contains("\"Stop\"") && asked[1].contains("\"HardStop\""),
        "{asked:?}"
    );
}

#[test]
fn a_vm_asked_to_stop_is_powered_off_by_the_engine() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");

    h.tick(&h.vm("vm-1", PowerState::Stopped));

    assert!(!alive(pid));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
}

#[test]
fn destroy_leaves_no_process_socket_pidfile_or_directory() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");
    let socket = h.backend.socket_path(&id("vm-1"));

    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!alive(pid));
    assert!(!socket.exists());
    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
}

#[test]
fn an_early_exit_puts_vfkits_error_in_the_row() {
    // SAFETY: set before this test's process starts a thread.
    unsafe {
        std::env::set_var(
            "STANDIN_VFKIT_FAIL",
            "vz: VZErrorDomain Code=2 invalid configuration",
        )
    };
    let h = Host::new();

    h.tick(&h.vm("vm-1", PowerState::Running));

    let row = h.row("vm-1");
    assert!(
        row.last_error
            .contains("Error: vz: VZErrorDomain Code=2 invalid configuration"),
        "{row:?}"
    );
}

#[test]
fn a_qcow2_base_is_refused() {
    let h = Host::with_base(b"QFI\xfb\0\0\0\x03");

    h.tick(&h.vm("vm-1", PowerState::Running));

    let row = h.row("vm-1");
    assert!(row.last_error.contains("QCOW2"), "{row:?}");
    assert!(h.pid("vm-1").is_none(), "no vfkit was started");
}

#[test]
fn a_leftover_socket_does_not_stop_a_boot() {
    let h = Host::new();
    let socket = h.backend.socket_path(&id("vm-1"));
    std::fs::create_dir_all(socket.parent().expect("dir")).expect("run dir");
    // A socket file a vfkit left when it died.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));

    h.tick(&h.vm("vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
}

#[test]
fn an_agent_restart_adopts_the_running_vfkit() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");

    let restarted = Vfkit::new(Arc::clone(&h.store), config(h.dir.path()));
    let notes = restarted.recover(&[id("vm-1")]);

    assert!(notes.is_empty(), "{notes:?}");
    assert!(restarted.running(&id("vm-1")));
    assert!(alive(pid), "adopted, not restarted");
}

#[test]
fn an_orphan_vfkit_is_stopped_at_start_and_said() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");

    let restarted = Vfkit::new(Arc::clone(&h.store), config(h.dir.path()));
    let notes = restarted.recover(&[]);

    wait_until("the orphan to be gone", || !alive(pid));
    assert_eq!(notes.len(), 1, "{notes:?}");
}

#[test]
fn the_address_is_the_newest_lease_for_the_vms_mac() {
    let h = Host::new();
    let mac = eitri_agent::model::Mac::underlay(&id("vm-1")).octets();
    let stripped: Vec<String> = mac.iter().map(|b| format!("{b:x}")).collect();
    std::fs::write(
        h.dir.path().join("dhcpd_leases"),
        format!(
            "{{\n\tname=vm-1\n\tip_address=192.168.64.12\n\thw_address=1,{}\n\tlease=0x1\n}}\n",
            stripped.join(":")
        ),
    )
    .expect("leases");

    assert_eq!(
        h.backend.address(&id("vm-1")),
        Some("192.168.64.12".parse().expect("ip"))
    );
}

#[test]
fn a_second_nic_is_refused_naming_the_entitlement() {
    let h = Host::new();
    let mut spec = desired("vm-1").spec;
    spec.network = "lab".into();

    let err = h.backend.boot(&spec, Deadline::NONE).expect_err("refused");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("com.apple.vm.networking"), "{err}");
}

// ── suspend and resume: the guest paused in place ────────────────────────

/// What the VM's vfkit says its state is.
fn vfkit_state(h: &Host, vm: &str) -> String {
    eitri_agent::provision::vfkit::api::state(
        &h.backend.socket_path(&id(vm)),
        std::time::Duration::from_secs(2),
    )
    .expect("vfkit's state")
}

#[test]
fn a_suspended_vm_is_its_guest_paused_in_a_vfkit_that_keeps_running() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");

    h.tick(&h.vm("vm-1", PowerState::Suspended));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Suspended));
    assert!(alive(pid), "vfkit holds the paused guest");
    assert_eq!(vfkit_state(&h, "vm-1"), "VirtualMachineStatePaused");
    let saved = h
        .store
        .get(&id("vm-1"))
        .expect("readable")
        .expect("a record")
        .lifecycle
        .suspension()
        .saved()
        .expect("suspended");
    assert!(saved.in_memory, "held in memory, not on disk");
}

#[test]
fn a_vm_paused_in_place_resumes_on_the_same_vfkit() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");
    h.tick(&h.vm("vm-1", PowerState::Suspended));

    h.tick(&h.vm("vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.pid("vm-1"), Some(pid));
    assert_eq!(vfkit_state(&h, "vm-1"), "VirtualMachineStateRunning");
}

#[test]
fn stopping_a_vm_paused_in_place_ends_its_vfkit_without_waiting_on_the_power_button() {
    let h = Host::new();
    h.tick(&h.vm("vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid");
    h.tick(&h.vm("vm-1", PowerState::Suspended));

    h.tick(&h.vm("vm-1", PowerState::Stopped));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
    wait_until("the paused vfkit to end", || !alive(pid));
}
