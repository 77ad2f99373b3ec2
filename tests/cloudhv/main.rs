//! The cloud-hypervisor backend against the project's stand-in hypervisor:
//! real forks, real sockets, real taps, real signals. Through the engine
//! where the rule is the engine's.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

mod boot;
mod clone;
mod guest;
mod hugepages;
mod jail;
mod limits;
mod logs;
mod network;
mod preflight;
mod process;
mod publish;
mod stop;
mod suspend;
mod usage;
mod wake;

// Helpers of these two that the other modules use too.
use self::{process::*, suspend::*};

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
use eitri_agent::provision::{HypervisorSettings, SavedGuest, Suspend};
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
    /// What the engine admits (0: no cap).
    caps: eitri_agent::reconcile::HostCaps,
    /// New VMs' seeds install a guest agent, as the daemon's do with
    /// `eitri-guest` beside it: the engine waits for it.
    delivers_guest_agent: bool,
    /// Whether `spec` lays down each VM's root disk (from the base image)
    /// and seed first, as the engine's create does before a boot: a real
    /// hypervisor reads each disk's first sector at start (v52 fails on
    /// an empty one), the stand-in reads nothing.
    lays_disks: bool,
}

/// A tap prefix of this test process alone: parallel tests never touch
/// each other's links, and no real host names a link like this.
/// `cfg` with another hypervisor binary.
fn with_binary(cfg: &CloudHvConfig, binary: PathBuf) -> CloudHvConfig {
    CloudHvConfig {
        hypervisor: Arc::new(HypervisorSettings {
            binary,
            ..(*cfg.hypervisor).clone()
        }),
        ..cfg.clone()
    }
}

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
        eitri_agent::testkit::remove_on_signal(dir.path());
        Host::in_dir(dir, knobs)
    }

    /// A host whose hypervisor is a real cloud-hypervisor booting `kernel`.
    /// The root disk is `EITRI_TEST_GUEST_IMAGE` when set, else a blank one.
    fn real(hypervisor: PathBuf, kernel: PathBuf) -> Host {
        let mut h = Host::new(&[]);
        Arc::make_mut(&mut h.cfg.hypervisor).binary = hypervisor;
        Arc::make_mut(&mut h.cfg.hypervisor).kernel = Some(kernel);
        h.cfg.boot_wait = Duration::from_secs(30);
        // Confined as on a host: the real VMM, as its own user, opens the
        // real /dev/kvm (its group is given access by an ACL entry).
        Arc::make_mut(&mut h.cfg.confinement).kvm = PathBuf::from("/dev/kvm");
        // And, resuming, the real userfaultfd device (given the same way).
        Arc::make_mut(&mut h.cfg.confinement).userfaultfd = Some(PathBuf::from("/dev/userfaultfd"));
        if let Some(image) = std::env::var_os("EITRI_TEST_GUEST_IMAGE") {
            h.base_sha = sha256_file(Path::new(&image)).expect("hash the guest image");
            h.base_url = format!("file://{}", PathBuf::from(image).display());
        }
        // The tiny guest (`mkguest.py`) prints its marker first thing.
        h.serial_marker =
            std::env::var("EITRI_TEST_GUEST_MARKER").unwrap_or_else(|_| "TINY-GUEST-UP".into());
        h.lays_disks = true;
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
            hypervisor: Arc::new(HypervisorSettings {
                cmdline: "console=ttyS0".into(),
                stop: StopTimeouts {
                    power_button: Duration::from_millis(500),
                    vmm_shutdown: Duration::from_millis(500),
                    terminate: Duration::from_millis(300),
                    ..StopTimeouts::default()
                },
                ..HypervisorSettings::new(
                    launcher(dir.path(), knobs),
                    Some(kernel),
                    dir.path().join("run"),
                )
            }),
            tap_prefix: tap_prefix(),
            boot_wait: Duration::from_secs(5),
            network: None,
            confinement: Arc::new(eitri_agent::testkit::confinement(dir.path())),
            limits: Arc::default(),
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
            caps: eitri_agent::reconcile::HostCaps::default(),
            delivers_guest_agent: false,
            lays_disks: false,
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
            // Any ELF is a guest agent to the seed; the stand-in's guest
            // is scripted, and never runs it.
            seed: Arc::new(if self.delivers_guest_agent {
                NoCloudSeed::delivering(Path::new("/bin/true")).expect("a seed carrying an ELF")
            } else {
                NoCloudSeed::default()
            }),
            host_keys: Arc::new(LocalHostKeys),
            host: self.fakes.seams().host,
        };
        let config = EngineConfig {
            agent_version: "1.0.0".into(),
            vm_timeout: Some(Duration::from_secs(30)),
            tombstone_grace: Duration::ZERO,
            caps: self.caps,
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

    /// The same host, its new VMs' seeds carrying a guest agent.
    fn delivering_a_guest_agent(mut self) -> Host {
        self.delivers_guest_agent = true;
        self.engine = Some(self.make_engine());
        self
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
        let disk = self.store.layout().root_disk(&id(vm));
        if self.lays_disks
            && !disk.exists()
            && let Some(base) = self.base_url.strip_prefix("file://")
        {
            std::fs::create_dir_all(disk.parent().expect("a VM dir")).expect("the VM's dir");
            std::fs::copy(base, &disk).expect("a root disk from the base image");
            // And a seed of a seed's size, where the engine writes its ISO.
            let seed = self.store.layout().seed(&id(vm));
            std::fs::write(&seed, vec![0u8; 1 << 20]).expect("a seed");
        }
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
        // The host's own devices (a real hypervisor's test) get their ACL
        // entry for this test's VMM group back: each test process has a
        // group of its own, and the entries would only grow.
        let confinement = &self.cfg.confinement;
        for device in confinement.devices() {
            if !device.starts_with(self.dir.path()) {
                let _ =
                    eitri_agent::provision::jail::acl::revoke_group(&device, confinement.first_id);
            }
        }
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
    ($($module:ident :: $scenario:ident),* $(,)?) => {
        mod with_stand_in {
            $(#[test] fn $scenario() {
                eitri_agent::testkit::net::private_network();
                let mut h = super::Host::new(&[]);
                h.connect();
                crate::$module::$scenario(h);
            })*
        }
        mod with_real_hypervisor {
            $(#[test] fn $scenario() {
                eitri_agent::testkit::net::private_network();
                match super::real_host() {
                    Ok(mut h) => {
                        h.connect();
                        crate::$module::$scenario(h)
                    }
                    Err(why) => println!("SKIPPED {}: {why}", stringify!($scenario)),
                }
            })*
        }
    };
}

both!(
    boot::a_created_vm_boots_and_runs_on,
    boot::booting_twice_starts_one_process_on,
    boot::an_agent_restart_adopts_the_running_hypervisor_on,
    boot::a_killed_hypervisor_is_booted_again_without_a_tick_on,
    boot::an_adopted_hypervisor_killed_is_booted_again_without_a_tick_on,
    stop::destroy_leaves_no_process_socket_pidfile_tap_or_directory_on,
    stop::the_tap_dies_with_a_killed_hypervisor_on,
    process::the_hypervisor_holds_only_its_own_fds_on,
    process::the_hypervisor_runs_in_network_and_mount_namespaces_of_its_own_on,
    process::a_hundred_boot_destroy_cycles_leave_no_zombie_and_no_fd_on,
    preflight::preflight_passes_on,
    suspend::suspend_and_resume_twice_keep_the_guest_and_its_console_on,
    suspend::a_suspended_vm_resumes_after_an_agent_restart_on,
    suspend::a_restore_whose_resume_cannot_be_recorded_is_ended_before_its_guest_runs_on,
    suspend::a_restore_cut_short_before_its_resume_was_recorded_is_stopped_at_start_on,
    suspend::a_restored_hypervisor_is_jailed_in_namespaces_of_its_own_on,
    suspend::a_disk_changed_while_suspended_boots_the_vm_from_its_disks_on,
    suspend::stopping_a_suspended_vm_discards_its_snapshot_on,
    suspend::destroying_a_suspended_vm_leaves_nothing_of_it_on,
    boot::a_serial_probe_makes_the_vm_ready_once_its_guest_prints_the_line_on,
    boot::a_serial_probe_for_a_line_the_guest_never_prints_holds_ready_back_on,
    suspend::a_resumed_guest_that_printed_its_probes_line_before_is_ready_again_on,
    suspend::a_cold_boot_does_not_count_the_line_its_last_boot_printed_on,
    usage::a_running_vms_reading_is_of_its_own_vmm_and_its_counts_on,
);
