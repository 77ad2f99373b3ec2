//! `make bench-limits`: a limit's measured rate over its set rate, with
//! the unlimited rate beside it in the same run. Run as root.
//!
//! - CPU cap (the host holds it: the VM's cgroup quota): the stand-in
//!   hypervisor with one vCPU thread that never idles, booted by the
//!   cloud-hypervisor backend jailed as on a host, its CPU time read from
//!   /proc over a window; capped at `CAP_MILLIS`, then with no cap.
//! - Disk bandwidth, disk IOPS and NIC bandwidth (the VMM holds them: its
//!   rate limiters), with `EITRI_REAL_CH` naming a cloud-hypervisor: a
//!   guest this bench builds from `tests/bench/guest` with the host's C
//!   compiler (a PVH kernel with a polling virtio driver that keeps a disk
//!   or a NIC as busy as its VMM lets it) is booted through the whole agent
//!   (engine, records, the jailed backend, the host network in a private
//!   namespace) with the limit in its spec, then without. A disk's rate is
//!   what its VMM counts it read (`vm.counters`); a NIC's is what the host
//!   kernel counts its tap took from the VMM (the VMM's own count beside
//!   it). Each rate is over `WINDOW`, after `SETTLE`: a bucket starts full,
//!   so the first second runs at the unlimited rate.
//!
//! The last line: `bench=limits cpu_ratio=… disk_ratio=… iops_ratio=…
//! net_ratio=…` (each measured over set; the goal is 0.9–1.1) with the set,
//! measured and unlimited rates.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::model::{Id, Phase, Snapshot, VmLimits};
use eitri_agent::provision::HypervisorSettings;
use eitri_agent::provision::Lifecycle;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::state::Store;
use eitri_agent::testkit::{desired, id, present, snapshot};

#[path = "agent.rs"]
mod agent;

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// The cap measured: half a CPU.
const CAP_MILLIS: u32 = 500;
/// The VMM-held limits measured: 20 MB/s of reads in 64 KiB requests,
/// 1,000 reads a second of 4 KiB, 80 Mbit/s (10 MB/s) sent.
const DISK_MBPS: u32 = 20;
const DISK_IOPS: u32 = 1000;
/// And 4,000 reads a second: cloud-hypervisor's ops bucket falls further
/// under its rate the higher the rate (README, Limits).
const DISK_IOPS_HIGH: u32 = 4000;
const NET_MBPS: u32 = 80;
/// What a rate is measured over, after `SETTLE` from its start.
const WINDOW: Duration = Duration::from_secs(5);
const SETTLE: Duration = Duration::from_secs(2);
/// A bound to give up on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(60);

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    eitri_agent::testkit::net::private_network();
    let set = f64::from(CAP_MILLIS) / 1000.0;
    let (capped, free) = cpu_rates()?;
    println!(
        "cpu: capped at {set} CPU, measured {capped:.3} CPU; with no cap {free:.3} CPU (one vCPU that never idles)"
    );
    let mut tail = format!(
        "cpu_set={set:.3} cpu_measured={capped:.3} cpu_ratio={:.3} cpu_unlimited={free:.3}",
        capped / set
    );
    match std::env::var_os("EITRI_REAL_CH") {
        Some(ch) => {
            for line in vmm_rates(Path::new(&ch))? {
                tail.push(' ');
                tail.push_str(&line);
            }
        }
        None => println!(
            "disk, net: skipped: their VMM holds them, so they need a real one (set EITRI_REAL_CH to a cloud-hypervisor binary)"
        ),
    }
    println!("bench=limits {tail}");
    Ok(())
}

/// CPUs a never-idle vCPU uses capped at `CAP_MILLIS`, and with no cap.
fn cpu_rates() -> Result<(f64, f64), Error> {
    let dir = agent::bench_dir()?;
    let hypervisor = dir.path().join("burner");
    eitri_agent::testkit::standin_hypervisor(
        Path::new(STANDIN),
        &hypervisor,
        &[("STANDIN_BURN_CPUS", "1")],
    );
    let backend = backend(dir.path(), hypervisor)?;
    Ok((
        cpu_rate(&backend, "capped", CAP_MILLIS)?,
        cpu_rate(&backend, "free", 0)?,
    ))
}

fn backend(dir: &Path, hypervisor: PathBuf) -> Result<CloudHypervisor, Error> {
    let kernel = dir.join("vmlinux");
    std::fs::write(&kernel, b"not really a kernel")?;
    let store = Arc::new(Store::open(&dir.join("state"))?);
    let cfg = CloudHvConfig {
        hypervisor: Arc::new(HypervisorSettings {
            cmdline: "console=ttyS0".into(),
            ..HypervisorSettings::new(hypervisor, Some(kernel), dir.join("run"))
        }),
        tap_prefix: format!("el{:04x}", std::process::id() & 0xffff),
        boot_wait: Duration::from_secs(10),
        network: None,
        confinement: Arc::new(eitri_agent::testkit::confinement(dir)),
        limits: Arc::default(),
    };
    Ok(CloudHypervisor::new(store, cfg))
}

/// CPUs a VM of one never-idle vCPU uses, capped at `millis` (0: none).
fn cpu_rate(backend: &CloudHypervisor, vm: &str, millis: u32) -> Result<f64, Error> {
    let mut spec = desired(vm).spec;
    spec.limits = VmLimits {
        cpu_max_millis: millis,
        ..VmLimits::default()
    };
    backend
        .boot(&spec, Deadline::after(Duration::from_secs(10)))
        .map_err(|e| eitri_agent::error::chain(&*e))?;
    let pid = backend.pid(&id(vm)).ok_or("no VMM pid")?;
    std::thread::sleep(SETTLE);
    let (start, used) = (Instant::now(), cpu_seconds(pid)?);
    std::thread::sleep(WINDOW);
    let rate = (cpu_seconds(pid)? - used) / start.elapsed().as_secs_f64();
    backend
        .destroy(&id(vm), Deadline::after(Duration::from_secs(10)))
        .map_err(|e| eitri_agent::error::chain(&*e))?;
    Ok(rate)
}

/// The process's CPU time so far, all its threads, user and system.
fn cpu_seconds(pid: u32) -> Result<f64, Error> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').ok_or("a stat line")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of the line, 12 and 13 after ')'.
    let ticks: u64 = fields.get(11).ok_or("utime")?.parse::<u64>()?
        + fields.get(12).ok_or("stime")?.parse::<u64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100);
    Ok(ticks as f64 / hz as f64)
}

/// The disk's, the IOPS and the NIC's rates against a real VMM, each
/// limited and then not; their `key=value` figures.
fn vmm_rates(ch: &Path) -> Result<Vec<String>, Error> {
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    let guest = io_guest(dir.path())?;
    let mut figures = Vec::new();
    let runs = [
        ("disk", "eitri.io=disk eitri.bs=65536", Counter::DiskBytes),
        (
            "iops",
            "eitri.io=disk eitri.bs=4096",
            Counter::DiskOps(DISK_IOPS),
        ),
        (
            "iops_high",
            "eitri.io=disk eitri.bs=4096",
            Counter::DiskOps(DISK_IOPS_HIGH),
        ),
        ("net_tx", "eitri.io=net-tx", Counter::Sent),
        ("net_rx", "eitri.io=net-rx", Counter::Received),
    ];
    for (name, cmdline, counter) in runs {
        let (limits, set) = counter.limit();
        let mut host = IoHost::new(ch, &guest, cmdline)?;
        let limited = host.rate("limited", limits, counter)?;
        let free = host.rate("free", VmLimits::default(), counter)?;
        let unit = counter.unit();
        println!(
            "{name}: limited to {} {unit}, measured {} {unit} (its VMM counted {}); with no limit {} {unit}",
            counter.show(set),
            counter.show(limited.0),
            counter.show(limited.1),
            counter.show(free.0),
        );
        figures.push(format!(
            "{name}_set={set:.0} {name}_measured={:.0} {name}_ratio={:.3} {name}_unlimited={:.0}",
            limited.0,
            limited.0 / set,
            free.0
        ));
    }
    Ok(figures)
}

/// What a rate counts.
#[derive(Clone, Copy)]
enum Counter {
    /// Bytes the VMM says its disks read.
    DiskBytes,
    /// Reads the VMM says its disks did.
    DiskOps(u32),
    /// Bytes the host kernel says the VM's tap took from its VMM (what the
    /// guest sent); the VMM's own count of them beside it.
    Sent,
    /// Bytes the host kernel says the VMM took from the VM's tap (for the
    /// guest), while the host sends as fast as it can; the VMM's count of
    /// what it gave the guest beside it.
    Received,
}

impl Counter {
    /// The limit this counter measures, and its rate a second.
    fn limit(self) -> (VmLimits, f64) {
        let none = VmLimits::default();
        match self {
            Counter::DiskBytes => (
                VmLimits {
                    disk_mbps: DISK_MBPS,
                    ..none
                },
                f64::from(DISK_MBPS) * 1e6,
            ),
            Counter::DiskOps(iops) => (
                VmLimits {
                    disk_iops: iops,
                    ..none
                },
                f64::from(iops),
            ),
            Counter::Sent | Counter::Received => (
                VmLimits {
                    net_mbps: NET_MBPS,
                    ..none
                },
                f64::from(NET_MBPS) * 1e6 / 8.0,
            ),
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Counter::DiskBytes | Counter::Sent | Counter::Received => "MB/s",
            Counter::DiskOps(_) => "reads/s",
        }
    }

    fn show(self, rate: f64) -> String {
        match self {
            Counter::DiskBytes | Counter::Sent | Counter::Received => format!("{:.2}", rate / 1e6),
            Counter::DiskOps(_) => format!("{rate:.0}"),
        }
    }

    /// The host's count and the VMM's (the same, for a disk).
    fn read(self, host: &IoHost, vm: &Id) -> Result<(f64, f64), Error> {
        let (status, body) = eitri_agent::provision::unix_http::request(
            &host.backend.socket_path(vm),
            "GET",
            "/api/v1/vm.counters",
            None,
            Duration::from_secs(2),
        )?;
        if status != 200 {
            return Err(format!("vm.counters answered {status}").into());
        }
        let devices: std::collections::HashMap<String, std::collections::HashMap<String, u64>> =
            serde_json::from_slice(&body)?;
        let sum = |key: &str| devices.values().filter_map(|d| d.get(key)).sum::<u64>() as f64;
        Ok(match self {
            Counter::DiskBytes => (sum("read_bytes"), sum("read_bytes")),
            Counter::DiskOps(_) => (sum("read_ops"), sum("read_ops")),
            Counter::Sent => (tap_counts(&host.tap(vm)?)?.0 as f64, sum("tx_bytes")),
            Counter::Received => (tap_counts(&host.tap(vm)?)?.1 as f64, sum("rx_bytes")),
        })
    }
}

/// Bytes `tap` has received (from its VMM) and sent (read by its VMM), as
/// this network namespace's kernel counts them (`/proc/self/net/dev`:
/// sysfs shows the namespace it was mounted in).
fn tap_counts(tap: &str) -> Result<(u64, u64), Error> {
    let table = std::fs::read_to_string("/proc/self/net/dev")?;
    let row = table
        .lines()
        .find_map(|l| l.trim_start().strip_prefix(tap)?.strip_prefix(':'))
        .ok_or_else(|| format!("no {tap} in /proc/self/net/dev"))?;
    let fields: Vec<u64> = row
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    // Eight receive columns, then the transmit ones.
    match (fields.first(), fields.get(8)) {
        (Some(&received), Some(&sent)) => Ok((received, sent)),
        _ => Err(format!("a short row for {tap}: {row}").into()),
    }
}

/// Sends 1514-byte frames out of `tap` (to its VMM, for the guest) as fast
/// as the host can until `stop`; what a packet socket sends on a tap is
/// queued to the VMM that holds it, past any bridge.
fn flood(tap: &str, stop: &std::sync::atomic::AtomicBool) -> std::io::Result<()> {
    let socket = eitri_agent::net::packet::PacketSocket::open_dhcp(tap, None)?;
    let mut frame = vec![0u8; 1514];
    frame[..6].copy_from_slice(&[0xff; 6]);
    frame[6..12].copy_from_slice(&socket.mac());
    frame[12..14].copy_from_slice(&[0x88, 0xb5]);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        // A full queue drops the frame (ENOBUFS at worst): the VMM takes
        // what it may, which is what is measured.
        let _ = socket.send(&frame);
    }
    Ok(())
}

/// Builds the I/O guest (`tests/bench/guest`) into `dir` with the host's C
/// compiler and linker.
fn io_guest(dir: &Path) -> Result<PathBuf, Error> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bench/guest");
    let out = dir.join("io-guest.elf");
    let run = |cmd: &mut Command| -> Result<(), Error> {
        let done = cmd
            .output()
            .map_err(|e| format!("{cmd:?} (the I/O guest needs a C compiler and ld): {e}"))?;
        if !done.status.success() {
            let said = String::from_utf8_lossy(&done.stderr);
            return Err(format!("{cmd:?}: {said}").into());
        }
        Ok(())
    };
    run(Command::new("cc")
        .args(["-c", "-O2", "-Wall", "-Wextra", "-Werror", "-ffreestanding"])
        .args(["-fno-pic", "-fno-pie", "-fno-stack-protector"])
        .args(["-mno-red-zone", "-mgeneral-regs-only", "-o"])
        .arg(dir.join("io.o"))
        .arg(src.join("io.c")))?;
    run(Command::new("cc")
        .args(["-c", "-fno-pic", "-o"])
        .arg(dir.join("entry.o"))
        .arg(src.join("entry.S")))?;
    run(Command::new("ld")
        .args(["-nostdlib", "-static", "--no-warn-rwx-segments", "-T"])
        .arg(src.join("guest.ld"))
        .arg("-o")
        .arg(&out)
        .arg(dir.join("entry.o"))
        .arg(dir.join("io.o")))?;
    Ok(out)
}

/// An agent (engine, records, the jailed real backend, the host network)
/// whose VMs boot the I/O guest with `cmdline`.
struct IoHost {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    backend: Arc<CloudHypervisor>,
    engine: Engine,
    base: (String, String),
    cgroup_root: String,
    epoch: u64,
}

impl Drop for IoHost {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

impl IoHost {
    fn new(ch: &Path, guest: &Path, cmdline: &str) -> Result<IoHost, Error> {
        let dir = tempfile::tempdir()?;
        eitri_agent::testkit::remove_on_signal(dir.path());
        let base = agent::base_image(dir.path())?;
        let store = Arc::new(Store::open(&dir.path().join("state"))?);
        let prefix = format!("eb{:04x}", std::process::id() & 0xffff);
        let mut cfg = agent::host_config(
            dir.path(),
            &store,
            (ch.to_path_buf(), guest.to_path_buf()),
            &prefix,
            true,
        )?;
        Arc::make_mut(&mut cfg.hypervisor).cmdline = format!("console=ttyS0 {cmdline}");
        let cgroup_root = cfg.confinement.cgroup_root.clone();
        let backend = Arc::new(CloudHypervisor::new(Arc::clone(&store), cfg));
        let engine = Engine::new(
            Arc::clone(&store),
            agent::seams(&store, Arc::clone(&backend), dir.path()),
            EngineConfig {
                agent_version: "1.0.0".into(),
                vm_timeout: Some(PATIENCE),
                tombstone_grace: Duration::ZERO,
                ..EngineConfig::default()
            },
        );
        Ok(IoHost {
            _dir: dir,
            store,
            backend,
            engine,
            base,
            cgroup_root,
            epoch: 0,
        })
    }

    /// Boots `vm` with `limits`, lets its guest run `SETTLE`, and counts
    /// over `WINDOW`: `counter`'s rate a second as the host and as the VMM
    /// count it. The VM is destroyed after.
    fn rate(&mut self, vm: &str, limits: VmLimits, counter: Counter) -> Result<(f64, f64), Error> {
        let mut d = desired(vm);
        (d.spec.image_url, d.spec.image_sha256) = self.base.clone();
        d.spec.limits = limits;
        let wanted = self.wanted(vec![present(d)]);
        self.engine.step(&wanted);
        self.until(|row| row.and_then(|r| r.phase) == Some(Phase::Ready))?;
        self.guest_runs(&id(vm))?;
        let stop = std::sync::atomic::AtomicBool::new(false);
        // Only a guest that receives needs the host to send.
        let tap = match counter {
            Counter::Received => Some(self.tap(&id(vm))?),
            _ => None,
        };
        let counted = std::thread::scope(|s| {
            let sender = tap.as_deref().map(|tap| s.spawn(|| flood(tap, &stop)));
            std::thread::sleep(SETTLE);
            let counted = self.count(&id(vm), counter);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            match sender.map(|t| t.join()) {
                Some(Ok(Err(e))) => Err(format!("sending to the guest: {e}").into()),
                Some(Err(_)) => Err("the sender panicked".into()),
                _ => counted,
            }
        });
        let empty = self.wanted(vec![]);
        self.engine.step(&empty);
        self.until(|row| row.is_none())?;
        counted
    }

    /// `counter`'s rate over `WINDOW`, as the host and as the VMM count.
    fn count(&self, vm: &Id, counter: Counter) -> Result<(f64, f64), Error> {
        let (start, first) = (Instant::now(), counter.read(self, vm)?);
        std::thread::sleep(WINDOW);
        let last = counter.read(self, vm)?;
        let took = start.elapsed().as_secs_f64();
        Ok(((last.0 - first.0) / took, (last.1 - first.1) / took))
    }

    fn tap(&self, vm: &Id) -> Result<String, Error> {
        Ok(self.backend.taps(vm).ok_or("the VM has no tap")?.underlay)
    }

    fn wanted(&mut self, vms: Vec<eitri_agent::model::WantedVm>) -> Snapshot {
        self.epoch += 1;
        snapshot(self.epoch, vms)
    }

    /// Waits until the one VM's row (or its absence) passes `done`.
    fn until(
        &self,
        done: impl Fn(Option<&eitri_agent::model::VmStatus>) -> bool,
    ) -> Result<(), Error> {
        let deadline = Deadline::after(PATIENCE);
        loop {
            let report = self.engine.published();
            let row = report.vms.first().map(|r| &**r);
            if done(row) {
                return Ok(());
            }
            if let Some(r) = row.filter(|r| r.phase == Some(Phase::Failed)) {
                return Err(format!("{} failed: {:?}", r.vm_id, r.last_error).into());
            }
            if deadline.expired() {
                return Err(format!("gave up waiting; the row: {row:?}").into());
            }
            let _ = self
                .engine
                .changes()
                .recv_timeout(Duration::from_millis(50));
        }
    }

    /// Waits until the guest says its device runs (or says why not).
    fn guest_runs(&self, vm: &Id) -> Result<(), Error> {
        let serial = self.store.layout().serial_log(vm);
        let deadline = Deadline::after(PATIENCE);
        loop {
            let said = std::fs::read_to_string(&serial).unwrap_or_default();
            if said.contains(" running") {
                return Ok(());
            }
            if let Some(why) = said
                .lines()
                .find(|l| l.starts_with("IO-GUEST: ") && !l.ends_with(": up"))
            {
                return Err(format!("the I/O guest stopped: {why}").into());
            }
            if deadline.expired() {
                return Err(format!("the I/O guest never said it runs; it said: {said:?}").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
