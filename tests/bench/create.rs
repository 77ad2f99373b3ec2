//! `make bench-create`: from a VM added to the desired state to its row
//! saying it runs, through the whole agent: the engine, the image cache
//! (the image already cached), the seed, the host key, the record saves,
//! the host network (underlay, guards, DHCP responder: on, in a private
//! network namespace) and the cloud-hypervisor backend starting the
//! stand-in hypervisor, jailed as on a host. Run as root.
//!
//! - Singles: `VMS` creates one at a time, each timed from the step that
//!   brings its SSH host certificate (its host key was made and reported
//!   in the step before, as the certificate flow goes) to its row saying
//!   running. The stand-in logs its own time
//!   from `main` to an API that answers; the rest is the agent's overhead.
//!   Then the median of every stage of those creates (as the agent logs
//!   them, see `eitri_agent::stages`).
//! - Burst: `VMS` more named in one step; creates_per_core_s is VMS over
//!   the time until the last runs, per core. `EITRI_BENCH_SLOTS` sets the
//!   create slots (default: the engine's).
//! - Real: with `EITRI_REAL_CH` naming a cloud-hypervisor binary (and
//!   `EITRI_REAL_GUEST` a PVH guest it boots, default the tiny guest at
//!   /srv/eitri-guest/guest.elf, from `mkguest.py`), what an operator
//!   waits for: the agent binary runs as a daemon over a desired file (in
//!   a private network namespace, guest networking on), and `REAL_VMS`
//!   VMs it has never seen are added one at a time, each timed from the
//!   desired file's rename (and SIGHUP) to the new VMM's own API saying
//!   Running, polled from outside (see `daemon.rs`). Each is followed by a
//!   bare start of the same binary with the same confinement (its own
//!   user and the KVM group, its own cgroups entered before exec,
//!   no_new_privs, Landlock, the API socket and a tap passed as fds 3 and
//!   4, the agent's own command line), timed from its fork to the same
//!   answer. The difference of the medians is the agent's
//!   (`real_overhead_ms_p50`); the stages are the ones the agent logged
//!   for those creates, and "outside the pass" the daemon's share before
//!   and after the VM's worker ran. `EITRI_BENCH_REAL_ONLY=1` runs this
//!   part alone; `EITRI_BENCH_AGENT` names another build of the agent to
//!   time. `EITRI_BENCH_AGENT_B` names a second build, run as a second
//!   daemon beside the first and timed in the same turns (their order
//!   swapped at each): two builds compared on the same minutes of the
//!   same disk (`real_b_minus_a_ms_p50`). After each turn, one durable
//!   save of the size of the agent's record is timed on the same disk
//!   (`real_durable_save_ms_p50`): the agent's figure read against what
//!   the disk charged meanwhile.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::model::{Id, Phase, PowerState, Snapshot, WantedVm};
use eitri_agent::provision::cloudhv::argv::VmFiles;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::provision::supervise::StopTimeouts;
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::stages::Stages;
use eitri_agent::state::Store;
use eitri_agent::testkit::{desired, present, snapshot, tombstoned};

#[path = "agent.rs"]
mod agent;
#[path = "daemon.rs"]
mod daemon;
#[path = "figures.rs"]
mod figures;
use figures::{ms, percentile, print_stages};

const VMS: usize = 20;
/// Creates and bare starts against a real hypervisor.
const REAL_VMS: usize = 25;
const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// Where `mkguest.py` writes the tiny guest by default here.
const TINY_GUEST: &str = "/srv/eitri-guest/guest.elf";
/// A bound to give up on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(60);

type Error = Box<dyn std::error::Error>;

/// Create slots: `EITRI_BENCH_SLOTS`, else the engine's default.
fn slots() -> Option<usize> {
    std::env::var("EITRI_BENCH_SLOTS").ok()?.parse().ok()
}

struct Bench {
    /// Held for its removal when the bench ends.
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    engine: Engine,
    base_url: String,
    base_sha: String,
    wanted: Vec<WantedVm>,
    epoch: u64,
    /// How long each measured `Engine::step` took.
    steps: parking_lot::Mutex<Vec<Duration>>,
    /// The cgroups every stand-in of this bench runs in: whatever way the
    /// bench ends (an error, a panic, ^C), every process in them is killed.
    cgroup_root: String,
}

impl Drop for Bench {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

/// The files of a VM the bare start boots from, in `vm`, owned by `uid`
/// as the agent gives them to its VMM.
fn vm_files(vm: &Path, uid: u32) -> Result<VmFiles, Error> {
    std::fs::create_dir_all(vm)?;
    std::fs::set_permissions(vm, std::os::unix::fs::PermissionsExt::from_mode(0o711))?;
    let files = VmFiles {
        root_disk: vm.join("disk.raw"),
        seed: vm.join("seed.iso"),
        volumes: Vec::new(),
        serial_log: vm.join("serial.log"),
        log: vm.join("hypervisor.log"),
        snapshot_work: vm.join("snapshot.tmp"),
        guest_socket: vm.join("vsock/guest.sock"),
    };
    for (path, len) in [
        (&files.root_disk, 1u64 << 20),
        (&files.seed, 1 << 16),
        (&files.serial_log, 0),
        (&files.log, 0),
    ] {
        std::fs::File::create(path)?.set_len(len)?;
        std::os::unix::fs::chown(path, Some(uid), Some(uid))?;
    }
    std::fs::create_dir_all(&files.snapshot_work)?;
    std::os::unix::fs::chown(&files.snapshot_work, Some(uid), Some(uid))?;
    let vsock = vm.join("vsock");
    std::fs::create_dir_all(&vsock)?;
    std::os::unix::fs::chown(&vsock, Some(uid), Some(uid))?;
    Ok(files)
}

/// One bare start of the real hypervisor `ch` booting `kernel`, confined
/// as the agent confines a VMM (see the module header), in `dir`: the time
/// from starting it to its API saying Running. The VMM is killed after.
fn bare_confined_start(
    ch: &Path,
    kernel: &Path,
    dir: &Path,
    n: usize,
    ids: (u32, u32),
    cgroup_root: &str,
) -> Result<Duration, Error> {
    use eitri_agent::provision::cloudhv::argv::{GuestImage, Nic, VmShape, argv, what_a_vmm_sees};
    use eitri_agent::provision::jail::{self, fork, view};
    use std::os::fd::OwnedFd;
    let (uid, kvm_group) = ids;
    let vm_id = Id::parse(&format!("bare-{n}"))?;
    let vm = dir.join(vm_id.as_str());
    let files = vm_files(&vm, uid)?;
    let socket = vm.join("api.sock");
    let api = OwnedFd::from(std::os::unix::net::UnixListener::bind(&socket)?);
    let tap_name = format!("eb{:04x}{n:02}", std::process::id() & 0xffff);
    let tap = eitri_agent::provision::cloudhv::tap::open(&tap_name)?;
    let cgroups = eitri_agent::provision::jail::cgroup::Cgroups::probe(cgroup_root)
        .map_err(|e| e.to_string())?;
    let mut spec = desired(vm_id.as_str()).spec;
    spec.mem_mb = 256;
    cgroups.prepare(&vm_id, jail::cgroup_limits(&spec, &spec.limits))?;
    let entries = cgroups.entry_files(&vm_id)?;
    let image = GuestImage::Kernel {
        kernel,
        cmdline: "console=ttyS0",
    };
    let nics = [Nic {
        fd: 4,
        mac: eitri_agent::model::Mac::underlay(&vm_id),
    }];
    let shape = VmShape {
        api_fd: 3,
        nics: &nics,
        vcpus: spec.vcpus,
        mem_mb: spec.mem_mb,
        hugepages: false,
        landlock: true,
        limits: spec.limits,
    };
    // The agent's jail for it: its user, the KVM group, the same limits,
    // its own network namespace (made by the child: the agent's are made
    // ahead, which is the agent's doing) and its own view of the files.
    let mut confined = jail::jail_for(&spec, uid, kvm_group, 1 << 20);
    let mountpoint = dir.join("vmm-root");
    std::fs::create_dir_all(&mountpoint)?;
    let seen = what_a_vmm_sees(
        view::runtime_of(ch)?,
        ch,
        &[kernel],
        &files,
        Path::new("/dev/kvm"),
    );
    confined.view = Some(view::View::plan(&mountpoint, &seen)?);
    let log = OwnedFd::from(std::fs::OpenOptions::new().append(true).open(&files.log)?);
    let args = argv(Some(image), &files, &shape);
    let started = Instant::now();
    let pid = fork::start(
        &fork::Start {
            program: ch,
            args: &args,
            log: &log,
            own: &[&api, &tap],
            cgroups: &entries,
            netns: None,
            jail: Some(&confined),
        },
        |_| Ok(()),
    )
    .map_err(|e| format!("the bare hypervisor did not start: {e:?}"))?;
    drop((api, tap, entries));
    let exited = || {
        nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(pid),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        )
        .is_ok_and(|s| s != nix::sys::wait::WaitStatus::StillAlive)
    };
    let running = daemon::wait_running(&socket, Instant::now() + PATIENCE, exited)
        .map(|()| started.elapsed())
        .map_err(|e| {
            let said = std::fs::read_to_string(&files.log).unwrap_or_default();
            format!("the bare hypervisor: {e}: {said}").into()
        });
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    let _ = cgroups.remove(&vm_id);
    running
}

impl Bench {
    /// Against the stand-in.
    fn new() -> Result<Bench, Error> {
        Bench::with(None)
    }

    /// Against a real hypervisor and guest kernel when given, on the real
    /// KVM device; against the stand-in otherwise.
    fn with(real: Option<(PathBuf, PathBuf)>) -> Result<Bench, Error> {
        let dir = tempfile::tempdir()?;
        eitri_agent::testkit::remove_on_signal(dir.path());
        let (hypervisor, kernel) = match real.clone() {
            Some(pair) => pair,
            None => {
                let kernel = dir.path().join("vmlinux");
                std::fs::write(&kernel, b"not really a kernel")?;
                (PathBuf::from(STANDIN), kernel)
            }
        };
        let (base_url, base_sha) = agent::base_image(dir.path())?;
        let store = Arc::new(Store::open(&dir.path().join("state"))?);
        let prefix = format!("ec{:04x}", std::process::id() & 0xffff);
        let mut cfg = CloudHvConfig {
            boot_wait: Duration::from_secs(10),
            ..agent::host_config(
                dir.path(),
                &store,
                (hypervisor, kernel),
                &prefix,
                real.is_some(),
            )?
        };
        Arc::make_mut(&mut cfg.hypervisor).stop = StopTimeouts {
            power_button: Duration::from_millis(200),
            vmm_shutdown: Duration::from_millis(200),
            terminate: Duration::from_millis(200),
            ..StopTimeouts::default()
        };
        let cgroup_root = cfg.confinement.cgroup_root.clone();
        let seams = agent::seams(
            &store,
            Arc::new(CloudHypervisor::new(Arc::clone(&store), cfg)),
            dir.path(),
        );
        let defaults = EngineConfig::default();
        let config = EngineConfig {
            agent_version: "1.0.0".into(),
            tombstone_grace: Duration::ZERO,
            max_concurrent_creates: slots().unwrap_or(defaults.max_concurrent_creates),
            ..defaults
        };
        let engine = Engine::new(Arc::clone(&store), seams, config);
        Ok(Bench {
            base_url,
            _dir: dir,
            store,
            engine,
            base_sha,
            wanted: Vec::new(),
            epoch: 0,
            steps: parking_lot::Mutex::default(),
            cgroup_root,
        })
    }

    /// A snapshot of every VM wanted so far, with `names` (re)placed:
    /// each requires an SSH host certificate, and has it when `certified`.
    fn want(&mut self, names: &[String], certified: bool) -> Snapshot {
        self.wanted.retain(|w| match w {
            WantedVm::Present(d) => !names.iter().any(|n| d.spec.vm_id.as_str() == n),
            WantedVm::Tombstoned(_) => true,
        });
        for name in names {
            let mut d = desired(name);
            d.spec.image_url = self.base_url.clone();
            d.spec.image_sha256 = self.base_sha.clone();
            d.host_cert_required = true;
            if certified {
                d.ssh_host_cert = "ssh-ed25519-cert-v01@openssh.com AAAAbench".into();
            }
            self.wanted.push(present(d));
        }
        self.epoch += 1;
        snapshot(self.epoch, self.wanted.clone())
    }

    /// What a host with SSH certificates does before a create: the VM is
    /// named without its certificate, its host key is made and reported,
    /// and the control plane signs it. The create's clock starts when the
    /// certificate arrives.
    fn keyed(&mut self, names: &[String]) {
        let snap = self.want(names, false);
        self.engine.step(&snap);
        self.engine.wait_idle(Deadline::after(PATIENCE));
    }

    /// Steps `snap` and waits until every VM in `names` runs; returns when
    /// the last did, from the step's start.
    fn create(&self, snap: &Snapshot, names: &[String]) -> Result<Duration, Error> {
        let started = Instant::now();
        self.engine.step(snap);
        self.steps.lock().push(started.elapsed());
        let deadline = Deadline::after(PATIENCE);
        loop {
            let report = self.engine.published();
            let running = names.iter().all(|name| {
                report.vms.iter().any(|r| {
                    r.vm_id == *name
                        && r.phase == Some(Phase::Ready)
                        && r.power == Some(PowerState::Running)
                })
            });
            if running {
                return Ok(started.elapsed());
            }
            if let Some(failed) = report
                .vms
                .iter()
                .find(|r| names.contains(&r.vm_id) && r.phase == Some(Phase::Failed))
            {
                return Err(format!("{} failed: {}", failed.vm_id, failed.last_error).into());
            }
            if deadline.expired() {
                return Err("creates did not finish in time".into());
            }
            let _ = self
                .engine
                .changes()
                .recv_timeout(Duration::from_millis(100));
        }
    }

    /// The stand-in's own time from `main` to an API that answers.
    fn standin_boot(&self, name: &str) -> Option<Duration> {
        let log = self.store.layout().hypervisor_log(&Id::parse(name).ok()?);
        let text = std::fs::read_to_string(log).ok()?;
        let line = text.lines().rev().find(|l| l.contains("standin-timing"))?;
        let field = |key: &str| -> Option<u64> {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))?
                .parse()
                .ok()
        };
        Some(Duration::from_nanos(
            field("ready_ns=")?.checked_sub(field("main_ns=")?)?,
        ))
    }

    /// Destroys every VM, so no stand-in outlives the bench.
    fn destroy_all(&mut self) {
        let ids: Vec<Id> = self.store.load_all().keys().cloned().collect();
        self.epoch += 1;
        let gone = snapshot(
            self.epoch,
            ids.iter().map(|i| tombstoned(i.as_str())).collect(),
        );
        let deadline = Deadline::after(PATIENCE);
        while !self.store.load_all().is_empty() && !deadline.expired() {
            self.engine.step(&gone);
            self.engine.wait_idle(Deadline::after(PATIENCE));
        }
    }
}

fn main() -> Result<(), Error> {
    eitri_agent::testkit::net::private_network();
    if std::env::var_os("EITRI_BENCH_REAL_ONLY").is_some() {
        let (ch, guest) = real_parts().ok_or("EITRI_BENCH_REAL_ONLY needs EITRI_REAL_CH")?;
        let real = real_figures(ch, guest)?;
        println!("bench=create{real}");
        return Ok(());
    }
    let mut bench = Bench::new()?;
    let traces: Arc<parking_lot::Mutex<Vec<Stages>>> = Arc::default();
    {
        let traces = Arc::clone(&traces);
        bench
            .engine
            .watch_stages(move |_, stages| traces.lock().push(stages.clone()));
    }
    // The image into the cache, and every lazy first (the KVM grant, the
    // cgroup parents) out of the way.
    let warm = vec!["warm".to_owned()];
    bench.keyed(&warm);
    let snap = bench.want(&warm, true);
    bench.create(&snap, &warm)?;
    bench.engine.wait_idle(Deadline::after(PATIENCE));
    traces.lock().clear();

    let mut agent = Vec::new();
    let mut standin = Vec::new();
    let mut overhead = Vec::new();
    for n in 0..VMS {
        let names = vec![format!("one-{n:02}")];
        bench.keyed(&names);
        let snap = bench.want(&names, true);
        let took = bench.create(&snap, &names)?;
        bench.engine.wait_idle(Deadline::after(PATIENCE));
        let own = bench
            .standin_boot(&names[0])
            .ok_or("the stand-in did not log its timing")?;
        agent.push(ms(took));
        standin.push(ms(own));
        overhead.push(ms(took.saturating_sub(own)));
    }
    let singles = std::mem::take(&mut *traces.lock());
    let steps: Vec<f64> = bench.steps.lock().iter().skip(1).map(|d| ms(*d)).collect();

    let names: Vec<String> = (0..VMS).map(|n| format!("burst-{n:02}")).collect();
    bench.keyed(&names);
    let snap = bench.want(&names, true);
    let burst = bench.create(&snap, &names)?;
    bench.engine.wait_idle(Deadline::after(PATIENCE));
    bench.destroy_all();

    print_stages("single creates", &singles);
    println!(
        "  {:<16} {:>8.3}  (the step that named them, before dispatch)",
        "step",
        percentile(steps, 0.5)
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "burst: {VMS} creates in {:.1} ms on {cores} cores, {} create slots",
        ms(burst),
        slots().map_or("default".to_owned(), |n| n.to_string())
    );
    drop(bench);
    let real = match real_parts() {
        Some((ch, guest)) => real_figures(ch, guest)?,
        None => {
            println!(
                "real: skipped (set EITRI_REAL_CH to a cloud-hypervisor binary to measure it)"
            );
            String::new()
        }
    };
    println!(
        "bench=create vms={VMS} agent_ms_p50={:.2} standin_boot_ms_p50={:.2} overhead_ms_p50={:.2} overhead_ms_p99={:.2} creates_per_core_s={:.2}{real}",
        percentile(agent, 0.5),
        percentile(standin, 0.5),
        percentile(overhead.clone(), 0.5),
        percentile(overhead, 0.99),
        VMS as f64 / burst.as_secs_f64() / cores as f64
    );
    Ok(())
}

/// The real hypervisor and the guest it boots, when `EITRI_REAL_CH` names
/// one.
fn real_parts() -> Option<(PathBuf, PathBuf)> {
    let ch = std::env::var_os("EITRI_REAL_CH")?;
    let guest = std::env::var_os("EITRI_REAL_GUEST").unwrap_or_else(|| TINY_GUEST.into());
    Some((PathBuf::from(ch), PathBuf::from(guest)))
}

/// The real hypervisor's figures (see the module header), as the tail of
/// the `bench=create` line: the agent binary as a daemon, each create timed
/// from the rename of the desired file to the new VMM's API saying
/// Running, each followed by a bare confined start of the same binary.
fn real_figures(ch: PathBuf, guest: PathBuf) -> Result<String, Error> {
    let dir = agent::bench_dir()?;
    let images = dir.path().join("images");
    std::fs::create_dir_all(&images)?;
    let (url, sha) = agent::base_image(&images)?;
    let tag = format!("{:04x}", std::process::id() & 0xffff);
    let roots = Roots(vec![
        format!("eitri-test-{}", std::process::id()),
        format!("eitri-test-{}-bare", std::process::id()),
        format!("eitri-test-{}-b", std::process::id()),
    ]);
    // Each daemon its own half of this process's VMM ids; the bare start
    // the last of them, in the first daemon's VMMs' group.
    let (first, count) = daemon::vmm_ids();
    let half = count / 2;
    let start = |name: &str, net: (&str, &str), root: &str, ids, binary: Option<&Path>| {
        daemon::Daemon::start(
            &dir.path().join(name),
            &daemon::Parts {
                hypervisor: &ch,
                kernel: &guest,
                image: (&url, &sha),
                images: &images,
                cgroup_root: root,
                tap_prefix: &format!("{}{tag}", net.0),
                bridge: &format!("{}{tag}", net.1),
                cmdline: "console=ttyS0",
                extra: &[],
                vmm_ids: ids,
                binary,
            },
            PATIENCE,
        )
    };
    let mut daemon = start("agent", ("ed", "ebd"), &roots.0[0], (first, half), None)?;
    let other = std::env::var_os("EITRI_BENCH_AGENT_B").map(PathBuf::from);
    let mut other = match &other {
        Some(binary) => Some(start(
            "agent-b",
            ("ef", "ebf"),
            &roots.0[2],
            (first + half, half - 1),
            Some(binary),
        )?),
        None => None,
    };
    // The image into the cache, and every lazy first (the KVM grant, the
    // cgroup parents) out of the way.
    daemon.create("real-warm", PATIENCE)?;
    if let Some(other) = &mut other {
        other.create("real-warm", PATIENCE)?;
    }
    let ids = (first + count - 1, first);
    let bare_dir = dir.path().join("bare");
    std::fs::create_dir_all(&bare_dir)?;
    // One of each in turn, so whatever else this machine does meanwhile
    // weighs on all alike; the two builds' order swapped at each turn.
    let (mut agent, mut bare, mut second, mut saves) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for n in 0..REAL_VMS {
        let name = format!("real-{n:02}");
        if let Some(other) = other.as_mut().filter(|_| n % 2 == 1) {
            second.push(ms(other.create(&name, PATIENCE)?));
        }
        agent.push(ms(daemon.create(&name, PATIENCE)?));
        if let Some(other) = other.as_mut().filter(|_| n % 2 == 0) {
            second.push(ms(other.create(&name, PATIENCE)?));
        }
        bare.push(ms(bare_confined_start(
            &ch,
            &guest,
            &bare_dir,
            n,
            ids,
            &roots.0[1],
        )?));
        saves.push(ms(durable_save(dir.path())?));
    }
    let passes = daemon.create_passes();
    daemon.destroy_all(PATIENCE)?;
    drop(daemon);
    let overhead: Vec<f64> = agent.iter().zip(&bare).map(|(a, b)| a - b).collect();
    println!("real hypervisor, through the agent binary (a desired file renamed + SIGHUP):");
    print_logged_stages(&passes[1..], percentile(agent.clone(), 0.5));
    let (agent_p50, bare_p50) = (percentile(agent.clone(), 0.5), percentile(bare, 0.5));
    let save_p50 = percentile(saves, 0.5);
    println!(
        "real: {REAL_VMS} creates through the daemon, p50 {agent_p50:.2} ms; {REAL_VMS} bare confined starts, p50 {bare_p50:.2} ms; paired differences p50 {:.2} ms; one durable save (2 KiB: write, fsync, rename, directory fsync) on the same disk meanwhile, p50 {save_p50:.2} ms",
        percentile(overhead.clone(), 0.5)
    );
    let mut figures = format!(
        " real_agent_ms_p50={agent_p50:.2} real_bare_confined_ms_p50={bare_p50:.2} real_overhead_ms_p50={:.2} real_durable_save_ms_p50={save_p50:.2}",
        agent_p50 - bare_p50
    );
    if let Some(other) = other {
        figures.push_str(&second_build(other, &second, &agent, bare_p50)?);
    }
    Ok(figures)
}

/// The other build's figures (`EITRI_BENCH_AGENT_B`), made in the same
/// turns as the first's `agent`: its creates `second` against them and
/// against the bare starts' p50, as the tail of the `bench=create` line.
fn second_build(
    mut other: daemon::Daemon,
    second: &[f64],
    agent: &[f64],
    bare_p50: f64,
) -> Result<String, Error> {
    let passes = other.create_passes();
    other.destroy_all(PATIENCE)?;
    drop(other);
    println!("the other build (EITRI_BENCH_AGENT_B), in the same turns:");
    print_logged_stages(&passes[1..], percentile(second.to_vec(), 0.5));
    let diff: Vec<f64> = second.iter().zip(agent).map(|(b, a)| b - a).collect();
    let second_p50 = percentile(second.to_vec(), 0.5);
    Ok(format!(
        " real_b_agent_ms_p50={second_p50:.2} real_b_overhead_ms_p50={:.2} real_b_minus_a_ms_p50={:.2}",
        second_p50 - bare_p50,
        percentile(diff, 0.5)
    ))
}

/// One small durable save made the way the agent saves its record (2 KiB:
/// [`write_then_rename`], then the directory's fsync) in `dir`: what the
/// disk charges for one, taken between the creates, so the agent's figure
/// is read against the disk of the same minutes (this host's fsync
/// latency doubles within a quarter hour).
///
/// [`write_then_rename`]: eitri_agent::state::atomic::write_then_rename
fn durable_save(dir: &Path) -> Result<Duration, Error> {
    use eitri_agent::state::atomic::{sync_dir, write_then_rename};
    let started = Instant::now();
    write_then_rename(&dir.join("durable-save"), &[b'x'; 2048])?;
    sync_dir(dir)?;
    Ok(started.elapsed())
}

/// Cgroup roots ended (their processes killed, the roots removed) when the
/// bench ends, however it ends.
struct Roots(Vec<String>);

impl Drop for Roots {
    fn drop(&mut self) {
        for root in &self.0 {
            eitri_agent::testkit::end_cgroup_root(root);
        }
    }
}

/// The median of each stage the agent logged for `passes` (`12.3 ms
/// (stage 0.1, other 2.0 ×2, ...)`), then what lay outside the pass: from
/// the rename to the pass's start (the daemon reading the file, its
/// snapshot save, the hand-off to the VM's worker) and after it.
fn print_logged_stages(passes: &[String], measured_p50: f64) {
    let parsed: Vec<(f64, Vec<(String, f64)>)> =
        passes.iter().filter_map(|p| parse_pass(p)).collect();
    let mut order: Vec<String> = Vec::new();
    for (_, stages) in &parsed {
        for (name, _) in stages {
            if !order.contains(name) {
                order.push(name.clone());
            }
        }
    }
    println!(
        "stage medians over {} create passes, as the agent logged them (ms; nested stages are inside their parents):",
        parsed.len()
    );
    for name in order {
        let values: Vec<f64> = parsed
            .iter()
            .map(|(_, stages)| {
                stages
                    .iter()
                    .filter(|(n, _)| *n == name)
                    .map(|(_, v)| v)
                    .sum()
            })
            .collect();
        println!("  {name:<16} {:>8.3}", percentile(values, 0.5));
    }
    let pass = percentile(parsed.iter().map(|(total, _)| *total).collect(), 0.5);
    println!("  {:<16} {pass:>8.3}", "pass");
    println!(
        "  {:<16} {:>8.3}  (the measured p50 less the pass's)",
        "outside the pass",
        measured_p50 - pass
    );
}

/// `12.3 ms (image 0.1, root disk 1.2 ×2)` as its total and its stages.
fn parse_pass(text: &str) -> Option<(f64, Vec<(String, f64)>)> {
    let (total, rest) = text.split_once(" ms (")?;
    let stages = rest
        .trim_end_matches(')')
        .split(", ")
        .filter_map(|entry| {
            let entry = entry.split(" ×").next()?;
            let (name, value) = entry.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect();
    Some((total.parse().ok()?, stages))
}
